"""The agent loop: one episode = render → generate → parse → run tools → extend … → grade.

Many episodes run concurrently as asyncio tasks against one synchronous :class:`~rlk3.engine.RolloutEngine`.
:class:`EngineFront` owns the engine: one stepper coroutine runs ``engine.step()`` in a worker thread (torch
releases the GIL, so tool calls and sandbox I/O proceed meanwhile), and episodes await their turns. Every engine
call happens under one lock, between steps.

Token-in, token-out: the trajectory's stream holds the ids the model actually sampled for its turns (decoding and
re-encoding need not give them back) and the harness's rendering of everything else (tool results, the next
generation prompt); multi-turn episodes continue one engine request with ``extend``, so each turn computes only
its new tokens.

**Pause and resume** (partial rollouts, issue 7). ``AgentLoop.pause()`` stops every running episode at its next
token (the engine keeps its MLA blocks and KDA state) or, for an episode inside a tool call, right after the call;
the episode returns a ``PAUSED`` trajectory whose ``metrics["loop"]`` says where it stopped. ``run(task, traj)`` with
that trajectory continues it: the engine request is resumed (or extended with the tokens it has not seen yet); when
the engine no longer knows the request (a restarted actor, a checkpoint reload) the stream is prefilled again as a new
request and the open turn continues from its last token. The sandbox is paused with the episode and resumed with it.

**Budget.** A turn may generate at most ``budget + 1 − generated`` tokens: an episode that goes over its budget
stops at the first token past it (``TRUNCATED``, ``metrics["over_budget"]``); the effort grade turns that into −1.

**Environment recovery.** With ``snapshot_turns`` the sandbox is snapshotted after every turn's tools ran; when a
tool call finds the sandbox gone, the episode restores the last snapshot into a fresh sandbox and repeats the
turn's calls there; without a snapshot it fails cleanly (``FAILED`` with the error in ``metrics["failure"]``), and
the iteration goes on.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import time
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any, Protocol

from envs.tasks import Task
from harness import Harness
from rlk3.engine import FinishReason, RequestStatus, RolloutEngine, SamplingParams
from rlk3.rollout.grading import Grading
from rlk3.rollout.trajectory import Status, Trajectory


class LoopError(RuntimeError):
    pass


@dataclass
class LoopConfig:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_turn_tokens: int = 512  # generated tokens per assistant turn
    max_context_tokens: int = 8192  # the whole stream: prompt, turns, tool output
    max_turns: int | None = None  # assistant turns; None: the task's own limit
    seed: int = 0
    snapshot_turns: bool = False  # snapshot the sandbox after each turn (environment recovery)
    sandbox_timeout_s: int = 3600  # sandbox lifetime (paused episodes may wait across iterations)

    def __post_init__(self) -> None:
        for name in ("max_turn_tokens", "max_context_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"LoopConfig.{name} must be a positive int, got {v!r}")
        if self.max_turns is not None and (not isinstance(self.max_turns, int) or self.max_turns < 1):
            raise ValueError(f"LoopConfig.max_turns must be a positive int or None, got {self.max_turns!r}")


# ------------------------------------------------------------------------------------------------ engine front


class EngineFront:
    """Async access to one synchronous engine. ``turn`` starts (or continues) a request and waits for the turn to
    finish or be paused; ``pause`` stops requests and hands their partial turns to whoever waits on them."""

    def __init__(self, engine: RolloutEngine) -> None:
        self.engine = engine
        self.lock = asyncio.Lock()
        self._waiters: dict[str, asyncio.Future] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.step_seconds = 0.0

    def start(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="engine-stepper")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def turn(
        self,
        request_id: str,
        new_ids: list[int],
        sampling: SamplingParams,
        *,
        turn_ends: tuple[int, ...] = (),
        paused: Any = None,
    ) -> Any:
        """A request the engine does not know: a new one named ``request_id`` with prompt ``new_ids``; a paused
        request with no ``new_ids``: resume it; otherwise extend it with ``new_ids``. Returns the turn's
        ``GenerationResult`` when it finishes or is paused. ``paused()`` is checked once the request is queued:
        true pauses it at once (a pause that raced with the call)."""
        self.start()
        async with self.lock:
            eng = self.engine
            if request_id not in eng.requests:
                eng.add_request(new_ids, sampling, request_id, turn_ends=turn_ends)
            elif not new_ids and eng.requests[request_id].status == RequestStatus.PAUSED:
                eng.resume(request_id)
            else:
                eng.extend(request_id, new_ids, sampling, turn_ends=turn_ends)
            if paused is not None and paused():
                return eng.pause(request_id)[0]
            fut = asyncio.get_running_loop().create_future()
            self._waiters[request_id] = fut
            self._wake.set()
        return await fut

    async def pause(self, request_ids: list[str]) -> None:
        async with self.lock:
            live = [r for r in request_ids if r in self.engine.requests
                    and self.engine.requests[r].status not in (RequestStatus.FINISHED, RequestStatus.PAUSED)]
            for res in self.engine.pause(live) if live else []:
                fut = self._waiters.pop(res.request_id, None)
                if fut is not None and not fut.done():
                    fut.set_result(res)

    async def release(self, request_id: str | None) -> None:
        """Forget a request (finished: its blocks stay in the prefix cache; otherwise aborted)."""
        if request_id is None:
            return
        async with self.lock:
            req = self.engine.requests.get(request_id)
            if req is None:
                return
            if req.status == RequestStatus.FINISHED:
                self.engine.release(request_id)
            else:
                self.engine.abort(request_id)
            self._waiters.pop(request_id, None)

    async def _run(self) -> None:
        eng = self.engine
        while True:
            await self._wake.wait()
            async with self.lock:
                if not eng.has_unfinished():
                    self._wake.clear()
                    continue
                t0 = time.perf_counter()
                try:
                    finished = await asyncio.to_thread(eng.step)
                except Exception as e:  # every waiter learns of it instead of hanging
                    for fut in self._waiters.values():
                        if not fut.done():
                            fut.set_exception(LoopError(f"engine step failed: {type(e).__name__}: {e}"))
                    self._waiters.clear()
                    self._wake.clear()
                    continue
                self.step_seconds += time.perf_counter() - t0
                for res in finished:
                    fut = self._waiters.pop(res.request_id, None)
                    if fut is not None and not fut.done():
                        fut.set_result(res)
            await asyncio.sleep(0)  # let episodes queue their requests between steps


# ------------------------------------------------------------------------------------------------ sandboxes


class EpisodeSandboxes(Protocol):
    """What the loop needs from a sandbox service (``E2BEpisodeSandboxes`` over the e2b SDK provides it); the
    tools use the ``exec``/``read``/``write``/``list`` part (``harness.tools.SandboxAPI``)."""

    async def create(self, task: Task, workdir: str) -> str: ...
    async def pause(self, sid: str) -> None: ...
    async def resume(self, sid: str) -> None: ...
    async def snapshot(self, sid: str) -> str: ...
    async def restore(self, snapshot_id: str) -> str: ...
    async def kill(self, sid: str) -> None: ...


class E2BEpisodeSandboxes:
    """Episode sandboxes on an E2B-compatible server through ``envs.sandbox.client.SandboxClient``."""

    def __init__(self, client, *, timeout_s: int = 3600, memory_pause: bool = True) -> None:
        self.client = client
        self.timeout_s = timeout_s
        self.memory_pause = memory_pause

    async def create(self, task: Task, workdir: str) -> str:
        sid = await self.client.create(task.template, timeout=self.timeout_s, metadata={"task": task.task_id})
        try:
            for path, data in task.files.items():
                await self.client.write(sid, path if path.startswith("/") else f"{workdir}/{path}", data)
        except BaseException:
            with contextlib.suppress(Exception):
                await self.client.kill(sid)
            raise
        return sid

    async def exec(self, sid, cmd, timeout=60):
        return await self.client.exec(sid, cmd, timeout)

    async def read(self, sid, path):
        return await self.client.read(sid, path)

    async def write(self, sid, path, data):
        await self.client.write(sid, path, data)

    async def list(self, sid, path):
        return await self.client.list(sid, path)

    async def pause(self, sid: str) -> None:
        await self.client.pause(sid, memory=self.memory_pause)

    async def resume(self, sid: str) -> None:
        await self.client.resume(sid, timeout=self.timeout_s)

    async def snapshot(self, sid: str) -> str:
        return await self.client.snapshot(sid)

    async def restore(self, snapshot_id: str) -> str:
        return await self.client.create(snapshot_id, timeout=self.timeout_s)

    async def kill(self, sid: str) -> None:
        with contextlib.suppress(Exception):
            await self.client.kill(sid)


# ------------------------------------------------------------------------------------------------ the loop


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("|".join(map(str, parts)).encode()).digest()[:6], "little")


class _Paused(Exception):
    pass


class AgentLoop:
    """Runs episodes of tasks against one engine. ``harnesses`` maps a domain to its harness (all sharing the
    engine's tokenizer); ``sandboxes`` is needed for tasks whose harness has tools; ``grading`` for rewards."""

    def __init__(
        self,
        front: EngineFront,
        harnesses: dict[str, Harness],
        *,
        sandboxes: EpisodeSandboxes | None = None,
        grading: Grading | None = None,
        config: LoopConfig | None = None,
    ) -> None:
        self.front = front
        self.harnesses = harnesses
        self.sandboxes = sandboxes
        self.grading = grading
        self.cfg = config or LoopConfig()
        self._pausing = False
        self._keep: set[str] = set()  # uids a pause leaves running
        self._active: dict[str, str] = {}  # uid -> engine request id of episodes now generating
        toks = {id(h.tokenizer) for h in harnesses.values()}
        if len(toks) > 1:
            raise LoopError("all harnesses of one loop must share the engine's tokenizer")

    # -------------------------------------------------------------------- control

    async def pause(self, keep: Collection[str] = ()) -> None:
        """Pause every running episode but those whose uid is in ``keep`` (see module docstring); any other episode
        that starts before ``unpause`` pauses at once."""
        self._pausing = True
        self._keep = set(keep)
        await self.front.pause([rid for uid, rid in self._active.items() if uid not in self._keep])

    def unpause(self) -> None:
        self._pausing = False
        self._keep = set()

    def _paused(self, traj: Trajectory) -> bool:
        return self._pausing and traj.uid not in self._keep

    # -------------------------------------------------------------------- episodes

    def new_trajectory(self, task: Task, *, effort: str, budget: int | None, group_id: str = "", uid: str | None = None
                       ) -> Trajectory:
        t = Trajectory(group_id=group_id or task.task_id, task_id=task.task_id, domain=task.domain, effort=effort,
                       budget=budget)
        if uid is not None:
            t.uid = uid
        return t

    async def run(self, task: Task, traj: Trajectory, *, grade: bool = True) -> Trajectory:
        """Run (or continue a paused) episode to its end or to a pause; grade it when it ended."""
        h = self.harnesses.get(task.domain)
        if h is None:
            raise LoopError(f"no harness for domain {task.domain!r}; configured: {sorted(self.harnesses)}")
        st = traj.metrics.setdefault("loop", {"rid": None, "open": 0, "unsent": 0, "turns": 0})
        traj.metrics.setdefault("timing", {"generate_s": 0.0, "tools_s": 0.0, "grade_s": 0.0})
        traj.status = Status.RUNNING
        try:
            await self._episode(task, traj, h, st)
        except _Paused:
            traj.status = Status.PAUSED
            if traj.sandbox_id and self.sandboxes is not None:
                try:
                    await self.sandboxes.pause(traj.sandbox_id)
                    st["sandbox_paused"] = True
                except Exception as e:  # resumable anyway: resume() finds it running
                    st["sandbox_pause_error"] = f"{type(e).__name__}: {e}"[:300]
            return traj
        except BaseException:
            # an engine step that failed, a sandbox that would not resume, a cancelled task: nobody else knows the
            # request's id, so the engine would keep it (running to its end, or paused with its cache) for good,
            # and a later episode of this uid would find the id taken
            with contextlib.suppress(Exception):
                await self.front.release(st.get("rid"))
            st["rid"] = None
            raise
        finally:
            self._active.pop(traj.uid, None)
        await self.front.release(st.get("rid"))
        st["rid"] = None
        if grade and self.grading is not None:
            t0 = time.perf_counter()
            await asyncio.to_thread(self.grading.grade, task, traj)
            traj.metrics["timing"]["grade_s"] += time.perf_counter() - t0
        await self.discard_sandbox(traj)
        return traj

    async def discard_sandbox(self, traj: Trajectory) -> None:
        if traj.sandbox_id and self.sandboxes is not None:
            await self.sandboxes.kill(traj.sandbox_id)
        traj.metrics.get("loop", {}).pop("snapshot", None)

    async def abandon(self, traj: Trajectory) -> None:
        """Drop a paused episode for good (staleness bound exceeded): its engine request and its sandbox."""
        await self.front.release(traj.metrics.get("loop", {}).get("rid"))
        await self.discard_sandbox(traj)

    async def _episode(self, task: Task, traj: Trajectory, h: Harness, st: dict) -> None:
        cfg = self.cfg
        tok = h.tokenizer
        max_turns = cfg.max_turns or task.max_turns
        if not traj.messages:  # a fresh episode
            traj.messages = h.start(task.prompt, effort=traj.effort, budget=traj.budget)
            traj.append(h.render(traj.messages), generated=False)
            st["unsent"] = len(traj.token_ids)
        if h.tools:
            if self.sandboxes is None:
                raise LoopError(f"preset {h.preset.name!r} (domain {task.domain}) has tools: pass sandboxes=")
            if traj.sandbox_id is None:
                if not await self._create_sandbox(task, traj, h):
                    return  # environment failure: FAILED recorded
            elif st.pop("sandbox_paused", False):
                await self.sandboxes.resume(traj.sandbox_id)
        while True:
            if self._paused(traj):
                raise _Paused
            generated = traj.num_generated
            room = cfg.max_context_tokens - len(traj.token_ids)
            cap = cfg.max_turn_tokens - st["open"]
            if traj.budget is not None:
                cap = min(cap, traj.budget + 1 - generated)
            if room < 1 or cap < 1:  # cannot happen for budget (we stop past it) unless the context is full
                traj.status = Status.TRUNCATED
                traj.metrics["truncated"] = "context" if room < 1 else "turn_tokens"
                return
            cap = min(cap, room)
            res = await self._generate(traj, st, tok, h, cap)
            if res is None:
                raise _Paused
            if traj.budget is not None and traj.num_generated > traj.budget:
                traj.status = Status.TRUNCATED
                traj.metrics["truncated"] = "budget"
                self._close_turn(traj, st, tok)
                return
            if res.finish_reason == FinishReason.LENGTH and len(traj.token_ids) >= cfg.max_context_tokens:
                traj.status = Status.TRUNCATED
                traj.metrics["truncated"] = "context"
                self._close_turn(traj, st, tok)
                return
            # the turn is complete: parse it, run its tools
            text = self._close_turn(traj, st, tok)
            st["turns"] += 1
            parsed = h.parse(text)
            before = len(traj.messages)
            traj.messages.append(parsed.message())
            if parsed.finished:
                traj.status = Status.FINISHED
                return
            t0 = time.perf_counter()
            ex = await self._execute(task, traj, h, parsed, st)
            traj.metrics["timing"]["tools_s"] += time.perf_counter() - t0
            if ex is None:
                return  # environment failure: FAILED recorded
            traj.messages += ex.messages
            traj.metrics["tool_errors"] = traj.metrics.get("tool_errors", 0) + ex.n_errors
            if ex.submitted is not None:
                traj.metrics["submitted"] = ex.submitted
                traj.status = Status.FINISHED
                return
            if st["turns"] >= max_turns:
                traj.status = Status.TRUNCATED
                traj.metrics["truncated"] = "turns"
                return
            cont = h.continuation(traj.messages, before + 1)
            traj.append(cont, generated=False)
            st["unsent"] += len(cont)  # after the end-of-turn token ``_close_turn`` may have added
            if cfg.snapshot_turns and traj.sandbox_id and self.sandboxes is not None:
                with contextlib.suppress(Exception):  # no snapshot: recovery falls back to a clean failure
                    st["snapshot"] = await self.sandboxes.snapshot(traj.sandbox_id)

    def _close_turn(self, traj: Trajectory, st: dict, tok) -> str:
        """The open turn's text; a turn cut short gets the end-of-turn token the template expects (not trained)."""
        n = st["open"]
        ids = traj.token_ids[len(traj.token_ids) - n :] if n else []
        st["open"] = 0
        end = tok.convert_tokens_to_ids("<|im_end|>")
        if not ids or ids[-1] != end:
            traj.append([end], generated=False)
            # the engine's request has not seen it: the next turn's extend sends it with the continuation, or the
            # engine would sample that turn (and record its behaviour log-probs) over a stream without it
            st["unsent"] += 1
        return tok.decode(ids, skip_special_tokens=False)

    async def _generate(self, traj: Trajectory, st: dict, tok, h: Harness, cap: int):
        """Generate (the rest of) one turn into ``traj``; ``None`` when paused (partial tokens kept)."""
        eng = self.front.engine
        rid = st.get("rid")
        known = rid is not None and rid in eng.requests
        turn_idx = st["turns"]
        sampling = SamplingParams(
            max_tokens=cap, temperature=self.cfg.temperature, top_p=self.cfg.top_p, top_k=self.cfg.top_k,
            stop_token_ids=list(h.stop_token_ids), seed=_seed(self.cfg.seed, traj.uid, turn_idx, st["open"]),
        )
        if known and st["unsent"] == 0 and eng.requests[rid].status == RequestStatus.PAUSED:
            new_ids = []  # resume: the engine's turn result includes the tokens before the pause
        elif known:
            new_ids = traj.token_ids[len(traj.token_ids) - st["unsent"] :]
        else:  # a fresh request: prefill the whole stream (a restart, or the first turn)
            if rid is not None:
                traj.metrics["recomputed"] = traj.metrics.get("recomputed", 0) + 1
            rid, new_ids = None, list(traj.token_ids)
        if rid is None:
            st["requests"] = st.get("requests", 0) + 1
            rid = f"{traj.uid}-{st['requests']}"
        ends = (len(new_ids),) if new_ids else ()
        self._active[traj.uid] = rid
        st["rid"] = rid  # before the turn, which may raise with the request queued (``run`` aborts it then)
        t0 = time.perf_counter()
        try:
            res = await self.front.turn(rid, new_ids, sampling, turn_ends=ends, paused=lambda: self._paused(traj))
        finally:
            self._active.pop(traj.uid, None)
        traj.metrics["timing"]["generate_s"] += time.perf_counter() - t0
        st["rid"] = res.request_id
        st["unsent"] = 0
        # The tokens of the engine's turn the trajectory already holds (appended at a pause), counted from where
        # this request's turn began: not the open turn's count, since a request made again mid-turn (a restart)
        # begins its turn after the tokens the lost one generated, and skipping those would drop as many new ones.
        skip = len(traj.token_ids) - len(res.prompt_token_ids)
        if skip < 0 or traj.token_ids[: len(res.prompt_token_ids)] != res.prompt_token_ids \
                or traj.token_ids[len(res.prompt_token_ids) :] != res.token_ids[:skip]:
            # the trainer recomputes every behaviour log-prob over the trajectory's stream: one that is not the
            # stream the engine sampled over would train on log-probs of other contexts
            at = next((i for i, (a, b) in enumerate(zip(traj.token_ids, res.prompt_token_ids + res.token_ids))
                       if a != b), min(len(traj.token_ids), len(res.prompt_token_ids) + len(res.token_ids)))
            raise LoopError(f"episode {traj.uid}: the trajectory's {len(traj.token_ids)} tokens part from engine "
                            f"request {res.request_id!r}'s stream at token {at}; they must be the prompt it was given "
                            f"({len(res.prompt_token_ids)} tokens) and the turn's first tokens it sampled")
        got = res.token_ids[skip:]
        traj.append(list(got), generated=True, logprobs=res.logprobs[skip:], versions=res.versions[skip:])
        st["open"] += len(got)
        if res.status == RequestStatus.PAUSED:
            return None
        return res

    async def _execute(self, task: Task, traj: Trajectory, h: Harness, parsed, st: dict):
        """Run the turn's calls. A sandbox that died under them is restored from the last snapshot and the calls
        run again there; with no snapshot the episode fails cleanly. ``None`` when it failed."""
        if not parsed.calls and parsed.error is not None:  # a parse error: no sandbox involved
            return await h.execute(parsed, h.context(_NoSandbox(), ""))
        for attempt in range(2):
            watch = _Watch(self.sandboxes)
            ex = await h.execute(parsed, h.context(watch, traj.sandbox_id or ""))
            if not watch.errors or await self._alive(traj.sandbox_id):
                return ex
            snap = st.get("snapshot")
            failure = {"error": f"{type(watch.errors[-1]).__name__}: {watch.errors[-1]}"[:500], "turn": st["turns"]}
            if snap is None or attempt == 1:
                traj.status = Status.FAILED
                traj.metrics["failure"] = {**failure, "recovered": False}
                traj.sandbox_id = None
                return None
            try:
                traj.sandbox_id = await self.sandboxes.restore(snap)
            except Exception as e:
                traj.status = Status.FAILED
                traj.metrics["failure"] = {**failure, "restore_error": f"{type(e).__name__}: {e}"[:300]}
                traj.sandbox_id = None
                return None
            traj.metrics.setdefault("recoveries", []).append(failure)
        return None

    async def _create_sandbox(self, task: Task, traj: Trajectory, h: Harness) -> bool:
        """The episode's sandbox, with one retry: under load a sandbox's agent can drop its connection while the
        task files are written (seen as a connection reset in RL on two cores). A second failure fails this episode
        cleanly rather than the whole iteration."""
        errors = []
        for _ in range(2):
            try:
                traj.sandbox_id = await self.sandboxes.create(task, h.preset.workdir)
                if errors:
                    traj.metrics.setdefault("recoveries", []).append({"error": errors[0], "turn": 0})
                return True
            except Exception as e:  # the provider kills a half-made sandbox before raising
                errors.append(f"{type(e).__name__}: {e}"[:500])
        traj.status = Status.FAILED
        traj.metrics["failure"] = {"error": errors[-1], "turn": 0, "stage": "create", "attempts": len(errors)}
        return False

    async def _alive(self, sid: str | None) -> bool:
        if sid is None:
            return False
        try:
            r = await self.sandboxes.exec(sid, "true", timeout=15)
            return getattr(r, "exit_code", 1) == 0
        except Exception:
            return False


class _Watch:
    """The sandbox as the tools see it, recording infrastructure errors (tools turn them into text for the model;
    the loop needs to know whether the sandbox itself is gone)."""

    def __init__(self, sbx) -> None:
        self.sbx = sbx
        self.errors: list[Exception] = []

    async def _call(self, name, *args, **kwargs):
        if self.sbx is None:
            raise LoopError("this episode has no sandbox (pass sandboxes= to the AgentLoop)")
        try:
            return await getattr(self.sbx, name)(*args, **kwargs)
        except Exception as e:
            self.errors.append(e)
            raise

    async def exec(self, sid, cmd, timeout=60):
        return await self._call("exec", sid, cmd, timeout)

    async def read(self, sid, path):
        return await self._call("read", sid, path)

    async def write(self, sid, path, data):
        return await self._call("write", sid, path, data)

    async def list(self, sid, path):
        return await self._call("list", sid, path)


class _NoSandbox(_Watch):
    def __init__(self) -> None:
        super().__init__(None)
