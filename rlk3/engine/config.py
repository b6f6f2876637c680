"""The engine's two configs, both validated when constructed: each error names the key, the value and what would be
valid (``EngineConfigError``, a ``ValueError``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from numbers import Integral, Real

BACKENDS = ("auto", "torch")
DEFAULT_MEMORY_BYTES = 256 * 2**20  # enough for k3-tiny work on a CPU; set memory_fraction on a GPU


class EngineConfigError(ValueError):
    """An invalid EngineConfig or SamplingParams value."""


def _is_int(value) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _int(owner: str, key: str, value, minimum: int, allow_none: bool = False, maximum: int | None = None) -> None:
    if value is None and allow_none:
        return
    if not _is_int(value) or value < minimum or (maximum is not None and value > maximum):
        upper = f" and <= {maximum}" if maximum is not None else ""
        none = " or None" if allow_none else ""
        raise EngineConfigError(f"{owner}.{key} must be an int >= {minimum}{upper}{none}, got {value!r}")


def _bool(owner: str, key: str, value) -> None:
    if not isinstance(value, bool):
        raise EngineConfigError(f"{owner}.{key} must be a bool, got {value!r}")


SAMPLERS = ("generator", "counter")  # sampling.py
SEED_MAX = 2**64 - 1  # seeds are 64-bit: what torch.Generator.manual_seed takes, and the counter sampler's keys hold


@dataclass
class EngineConfig:
    """How the engine sizes its pool, schedules, caches prefixes and reacts to weight updates (docs/engine.md)."""

    # -- memory: at most one of the two (neither: DEFAULT_MEMORY_BYTES); the pool is preallocated and never grows
    memory_bytes: int | None = None  # the pool's byte budget
    memory_fraction: float | None = None  # or: this fraction of the device's free memory (pool.device_free_bytes)
    block_size: int | None = None  # MLA tokens per page (a power of two dividing prefix_block_tokens); None = auto
    max_model_len: int | None = None  # longest sequence (prompt + every turn); None = whatever fits the pool

    # -- scheduling
    max_num_seqs: int = 256  # sequences in one step
    # the per-step token budget (decode tokens + prefill chunks). None (the default): 8192 on CUDA, where a step's
    # cost is mostly its kernel launches whatever its size, so fewer larger prefill steps win (128 prompts decode
    # 38% faster on the H200 than with 2048: docs/BENCHMARKS.md); 2048 on CPU, where a step costs its tokens
    max_tokens_per_step: int | None = None
    prefill_chunk: int = 512  # each prefill's share of a step before leftover budget is handed out (fairness)

    # -- prefix cache
    enable_prefix_cache: bool = True
    prefix_block_tokens: int = 512  # hash-block size; MLA entries are reusable at every such boundary
    checkpoint_interval: int = 2048  # KDA state checkpoints every this many tokens (a multiple of the block)
    # ... and at the last boundary of every prompt / extension (a turn end), plus a tail checkpoint at its exact end
    checkpoint_prompt_end: bool = True
    # a tail checkpoint where a finished generation's computed tokens end: an agent loop that re-sends the
    # conversation with the model's reply resumes after the reply instead of recomputing it
    checkpoint_generation_end: bool = True
    # a checkpoint at a block boundary inside a prefill chunk is taken in the step (read off the chunked kernel's
    # intermediate states: runner.KdaSplit) instead of ending the chunk there and computing the rest in another step
    checkpoint_in_step: bool = True
    spill_bytes: int = 0  # evicted prefix blocks may spill to CPU memory up to this many bytes (0 = drop them)
    # under memory pressure a block's KDA checkpoint that a deeper one supersedes (the cached chain below it runs
    # there without branching) is dropped alone, its block kept, before any entry is evicted (prefix_cache.py): an
    # agent loop's earlier turns' checkpoints go before any conversation's blocks. False: plain LRU over whole entries
    drop_superseded_checkpoints: bool = True
    # requests whose prompt equals one being prefilled wait for it and continue from a copy of its cache (KDA state,
    # MLA pages shared): a GRPO group's prompt is computed once, not once per sample (scheduler.py)
    share_prefill: bool = True

    # -- weights and versions
    recompute_on_weight_update: bool = False  # paused/finished requests drop their (old-policy) cache on update

    # -- execution
    backend: str = "auto"  # "auto": FLA/Triton kernels on CUDA when importable, torch otherwise; "torch": always
    cuda_graphs: bool = True  # capture the decode step on CUDA (only over FLA's kernels: ignored on CPU or without)
    # torch.compile the per-token blocks between attention kernels (runner.py); None (the default): on CUDA only,
    # where it halves a decode step (docs/BENCHMARKS.md); on CPU it gains nothing and costs compile time
    compile: bool | None = None
    cuda_graph_batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32, 64, 128, 256])
    # capture all-prefill steps too, piecewise (each MLA layer's attention stays eager between the pieces), padded to
    # 1/32 of the token count's octave (at least 128) and 4/16/64/256 sequences (cuda_graphs.PrefillGraphs): a
    # prefill step's ~850 launches cost ~50 ms of host time for a few ms of GPU work (a cached multi-turn turn 4.6x
    # faster on the H200: docs/BENCHMARKS.md). None (the default): on where decode steps replay CUDA graphs. True on
    # CPU (or the torch backend) runs the same padded pieces eagerly, which only tests them
    prefill_graphs: bool | None = None
    seed: int = 0  # seeds the generators of requests that bring no seed of their own
    # how sampled rows draw (sampling.py): "generator" (a torch.Generator per request, row by row) or "counter"
    # (hashed (seed, position) noise, every row in one batched draw: ~65-95 operators per step whatever the batch,
    # against 6-15 per drawn row). None (the default): counter on CUDA, where it draws a batch of 128 in 0.84 ms
    # against 15.7 ms (H200), generator on CPU, where hashing a large vocabulary costs more (docs/BENCHMARKS.md)
    sampler: str | None = None
    # launch each decode step before reading back the one before it, so the host's per-step work (batch building,
    # read-back, stop checks) runs while the GPU computes (engine.py's docstring says what changes: results come one
    # step() later, a stop token is computed ahead). None (the default): on where decode steps replay CUDA graphs
    async_decode: bool | None = None
    # causal prefill attention (fresh prompts, extensions of 512+ tokens) through cuDNN, padded to a few shapes, on
    # CUDA in half precision (runner.py). Off (the default): FlashAttention-2, as the lengths come. cuDNN was 1.45-1.85x
    # faster per call for a turn's 2K queries over 10-20K cached keys, but padded as it must be (a plan per new shape
    # costs 40-100 ms) it did not beat FlashAttention-2 in the measured runs (docs/BENCHMARKS.md)
    cudnn_attention: bool = False

    def __post_init__(self) -> None:
        own = "EngineConfig"
        if self.memory_bytes is not None and self.memory_fraction is not None:
            raise EngineConfigError(
                f"{own}: set at most one of memory_bytes and memory_fraction, got memory_bytes={self.memory_bytes!r}, "
                f"memory_fraction={self.memory_fraction!r}"
            )
        if self.memory_bytes is None and self.memory_fraction is None:
            self.memory_bytes = DEFAULT_MEMORY_BYTES
        _int(own, "memory_bytes", self.memory_bytes, 1, allow_none=True)
        if self.memory_fraction is not None and (
            not isinstance(self.memory_fraction, Real) or isinstance(self.memory_fraction, bool)
            or not 0.0 < self.memory_fraction <= 1.0
        ):
            raise EngineConfigError(f"{own}.memory_fraction must be a number in (0, 1], got {self.memory_fraction!r}")
        _int(own, "prefix_block_tokens", self.prefix_block_tokens, 1)
        if self.block_size is not None:
            bs, pb = self.block_size, self.prefix_block_tokens
            if not _is_int(bs) or bs < 1 or bs & (bs - 1) or pb % bs:
                raise EngineConfigError(
                    f"{own}.block_size must be a power of two dividing prefix_block_tokens={pb} (so that a cached "
                    f"prefix block is whole pages), or None for auto, got {bs!r}"
                )
        _int(own, "max_model_len", self.max_model_len, 1, allow_none=True)
        _int(own, "max_num_seqs", self.max_num_seqs, 1)
        _int(own, "max_tokens_per_step", self.max_tokens_per_step, 1, allow_none=True)
        _int(own, "prefill_chunk", self.prefill_chunk, 1)
        _int(own, "checkpoint_interval", self.checkpoint_interval, 1)
        if self.checkpoint_interval % self.prefix_block_tokens:
            raise EngineConfigError(
                f"{own}.checkpoint_interval must be a multiple of prefix_block_tokens={self.prefix_block_tokens} "
                f"(checkpoints sit on block boundaries), got {self.checkpoint_interval}"
            )
        _int(own, "spill_bytes", self.spill_bytes, 0)
        for key in ("enable_prefix_cache", "share_prefill", "checkpoint_prompt_end", "checkpoint_generation_end",
                    "checkpoint_in_step", "drop_superseded_checkpoints", "recompute_on_weight_update", "cuda_graphs",
                    "cudnn_attention"):
            _bool(own, key, getattr(self, key))
        if self.compile is not None and not isinstance(self.compile, bool):
            raise EngineConfigError(f"{own}.compile must be a bool or None (None: on CUDA only), got {self.compile!r}")
        if self.prefill_graphs is not None and not isinstance(self.prefill_graphs, bool):
            raise EngineConfigError(
                f"{own}.prefill_graphs must be a bool or None (None: on where decode steps replay CUDA graphs), got "
                f"{self.prefill_graphs!r}"
            )
        if self.async_decode is not None and not isinstance(self.async_decode, bool):
            raise EngineConfigError(
                f"{own}.async_decode must be a bool or None (None: on where CUDA graphs replay decode steps), got "
                f"{self.async_decode!r}"
            )
        if self.sampler is not None and self.sampler not in SAMPLERS:
            raise EngineConfigError(
                f"{own}.sampler must be 'generator', 'counter' or None (counter on CUDA, generator on CPU; "
                f"sampling.py), got {self.sampler!r}"
            )
        if self.backend not in BACKENDS:
            raise EngineConfigError(f"{own}.backend must be one of {list(BACKENDS)}, got {self.backend!r}")
        sizes = self.cuda_graph_batch_sizes
        if not isinstance(sizes, (list, tuple)) or not sizes or any(not _is_int(s) or s < 1 for s in sizes):
            raise EngineConfigError(
                f"{own}.cuda_graph_batch_sizes must be a non-empty list of ints >= 1, got {sizes!r}"
            )
        self.cuda_graph_batch_sizes = sorted(set(sizes))
        _int(own, "seed", self.seed, 0, maximum=SEED_MAX)

    @classmethod
    def from_dict(cls, values: dict) -> EngineConfig:
        """From a plain mapping (an OmegaConf node turned into a dict); unknown keys are errors."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise EngineConfigError(f"EngineConfig: unknown keys {unknown}; valid keys: {sorted(known)}")
        return cls(**values)


# the smallest temperature other than 0. Far below it (~1e-37 for logits of ordinary size) logits / temperature
# overflow float32 and the draw gets NaN probabilities; vLLM treats temperatures under 1e-5 as greedy, here 0 says so
MIN_TEMPERATURE = 1e-5


@dataclass
class SamplingParams:
    """How one request samples. ``temperature=0`` is greedy. The reported logprob of a token is always under
    ``softmax(logits / temperature)`` (plain ``softmax(logits)`` when greedy) over the whole vocabulary, before
    top-k/top-p: the quantity the trainer recomputes from the same logits."""

    max_tokens: int = 16  # generated tokens in this turn
    temperature: float = 1.0
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p
    top_k: int = 0  # the k most likely tokens; 0 = no limit
    stop_token_ids: list[int] = field(default_factory=list)  # finish after sampling one of these (it is kept)
    stop: list[str] = field(default_factory=list)  # finish once the decoded output contains one (needs a tokenizer)
    seed: int | None = None  # a per-request generator: the same seed gives the same tokens

    def __post_init__(self) -> None:
        own = "SamplingParams"
        _int(own, "max_tokens", self.max_tokens, 1)
        t = self.temperature
        if (not isinstance(t, Real) or isinstance(t, bool) or not (t == 0.0 or t >= MIN_TEMPERATURE)
                or t == float("inf")):
            raise EngineConfigError(f"{own}.temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE} "
                                    f"(logits / temperature must stay finite), got {t!r}")
        p = self.top_p
        if not isinstance(p, Real) or isinstance(p, bool) or not 0.0 < p <= 1.0:
            raise EngineConfigError(f"{own}.top_p must be a number in (0, 1], got {p!r}")
        _int(own, "top_k", self.top_k, 0)
        ids = self.stop_token_ids
        if not isinstance(ids, (list, tuple)) or any(not _is_int(i) or i < 0 for i in ids):
            raise EngineConfigError(f"{own}.stop_token_ids must be a list of ints >= 0, got {ids!r}")
        self.stop_token_ids = list(ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, (list, tuple)) or any(not isinstance(s, str) or not s for s in self.stop):
            raise EngineConfigError(f"{own}.stop must be a list of non-empty strings, got {self.stop!r}")
        self.stop = list(self.stop)
        _int(own, "seed", self.seed, 0, allow_none=True, maximum=SEED_MAX)
        # stored as Python numbers (a NumPy uint64 seed or int64 max_tokens passes the checks above, but the seed's
        # hashing and the samplers' arithmetic want ints and floats)
        self.max_tokens, self.top_k, self.temperature, self.top_p = (
            int(self.max_tokens), int(self.top_k), float(self.temperature), float(self.top_p))
        self.stop_token_ids = [int(i) for i in self.stop_token_ids]
        if self.seed is not None:
            self.seed = int(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
