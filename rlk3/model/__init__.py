"""The K3 hybrid model (KDA + Gated MLA + Stable LatentMoE), HF-native.

Importing this package registers ``K3Config`` / ``K3ForCausalLM`` with transformers' Auto classes under the
model type ``"k3"``, so ``AutoModelForCausalLM.from_pretrained(path)`` loads an rlk3 checkpoint.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from rlk3.model.cache import K3Cache
from rlk3.model.configuration_k3 import PRESETS, K3Config, K3ConfigError
from rlk3.model.modeling_k3 import K3ForCausalLM, K3Model, K3PreTrainedModel

AutoConfig.register("k3", K3Config, exist_ok=True)
AutoModel.register(K3Config, K3Model, exist_ok=True)
AutoModelForCausalLM.register(K3Config, K3ForCausalLM, exist_ok=True)

__all__ = ["PRESETS", "K3Cache", "K3Config", "K3ConfigError", "K3ForCausalLM", "K3Model", "K3PreTrainedModel"]
