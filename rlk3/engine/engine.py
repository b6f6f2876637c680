"""``RolloutEngine``: the rollout engine's API (DESIGN.md §3) over the scheduler, the pool and the model runner.

The engine is single-threaded: the caller drives it with ``step()`` (or the blocking ``generate()``), and every
other call happens between steps, so "pause" stops a request at its current token.

**Asynchronous decode** (``EngineConfig.async_decode``, on by default where decode steps replay CUDA graphs): a
step's host work (building the batch, reading the sampled tokens back, appending them, the stop checks) would
otherwise leave the GPU idle ~1 ms a step at batch 128 (a third of a k3-small step on an H200). So a decode step is
launched and ``step()`` returns without waiting for its tokens; the next ``step()`` launches the step after it, fed by
the sampled tokens still on the device, and only then reads the previous step's tokens while the GPU computes. Two
consequences, both bounded to one step: ``step()`` returns a request's finished result one call later, and a
request that samples a stop token (or string) has that token fed through the model by the already-launched step —
its cache then covers it (``extend`` continues from there), and the token that step sampled for it is dropped. Only
requests that cannot draw randomness from a per-request generator take part (counter sampler, or greedy), so a
dropped draw changes nothing later. Every other method first settles the step in flight, so what it sees and
changes is exactly what a synchronous engine would show after that step; ``pause`` of a request that finished in
that settled step returns its final result instead of raising.
"""

from __future__ import annotations

import array
import dataclasses
import functools
import itertools
import math
import time
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlk3.engine import runner_cpu
from rlk3.engine.config import EngineConfig, EngineConfigError, SamplingParams, _is_int
from rlk3.engine.cuda_graphs import DecodeGraphs, PrefillGraphs, prefill_bucket
from rlk3.engine.pool import PagedPool, PoolError, PoolLayout, budget_bytes
from rlk3.engine.prefix_cache import PrefixCache
from rlk3.engine.request import FinishReason, GenerationResult, Request, RequestStatus
from rlk3.engine.runner import (
    ForwardBatch,
    GraphPad,
    KdaSplit,
    ModelRunner,
    PackedPrefill,
    decode_conv_indices,
    static_parts,
)
from rlk3.engine.sampling import counter_key, generator_seed, sample, sample_tensors, to_device
from rlk3.engine.scheduler import Scheduler
from rlk3.model.ops import cpu as cpu_kernels
from rlk3.model.ops.kda import fla_available

# Consecutive multi-token sequences share one masked MLA attention while (new tokens) x (their cached + new tokens)
# stays under this many mask entries (a larger step attends in several such runs): that saves per-sequence overhead
# for short chunks, but the packed attention also computes every cross-sequence score, so longer prefills attend one
# sequence at a time. On CUDA the per-sequence overhead is the cost (each sequence's attention is ~15 launches of
# ~35 us host time per MLA layer, a 2,048-token step of 32 prompts took ~100 ms for ~15 ms of GPU work) and the
# cross-sequence scores are nearly free, so the bound is the mask's memory: 16M entries (a 4,096-token run; SDPA
# expands the mask to a float bias, 64 MiB).
PACKED_PREFILL_MAX = {"cpu": 1 << 16, "cuda": 1 << 24}
# Whether a step over the bound is split into runs that each fit. On CUDA yes (an 8,192-token step of 64-token
# prompts is two masked attentions per MLA layer, not 128). On CPU the per-sequence overhead is small and pairs of
# sequences gain nothing measurable; all-or-none keeps its numerics (and the learning tests' rollouts) as they were.
PACKED_PREFILL_RUNS = {"cpu": False, "cuda": True}
# Tokens before a stop check's window decoded with it as context, then cut off (``_turn_tail_text``): a first piece's
# leading space and a character begun before the window depend on them; vLLM's incremental detokenizer starts from
# the prompt's last 5 tokens (its first prefix offset) for the same reason.
STOP_CONTEXT_TOKENS = 4


class EngineError(RuntimeError):
    """A call that is not valid in the engine's current state (released memory, wrong request status)."""


class StopCheckError(EngineError):
    """A request's stop strings could not be checked (its tokenizer's ``decode`` raised): that request is ended
    (``FinishReason.ABORT``, its tokens kept); the other requests of the step are recorded as usual."""


class UnknownRequestError(ValueError):
    """A request id the engine does not know (never added, or already aborted / released)."""


@dataclass
class PoolStats:
    budget_bytes: int  # the byte budget the pool was sized from
    allocated_bytes: int  # what the pool holds now (0 after release_memory)
    page_bytes: int
    block_size: int  # MLA tokens per page
    pages_per_slot: int  # pages of one request's KDA state
    total_pages: int
    free_pages: int
    request_pages: int  # pages referenced by requests (shared prefix pages counted once)
    prefix_cache_pages: int  # pages referenced only by the prefix cache


@dataclass
class PrefixCacheStats:
    blocks: int  # cached hash blocks on the device (tails included)
    checkpoints: int  # of which carry a KDA checkpoint
    tails: int  # of which are tails: a partial block at a prompt's or a generation's end, with its checkpoint
    lookups: int  # admissions that looked the prefix up (one that waited for memory counts once)
    hits: int  # of those, admissions that resumed from a checkpoint
    hit_tokens: int  # prompt tokens not recomputed thanks to the cache
    evictions: int
    spilled_blocks: int
    spilled_bytes: int
    restores: int  # spilled blocks brought back on a hit
    checkpoints_taken: int
    checkpoints_skipped: int  # no room for a checkpoint even after eviction
    checkpoints_dropped: int  # superseded block checkpoints dropped alone under memory pressure
    tails_taken: int
    tail_hits: int  # of the hits, those that resumed after a tail


@dataclass
class EngineStats:
    version: int  # the current policy version
    kernels: str  # which kernels run the model: "cpu" (rlk3's CPU kernels), "cuda" (FLA / Triton), "torch" (reference)
    steps: int
    prefill_tokens: int  # tokens computed in multi-token chunks (prompts, extensions, recomputation)
    decode_tokens: int  # tokens computed one per sequence per step
    generated_tokens: int  # tokens sampled
    prefill_seconds: float  # scheduling (prefix lookups included) + forward + sampling time of steps with any
    # multi-token chunk
    decode_seconds: float  # ... of steps that computed only single tokens
    overlapped_steps: int  # decode steps launched before the previous one was read back (asynchronous decode)
    padded_prefill_steps: int  # all-prefill steps run padded through the prefill graphs (prefill_graphs)
    prefill_padding_tokens: int  # padding tokens those steps computed and dropped
    prefill_capture_seconds: float  # of prefill_seconds: capturing the prefill graphs, once per shape
    split_checkpoints: int  # KDA checkpoints taken inside a prefill chunk (checkpoint_in_step), each a step saved
    preemptions: int  # running requests preempted for memory, by a recomputing weight update or a failed step
    dropped_caches: int  # paused / finished caches given up under memory pressure or by a weight update (a
    # release_memory, which drops every cache, counts in neither)
    shared_prefill_tokens: int  # prompt tokens requests did not compute: copied from a leader's (share_prefill)
    num_waiting: int
    num_running: int
    num_paused: int
    num_finished: int  # finished and not yet released
    pool: PoolStats
    prefix_cache: PrefixCacheStats | None


@functools.cache
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _token_list(ids, name: str) -> list[int]:
    if isinstance(ids, torch.Tensor) or _is_array(ids):
        if isinstance(ids, torch.Tensor):
            integer = not (ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex())
        else:
            integer = ids.dtype.kind in "iu"  # NumPy's signed and unsigned integers (not bool, float, complex)
        if ids.ndim != 1 or not integer:
            raise ValueError(f"{name} must be a list of ints or a 1-D integer tensor or array, got a "
                             f"{type(ids).__name__} of {ids.dtype} and shape {list(ids.shape)}")
        return ids.tolist()
    if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
        raise ValueError(f"{name} must be a list of ints or a 1-D integer tensor or array, got "
                         f"{type(ids).__name__}")
    out = list(ids)
    if set(map(type, out)) <= {int}:  # the common case in one C-level pass (an agent re-sends 100K-token lists)
        return out
    for t in out:
        if not _is_int(t):
            raise ValueError(f"{name} must contain ints, got {t!r} ({type(t).__name__})")
    return [int(t) for t in out]  # NumPy's integers, say: stored as Python ints


def _is_array(value) -> bool:
    """A NumPy (or NumPy-like) array, recognised without importing NumPy."""
    return hasattr(value, "__array_interface__") and hasattr(value, "dtype") and hasattr(value, "tolist")


def _turn_ends(turn_ends, new: int) -> list[int]:
    """``turn_ends`` checked before anything is changed: positions within the ``new`` tokens."""
    if isinstance(turn_ends, (str, bytes, Mapping)) or not isinstance(turn_ends, Iterable):
        raise ValueError(f"turn_ends must be a list of token positions (ints in [1, {new}]), got "
                         f"{type(turn_ends).__name__}")
    positions = list(turn_ends)
    for pos in positions:
        if not _is_int(pos) or not 1 <= pos <= new:
            raise ValueError(f"turn_ends positions must be ints in [1, {new}], got {pos!r}")
    return [int(pos) for pos in positions]


@dataclass
class _InFlight:
    """A decode step launched but not yet read back (asynchronous decode)."""

    reqs: list[Request]
    tokens: torch.Tensor  # [n] sampled ids on the device: the next step's inputs
    host: torch.Tensor  # [2, n] float64 (ids, logprobs), filled by a non-blocking copy
    done: torch.cuda.Event | None  # recorded after that copy (None on CPU, where it is already done)


def _check_weights(items: list, params: dict[str, torch.Tensor]) -> None:
    """Every name known, every value a tensor with data, of the model's shape and of its kind (a floating-point
    weight from floating-point values of any precision: copying casts), and finite. A non-finite weight is a
    diverged trainer's, and would sample garbage under a valid version tag; it is refused here, by name."""
    flags: dict[torch.device, list[torch.Tensor]] = {}
    tied: dict[int, tuple[str, torch.Tensor]] = {}  # the model's tensor -> the first (name, value) this update gave it
    for item in items:
        if not (isinstance(item, tuple | list) and len(item) == 2):
            raise ValueError(f"update_weights: expected (name, tensor) pairs, got {type(item).__name__}")
        name, tensor = item
        if name not in params:
            raise ValueError(f"update_weights: unknown weight {name!r} (not in the model's state dict)")
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"update_weights: {name!r} must be a torch.Tensor, got {type(tensor).__name__}")
        if tensor.is_meta:
            raise ValueError(f"update_weights: {name!r} is a meta tensor (no data)")
        if tuple(tensor.shape) != tuple(params[name].shape):
            raise ValueError(f"update_weights: {name!r} has shape {list(tensor.shape)}, the model's is "
                             f"{list(params[name].shape)}")
        if tensor.is_floating_point() != params[name].is_floating_point() or tensor.is_complex():
            raise ValueError(f"update_weights: {name!r} has dtype {tensor.dtype}, the model's is "
                             f"{params[name].dtype} (a floating-point weight takes any floating-point dtype)")
        if tensor.is_floating_point():
            flags.setdefault(tensor.device, []).extend(_finite_flags(tensor))
        first = tied.setdefault(id(params[name]), (name, tensor))
        if first[0] != name and not torch.equal(first[1], tensor.to(first[1].device, first[1].dtype)):
            raise ValueError(f"update_weights: {first[0]!r} and {name!r} are one tied weight in the model "
                             f"(tie_word_embeddings) but differ in this update; send equal values, or one of the names")
    # one read-back per device, not one per tensor; the names are looked up only when something is wrong
    if any(not bool(torch.stack(f).all()) for f in flags.values()):
        counts = [(n, sum(int((~torch.isfinite(part)).sum()) for part in _chunks(t))) for n, t in items
                  if t.is_floating_point()]
        bad = [(n, k) for n, k in counts if k]
        listed = ", ".join(f"{n!r} ({k} of {params[n].numel()})" for n, k in bad[:5])
        raise ValueError(f"update_weights: non-finite values (NaN or inf) in {len(bad)} weight(s): {listed}"
                         f"{', ...' if len(bad) > 5 else ''}; nothing was copied")


def _chunks(t: torch.Tensor, n: int = 1 << 26) -> list[torch.Tensor]:
    """``t`` in flat pieces of at most ``n`` elements (a contiguous one; other layouts whole): the finiteness
    check's boolean temporary stays at 64 MiB even for a 2 GiB embedding."""
    if not t.is_contiguous() or t.numel() <= n:
        return [t]
    return list(t.view(-1).split(n))


def _finite_flags(t: torch.Tensor) -> list[torch.Tensor]:
    return [torch.isfinite(part).all() for part in _chunks(t)]


def _longs(values: Sequence[int] | Sequence[Sequence[int]]) -> torch.Tensor:
    """A flat int64 tensor of a list of Python ints (or of equal-length lists of them, flattened row by row).
    ``torch.tensor`` parses a list element by element (~0.16 µs each: a cached turn's 2,300 input ids took 0.37 ms of
    a 1-1.5 ms batch build); ``array`` parses it in C (~20 ns each)."""
    if values and isinstance(values[0], (list, tuple)):
        values = list(itertools.chain.from_iterable(values))
    return torch.frombuffer(array.array("q", values), dtype=torch.long) if values else torch.zeros(0, dtype=torch.long)


def _ranges(counts: torch.Tensor, total: int) -> torch.Tensor:
    """``cat([arange(c) for c in counts])`` in a few tensor operations."""
    return torch.arange(total) - (counts.cumsum(0) - counts).repeat_interleave(counts, output_size=total)


class RolloutEngine:
    """Generation for RL rollouts on a K3 model (docs/engine.md)."""

    def __init__(self, model, config: EngineConfig | None = None, tokenizer=None):
        config = config if config is not None else EngineConfig()
        if not isinstance(config, EngineConfig):
            raise EngineConfigError(f"RolloutEngine: config must be an EngineConfig, got {type(config).__name__}")
        if not hasattr(model, "config") or not hasattr(model.config, "layer_kinds") or not hasattr(model, "model"):
            raise EngineConfigError(f"RolloutEngine: model must be a K3ForCausalLM, got {type(model).__name__}")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size
        self.device = next(model.parameters()).device
        if config.max_tokens_per_step is None:  # the device's default (config.py)
            config = dataclasses.replace(config, max_tokens_per_step=8192 if self.device.type == "cuda" else 2048)
        self.config = config
        cache_dtype = model.model.embed_tokens.weight.dtype
        self.layout = PoolLayout.for_model(model.config, cache_dtype, config.block_size, config.prefix_block_tokens)
        self.pool = PagedPool(self.layout, budget_bytes(config.memory_bytes, config.memory_fraction, self.device),
                              self.device)
        self.prefix = (
            PrefixCache(self.pool, config.prefix_block_tokens, config.spill_bytes,
                        config.drop_superseded_checkpoints)
            if config.enable_prefix_cache else None
        )
        self.requests: dict[str, Request] = {}
        self.scheduler = Scheduler(config, self.pool, self.prefix, self.requests)
        compile = config.compile if config.compile is not None else self.device.type == "cuda"
        sampler = config.sampler or ("counter" if self.device.type == "cuda" else "generator")
        self.counter_sampling = sampler == "counter"
        self.runner = self._runner(model, config, compile)
        # checkpoints inside a chunk (runner.KdaSplit): only a model with KDA layers has any to take
        self.scheduler.split_ok = config.checkpoint_in_step and self.layout.pages_per_slot > 0
        self.version = 0
        self.released = False
        self._arrivals = itertools.count()
        self._ids = itertools.count()
        self._seeds = torch.Generator().manual_seed(generator_seed(config.seed))
        self._decode_index_cache: dict[int, tuple[torch.Tensor, ...]] = {}
        self._graphs = None  # CUDA graphs of the decode step, captured per batch size on first use (cuda_graphs.py)
        self._prefill_graphs = None  # ... and of all-prefill steps, piecewise, per padded shape
        # CUDA graphs only over the kernel path: FLA's chunked KDA has a graph mode, the torch reference reads
        # sequence lengths on the host (it cannot be captured), and without FLA the torch path runs eagerly
        graphs = self._graphs_ok = self.kernels == "cuda" and config.cuda_graphs
        self.async_decode = config.async_decode if config.async_decode is not None else graphs
        self.prefill_graphs = config.prefill_graphs if config.prefill_graphs is not None else graphs
        self._inflight: _InFlight | None = None
        self._unreported: dict[str, GenerationResult] = {}  # finished while settling a step, for the next step()
        self._stop_error: StopCheckError | None = None  # raised while another call settled a step: for step()
        self._progress = 0  # step() calls that did any work (generate()'s check that something can run)
        self._overlapped = 0
        self._padded_steps = self._padding_tokens = self._split_checkpoints = 0
        self._capture_seconds = 0.0  # of prefill graphs since dropped (release_memory)
        self._steps = self._prefill_tokens = self._decode_tokens = self._generated = 0
        self._prefill_seconds = self._decode_seconds = 0.0
        # the graphs' scratch slot and page: pages no request can have (what _check_fits compares against)
        self._scratch_pages = (self.layout.pages_per_slot + 1) * (int(self._graphs_ok) + int(self.prefill_graphs))
        self._make_graphs()

    def _make_graphs(self) -> None:
        """The graph holders, with their scratch pages, as soon as the pool exists: taken at first use they could
        find it full (admission fills it to the last page) and stop the step."""
        one = self.layout.pages_per_slot + 1  # the least one request needs: a KDA slot and one MLA block
        if self._scratch_pages and self._scratch_pages > self.pool.num_pages - one:
            need = self._scratch_pages + one
            raise PoolError(f"the pool's {self.pool.num_pages} pages of {self.layout.page_bytes} bytes cannot hold "
                            f"the graphs' scratch ({self._scratch_pages} pages) and one request ({one} pages): set a "
                            f"budget of at least {need * self.layout.page_bytes} bytes ({need} pages), or "
                            f"prefill_graphs / cuda_graphs off")
        if self._graphs_ok:
            self._graphs = DecodeGraphs(self.runner, self.pool, self.config)
        if self.prefill_graphs:
            self._prefill_graphs = PrefillGraphs(self.runner, self.pool, capture=self._graphs_ok)

    def _runner(self, model, config: EngineConfig, compile: bool) -> ModelRunner:
        """The CPU kernels' runner for a float32 model on the CPU (``backend="auto"``), else the torch runner, whose
        ops take FLA's and Triton's kernels on CUDA. ``self.kernels`` says which ran (and ``stats().kernels``)."""
        if self.device.type == "cpu" and config.backend == "auto":
            if runner_cpu.supported(model):
                self.kernels = "cpu"
                return runner_cpu.CPURunner(model, self.layout, config.backend, compile=compile)
            if model.model.embed_tokens.weight.dtype == torch.float32 and not cpu_kernels.available():
                _warn_once(f"rlk3 CPU kernels unavailable ({cpu_kernels.unavailable_reason()}); the engine runs the "
                           "torch path, several times slower")
        gpu_kernels = self.device.type == "cuda" and config.backend == "auto" and fla_available()
        if self.device.type == "cuda" and config.backend == "auto" and not gpu_kernels:
            _warn_once("flash-linear-attention (fla-core, with triton) is not importable: the engine runs the torch "
                       "path on CUDA, eagerly (no CUDA graphs), several times slower")
        self.kernels = "cuda" if gpu_kernels else "torch"
        return ModelRunner(model, self.layout, config.backend, compile=compile, cudnn=config.cudnn_attention)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt_ids: Sequence[int] | torch.Tensor,
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        turn_ends: Sequence[int] = (),
    ) -> str:
        """Queues a prompt; returns its id. ``turn_ends``: positions in the prompt where earlier turns end (the
        agent loop's marks); the last block boundary at or before each keeps a KDA checkpoint in the prefix cache,
        as does the prompt's own end (``checkpoint_prompt_end``, which also keeps a tail checkpoint at each exact
        position, prefix_cache.py)."""
        self._settle()
        given, sampling = sampling, self._check_sampling(sampling)
        tokens, packed = self._check_tokens(prompt_ids, "prompt_ids")
        turn_ends = _turn_ends(turn_ends, len(tokens))
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:
                request_id = f"req-{next(self._ids)}"
        elif not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty str or None, got {request_id!r}")
        elif request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use (abort or release it first)")
        self._check_fits(len(tokens) + sampling.max_tokens, f"request {request_id!r}")
        req = Request(
            request_id=request_id, tokens=tokens, sampling=sampling, sampling_arg=given, **self._stream(sampling),
            arrival=next(self._arrivals), turn_start=len(tokens), packed=packed if self.prefix is not None else None,
        )
        self._mark_turn_ends(req, turn_ends, 0)
        self.requests[request_id] = req
        self.scheduler.enqueue(req)
        return request_id

    def extend(
        self,
        request_id: str,
        token_ids: Sequence[int] | torch.Tensor,
        sampling: SamplingParams | None = None,
        *,
        turn_ends: Sequence[int] = (),
    ) -> None:
        """Appends ``token_ids`` (tool output, the next user turn) to a paused or finished request and continues it
        as a new turn, reusing its cache: only the appended tokens (and the last sampled one) are computed.
        ``sampling`` defaults to the request's previous parameters (a fresh ``max_tokens`` budget)."""
        self._settle()
        req = self._get(request_id)
        if req.status not in (RequestStatus.PAUSED, RequestStatus.FINISHED):
            raise EngineError(
                f"extend: request {request_id!r} is {req.status.value}; only paused or finished requests can be "
                f"extended (pause it first)"
            )
        given = sampling
        sampling = self._check_sampling(given) if given is not None else req.sampling
        tokens, _ = self._check_tokens(token_ids, "token_ids")
        self._check_fits(len(req.tokens) + len(tokens) + sampling.max_tokens, f"request {request_id!r}")
        turn_ends = _turn_ends(turn_ends, len(tokens))
        # the previous turn's result, if this call's settling finished it, is the caller's already (the status it
        # read to extend): step() must not report it as the new turn's end
        self._unreported.pop(request_id, None)
        start = len(req.tokens)
        if given is not None and given is not req.sampling_arg and sampling.seed is not None:
            stream = self._stream(sampling)
            req.generator, req.seed = stream["generator"], stream["seed"]
        if given is not None:
            req.sampling_arg = given
        req.tokens += tokens
        req.sampling = sampling
        req.turn += 1
        req.turn_start = len(req.tokens)
        req.logprobs, req.versions, req.finish_reason = [], [], None
        req.arrival = next(self._arrivals)
        req.num_cached_tokens = req.num_computed  # this turn reuses what the request's cache holds
        self._mark_turn_ends(req, turn_ends, start)
        if req.has_cache:
            req.priority = next(self.scheduler._admissions)
            self.scheduler.add_running(req)
        else:
            self.scheduler.enqueue(req)

    def pause(self, request_ids: str | Iterable[str]) -> list[GenerationResult]:
        """Stops requests at their current token, keeping their cache (MLA pages and KDA state) for ``resume``.
        Returns their partial results. Pausing a paused request does nothing; a request that finished in the step
        this call settled (asynchronous decode) returns its final result, which ``step()`` then no longer reports."""
        self._settle()
        reqs = self._many(request_ids)
        for req in reqs:  # all checked before any is paused
            if req.status == RequestStatus.FINISHED and req.request_id not in self._unreported:
                raise EngineError(f"pause: request {req.request_id!r} is finished (extend or release it instead)")
        out = []
        for req in reqs:
            if req.status == RequestStatus.FINISHED:  # in the step this call settled: its final result
                out.append(self._unreported.pop(req.request_id))
                continue
            if req.status != RequestStatus.PAUSED:
                self.scheduler.remove(req)
                req.status = RequestStatus.PAUSED
            out.append(req.result())
        return out

    def resume(self, request_ids: str | Iterable[str]) -> None:
        """Continues paused requests where they stopped (recomputed first if their cache had to be dropped)."""
        self._settle()
        reqs = self._many(request_ids)
        for req in reqs:
            if req.status != RequestStatus.PAUSED:
                raise EngineError(f"resume: request {req.request_id!r} is {req.status.value}, not paused")
        for req in reqs:
            if req.has_cache:
                self.scheduler.add_running(req)
            else:
                self.scheduler.enqueue(req)

    def abort(self, request_ids: str | Iterable[str]) -> list[GenerationResult]:
        """Ends requests in any state and forgets them; unfinished ones end with ``FinishReason.ABORT``."""
        self._settle()
        out = []
        for req in self._many(request_ids):
            if req.status != RequestStatus.FINISHED:
                req.finish_reason = FinishReason.ABORT
            req.status = RequestStatus.FINISHED
            out.append(req.result())
            self._forget(req)
        return out

    def release(self, request_ids: str | Iterable[str]) -> None:
        """Forgets finished requests (their full blocks stay in the prefix cache); ``extend`` is no longer possible."""
        self._settle()
        reqs = self._many(request_ids)
        for req in reqs:
            if req.status != RequestStatus.FINISHED:
                raise EngineError(f"release: request {req.request_id!r} is {req.status.value}; abort it instead")
        for req in reqs:
            self._forget(req)

    def result(self, request_id: str) -> GenerationResult:
        """The current state of a request's turn (partial while it runs)."""
        self._settle()
        return self._get(request_id).result()

    def has_unfinished(self) -> bool:
        """Whether ``step()`` has work: requests to run, a step in flight, or finished results to report."""
        return bool(self.scheduler.waiting or self.scheduler.running or self._inflight or self._unreported)

    # ------------------------------------------------------------------ stepping

    @torch.no_grad()  # the prefill graphs' eager attention runs outside the runner's no_grad forward
    def step(self) -> list[GenerationResult]:
        """Runs one scheduler step (one forward pass); returns the results of requests that finished in it — with
        asynchronous decode, of those that finished in the step read back during this call (module docstring)."""
        if self.released:
            raise EngineError("step: the pool was released (release_memory); call reacquire_memory() first")
        if self._stop_error is not None:  # from a step settled by another call (its results stay unreported)
            error, self._stop_error = self._stop_error, None
            raise error
        finished = list(self._unreported.values())
        self._unreported.clear()
        try:
            self._step(finished)
        except BaseException:  # results already final are reported by the next call, not lost with this one
            for res in finished:
                self._unreported.setdefault(res.request_id, res)
            raise
        return finished

    def _step(self, finished: list[GenerationResult]) -> None:
        if self._inflight is not None:
            start, prev, self._inflight = time.perf_counter(), self._inflight, None
            try:
                after = self._lookahead(prev)  # launched before prev's tokens are on the host
            except BaseException:  # prev's tokens are still recorded (and reported by the next call)
                try:
                    self._settle_step(prev)
                finally:  # the step after it (its rows among prev's) may have run part of its forward
                    self._recompute(prev.reqs)
                raise
            try:
                finished += self._read_back(prev)
            finally:  # (also when a stop check raised: the step after is launched, its rows counted as computed)
                if after is not None:
                    for req in after.reqs:  # now that prev's tokens are appended (the block hashes need them)
                        self.scheduler.register(req)
                    self._inflight = after
            self._decode_seconds += time.perf_counter() - start
            if after is not None:
                return
        start = time.perf_counter()  # admission counts: a prefix hit's lookup and restore are part of its prefill
        plan = self.scheduler.schedule()
        if not plan:
            return
        self._progress += 1
        self.pool.flush()  # the slots admitted above are zeroed (a CUDA-graph replay reads the pool without a view)
        if self.async_decode and self._can_overlap(plan):
            reqs = [req for req, _ in plan]
            try:
                self._inflight = self._launch(reqs, self._decode_batch(reqs))
            except BaseException:
                self._recompute(reqs)
                raise
            for req in reqs:
                self.scheduler.register(req)
            self._decode_seconds += time.perf_counter() - start
            return
        try:
            logits = self._forward(self._batch(plan))
        except BaseException:
            self._recompute([req for req, _ in plan])
            raise
        wanted = [req for req, n in plan if req.num_computed + n == len(req.tokens)]
        for req, n in plan:
            req.num_computed += n
            self.scheduler.register(req)
        finished += self._sample(wanted, logits)
        elapsed = time.perf_counter() - start
        self._steps += 1
        multi = sum(n for _, n in plan if n > 1)
        self._prefill_tokens += multi
        self._decode_tokens += sum(n for _, n in plan if n == 1)
        if multi:
            self._prefill_seconds += elapsed
        else:
            self._decode_seconds += elapsed

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[GenerationResult]:
        """Generates one turn for each prompt (blocking) and returns the results in prompt order. The requests are
        released afterwards (their blocks stay in the prefix cache)."""
        if isinstance(prompts, torch.Tensor) or not isinstance(prompts, Sequence) or not prompts:
            raise ValueError("generate: prompts must be a non-empty list of token-id lists")
        if sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling] * len(prompts)
        elif isinstance(sampling, (Mapping, str, bytes)) or not isinstance(sampling, Iterable):
            raise ValueError(f"generate: sampling must be a SamplingParams (one for all prompts) or a list of them "
                             f"(one per prompt), got {type(sampling).__name__}")
        else:
            params = list(sampling)
            if len(params) != len(prompts):
                raise ValueError(f"generate: {len(prompts)} prompts but {len(params)} SamplingParams")
        ids = []
        try:
            for prompt, p in zip(prompts, params):
                ids.append(self.add_request(prompt, p))
            while any(self.requests[i].status != RequestStatus.FINISHED for i in ids):
                before = self._progress
                self.step()
                if self._progress == before:
                    raise EngineError("generate: no request could be scheduled (is a request paused?)")
            results = [self.requests[i].result() for i in ids]
        except BaseException:
            self.abort([i for i in ids if i in self.requests])
            raise
        self.release(ids)
        return results

    # ------------------------------------------------------------------ weights and memory

    @torch.no_grad()
    def update_weights(self, state_dict: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                       version: int) -> None:
        """Copies new weights into the model in place (a full or partial state dict, or an iterable of
        ``(name, tensor)`` pairs, e.g. streamed in buckets) and sets the policy version that tags every token
        sampled from now on. The prefix cache is invalidated. Requests keep their caches (computed under the old
        weights) unless ``recompute_on_weight_update``, which recomputes them under the new ones."""
        self._settle()
        if isinstance(version, bool) or not isinstance(version, int) or version <= self.version:
            raise ValueError(f"update_weights: version must be an int greater than the current {self.version}, "
                             f"got {version!r}")
        # every name of a tied weight (tie_word_embeddings: lm_head.weight is model.embed_tokens.weight): a state dict
        # lists both, and named_parameters() alone would leave the second out and refuse it as unknown
        params = dict(self.model.named_parameters(remove_duplicate=False))
        params.update(dict(self.model.named_buffers(remove_duplicate=False)))
        not_pairs = (str, bytes, torch.Tensor, torch.nn.Module)  # iterable, but not of (name, tensor) pairs
        if not isinstance(state_dict, Mapping) and (not isinstance(state_dict, Iterable)
                                                     or isinstance(state_dict, not_pairs)):
            raise ValueError(f"update_weights: state_dict must be a mapping of weight names to tensors (e.g. "
                             f"model.state_dict()) or an iterable of (name, tensor) pairs, got "
                             f"{type(state_dict).__name__}")
        items = list(state_dict.items() if isinstance(state_dict, Mapping) else state_dict)
        _check_weights(items, params)  # everything before touching anything: a failed update changes nothing
        for name, tensor in items:
            params[name].copy_(tensor)
        self.runner.refresh_weights()
        self.version = self.scheduler.version = version
        if self.prefix is not None:
            self.prefix.clear()
        if self.config.recompute_on_weight_update:
            for req in list(self.requests.values()):
                if req.status == RequestStatus.RUNNING:
                    self.scheduler.preempt(req)
                elif req.has_cache:
                    self.scheduler.drop_cache(req)

    def release_memory(self) -> None:
        """Frees the whole pool (colocation: training gets the memory). Every cache is dropped; requests stay and
        are recomputed after ``reacquire_memory``. ``step`` refuses to run in between."""
        self._settle()
        if self.released:
            return
        for req in list(self.requests.values()):  # not counted in stats(): its preemptions say memory pressure
            if req.status == RequestStatus.RUNNING:
                self.scheduler.preempt(req, count=False)
            elif req.has_cache:
                self.scheduler.drop_cache(req, count=False)
        if self.prefix is not None:
            self.prefix.clear()
        if self._prefill_graphs is not None:
            self._capture_seconds += self._prefill_graphs.capture_seconds
        for graphs in (self._graphs, self._prefill_graphs):  # they point into the pool and hold scratch pages
            if graphs is not None:
                graphs.close()
        self._graphs = self._prefill_graphs = None
        self.pool.release()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.released = True

    def reacquire_memory(self) -> None:
        """Re-creates the pool released by ``release_memory``."""
        self._settle()
        if not self.released:
            return
        self.pool.reacquire()
        self.released = False
        self._make_graphs()

    # ------------------------------------------------------------------ stats

    def stats(self) -> EngineStats:
        self._settle()
        counts = {s: 0 for s in RequestStatus}
        for req in self.requests.values():
            counts[req.status] += 1
        referenced = {p for r in self.requests.values() for p in r.pages + (r.slot or [])}
        cache_pages = set(self.prefix.pages_held()) if self.prefix is not None else set()
        pool = PoolStats(
            budget_bytes=self.pool.budget, allocated_bytes=self.pool.allocated_bytes,
            page_bytes=self.layout.page_bytes, block_size=self.layout.block_size,
            pages_per_slot=self.layout.pages_per_slot, total_pages=self.pool.num_pages,
            free_pages=self.pool.num_free, request_pages=len(referenced),
            prefix_cache_pages=len(cache_pages - referenced),
        )
        prefix = None
        if self.prefix is not None:
            c = self.prefix
            prefix = PrefixCacheStats(
                blocks=c.num_blocks, checkpoints=c.num_checkpoints, tails=c.num_tails, lookups=c.lookups, hits=c.hits,
                hit_tokens=c.hit_tokens, evictions=c.evictions, spilled_blocks=len(c.spilled),
                spilled_bytes=c.spilled_bytes, restores=c.restores, checkpoints_taken=c.checkpoints_taken,
                checkpoints_skipped=c.checkpoints_skipped, checkpoints_dropped=c.checkpoints_dropped,
                tails_taken=c.tails_taken, tail_hits=c.tail_hits,
            )
        return EngineStats(
            version=self.version, kernels=self.kernels, steps=self._steps, prefill_tokens=self._prefill_tokens,
            decode_tokens=self._decode_tokens, generated_tokens=self._generated,
            prefill_seconds=self._prefill_seconds, decode_seconds=self._decode_seconds,
            overlapped_steps=self._overlapped, padded_prefill_steps=self._padded_steps,
            split_checkpoints=self._split_checkpoints,
            prefill_padding_tokens=self._padding_tokens, prefill_capture_seconds=self._capture_seconds + (
                self._prefill_graphs.capture_seconds if self._prefill_graphs is not None else 0.0),
            preemptions=self.scheduler.preemptions, dropped_caches=self.scheduler.dropped_caches,
            shared_prefill_tokens=self.scheduler.shared_prefill_tokens,
            num_waiting=counts[RequestStatus.WAITING], num_running=counts[RequestStatus.RUNNING],
            num_paused=counts[RequestStatus.PAUSED], num_finished=counts[RequestStatus.FINISHED],
            pool=pool, prefix_cache=prefix,
        )

    def clear_prefix_cache(self) -> None:
        self._settle()
        if self.prefix is not None:
            self.prefix.clear()

    def check_invariants(self) -> None:
        """Raises ``AssertionError`` if the pool's bookkeeping is inconsistent: every page's reference count equals
        the references held by requests, the prefix cache and the CUDA-graph scratch; free pages are exactly those
        with none; the pool never holds more than its budget; every admitted request has room for what it
        computed; every request is in its status's queue once, and a running one has a token to compute (or it
        would never be scheduled again). A debugging aid (the stress test calls it every step); O(pages)."""
        self._settle()
        pool, sched = self.pool, self.scheduler
        assert pool.allocated_bytes <= pool.budget, (pool.allocated_bytes, pool.budget)
        for queue, status in ((sched.running, RequestStatus.RUNNING), (sched.waiting, RequestStatus.WAITING)):
            assert len({id(r) for r in queue}) == len(queue), f"a request is {status.value} twice"
            for req in queue:
                assert req.status == status and self.requests.get(req.request_id) is req, req.request_id
        for req in self.requests.values():
            assert 0 <= req.num_computed <= len(req.tokens), (req.request_id, req.num_computed, len(req.tokens))
            if req.status == RequestStatus.RUNNING:
                assert req.pending >= 1, f"running request {req.request_id!r} has nothing to compute"
        if self.released:
            assert pool.allocated_bytes == 0
            return
        refs = [0] * pool.num_pages
        for req in self.requests.values():
            for p in req.pages + (req.slot or []) + (req.split_slot or []):
                refs[p] += 1
            if req.slot is not None:
                assert req.status != RequestStatus.WAITING, req.request_id
                assert len(req.slot) == self.layout.pages_per_slot
                if self.layout.mla_layers:
                    assert len(req.pages) * self.layout.block_size >= req.num_computed, req.request_id
            else:
                assert req.num_computed == 0 and not req.pages, req.request_id
            if req.status == RequestStatus.RUNNING:
                assert req in self.scheduler.running and req.slot is not None, req.request_id
            if req.status == RequestStatus.WAITING:
                assert req in self.scheduler.waiting, req.request_id
        if self.prefix is not None:
            for p in self.prefix.pages_held():
                refs[p] += 1
            self.prefix.check()
        for graphs in (self._graphs, self._prefill_graphs):
            for p in graphs.scratch if graphs is not None else []:
                refs[p] += 1
        assert refs == pool.refcount, "page reference counts disagree with their holders"
        free = set(pool._free)
        assert len(free) == len(pool._free), "a page is on the free list twice"
        assert free == {p for p, n in enumerate(refs) if n == 0}, "free list disagrees with reference counts"

    # ------------------------------------------------------------------ internals

    def _get(self, request_id: str) -> Request:
        req = self.requests.get(request_id) if isinstance(request_id, str) else None
        if req is None:
            raise UnknownRequestError(f"unknown request id {request_id!r}")
        return req

    def _many(self, request_ids: str | Iterable[str]) -> list[Request]:
        if isinstance(request_ids, str):
            ids = [request_ids]
        elif isinstance(request_ids, Iterable) and not isinstance(request_ids, (bytes, bytearray, Mapping)):
            ids = list(request_ids)
        else:
            raise ValueError(f"request ids must be a str or an iterable of str, got {type(request_ids).__name__}")
        # all checked before any is touched; a repeated id counts once (resuming a request twice would queue it
        # twice, and its second admission would overwrite its cache's pages without freeing them)
        return list({id(r): r for r in map(self._get, ids)}.values())

    def _forget(self, req: Request) -> None:
        self._unreported.pop(req.request_id, None)
        self.scheduler.remove(req)
        if req.has_cache or req.pages:
            self.scheduler.free_cache(req)
        del self.requests[req.request_id]

    def _check_sampling(self, sampling) -> SamplingParams:
        sampling = sampling if sampling is not None else SamplingParams()
        if not isinstance(sampling, SamplingParams):
            raise ValueError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        # the request's own copy, validated again: the caller may have set fields since constructing it (or go on
        # to edit it for the next batch while this request is queued)
        sampling = dataclasses.replace(sampling)
        bad = [t for t in sampling.stop_token_ids if t >= self.vocab_size]
        if bad:
            raise ValueError(f"SamplingParams.stop_token_ids {bad} are out of the vocabulary [0, {self.vocab_size})")
        if sampling.stop and self.tokenizer is None:
            raise ValueError("SamplingParams.stop (stop strings) needs a tokenizer: RolloutEngine(..., tokenizer=...)")
        return sampling

    def _check_tokens(self, ids, name: str) -> tuple[list[int], array.array]:
        """The ids as a list of ints, and packed as int64s: one C-level pass that the range check reads (min and max
        of a 20K-token list in Python took 0.47 ms) and the prefix cache's block hashes read again at admission."""
        tokens = _token_list(ids, name)
        if not tokens:
            raise ValueError(f"{name} is empty; at least one token is needed")
        try:
            packed = array.array("q", tokens)
        except OverflowError:  # beyond int64: out of any vocabulary
            packed = None
        lo, hi = ((min(tokens), max(tokens)) if packed is None
                  else (int(x) for x in torch.frombuffer(packed, dtype=torch.long).aminmax()))
        if packed is None or lo < 0 or hi >= self.vocab_size:
            raise ValueError(f"{name} has token ids out of the vocabulary [0, {self.vocab_size}): min {lo}, max {hi}")
        return tokens, packed

    def _check_fits(self, total_tokens: int, what: str) -> None:
        limit = self.config.max_model_len
        if limit is not None and total_tokens > limit:
            raise ValueError(f"{what} needs {total_tokens} tokens (prompt + max_tokens), over max_model_len={limit}")
        need, room = self.scheduler.pages_for(total_tokens), self.pool.num_pages - self._scratch_pages
        if need > room:
            scratch = f", {self._scratch_pages} of them the graphs' scratch" if self._scratch_pages else ""
            raise ValueError(
                f"{what} needs {total_tokens} tokens (prompt + max_tokens) = {need} pages of "
                f"{self.layout.page_bytes} bytes ({need * self.layout.page_bytes} bytes), but the whole pool is "
                f"{self.pool.num_pages} pages ({self.pool.num_pages * self.layout.page_bytes} bytes{scratch})"
            )

    def _stream(self, sampling: SamplingParams) -> dict:
        """A request's random stream: its seed and the generator seeded with it."""
        seed = sampling.seed
        if seed is None:  # drawn from the engine's seed: reproducible given the same sequence of calls
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
        return dict(seed=seed, generator=torch.Generator(device=self.device).manual_seed(generator_seed(seed)))

    def _mark_turn_ends(self, req: Request, turn_ends: list[int], offset: int) -> None:
        B = self.config.prefix_block_tokens
        for pos in turn_ends:  # (checked by ``_turn_ends``)
            req.marks.add((offset + pos) // B)
            if self.config.checkpoint_prompt_end and (offset + pos) % B:
                req.tail_marks.add(offset + pos)
        if self.config.checkpoint_prompt_end:
            req.marks.add(len(req.tokens) // B)
        req.marks.discard(0)

    def _batch(self, plan: list[tuple[Request, int]]) -> ForwardBatch:
        """The runner's view of a step (see ``ForwardBatch``): packed tokens, pages, and the gather indices. The
        per-token indices are tensor arithmetic over the per-sequence starts and lengths (not four Python calls per
        token), sent to the device in one copy (not a pageable copy and a sync per tensor). An all-prefill step that
        the prefill graphs take is padded to its bucket (``GraphPad``): a padding sequence over the padding tokens,
        then empty sequences, all on the graphs' scratch slot and page."""
        if plan[-1][1] == 1:  # single-token sequences come first: this step is all decode
            return self._decode_batch([req for req, _ in plan])
        bs, W, N = self.layout.block_size, self.layout.conv_width, len(plan)
        has_mla = bool(self.layout.mla_layers)
        ids, logit_rows, starts, lens, multi, slots, tables, seq_lens = [], [], [], [], [], [], [], []
        width = max(math.ceil((r.num_computed + n) / bs) for r, n in plan) if has_mla else 1
        for req, n in plan:
            start = req.num_computed
            ids += req.tokens[start : start + n]
            if start + n == len(req.tokens):
                logit_rows.append(len(ids) - 1)
            if n > 1:
                starts.append(start)
                lens.append(n)
                multi.append(req)
            slots.append(req.slot)
            used = math.ceil((start + n) / bs)
            tables.append(req.pages[:used] + [0] * (width - used))
            seq_lens.append(start + n)
        T, L = len(ids), len(logit_rows)
        lens_all = [n for _, n in plan]
        bucket = self._prefill_bucket(T, N) if plan[0][1] > 1 else None
        if bucket is not None:  # padded: the padding tokens are one sequence, then empty ones up to the bucket
            T_pad, N_pad = bucket
            graphs = self._prefill_graphs
            ids += [0] * (T_pad - T)
            lens_all += [T_pad - T] + [0] * (N_pad - N - 1)
            slots += [graphs.scratch_slot()] * (N_pad - N)
            logit_rows += [0] * (N_pad - L)
        n_all = len(lens_all)
        n_seq = _longs(lens_all)
        row0 = n_seq.cumsum(0) - n_seq  # each sequence's first row among the step's tokens
        seq = torch.repeat_interleave(torch.arange(n_all), n_seq, output_size=len(ids))  # each token's sequence
        local = torch.arange(len(ids)) - row0[seq]  # each token's index inside its sequence's chunk

        def conv_rows(s, r0, p):
            """Buffer rows of chunk inputs p of sequences s (p < 0: the sequence's conv cache, kernel − 1 rows)."""
            return torch.where(p >= 0, n_all * W + r0 + p, s * W + W + p)

        taps = torch.arange(W + 1) - W  # tap j of token i reads input i − W + j
        conv_src = conv_rows(seq[:, None], row0[seq][:, None], local[:, None] + taps)
        conv_new = conv_rows(torch.arange(n_all)[:, None], row0[:, None], n_seq[:, None] + taps[:-1])  # last W inputs
        table = _longs(tables).view(len(tables), width)
        if has_mla:
            real = seq[:T]
            pos = _longs(seq_lens)[real] - n_seq[real] + local[:T]  # each token's position in its sequence
            write_pages, write_offsets = table[real, pos // bs], pos % bs
            if bucket is not None:  # padding tokens write the scratch page
                write_pages = torch.cat([write_pages, torch.full((len(ids) - T,), graphs.scratch_page())])
                write_offsets = torch.cat([write_offsets, local[T:] % bs])
        else:
            write_pages = write_offsets = torch.zeros(0, dtype=torch.long)
        slot_t = _longs(slots).view(n_all, self.layout.pages_per_slot)
        cu = torch.cat([torch.zeros(1, dtype=torch.long), n_seq.cumsum(0)])
        nd = N - len(multi)
        split, split_host = self._kda_split(plan, nd, lens_all, row0, len(ids), bucket is not None, conv_rows,
                                            conv_new)
        # the fixed-layout part first (runner.static_parts: a prefill graph copies it in one operation)
        parts = [_longs(ids), slot_t, write_pages, write_offsets, _longs(logit_rows),
                 conv_src, conv_new, cu, *split.values(), table, _longs(seq_lens)]
        buf = torch.cat([x.reshape(-1) for x in parts])
        if self.device.type != "cpu":
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        views = [x.view(p.shape) for x, p in zip(buf.split([x.numel() for x in parts]), parts)]
        ids_t, slots_t, pages_t, offsets_t, rows_t, src_t, new_t, cu_t = views[:8]
        table_t, seq_lens_t = views[-2:]
        batch = ForwardBatch(
            input_ids=ids_t, num_decode=nd, prefill_starts=starts, prefill_lens=lens,
            slot_pages=slots_t, block_tables=table_t, seq_lens=seq_lens_t, write_pages=pages_t,
            write_offsets=offsets_t, logit_rows=rows_t, conv_src=src_t, conv_new=new_t,
        )
        S = 0
        if split:
            batch.kda_split = KdaSplit(**dict(zip(split, views[8:-2])), **split_host)
            S = split["ckpt"].shape[0]
            self._split_checkpoints += S
        if bucket is not None:
            fixed = sum(math.prod(shape) for _, shape in static_parts(len(ids), n_all, self.layout, S,
                                                                      self.runner.kda_chunk_size))
            batch.prefill_offsets = (cu_t, cu)
            batch.pad = GraphPad(tokens=T, seqs=n_all, logits=L, static=buf[:fixed], splits=S)
        if has_mla and len(multi) > 1:
            batch.packed = self._packed_groups(multi, starts, lens)
        return batch

    def _kda_split(self, plan, nd: int, lens: list[int], row0: torch.Tensor, rows: int, padded: bool,
                   conv_rows, conv_new: torch.Tensor) -> tuple[dict[str, torch.Tensor], dict]:
        """``KdaSplit``'s tensors (host) for the sequences the scheduler split at a checkpoint boundary inside their
        chunk (``Request.split_at``), in ``runner.split_parts`` order, and its host fields; empty when there are
        none. ``lens`` and ``row0`` cover every sequence of the step (padding ones included), ``rows`` its
        tokens; ``conv_rows`` maps (sequence, first row, chunk inputs) to rows of the conv buffer, ``conv_new`` holds
        every sequence's new conv cache's rows there (the checkpoints' rows follow them). A padded step's KDA
        input has room for a chunk of identity rows per checkpoint (a shape that depends only on the count); what a
        step does not use goes to its padding sequence."""
        at = {i: (req.split_at - req.num_computed, req.split_slot) for i, (req, _) in enumerate(plan)
              if req.split_at is not None}
        if not at:
            return {}, {}
        C, M = self.runner.kda_chunk_size, len(lens) - nd
        front = [0] * M  # identity rows in front of each multi-token sequence
        conv, ckpt = [], []
        for i, (a, ck) in at.items():
            front[i - nd] = -a % C  # then the boundary, a rows in, starts a chunk
            conv.append(conv_rows(torch.tensor(i), row0[i], a - self.layout.conv_width + torch.arange(
                self.layout.conv_width)))
            ckpt.append(ck)
        seg = [n + f for n, f in zip(lens[nd:], front)]
        if padded:  # the slack up to a chunk per checkpoint: identity rows at the end of the padding sequence
            seg[len(plan) - nd] += C * len(at) - sum(front)
        chunks = torch.tensor([0] + [-(-n // C) for n in seg]).cumsum(0)  # each sequence's first chunk in h
        hidx = [int(chunks[i - nd]) + (front[i - nd] + a) // C for i, (a, _) in at.items()]
        cu = torch.tensor([0, *seg]).cumsum(0)
        n = _longs(lens[nd:])
        shift = (cu[:-1] + _longs(front)) - (row0[nd:] - nd)  # a row's padded place: its own plus its sequence's shift
        dst = torch.arange(rows - nd) + torch.repeat_interleave(shift, n, output_size=rows - nd)
        src = torch.zeros(int(cu[-1]), dtype=torch.long).index_copy_(0, dst, torch.arange(rows - nd))
        identity = torch.ones(int(cu[-1]), dtype=torch.bool).index_fill_(0, dst, False)
        host = dict(padded_rows=int(cu[-1]), cu_cpu=cu,
                    lens_before=[at[i][0] if i in at else lens[i] for i in range(nd, len(lens))],
                    lens_after=[lens[i] - at[i][0] if i in at else 0 for i in range(nd, len(lens))])
        pps = self.layout.pages_per_slot
        return dict(rows=dst, src=src, ident=identity.nonzero()[:, 0], kda_cu=cu, hidx=_longs(hidx),
                    conv_rows=torch.cat([conv_new, torch.stack(conv)]),
                    ckpt=_longs([p for c in ckpt for p in c]).view(len(ckpt), pps)), host

    def _prefill_bucket(self, tokens: int, seqs: int) -> tuple[int, int] | None:
        """The padded shape of an all-prefill step the prefill graphs take, or None (it runs as it is)."""
        if not self.prefill_graphs:
            return None
        bucket = prefill_bucket(tokens, seqs, self.config.max_tokens_per_step)
        if bucket is None:
            return None
        return bucket

    def _packed_groups(self, multi: list[Request], starts: list[int], lens: list[int]) -> list[PackedPrefill]:
        """Runs of consecutive multi-token sequences whose masked attention stays under ``PACKED_PREFILL_MAX``
        entries (new tokens x their cached + new tokens), each run attended in one call; a sequence left alone in
        its run attends by itself (the runner's per-sequence path)."""
        dev, bs = self.device, self.layout.block_size
        kind = "cuda" if dev.type == "cuda" else "cpu"
        packed_max, split = PACKED_PREFILL_MAX[kind], PACKED_PREFILL_RUNS[kind]
        runs, run, q, k = [], [], 0, 0
        for j, (a, n) in enumerate(zip(starts, lens)):
            if split and run and (q + n) * (k + a + n) > packed_max:
                runs.append(run)
                run, q, k = [], 0, 0
            run.append(j)
            q, k = q + n, k + a + n
        runs.append(run)
        groups = []
        for run in runs:
            q = sum(lens[j] for j in run)
            k = sum(starts[j] + lens[j] for j in run)
            if len(run) < 2 or q * k > packed_max:
                continue
            a, n = torch.tensor([starts[j] for j in run]), torch.tensor([lens[j] for j in run])
            seg = torch.tensor(run)
            q_seg, k_seg = seg.repeat_interleave(n, output_size=q), seg.repeat_interleave(a + n, output_size=k)
            q_pos = a.repeat_interleave(n, output_size=q) + _ranges(n, q)  # new tokens: positions a .. a + n − 1
            k_pos = _ranges(a + n, k)  # keys: every position 0 .. a + n − 1
            width = max(len(multi[j].pages) for j in run)
            table = torch.tensor([multi[j].pages + [0] * (width - len(multi[j].pages)) for j in run])
            pages = table[torch.arange(len(run)).repeat_interleave(a + n, output_size=k), k_pos // bs]
            parts = torch.cat([q_seg, q_pos, k_seg, k_pos, pages])
            if dev.type != "cpu":
                parts = parts.pin_memory().to(dev, non_blocking=True)
            q_seg, q_pos, k_seg, k_pos, pages = parts.split([q, q, k, k, k])
            # the mask is built where it is used: the vectors are O(tokens), the mask O(tokens²)
            mask = (q_seg[:, None] == k_seg[None, :]) & (k_pos[None, :] <= q_pos[:, None])
            groups.append(PackedPrefill(run[0], run[-1] + 1, pages, k_pos % bs, mask))
        return groups

    def _decode_batch(self, reqs: list[Request], ids: torch.Tensor | None = None) -> ForwardBatch:
        """``_batch`` for a step of one token per sequence, the common case, in a few list passes and one host-to-
        device copy, where the general builder makes per-token index lists (with scheduling, ~1.3 against ~0.65 ms
        of host time per batch-128 step on a 2-core VM). The conv gather indices depend only on the batch size.
        ``ids``: the input tokens as a device tensor (a step launched ahead: not on the host yet), every row at its
        sequence's end."""
        bs, N, dev = self.layout.block_size, len(reqs), self.device
        pos = [r.num_computed for r in reqs]
        cols = [self.layout.pages_per_slot, 1, 1, 1, 1]  # slot pages, token, sequence length, write page, offset
        flat = [page for r in reqs for page in r.slot] if self.layout.pages_per_slot else []
        flat += [r.tokens[p] for r, p in zip(reqs, pos)] if ids is None else [0] * N
        flat += [p + 1 for p in pos]
        if self.layout.mla_layers:
            used = [p // bs + 1 for p in pos]
            width = max(used)
            flat += [r.pages[u - 1] for r, u in zip(reqs, used)]
            flat += [p % bs for p in pos]
            for r, u in zip(reqs, used):
                flat += r.pages[:u]
                flat += [0] * (width - u)
        else:
            width = 1
            flat += [0] * (3 * N)
        cols.append(width)
        buf = _longs(flat)
        if dev.type != "cpu":
            buf = buf.pin_memory().to(dev, non_blocking=True)
        slots, host_ids, seq_lens, write_pages, write_offsets, tables = buf.split([c * N for c in cols])
        rows, conv_src, conv_new = self._decode_indices(N)
        if ids is None:
            ids = host_ids
            # a one-token step is not always a sequence's last pending token (a prefill cut at a checkpoint boundary,
            # a fork point or by memory): only rows that reach the end have logits wanted
            wanted = [i for i, (r, p) in enumerate(zip(reqs, pos)) if p + 1 == len(r.tokens)]
            if len(wanted) < N:
                rows = torch.tensor(wanted, dtype=torch.long, device=dev)
        return ForwardBatch(
            input_ids=ids, num_decode=N, prefill_starts=[], prefill_lens=[], slot_pages=slots.view(N, cols[0]),
            block_tables=tables.view(N, width), seq_lens=seq_lens, write_pages=write_pages, write_offsets=write_offsets,
            logit_rows=rows, conv_src=conv_src, conv_new=conv_new,
        )

    def _decode_indices(self, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Logit rows and the short conv's gather indices of an all-decode batch of ``n`` (cached per size): token
        t's taps read its sequence's kernel − 1 cached rows, then its own new row."""
        hit = self._decode_index_cache.get(n)
        if hit is None:
            hit = (torch.arange(n, device=self.device), *decode_conv_indices(n, self.layout.conv_width, self.device))
            self._decode_index_cache[n] = hit
        return hit

    def _forward(self, batch: ForwardBatch) -> torch.Tensor:
        if batch.pad is not None:
            self._padded_steps += 1
            self._padding_tokens += batch.input_ids.shape[0] - batch.pad.tokens
            return self._prefill_graphs.run(batch)
        if self._graphs_ok and not batch.prefill_lens:
            logits = self._graphs.run(batch)  # every row's logits: keep the wanted ones
            if logits is not None:
                return logits if batch.logit_rows.numel() == batch.num_decode else logits[batch.logit_rows]
        return self.runner.forward(self.pool, batch)

    def _sample(self, wanted: list[Request], logits: torch.Tensor) -> list[GenerationResult]:
        if not wanted:
            return []
        try:
            keys = self._keys(wanted) if self.counter_sampling else None
            tokens, logprobs = sample(logits, [r.sampling for r in wanted], [r.generator for r in wanted], keys=keys,
                                      cpu_kernels=self.kernels == "cpu")
        except BaseException:
            self._recompute(wanted)
            raise
        return self._append_all(zip(wanted, tokens, logprobs))

    def _recompute(self, reqs: list[Request]) -> None:
        """After a step that raised in its forward or its draw: its requests are recomputed from the start
        (preempted) when they next run. A forward that raised part-way may have advanced KDA states and conv
        caches in place (a layer at a time) that their token counts do not show, and a draw that raised leaves
        requests whose last token was computed with nothing pending, never to be scheduled again."""
        for req in reqs:
            if req.status == RequestStatus.RUNNING and req in self.scheduler.running:
                self.scheduler.preempt(req)

    def _append_all(self, drawn: Iterable[tuple[Request, int, float]]) -> list[GenerationResult]:
        """Records a step's draws. A request whose stop check raised is ended with its tokens kept, the others are
        recorded regardless, and the error is raised once all are: the step's finished results (that request's
        among them) are then reported by the next ``step()``."""
        finished, error = [], None
        for req, tok, lp in drawn:
            try:
                finished += self._append(req, tok, lp)
            except StopCheckError as e:
                finished.append(req.result())
                error = error or e
        if error is not None:
            for res in finished:
                self._unreported[res.request_id] = res
            raise error
        return finished

    def _keys(self, reqs: list[Request]) -> torch.Tensor:
        """The counter sampler's (seed, position of the token being drawn) rows, the seed as an int64. The
        position is ``num_computed``: every token before the drawn one has been computed (and, outside a step
        launched ahead of its predecessor's read-back, ``len(tokens)`` equals it)."""
        return to_device([[counter_key(r.seed), r.num_computed] for r in reqs], self.device)

    def _append(self, req: Request, token: int, logprob: float) -> list[GenerationResult]:
        """Records a sampled token; returns the request's result if it finished with it."""
        req.tokens.append(token)
        req.logprobs.append(logprob)
        req.versions.append(self.version)
        self._generated += 1
        try:
            reason = self._finish_reason(req, token)
        except Exception as e:  # the caller's tokenizer, decoding for the stop strings
            self._finish(req, FinishReason.ABORT)
            raise StopCheckError(
                f"request {req.request_id!r}: its stop strings could not be checked, the tokenizer's decode raised "
                f"{type(e).__name__}: {e}; the request was ended (finish_reason abort) with its {len(req.logprobs)} "
                f"tokens of this turn kept, and every other request of the step was recorded") from e
        if reason is None:
            return []
        self._finish(req, reason)
        if self.config.checkpoint_generation_end:
            self.scheduler.save_tail(req, evict=False)
        return [req.result()]

    def _finish(self, req: Request, reason: FinishReason) -> None:
        req.finish_reason = reason
        self.scheduler.running.remove(req)
        req.status = RequestStatus.FINISHED
        self.scheduler.mark_finished(req)

    # -- asynchronous decode (module docstring)

    def _can_overlap(self, plan: list[tuple[Request, int]]) -> bool:
        """A scheduled step may run ahead of its read-back: all decode, every row wanting its next token, and no
        row drawing from a per-request generator (a dropped draw would shift its stream)."""
        return all(n == 1 and req.num_computed + 1 == len(req.tokens) for req, n in plan) and (
            self.counter_sampling or all(req.sampling.greedy for req, _ in plan))

    def _launch(self, reqs: list[Request], batch: ForwardBatch) -> _InFlight:
        """Forward and sample a decode batch; the tokens stay on the device, a non-blocking copy brings them back."""
        logits = self._forward(batch)
        for req in reqs:
            req.num_computed += 1
        keys = self._keys(reqs) if self.counter_sampling else None  # (a raise here: the caller's ``_recompute``)
        tokens, logprobs = sample_tensors(logits, [r.sampling for r in reqs], [r.generator for r in reqs], keys=keys)
        host, done = torch.stack([tokens.double(), logprobs.double()]), None
        if host.is_cuda:
            pinned = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
            host, done = pinned.copy_(host, non_blocking=True), torch.cuda.Event()
            done.record()
        self._steps += 1
        self._decode_tokens += len(reqs)
        return _InFlight(reqs, tokens, host, done)

    def _lookahead(self, prev: _InFlight) -> _InFlight | None:
        """The decode step after ``prev``, launched before ``prev``'s tokens are read: its inputs are ``prev``'s
        sampled ids on the device. Only when it is the step the scheduler would plan — nothing waiting, forking or
        prefilling, every running request in ``prev``, pages for the new positions free without reclaiming — less
        the requests ``prev`` ends by length (known now). Requests ``prev`` ends with a stop token are in it (not
        known yet): it computes their stop token and its draw for them is dropped. None: read back first."""
        sched, cfg = self.scheduler, self.config
        if sched.waiting or sched.leaders:
            return None
        live = [r for r in prev.reqs if r.status == RequestStatus.RUNNING]  # the step before may have ended some
        if len(live) != len(sched.running):
            return None
        keep = [i for i, r in enumerate(prev.reqs) if r.status == RequestStatus.RUNNING and not self._at_length(r, 1)]
        reqs = [prev.reqs[i] for i in keep]
        if not reqs or len(reqs) > min(cfg.max_num_seqs, cfg.max_tokens_per_step):
            return None
        if not (self.counter_sampling or all(r.sampling.greedy for r in reqs)):
            return None
        if self.layout.mla_layers:
            bs = self.layout.block_size
            grow = [r for r in reqs if r.num_computed >= len(r.pages) * bs]
            if len(grow) > self.pool.num_free:
                return None
            for r in grow:
                r.pages += self.pool.alloc(1)
        ids = prev.tokens if len(keep) == len(prev.reqs) else prev.tokens[to_device(keep, self.device)]
        self._progress += 1
        self._overlapped += 1
        return self._launch(reqs, self._decode_batch(reqs, ids=ids))

    def _at_length(self, req: Request, ahead: int = 0) -> bool:
        """Whether the turn has reached its length limit (``max_tokens``, ``max_model_len``) — with ``ahead`` tokens
        still in flight counted."""
        if req.num_generated + ahead >= req.sampling.max_tokens:
            return True
        return self.config.max_model_len is not None and len(req.tokens) + ahead >= self.config.max_model_len

    def _read_back(self, step: _InFlight) -> list[GenerationResult]:
        """Waits for a launched step's tokens and records them; rows of requests that finished in the step before
        (their stop token was computed ahead) are dropped."""
        if step.done is not None:
            step.done.synchronize()
        self._progress += 1
        tokens, logprobs = step.host.tolist()
        return self._append_all(
            (req, int(tok), lp) for req, tok, lp in zip(step.reqs, tokens, logprobs)
            if req.status == RequestStatus.RUNNING and self.requests.get(req.request_id) is req)

    def _settle(self) -> None:
        """Reads back the step in flight, keeping its finished results for the next ``step()``. A stop check that
        raised in it is raised by that ``step()`` too, not by whichever call settled (``result``, ``pause``...)."""
        if self._inflight is not None:
            step, self._inflight = self._inflight, None
            try:
                self._settle_step(step)
            except StopCheckError as e:
                self._stop_error = self._stop_error or e

    def _settle_step(self, step: _InFlight) -> None:
        for res in self._read_back(step):
            self._unreported[res.request_id] = res

    def _finish_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.sampling
        if token in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop:
            text = self._turn_tail_text(req, max(len(s) for s in p.stop))
            if any(s in text for s in p.stop):
                return FinishReason.STOP
        return FinishReason.LENGTH if self._at_length(req) else None

    def _turn_tail_text(self, req: Request, longest: int) -> str:
        """The text this turn's last tokens add, enough to hold a stop string of ``longest`` characters completed by
        the last token: a window of the turn's tokens (each at least one byte of text, so ``4 * longest`` of them
        hold any such string; sliced from its start, never the whole turn: that made long generations' stop checks
        quadratic). Where the window reaches the turn's start it is decoded after ``STOP_CONTEXT_TOKENS`` tokens
        before it (the prompt's or the extension's) and only what it adds is kept: decoded alone, it loses what
        depends on the tokens before it, as vLLM's incremental detokenizer knows (its prefix offset) — a
        SentencePiece / Metaspace decoder drops the leading space of the first piece it is given (" Observation" as
        a turn's first token read "Observation"), and a first token that completes a multi-byte character begun
        before it reads U+FFFD."""
        end = len(req.tokens)
        start = max(req.turn_start, end - (4 * longest + 8))
        if start > req.turn_start:
            # a window inside the turn needs no context: what decoding it alone gets wrong (a dropped space, a
            # character begun before it) lies in its first 4 tokens, and its 8 tokens over 4 * longest are never
            # part of a stop string the last token completes. One decode, as many as before the context
            return self.tokenizer.decode(req.tokens[start:end])
        context = max(0, start - STOP_CONTEXT_TOKENS)
        head = self.tokenizer.decode(req.tokens[context:start]) if context < start else ""
        text = self.tokenizer.decode(req.tokens[context:end])
        # what the window adds is the text past the context's. Where the context ends inside a character its text
        # ends in U+FFFD (one per byte with byte fallback) that the whole decode replaces by the character: the
        # common prefix then leaves that character to the window, never a character of the window to the context
        keep = len(head)
        if not text.startswith(head):
            keep = next((i for i, (a, b) in enumerate(zip(head, text)) if a != b), min(len(head), len(text)))
        return text[keep:]
