"""The sandbox manager: lifecycle, registry on disk, agent connections, timeouts.

Everything the HTTP layer does goes through :class:`Manager`; it raises :class:`ApiError` with an HTTP
status and a message naming what was wrong and what would be valid, which the server turns into E2B's
``{code, message}`` JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import string
import struct
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .bwrap import BwrapBackend
from .host import HostError, Limits, Reaper, proc_start_time
from .link import HDR, AgentError, AgentGone, AgentLink
from .templates import BUILTIN, TemplateSpec

log = logging.getLogger("rlk3.sandbox")
ENVD_VERSION = "0.6.4"  # the envd protocol level we speak (gates SDK features, see e2b/envd/versions.py)
ID_ALPHABET = string.ascii_lowercase + string.digits
MAX_FORK = 20
MAX_TIMEOUT = 24 * 3600


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def new_id(prefix: str = "") -> str:
    return prefix + "".join(secrets.choice(ID_ALPHABET) for _ in range(20))


@dataclass
class Template:
    name: str
    digest: str
    layers: list[str]  # top first
    envs: dict[str, str]
    limits: dict


@dataclass
class SandboxRec:
    id: str
    template_id: str
    layers: list[str]
    upper: str
    limits: dict
    envs: dict[str, str]
    metadata: dict[str, str]
    started_at: float
    end_at: float
    state: str = "running"  # running | paused
    pause_kind: str | None = None  # freeze | memory | filesystem
    image: str | None = None  # CRIU image of a memory pause
    on_timeout: str = "kill"  # kill | pause
    timeout_memory: bool = True
    auto_resume: bool = False
    agent_pid: int | None = None
    agent_start: int | None = None
    alias: str | None = None
    generation: int = 0  # bumped on each seal, so upper names stay unique


@dataclass
class SnapshotRec:
    id: str
    names: list[str]
    source: str
    template_id: str
    layers: list[str]
    image: str | None
    limits: dict
    envs: dict[str, str]
    created_at: float


@dataclass
class Live:
    rec: SandboxRec
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    link: AgentLink | None = None
    cpu_sample: tuple[float, int] | None = None


class Registry:
    """One JSON file per record; written atomically so a crash never leaves half a record."""

    def __init__(self, root: Path) -> None:
        self.root = root
        for kind in ("sandboxes", "snapshots", "templates"):
            (root / kind).mkdir(parents=True, exist_ok=True)

    def save(self, kind: str, key: str, obj) -> None:
        path = self.root / kind / f"{key}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(obj), indent=1))
        os.replace(tmp, path)

    def delete(self, kind: str, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.root / kind / f"{key}.json").unlink()

    def load(self, kind: str, cls) -> list:
        out = []
        for p in sorted((self.root / kind).glob("*.json")):
            try:
                out.append(cls(**json.loads(p.read_text())))
            except (ValueError, TypeError) as e:
                log.warning("skipping unreadable registry record %s: %s", p, e)
        return out


class Manager:
    def __init__(
        self,
        state: Path,
        *,
        backend: str = "bwrap",
        disk_gb: int = 64,
        criu: str | None = None,
        default_pause: str = "memory",
        on_exit: str = "pause",
        max_sandboxes: int = 1000,
    ) -> None:
        self.state = state.resolve()
        self.reaper = Reaper()
        if backend == "bwrap":
            self.backend = BwrapBackend(self.state, self.reaper, disk_gb=disk_gb, criu=criu)
        else:
            raise ValueError(f"unknown backend {backend!r}; valid: bwrap (gvisor is not implemented yet)")
        if default_pause not in ("memory", "freeze"):
            raise ValueError(f"default_pause must be 'memory' or 'freeze', not {default_pause!r}")
        self.default_pause = default_pause
        self.on_exit = on_exit
        self.max_sandboxes = max_sandboxes
        self.registry = Registry(self.state / "registry")
        self.live: dict[str, Live] = {}
        self.snapshots: dict[str, SnapshotRec] = {}
        self.templates: dict[str, Template] = {}
        self.template_locks: dict[str, asyncio.Lock] = {}
        self.expect: dict[int, asyncio.Future] = {}  # agent host PID -> future of its link
        self.base_layer = ""
        self.server: asyncio.AbstractServer | None = None
        self.tasks: list[asyncio.Task] = []
        self.gc_lock = asyncio.Lock()

    # ====================================================================================== start / stop
    async def start(self) -> None:
        await self.backend.start()
        self.base_layer = self.backend.build_base_layer()
        for t in self.registry.load("templates", Template):
            self.templates[t.name] = t
        for s in self.registry.load("snapshots", SnapshotRec):
            self.snapshots[s.id] = s
        sock = self.backend.run_dir / "agent.sock"
        with contextlib.suppress(FileNotFoundError):
            sock.unlink()
        self.server = await asyncio.start_unix_server(
            self._on_agent, path=str(sock), limit=HDR.size + (64 << 20)
        )
        os.chmod(sock, 0o666)
        await self._recover()
        self.tasks.append(asyncio.create_task(self._timeouts()))

    async def _recover(self) -> None:
        """After a restart: keep paused sandboxes, reattach running ones whose agent is still alive."""
        for rec in self.registry.load("sandboxes", SandboxRec):
            live = Live(rec)
            self.live[rec.id] = live
            if rec.state == "paused" and rec.pause_kind != "freeze":
                continue
            alive = rec.agent_pid and proc_start_time(rec.agent_pid) == rec.agent_start
            if alive:
                fut = asyncio.get_running_loop().create_future()
                self.expect[rec.agent_pid] = fut
                if rec.pause_kind == "freeze":
                    self.backend.thaw(rec.id)
                self.backend.wake(rec.agent_pid)
                try:
                    live.link = await asyncio.wait_for(fut, 5)
                    if rec.pause_kind == "freeze":
                        self.backend.freeze(rec.id)
                    continue
                except TimeoutError:
                    self.expect.pop(rec.agent_pid, None)
            log.warning("sandbox %s did not survive the restart; removing it", rec.id)
            await self._destroy(live)
        await self._gc()

    async def stop(self) -> None:
        for t in self.tasks:
            t.cancel()
        for live in list(self.live.values()):
            if live.rec.state != "running":
                continue
            try:
                if self.on_exit == "pause" and self.backend.criu:
                    await self.pause(live.rec.id, memory=True)
                elif self.on_exit != "keep":
                    await self.kill(live.rec.id)
            except Exception as e:  # a sandbox that cannot be paused is killed: never leave it behind
                log.warning("could not pause %s on exit (%s); killing it", live.rec.id, e)
                await self.kill(live.rec.id)
        if self.server is not None:
            self.server.close()
        await self.backend.stop(unmount=self.on_exit != "keep")

    # ====================================================================================== agents
    async def _on_agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, _, _ = struct.unpack("3i", creds)
        fut = self.expect.pop(pid, None)
        if fut is None or fut.done():
            # not an agent we started: a process inside a sandbox poking at the shared socket, or a stale one
            writer.close()
            return
        link = AgentLink(reader, writer, pid)
        try:
            head = await asyncio.wait_for(reader.readexactly(HDR.size), 5)
            hl, bl = HDR.unpack(head)
            hello = json.loads(await reader.readexactly(hl))
            if bl:
                await reader.readexactly(bl)
        except (TimeoutError, asyncio.IncompleteReadError, ValueError):
            writer.close()
            fut.set_exception(AgentGone("agent did not say hello"))
            return
        link.adopt(hello.get("procs", []))
        link.task = asyncio.current_task()
        fut.set_result(link)
        await link.serve()

    async def _await_agent(self, pid: int, timeout: float = 15.0) -> AgentLink:
        fut = self.expect.get(pid)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self.expect[pid] = fut
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.expect.pop(pid, None)

    async def _launch(self, live: Live, *, image: str | None = None) -> None:
        """Boot (or CRIU-restore) the sandbox's process tree and wait for its agent."""
        rec = live.rec
        limits = Limits(**rec.limits)
        if image is None:
            pid = await self.backend.boot(rec.id, rec.layers, rec.upper, limits)
        else:
            pid = await self.backend.restore(rec.id, image, rec.layers, rec.upper, limits)
        fut = asyncio.get_running_loop().create_future()
        self.expect[pid] = fut
        if image is not None:
            self.backend.wake(pid)
        try:
            live.link = await self._await_agent(pid)
        except TimeoutError:
            raise HostError(f"the agent of sandbox {rec.id} did not connect") from None
        rec.agent_pid = pid
        rec.agent_start = proc_start_time(pid)
        if image is None:
            await live.link.request("env", envs=rec.envs)

    async def _detach(self, live: Live) -> None:
        link = live.link
        if link is None or link.closed.is_set():
            return
        link.detaching = True
        with contextlib.suppress(AgentGone, TimeoutError):
            await link.request("detach", timeout=10)
        await asyncio.wait_for(link.closed.wait(), 10)
        live.link = None

    # ====================================================================================== templates
    async def template(self, name: str) -> Template:
        if name == "base" and "base" not in BUILTIN:
            raise ApiError(500, "no base template")
        spec = BUILTIN.get(name)
        if spec is None:
            known = self.templates.get(name)
            if known is not None:
                return known
            raise ApiError(
                404,
                f"template '{name}' not found; valid templates: {', '.join(self.template_names())}"
                " or a snapshot ID",
            )
        lock = self.template_locks.setdefault(name, asyncio.Lock())
        async with lock:
            parent_layers = (
                [self.base_layer] if spec.parent is None else (await self.template(spec.parent)).layers
            )
            digest = spec.digest(parent_layers)
            have = self.templates.get(name)
            if (
                have is not None
                and have.digest == digest
                and all((self.backend.layer_path(la)).exists() for la in have.layers)
            ):
                return have
            t = await self._build(spec, parent_layers, digest)
            self.templates[name] = t
            self.registry.save("templates", name, t)
            await self._gc()
            return t

    def template_names(self) -> list[str]:
        return sorted(set(BUILTIN) | set(self.templates))

    async def _build(self, spec: TemplateSpec, parent_layers: list[str], digest: str) -> Template:
        limits = Limits(
            cpu_count=spec.cpu_count, memory_mb=spec.memory_mb, pids=spec.pids, disk_mb=spec.disk_mb
        )
        parent_envs = {} if spec.parent is None else dict((await self.template(spec.parent)).envs)
        envs = {**parent_envs, **spec.envs}
        if not spec.files and not spec.setup:
            return Template(spec.name, digest, parent_layers, envs, asdict(limits))
        sid = f"build-{spec.name}-{digest}"
        rec = SandboxRec(
            id=sid,
            template_id=spec.name,
            layers=parent_layers,
            upper=sid,
            limits=asdict(limits),
            envs=envs,
            metadata={},
            started_at=time.time(),
            end_at=time.time() + 600,
        )
        live = Live(rec)
        self.backend.delete_upper(sid)
        self.backend.new_upper(sid, limits)
        try:
            await self._launch(live)
            for path, content in spec.files.items():
                await self._write(live.link, path, content.encode(), "root")
            for cmd in spec.setup:
                code, out = await self._run(live.link, cmd, user="root", timeout=600)
                if code != 0:
                    raise ApiError(
                        500,
                        f"building template '{spec.name}': setup command {cmd!r} exited {code}: "
                        f"{out[-2000:]}",
                    )
        finally:
            if live.link is not None:
                live.link.writer.close()
            await self.backend.destroy(sid)
        layer = f"tpl-{spec.name}-{digest}"
        if self.backend.layer_path(layer).exists():
            self.backend.delete_layer(layer)
        self.backend.seal(sid, layer)
        return Template(spec.name, digest, [layer, *parent_layers], envs, asdict(limits))

    async def _write(self, link: AgentLink, path: str, data: bytes, user: str | None) -> dict:
        hdr, _ = await link.request("wopen", path=path, user=user)
        wid = hdr["rid"]
        for i in range(0, len(data), 1 << 20):
            await link.request("wdata", data[i : i + (1 << 20)], wid=wid)
        hdr, _ = await link.request("wclose", wid=wid)
        return hdr["entry"]

    async def _run(
        self, link: AgentLink, cmd: str, *, user: str = "user", timeout: float = 60
    ) -> tuple[int, str]:
        p = await link.start(
            {"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": {}, "cwd": "", "user": user}
        )
        q = p.subscribe()
        out = bytearray()
        async with asyncio.timeout(timeout):
            while True:
                kind, data = await q.get()
                if kind in ("stdout", "stderr"):
                    out += data
                elif kind == "end":
                    return int(data["code"]), out.decode(errors="replace")
                elif kind == "gone":
                    raise AgentGone("sandbox agent disconnected during a template build")

    # ====================================================================================== lifecycle
    def get(self, sid: str) -> Live:
        live = self.live.get(sid)
        if live is None:
            raise ApiError(404, f"sandbox '{sid}' not found")
        return live

    async def create(
        self,
        template_id: str,
        *,
        timeout: int = 300,
        metadata: dict | None = None,
        envs: dict | None = None,
        on_timeout: str = "kill",
        timeout_memory: bool = True,
        auto_resume: bool = False,
    ) -> SandboxRec:
        running = sum(1 for live in self.live.values() if live.rec.state == "running")
        if running >= self.max_sandboxes:
            raise ApiError(
                429,
                f"this server runs at most {self.max_sandboxes} sandboxes at once "
                f"(--max-sandboxes); kill or pause some first",
            )
        snap = self.snapshots.get(template_id) or next(
            (s for s in self.snapshots.values() if template_id in s.names), None
        )
        if snap is not None:
            layers, limits, base_envs, image, tpl = snap.layers, snap.limits, snap.envs, snap.image, snap.id
        else:
            t = await self.template(template_id)
            layers, limits, base_envs, image, tpl = t.layers, t.limits, t.envs, None, t.name
        sid = new_id("i")
        now = time.time()
        rec = SandboxRec(
            id=sid,
            template_id=tpl,
            layers=list(layers),
            upper=f"{sid}-0",
            limits=dict(limits),
            envs={**base_envs, **(envs or {})},
            metadata=dict(metadata or {}),
            started_at=now,
            end_at=now + timeout,
            on_timeout=on_timeout,
            timeout_memory=timeout_memory,
            auto_resume=auto_resume,
        )
        live = Live(rec)
        self.live[sid] = live
        async with live.lock:
            try:
                self.backend.new_upper(rec.upper, Limits(**rec.limits))
                await self._launch(live, image=image)
                if image is not None and envs:
                    await live.link.request("env", envs=envs)
            except BaseException:
                await self._destroy(live)
                raise
            self.registry.save("sandboxes", sid, rec)
        return rec

    async def connect(self, sid: str, *, timeout: int | None = None, memory: bool = True) -> SandboxRec:
        live = self.get(sid)
        async with live.lock:
            rec = live.rec
            if timeout is not None:
                rec.end_at = (
                    max(rec.end_at, time.time() + timeout)
                    if rec.state == "running"
                    else time.time() + timeout
                )
            if rec.state == "paused":
                await self._resume(live, reboot=not memory)
            self.registry.save("sandboxes", sid, rec)
            return rec

    async def _resume(self, live: Live, *, reboot: bool = False) -> None:
        rec = live.rec
        kind = rec.pause_kind
        if kind == "freeze" and not reboot:
            self.backend.thaw(rec.id)
        elif kind == "memory" and not reboot and rec.image:
            await self._launch(live, image=rec.image)
            rec.image = None
        else:  # filesystem pause, or a reboot asked for: a fresh agent over the same disk
            if kind == "freeze":
                await self._stop_processes(live)
            rec.image = None
            await self._launch(live)
        rec.state, rec.pause_kind = "running", None
        self.registry.save("sandboxes", rec.id, rec)
        await self._gc()

    async def pause(self, sid: str, *, memory: bool = True, kind: str | None = None) -> bool:
        """Returns False when the sandbox is already paused (the API answers 409)."""
        live = self.get(sid)
        async with live.lock:
            rec = live.rec
            if rec.state == "paused":
                return False
            kind = kind or (self.default_pause if memory else "filesystem")
            if kind not in ("freeze", "memory", "filesystem"):
                raise ApiError(400, f"unknown pause mode {kind!r}; valid: freeze, memory, filesystem")
            if kind == "freeze":
                self.backend.freeze(rec.id)
            elif kind == "memory":
                rec.image = await self._checkpoint(live)
            else:
                await self._stop_processes(live)
            rec.state, rec.pause_kind = "paused", kind
            self.registry.save("sandboxes", sid, rec)
            return True

    async def _checkpoint(self, live: Live) -> str:
        """Detach the agent, CRIU-dump the tree (which kills it), free the cgroups. Returns the image id."""
        rec = live.rec
        image = new_id("m")
        await self._detach(live)
        try:
            await self.backend.dump(rec.id, rec.agent_pid, image)
        except HostError:
            self.backend.delete_image(image)
            self.backend.wake(rec.agent_pid)  # the dump left the tree running: let the agent reconnect
            with contextlib.suppress(Exception):
                live.link = await self._await_agent(rec.agent_pid, 5)
            raise
        await self.backend.destroy(rec.id)
        rec.agent_pid = rec.agent_start = None
        return image

    async def _stop_processes(self, live: Live) -> None:
        if live.link is not None:
            live.link.writer.close()
            live.link = None
        await self.backend.destroy(live.rec.id)
        live.rec.agent_pid = live.rec.agent_start = None

    async def _seal_and_restack(self, live: Live) -> str:
        """Seal the (stopped) sandbox's upper as a layer and give it a fresh, empty upper on top."""
        rec = live.rec
        layer = new_id("l")
        self.backend.seal(rec.upper, layer)
        rec.layers = [layer, *rec.layers]
        rec.generation += 1
        rec.upper = f"{rec.id}-{rec.generation}"
        self.backend.new_upper(rec.upper, Limits(**rec.limits))
        return layer

    async def snapshot(self, sid: str, *, name: str | None = None, memory: bool = True) -> SnapshotRec:
        live = self.get(sid)
        async with live.lock:
            rec = live.rec
            image, refreeze = None, False
            if rec.state == "paused" and rec.pause_kind == "freeze":
                self.backend.thaw(rec.id)
                refreeze = True
            if rec.state == "running" or refreeze:
                image = await self._checkpoint(live)
                await self._seal_and_restack(live)
                try:
                    await self._launch(live, image=image)
                finally:
                    self.registry.save("sandboxes", sid, rec)
                if refreeze:
                    self.backend.freeze(rec.id)
            else:  # paused with memory or filesystem: the sandbox keeps its own image, the snapshot shares it
                await self._seal_and_restack(live)
                image = rec.image
            snap = SnapshotRec(
                id=new_id("s"),
                names=[name] if name else [],
                source=sid,
                template_id=rec.template_id,
                layers=list(rec.layers),
                image=image if memory else None,
                limits=dict(rec.limits),
                envs=dict(rec.envs),
                created_at=time.time(),
            )
            self.snapshots[snap.id] = snap
            self.registry.save("snapshots", snap.id, snap)
            self.registry.save("sandboxes", sid, rec)
        await self._gc()
        return snap

    async def fork(
        self, sid: str, *, count: int = 1, timeout: int | None = None
    ) -> list[SandboxRec | Exception]:
        if not 1 <= count <= MAX_FORK:
            raise ApiError(400, f"count must be between 1 and {MAX_FORK}, got {count}")
        live = self.get(sid)
        children: list[Live] = []
        async with live.lock:
            rec = live.rec
            if rec.state == "paused" and rec.pause_kind in ("memory", "filesystem"):
                await self._seal_and_restack(live)
                image, parent_back = rec.image, None
            else:
                refreeze = rec.state == "paused"
                if refreeze:
                    self.backend.thaw(rec.id)
                image = await self._checkpoint(live)
                await self._seal_and_restack(live)
                parent_back = refreeze
            now = time.time()
            for _ in range(count):
                cid = new_id("i")
                child = SandboxRec(
                    id=cid,
                    template_id=rec.template_id,
                    layers=list(rec.layers),
                    upper=f"{cid}-0",
                    limits=dict(rec.limits),
                    envs=dict(rec.envs),
                    metadata=dict(rec.metadata),
                    started_at=now,
                    end_at=now + (timeout if timeout is not None else max(rec.end_at - now, 60)),
                    on_timeout=rec.on_timeout,
                    timeout_memory=rec.timeout_memory,
                    auto_resume=rec.auto_resume,
                )
                children.append(Live(child))
                self.live[cid] = children[-1]

            async def bring_up(c: Live) -> SandboxRec:
                async with c.lock:
                    try:
                        self.backend.new_upper(c.rec.upper, Limits(**c.rec.limits))
                        if image is not None:
                            await self._launch(c, image=image)
                        else:
                            await self._launch(c)
                    except BaseException:
                        await self._destroy(c)
                        raise
                    self.registry.save("sandboxes", c.rec.id, c.rec)
                    return c.rec

            jobs = [bring_up(c) for c in children]
            if parent_back is not None:
                jobs.append(self._launch(live, image=image))
            results = await asyncio.gather(*jobs, return_exceptions=True)
            if parent_back is not None:
                if isinstance(results[-1], BaseException):
                    log.error("fork: the parent %s failed to come back: %s", sid, results[-1])
                    await self._destroy(live)
                    raise ApiError(
                        500, f"fork: sandbox {sid} could not be restored after its checkpoint: {results[-1]}"
                    )
                if parent_back:
                    self.backend.freeze(rec.id)
                results = results[:-1]
            self.registry.save("sandboxes", sid, rec)
        await self._gc()
        return [r if isinstance(r, SandboxRec) else Exception(str(r)) for r in results]

    def _image_used(self, image: str) -> bool:
        return any(live.rec.image == image for live in self.live.values()) or any(
            s.image == image for s in self.snapshots.values()
        )

    async def kill(self, sid: str) -> None:
        live = self.get(sid)
        async with live.lock:
            await self._destroy(live)
        await self._gc()

    async def _destroy(self, live: Live) -> None:
        rec = live.rec
        if live.link is not None:
            live.link.writer.close()
            live.link = None
        await self.backend.destroy(rec.id)
        self.backend.delete_upper(rec.upper)
        self.live.pop(rec.id, None)
        self.registry.delete("sandboxes", rec.id)

    async def set_timeout(self, sid: str, timeout: int) -> None:
        live = self.get(sid)
        live.rec.end_at = time.time() + timeout
        self.registry.save("sandboxes", sid, live.rec)

    async def delete_snapshot(self, snap_id: str) -> bool:
        snap = self.snapshots.pop(snap_id, None)
        if snap is None:
            return False
        self.registry.delete("snapshots", snap_id)
        await self._gc()
        return True

    async def _gc(self) -> None:
        """Delete layers and images that no sandbox, snapshot or template references any more."""
        async with self.gc_lock:
            layers = {self.base_layer}
            images = set()
            for t in self.templates.values():
                layers.update(t.layers)
            for live in self.live.values():
                layers.update(live.rec.layers)
                if live.rec.image:
                    images.add(live.rec.image)
            for s in self.snapshots.values():
                layers.update(s.layers)
                if s.image:
                    images.add(s.image)
            for layer in self.backend.layers_on_disk() - layers:
                self.backend.delete_layer(layer)
            for image in self.backend.images_on_disk() - images:
                self.backend.delete_image(image)

    async def _timeouts(self) -> None:
        while True:
            await asyncio.sleep(0.5)
            now = time.time()
            for live in list(self.live.values()):
                rec = live.rec
                if rec.state != "running" or rec.end_at > now or live.lock.locked():
                    continue
                try:
                    if rec.on_timeout == "pause":
                        await self.pause(rec.id, memory=rec.timeout_memory)
                    else:
                        await self.kill(rec.id)
                except ApiError:
                    pass
                except Exception as e:
                    log.warning("timeout of %s failed (%s); killing it", rec.id, e)
                    with contextlib.suppress(Exception):
                        await self.kill(rec.id)

    # ====================================================================================== envd access
    async def link(self, sid: str) -> AgentLink:
        """The agent link of a running sandbox (auto-resuming a paused one when it asked for that)."""
        live = self.live.get(sid)
        if live is None:
            raise ApiError(502, f"sandbox '{sid}' is not running (not found)")
        if live.rec.state == "paused":
            if not live.rec.auto_resume:
                raise ApiError(502, f"sandbox '{sid}' is paused; resume it with Sandbox.connect() first")
            await self.connect(sid)
        if live.link is None or live.link.closed.is_set():
            raise ApiError(502, f"sandbox '{sid}' is not running (its agent is not connected)")
        return live.link

    def metrics(self, sid: str) -> dict:
        live = self.get(sid)
        rec = live.rec
        limits = Limits(**rec.limits)
        cpu_pct = 0.0
        mem = 0
        if rec.state == "running" or rec.pause_kind == "freeze":
            usec = self.backend.cpu_usec(sid)
            now = time.monotonic()
            if live.cpu_sample is not None and now > live.cpu_sample[0]:
                cpu_pct = (
                    100.0
                    * (usec - live.cpu_sample[1])
                    / ((now - live.cpu_sample[0]) * 1e6)
                    / limits.cpu_count
                )
            live.cpu_sample = (now, usec)
            mem = self.backend.memory_bytes(sid)
        disk = _tree_bytes(self.backend.upper_path(rec.upper) / "upper")
        return {
            "cpuCount": max(1, round(limits.cpu_count)),
            "cpuUsedPct": round(max(cpu_pct, 0.0), 2),
            "memUsed": mem,
            "memTotal": limits.memory_mb << 20,
            "memCache": 0,
            "diskUsed": disk,
            "diskTotal": limits.disk_mb << 20,
        }


def _tree_bytes(root: Path, cap: int = 20000) -> int:
    total, seen = 0, 0
    stack = [str(root)]
    while stack and seen < cap:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    seen += 1
                    if e.is_dir(follow_symlinks=False):
                        stack.append(e.path)
                    elif e.is_file(follow_symlinks=False):
                        total += e.stat(follow_symlinks=False).st_blocks * 512
        except OSError:
            continue
    return total


__all__ = ["ENVD_VERSION", "AgentError", "AgentGone", "ApiError", "Manager", "SandboxRec", "SnapshotRec"]
