"""rlk3's rollout engine for K3 hybrid models (issue 3; DESIGN.md §3 and §4; docs/engine.md).

One paged pool holds both cache kinds (MLA latent blocks and KDA state slots); a prefix cache reuses MLA blocks at
every 512-token boundary and KDA states where checkpoints were taken; the scheduler batches continuously with
chunked prefill under a per-step token budget; requests pause, resume, extend (multi-turn) and carry the policy
version of every token they sample.
"""

from rlk3.engine.config import EngineConfig, EngineConfigError, SamplingParams
from rlk3.engine.engine import (
    EngineError,
    EngineStats,
    PoolStats,
    PrefixCacheStats,
    RolloutEngine,
    StopCheckError,
    UnknownRequestError,
)
from rlk3.engine.pool import PoolError
from rlk3.engine.request import FinishReason, GenerationResult, RequestStatus

__all__ = [
    "EngineConfig",
    "EngineConfigError",
    "EngineError",
    "EngineStats",
    "FinishReason",
    "GenerationResult",
    "PoolError",
    "PoolStats",
    "PrefixCacheStats",
    "RequestStatus",
    "RolloutEngine",
    "SamplingParams",
    "StopCheckError",
    "UnknownRequestError",
]
