"""A request's life in the engine, and the typed result the rollout layer reads."""

from __future__ import annotations

import array
import enum
from dataclasses import dataclass, field

import torch

from rlk3.engine.config import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued; no cache in the pool (new, preempted, or its cache was dropped)
    RUNNING = "running"  # admitted: a KDA slot and MLA pages; prefilling or decoding
    PAUSED = "paused"  # stopped by pause(); keeps its cache unless memory pressure forced it out
    FINISHED = "finished"  # this turn is over; the cache stays (reclaimable) until extend() or release()


class FinishReason(enum.Enum):
    STOP = "stop"  # a stop token or stop string
    LENGTH = "length"  # max_tokens of this turn, or max_model_len
    ABORT = "abort"  # abort()


@dataclass
class GenerationResult:
    """One turn of one request: what the trainer needs per generated token."""

    request_id: str
    prompt_token_ids: list[int]  # everything before this turn's generation (earlier turns and extensions included)
    token_ids: list[int]  # generated in this turn
    logprobs: list[float]  # per generated token, under softmax(logits / temperature) (greedy: softmax(logits))
    versions: list[int]  # per generated token, the policy version (update_weights) that sampled it
    status: RequestStatus
    finish_reason: FinishReason | None  # None while the turn is unfinished (paused, running)
    turn: int  # 0 for the first add_request, +1 per extend()
    num_cached_tokens: int  # prompt tokens of this turn not computed for it: in the request's cache or the prefix cache


@dataclass(eq=False)
class Request:
    request_id: str
    tokens: list[int]  # the whole sequence: prompt, generated tokens, appended tool output, ...
    sampling: SamplingParams  # the request's own copy (engine._check_sampling)
    generator: torch.Generator
    seed: int  # the request's seed (drawn from the engine's when the request brought none): the counter sampler's key
    arrival: int  # FIFO order of add_request / extend
    turn_start: int  # tokens[turn_start:] are this turn's generated tokens
    # the object the caller passed: an extend given the same object again continues the random stream, a new
    # one with a seed starts that seed's stream (by identity: ``sampling`` is the engine's copy of it)
    sampling_arg: SamplingParams | None = field(default=None, repr=False)
    marks: set[int] = field(default_factory=set)  # block boundaries that want a KDA checkpoint (turn ends)
    tail_marks: set[int] = field(default_factory=set)  # positions off a boundary that want a tail checkpoint
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    turn: int = 0
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # -- cache state
    slot: list[int] | None = None  # KDA state pages
    pages: list[int] = field(default_factory=list)  # MLA pages, token t in pages[t // block_size]
    num_computed: int = 0  # tokens whose KDA state and MLA entries are in the cache
    num_registered: int = 0  # leading blocks already handed to the prefix cache
    keys: list[bytes] = field(default_factory=list)  # chained hashes of the leading full blocks
    # the prompt as add_request packed it (int64s) until its blocks are hashed: the hashes read slices of it instead
    # of packing each block of a re-sent conversation again
    packed: array.array | None = field(default=None, repr=False)
    priority: int = 0  # admission order: older admitted requests are served and kept first
    num_cached_tokens: int = 0
    cache_version: int = 0  # the weight version its cache was computed under (from num_computed = 0)
    finish_seq: int = 0  # order of finishing: the oldest finished cache is reclaimed first
    # -- shared prefill (EngineConfig.share_prefill): requests with one prompt compute it once
    fork_at: int = 0  # as a leader: the position where its followers take a copy of its cache (prompt length - 1)
    followers: list[Request] = field(default_factory=list, repr=False)  # waiting for this request to reach fork_at
    leader: Request | None = field(default=None, repr=False)  # as a follower: whose prefill it waits for
    # this step's KDA checkpoint inside the chunk (Scheduler.split): its position and the slot reserved for it
    split_at: int | None = None
    split_slot: list[int] | None = None

    @property
    def pending(self) -> int:
        """Tokens known but not yet fed through the model (the last sampled token, a prompt, tool output)."""
        return len(self.tokens) - self.num_computed

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.turn_start

    @property
    def has_cache(self) -> bool:
        return self.slot is not None

    def result(self) -> GenerationResult:
        return GenerationResult(
            request_id=self.request_id,
            prompt_token_ids=list(self.tokens[: self.turn_start]),
            token_ids=list(self.tokens[self.turn_start :]),
            logprobs=list(self.logprobs),
            versions=list(self.versions),
            status=self.status,
            finish_reason=self.finish_reason,
            turn=self.turn,
            num_cached_tokens=self.num_cached_tokens,
        )
