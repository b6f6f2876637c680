"""The server's end of the agent connection: request/response by id, process and watch event fan-out."""

from __future__ import annotations

import asyncio
import itertools
import json
import struct
from dataclasses import dataclass, field

HDR = struct.Struct(">II")
MAX_FRAME = 64 << 20


class AgentError(Exception):
    """The agent answered with an error: ``code`` is an envd/Connect code name (not_found, ...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class AgentGone(Exception):
    """The agent connection closed (sandbox paused, killed, or its PID 1 died)."""


@dataclass
class ProcState:
    pid: int
    tag: str | None
    cmd: str
    args: list[str]
    envs: dict[str, str]
    cwd: str
    subscribers: set[asyncio.Queue] = field(default_factory=set)
    end: dict | None = None
    backlog: list | None = field(default_factory=list)  # events before the first subscriber arrives

    def publish(self, item: tuple) -> None:
        if self.backlog is not None:
            self.backlog.append(item)
        for q in list(self.subscribers):
            q.put_nowait(item)

    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        if self.backlog is not None:
            for item in self.backlog:
                q.put_nowait(item)
            self.backlog = None
        if self.end is not None:
            q.put_nowait(("end", self.end))
        self.subscribers.add(q)
        return q


class AgentLink:
    """One live connection to one sandbox's agent."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, pid: int) -> None:
        self.reader = reader
        self.writer = writer
        self.pid = pid
        self.ids = itertools.count(1)
        self.pending: dict[int, asyncio.Queue] = {}
        self.starting: dict[int, dict] = {}
        self.procs: dict[int, ProcState] = {}
        self.watches: dict[str, asyncio.Queue] = {}
        self.closed = asyncio.Event()
        self.detaching = False
        self.task: asyncio.Task | None = None

    def adopt(self, procs: list[dict]) -> None:
        """Processes the agent reports as still running (after a restore or a server restart)."""
        for p in procs:
            if p["pid"] not in self.procs:
                self.procs[p["pid"]] = ProcState(
                    p["pid"],
                    p.get("tag"),
                    p["cmd"],
                    p.get("args", []),
                    p.get("envs", {}),
                    p.get("cwd", ""),
                    backlog=None,
                )

    async def serve(self) -> None:
        try:
            while True:
                head = await self.reader.readexactly(HDR.size)
                hl, bl = HDR.unpack(head)
                if hl + bl > MAX_FRAME:
                    raise AgentGone(f"agent sent an oversize frame ({hl + bl} bytes)")
                hdr = json.loads(await self.reader.readexactly(hl))
                body = await self.reader.readexactly(bl) if bl else b""
                self._dispatch(hdr, body)
        except (asyncio.IncompleteReadError, ConnectionError, AgentGone, json.JSONDecodeError):
            pass
        finally:
            self.closed.set()
            for q in self.pending.values():
                q.put_nowait(({"ev": "gone"}, b""))
            for p in self.procs.values():
                p.publish(("gone", None))
            for q in self.watches.values():
                q.put_nowait(None)
            self.writer.close()

    def _dispatch(self, hdr: dict, body: bytes) -> None:
        ev = hdr.get("ev")
        if ev == "out":
            p = self.procs.get(hdr["pid"])
            if p is not None:
                p.publish((hdr["s"], body))
        elif ev == "exit":
            p = self.procs.pop(hdr["pid"], None)
            if p is not None:
                p.end = hdr
                p.publish(("end", hdr))
        elif ev == "fsev":
            q = self.watches.get(hdr["wid"])
            if q is not None:
                q.put_nowait(hdr)
        elif ev == "unwatched":
            q = self.watches.pop(hdr["wid"], None)
            if q is not None:
                q.put_nowait(None)
        elif "rid" in hdr:
            if ev == "started":  # register before any output frame that follows it is dispatched
                msg = self.starting.pop(hdr["rid"], {})
                p = ProcState(
                    hdr["pid"],
                    msg.get("tag"),
                    msg.get("cmd", ""),
                    msg.get("args", []),
                    msg.get("envs", {}),
                    msg.get("cwd", ""),
                )
                self.procs[p.pid] = p
                hdr["proc"] = p
            q = self.pending.get(hdr["rid"])
            if q is not None:
                q.put_nowait((hdr, body))

    def send(self, hdr: dict, body: bytes = b"") -> None:
        if self.closed.is_set():
            raise AgentGone("the sandbox agent is not connected")
        h = json.dumps(hdr, separators=(",", ":")).encode()
        self.writer.write(HDR.pack(len(h), len(body)) + h + body)

    async def request(
        self, op: str, body: bytes = b"", *, timeout: float = 60.0, **fields
    ) -> tuple[dict, bytes]:
        rid = next(self.ids)
        q: asyncio.Queue = asyncio.Queue()
        self.pending[rid] = q
        try:
            self.send({"op": op, "rid": rid, **fields}, body)
            await self.writer.drain()
            hdr, data = await asyncio.wait_for(q.get(), timeout)
        finally:
            self.pending.pop(rid, None)
        return _check(hdr), data

    async def read_file(self, path: str, user: str | None):
        """Yields the file's bytes in chunks; the first step raises AgentError if it cannot be read."""
        rid = next(self.ids)
        q: asyncio.Queue = asyncio.Queue()
        self.pending[rid] = q
        try:
            self.send({"op": "read", "rid": rid, "path": path, "user": user})
            hdr, _ = await asyncio.wait_for(q.get(), 60)
            _check(hdr)
            yield hdr.get("size", 0)
            while True:
                hdr, data = await asyncio.wait_for(q.get(), 60)
                if hdr.get("ev") == "chunk":
                    yield data
                elif hdr.get("ev") == "eof":
                    return
                else:
                    _check(hdr)
        finally:
            self.pending.pop(rid, None)

    async def start(self, msg: dict) -> ProcState:
        rid = next(self.ids)
        self.starting[rid] = msg
        q: asyncio.Queue = asyncio.Queue()
        self.pending[rid] = q
        try:
            self.send({"op": "start", "rid": rid, **msg})
            await self.writer.drain()
            hdr, _ = await asyncio.wait_for(q.get(), 60)
        finally:
            self.pending.pop(rid, None)
            self.starting.pop(rid, None)
        _check(hdr)
        return hdr["proc"]


def _check(hdr: dict) -> dict:
    ev = hdr.get("ev")
    if ev == "gone":
        raise AgentGone("the sandbox agent disconnected")
    if ev == "error":
        raise AgentError(hdr.get("code", "internal"), hdr.get("message", "agent error"))
    return hdr
