"""The in-sandbox daemon API (E2B's "envd"): Connect-RPC ``process.Process`` and ``filesystem.Filesystem``.

The e2b wheel ships the generated Connect server stubs; these classes implement them by forwarding each
call to the sandbox's agent (routed by the ``E2b-Sandbox-Id`` header) and translating agent errors to
Connect codes.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import signal
import time

from connectrpc.code import Code
from connectrpc.errors import ConnectError
from e2b.envd.filesystem import filesystem_pb as fpb
from e2b.envd.filesystem.filesystem_connect import Filesystem
from e2b.envd.process import process_pb as ppb
from e2b.envd.process.process_connect import Process
from protobuf import Oneof
from protobuf.wkt.google.protobuf.timestamp_pb import Timestamp

from .link import AgentError, AgentGone, AgentLink, ProcState
from .runtime import ApiError, Manager

KEEPALIVE_S = 30.0
CODES = {
    "not_found": Code.NOT_FOUND,
    "already_exists": Code.ALREADY_EXISTS,
    "permission_denied": Code.PERMISSION_DENIED,
    "invalid_argument": Code.INVALID_ARGUMENT,
    "resource_exhausted": Code.RESOURCE_EXHAUSTED,
    "failed_precondition": Code.FAILED_PRECONDITION,
    "unimplemented": Code.UNIMPLEMENTED,
}
_watch_ids = itertools.count(1)


def username(headers) -> str | None:
    auth = headers.get("authorization") or ""
    if auth.lower().startswith("basic "):
        try:
            return base64.b64decode(auth[6:]).decode().split(":", 1)[0] or None
        except (ValueError, UnicodeDecodeError):
            return None
    return None


async def _link(manager: Manager, ctx) -> AgentLink:
    sid = ctx.request_headers.get("e2b-sandbox-id")
    if not sid:
        raise ConnectError(
            Code.INVALID_ARGUMENT, "missing E2b-Sandbox-Id header (which sandbox is this call for?)"
        )
    try:
        return await manager.link(sid)
    except ApiError as e:
        raise ConnectError(Code.UNAVAILABLE, e.message) from None


def _err(e: Exception) -> ConnectError:
    if isinstance(e, AgentError):
        return ConnectError(CODES.get(e.code, Code.INTERNAL), e.message)
    if isinstance(e, AgentGone):
        return ConnectError(Code.UNAVAILABLE, f"sandbox is not running: {e}")
    if isinstance(e, TimeoutError):
        return ConnectError(Code.DEADLINE_EXCEEDED, "the sandbox agent did not answer in time")
    return ConnectError(Code.INTERNAL, str(e))


def _user(ctx) -> str:
    name = username(ctx.request_headers)
    if name not in (None, "user", "root"):
        raise ConnectError(Code.INVALID_ARGUMENT, f"unknown user {name!r}; valid: user, root")
    return name or "user"


def _proc_info(p: ProcState) -> ppb.ProcessInfo:
    cfg = ppb.ProcessConfig(cmd=p.cmd, args=list(p.args), envs=dict(p.envs), cwd=p.cwd or None)
    return ppb.ProcessInfo(config=cfg, pid=p.pid, tag=p.tag)


def _event(kind: str, data) -> ppb.ProcessEvent:
    if kind == "start":
        return ppb.ProcessEvent(event=Oneof("start", ppb.ProcessEvent.StartEvent(pid=data)))
    if kind in ("stdout", "stderr"):
        return ppb.ProcessEvent(event=Oneof("data", ppb.ProcessEvent.DataEvent(output=Oneof(kind, data))))
    if kind == "end":
        code = int(data.get("code", -1))
        return ppb.ProcessEvent(
            event=Oneof(
                "end",
                ppb.ProcessEvent.EndEvent(
                    exit_code=code,
                    exited=not data.get("signal"),
                    status=data.get("status", ""),
                    error=data.get("error"),
                ),
            )
        )
    return ppb.ProcessEvent(event=Oneof("keepalive", ppb.ProcessEvent.KeepAlive()))


def _selector_msg(sel) -> dict:
    if sel is None or sel.selector is None:
        raise ConnectError(Code.INVALID_ARGUMENT, "process selector is empty: give a pid or a tag")
    return {"pid": sel.selector.value} if sel.selector.field == "pid" else {"tag": sel.selector.value}


def _find(link: AgentLink, sel: dict) -> ProcState:
    if "pid" in sel:
        p = link.procs.get(int(sel["pid"]))
    else:
        p = next((x for x in link.procs.values() if x.tag == sel["tag"]), None)
    if p is None:
        raise ConnectError(Code.NOT_FOUND, f"process {sel} not found (it may have ended)")
    return p


class ProcessService(Process):
    def __init__(self, manager: Manager) -> None:
        self.m = manager

    async def list(self, request, ctx):
        link = await _link(self.m, ctx)
        return ppb.ListResponse(processes=[_proc_info(p) for p in link.procs.values()])

    async def start(self, request, ctx):
        link = await _link(self.m, ctx)
        cfg = request.process
        if cfg is None or not cfg.cmd:
            raise ConnectError(Code.INVALID_ARGUMENT, "process.cmd is empty: give a command to run")
        if request.pty is not None:
            raise ConnectError(
                Code.UNIMPLEMENTED, "PTY sessions are not supported by the rlk3 sandbox; use commands.run"
            )
        msg = {
            "cmd": cfg.cmd,
            "args": list(cfg.args),
            "envs": dict(cfg.envs),
            "cwd": cfg.cwd or "",
            "user": _user(ctx),
            "stdin": bool(request.stdin),
            "tag": request.tag,
        }
        deadline_ms = ctx.request_headers.get("connect-timeout-ms")
        try:
            p = await link.start(msg)
        except (AgentError, AgentGone, TimeoutError) as e:
            raise _err(e) from None
        async for ev in self._follow(link, p, deadline_ms, kill_on_close=deadline_ms is not None):
            yield ppb.StartResponse(event=ev)

    async def connect(self, request, ctx):
        link = await _link(self.m, ctx)
        p = _find(link, _selector_msg(request.process))
        async for ev in self._follow(
            link, p, ctx.request_headers.get("connect-timeout-ms"), kill_on_close=False
        ):
            yield ppb.ConnectResponse(event=ev)

    async def _follow(self, link: AgentLink, p: ProcState, deadline_ms: str | None, *, kill_on_close: bool):
        q = p.subscribe()
        ended = False
        limit = time.monotonic() + float(deadline_ms) / 1000 if deadline_ms else None
        try:
            yield _event("start", p.pid)
            while True:
                wait = KEEPALIVE_S if limit is None else max(0.0, min(KEEPALIVE_S, limit - time.monotonic()))
                try:
                    kind, data = await asyncio.wait_for(q.get(), wait)
                except TimeoutError:
                    if limit is not None and time.monotonic() >= limit:
                        # Connect servers enforce the client's deadline; the finally block kills the command
                        raise ConnectError(
                            Code.DEADLINE_EXCEEDED, f"command {p.pid} exceeded its timeout"
                        ) from None
                    yield _event("keepalive", None)
                    continue
                if kind == "gone":
                    ended = True
                    if link.detaching:  # paused or snapshotted: the process may live on (memory pause)
                        raise ConnectError(
                            Code.CANCELED,
                            f"the sandbox was paused while command {p.pid} ran; after resume, "
                            "commands.connect(pid) follows it again if it survived the pause",
                        )
                    # The agent died under us: the sandbox was killed, or its runtime was (the host's OOM
                    # killer takes a gVisor Sentry at the memory limit). Ending the stream quietly would
                    # leave the SDK with "Command ended without an end event"; UNAVAILABLE makes it probe
                    # the sandbox and raise a SandboxException that says whether it is still running.
                    raise ConnectError(
                        Code.UNAVAILABLE,
                        f"the connection to the sandbox ended before command {p.pid} completed: "
                        "its agent is gone (the sandbox was killed or its runtime died)",
                    )
                if kind == "end":
                    ended = True
                    yield _event("end", data)
                    return
                yield _event(kind, data)
        finally:
            p.subscribers.discard(q)
            if kill_on_close and not ended and p.end is None and not link.closed.is_set():
                with contextlib.suppress(Exception):
                    link.send({"op": "signal", "rid": 0, "pid": p.pid, "sig": int(signal.SIGKILL)})

    async def send_input(self, request, ctx):
        link = await _link(self.m, ctx)
        sel = _selector_msg(request.process)
        data = (
            request.input.input.value
            if request.input is not None and request.input.input is not None
            else b""
        )
        try:
            await link.request("input", data, **sel)
        except (AgentError, AgentGone, TimeoutError) as e:
            raise _err(e) from None
        return ppb.SendInputResponse()

    async def stream_input(self, request, ctx):
        link = await _link(self.m, ctx)
        sel = None
        async for item in request:
            ev = item.event
            if ev is None or ev.field == "keepalive":
                continue
            if ev.field == "start":
                sel = _selector_msg(ev.value.process)
            elif ev.field == "data":
                if sel is None:
                    raise ConnectError(Code.INVALID_ARGUMENT, "stream input data came before its start event")
                try:
                    await link.request("input", ev.value.input.input.value, **sel)
                except (AgentError, AgentGone, TimeoutError) as e:
                    raise _err(e) from None
        return ppb.StreamInputResponse()

    async def send_signal(self, request, ctx):
        link = await _link(self.m, ctx)
        sig = {ppb.Signal.SIGKILL: signal.SIGKILL, ppb.Signal.SIGTERM: signal.SIGTERM}.get(request.signal)
        if sig is None:
            raise ConnectError(Code.INVALID_ARGUMENT, "signal must be SIGTERM or SIGKILL")
        try:
            await link.request("signal", sig=int(sig), **_selector_msg(request.process))
        except (AgentError, AgentGone, TimeoutError) as e:
            raise _err(e) from None
        return ppb.SendSignalResponse()

    async def close_stdin(self, request, ctx):
        link = await _link(self.m, ctx)
        try:
            await link.request("close_stdin", **_selector_msg(request.process))
        except (AgentError, AgentGone, TimeoutError) as e:
            raise _err(e) from None
        return ppb.CloseStdinResponse()

    async def update(self, request, ctx):
        raise ConnectError(Code.UNIMPLEMENTED, "PTY resize is not supported by the rlk3 sandbox")


def entry_info(e: dict) -> fpb.EntryInfo:
    kind = {1: fpb.FileType.FILE, 2: fpb.FileType.DIRECTORY, 3: fpb.FileType.SYMLINK}.get(
        e["type"], fpb.FileType.UNSPECIFIED
    )
    secs = float(e.get("mtime", 0.0))
    return fpb.EntryInfo(
        name=e["name"],
        type=kind,
        path=e["path"],
        size=e["size"],
        mode=e["mode"],
        permissions=e["permissions"],
        owner=e["owner"],
        group=e["group"],
        modified_time=Timestamp(seconds=int(secs), nanos=int((secs % 1) * 1e9)),
        symlink_target=e.get("symlink"),
        is_symlink=e.get("symlink") is not None,
    )


class FilesystemService(Filesystem):
    def __init__(self, manager: Manager) -> None:
        self.m = manager
        self.watchers: dict[str, tuple[AgentLink, asyncio.Queue, list]] = {}

    async def _call(self, ctx, op: str, **fields) -> dict:
        link = await _link(self.m, ctx)
        try:
            hdr, _ = await link.request(op, user=_user(ctx), **fields)
        except (AgentError, AgentGone, TimeoutError) as e:
            raise _err(e) from None
        return hdr

    async def stat(self, request, ctx):
        return fpb.StatResponse(entry=entry_info((await self._call(ctx, "stat", path=request.path))["entry"]))

    async def make_dir(self, request, ctx):
        return fpb.MakeDirResponse(
            entry=entry_info((await self._call(ctx, "mkdir", path=request.path))["entry"])
        )

    async def move(self, request, ctx):
        hdr = await self._call(ctx, "move", path=request.source, dest=request.destination)
        return fpb.MoveResponse(entry=entry_info(hdr["entry"]))

    async def list_dir(self, request, ctx):
        hdr = await self._call(ctx, "list_dir", path=request.path, depth=request.depth or 1)
        return fpb.ListDirResponse(entries=[entry_info(e) for e in hdr["entries"]])

    async def remove(self, request, ctx):
        await self._call(ctx, "remove", path=request.path)
        return fpb.RemoveResponse()

    async def _watch(self, ctx, request) -> tuple[AgentLink, str, asyncio.Queue]:
        link = await _link(self.m, ctx)
        wid = f"w{next(_watch_ids)}"
        q: asyncio.Queue = asyncio.Queue()
        link.watches[wid] = q
        try:
            await link.request(
                "watch", path=request.path, recursive=bool(request.recursive), wid=wid, user=_user(ctx)
            )
        except (AgentError, AgentGone, TimeoutError) as e:
            link.watches.pop(wid, None)
            raise _err(e) from None
        return link, wid, q

    async def watch_dir(self, request, ctx):
        link, wid, q = await self._watch(ctx, request)
        try:
            yield fpb.WatchDirResponse(event=Oneof("start", fpb.WatchDirResponse.StartEvent()))
            while True:
                try:
                    ev = await asyncio.wait_for(q.get(), KEEPALIVE_S)
                except TimeoutError:
                    yield fpb.WatchDirResponse(event=Oneof("keepalive", fpb.WatchDirResponse.KeepAlive()))
                    continue
                if ev is None:
                    return
                yield fpb.WatchDirResponse(
                    event=Oneof(
                        "filesystem", fpb.FilesystemEvent(name=ev["name"], type=fpb.EventType(ev["type"]))
                    )
                )
        finally:
            link.watches.pop(wid, None)
            with contextlib.suppress(Exception):
                link.send({"op": "unwatch", "rid": 0, "wid": wid})

    async def create_watcher(self, request, ctx):
        link, wid, q = await self._watch(ctx, request)
        events: list = []
        self.watchers[wid] = (link, q, events)
        return fpb.CreateWatcherResponse(watcher_id=wid)

    async def get_watcher_events(self, request, ctx):
        w = self.watchers.get(request.watcher_id)
        if w is None:
            raise ConnectError(Code.NOT_FOUND, f"watcher {request.watcher_id!r} not found")
        _, q, _ = w
        out = []
        while not q.empty():
            ev = q.get_nowait()
            if ev is not None:
                out.append(fpb.FilesystemEvent(name=ev["name"], type=fpb.EventType(ev["type"])))
        return fpb.GetWatcherEventsResponse(events=out)

    async def remove_watcher(self, request, ctx):
        w = self.watchers.pop(request.watcher_id, None)
        if w is not None:
            link, _, _ = w
            link.watches.pop(request.watcher_id, None)
            with contextlib.suppress(Exception):
                link.send({"op": "unwatch", "rid": 0, "wid": request.watcher_id})
        return fpb.RemoveWatcherResponse()
