"""rlk3: agentic RL and multi-teacher on-policy distillation for K3-style hybrid models.

Importing rlk3 registers the K3 model with transformers' Auto classes.
"""

from rlk3 import model as model

__version__ = "0.1.0"
