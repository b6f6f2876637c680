"""The sandbox manager: lifecycle, registry on disk, agent connections, timeouts.

Everything the HTTP layer does goes through :class:`Manager`; it raises :class:`ApiError` with an HTTP
status and a message naming what was wrong and what would be valid, which the server turns into E2B's
``{code, message}`` JSON.
"""

from __future__ import annotations

import asyncio
import collections
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
from .gvisor import GvisorBackend
from .host import HostError, Limits, Reaper, proc_start_time, subvol_snapshot
from .link import HDR, AgentError, AgentGone, AgentLink
from .templates import BUILTIN, ROOT, TemplateSpec

log = logging.getLogger("rlk3.sandbox")

# How long a booted or restored sandbox's agent may take to connect and say hello. Generous on purpose: on a
# loaded two-core host, fifty sandboxes booting at once (each agent starts a Python interpreter) took over 15 s;
# a boot that has not connected in a minute is broken, not slow.
AGENT_CONNECT_S = 60.0
AGENT_HELLO_S = 30.0
ENVD_VERSION = "0.6.4"  # the envd protocol level we speak (gates SDK features, see e2b/envd/versions.py)
ID_ALPHABET = string.ascii_lowercase + string.digits
MAX_FORK = 20
MAX_TIMEOUT = 24 * 3600
BACKEND_KEY = "rlk3.backend"  # sandbox metadata key that picks the backend of one create request


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
    generation: int = 0  # unused since forks and snapshots copy the upper; kept so older records load
    backend: str = "bwrap"  # bwrap | gvisor: what runs its processes (the disk is the same for both)


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
    backend: str = "bwrap"  # a memory image restores only under the backend that made it


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
        runsc: str | None = None,
        gvisor_platform: str = "systrap",
        default_pause: str = "memory",
        on_exit: str = "pause",
        max_sandboxes: int = 1000,
        pool: int = 2,
        max_starting: int | None = None,
    ) -> None:
        self.state = state.resolve()
        self.reaper = Reaper()
        # the bwrap backend owns the disk (layers, uppers, images) and the cgroup sub-tree; gVisor runs its
        # processes over the same disk. Templates are always built under bwrap (faster, same layers).
        self.host = BwrapBackend(self.state, self.reaper, disk_gb=disk_gb, criu=criu)
        self.backends = {
            "bwrap": self.host,
            "gvisor": GvisorBackend(self.host, runsc=runsc, platform=gvisor_platform),
        }
        if backend not in self.backends:
            raise ValueError(f"unknown backend {backend!r}; valid: {', '.join(self.backends)}")
        self.default_backend = backend
        if default_pause not in ("memory", "freeze"):
            raise ValueError(f"default_pause must be 'memory' or 'freeze', not {default_pause!r}")
        self.default_pause = default_pause
        self.on_exit = on_exit
        self.max_sandboxes = max_sandboxes
        # sandboxes starting (booted or restored, up to their agent's connection) at once; the rest wait their
        # turn. Each start has its own timeouts (10 s for bwrap's report, the agent's connection), which must
        # measure that start, not a queue: an RL iteration creates its 128 episodes' sandboxes at once, and on two
        # busy cores two servers' 256 starts side by side ran the last ones past 10 s (a quarter of the episodes
        # failed). Starts are CPU work (namespaces, mounts, an interpreter), so a few per core keep them all busy.
        self.max_starting = max_starting or max(4, 2 * (os.cpu_count() or 1))
        if self.max_starting < 1:
            raise ValueError(f"max_starting must be >= 1, not {max_starting!r}")
        self.starting = asyncio.Semaphore(self.max_starting)
        # warm pool: booted sandboxes waiting per (template, backend), handed out by create; a sandbox's
        # start-up (namespaces, overlay, the agent's interpreter: ~40-90 ms under bwrap, ~300 ms under
        # gVisor) then happens before the request instead of during it. Filled on a template's first use.
        self.pool_size = pool
        self.pool: dict[tuple[str, str], list[Live]] = {}
        self.pool_tasks: dict[tuple[str, str], asyncio.Task] = {}
        self.warming: set[str] = set()  # warm sandboxes still booting (owned by no record yet)
        self.stopping = False
        self.registry = Registry(self.state / "registry")
        self.live: dict[str, Live] = {}
        self.snapshots: dict[str, SnapshotRec] = {}
        self.templates: dict[str, Template] = {}
        self.template_locks: dict[str, asyncio.Lock] = {}
        self.expect: dict[int, asyncio.Future] = {}  # agent host PID -> future of its link
        self.base_layer = ""
        self.servers: list[asyncio.AbstractServer] = []
        self.tasks: list[asyncio.Task] = []
        self.gc_lock = asyncio.Lock()
        # images and layers an operation has made but no record references yet (a fork's checkpoint while its
        # children restore from it, a snapshot's before it is registered): _gc must not delete them meanwhile
        self.in_flight: collections.Counter[str] = collections.Counter()

    # ====================================================================================== start / stop
    async def start(self) -> None:
        gvisor = self.backends["gvisor"]
        if self.default_backend == "gvisor" and gvisor.available:
            raise HostError(f"--backend gvisor: {gvisor.available}")
        await self.host.start()
        await gvisor.start()
        self.base_layer = self.host.build_base_layer()
        for t in self.registry.load("templates", Template):
            self.templates[t.name] = t
        for s in self.registry.load("snapshots", SnapshotRec):
            self.snapshots[s.id] = s
        socks = [self.host.run_dir / "agent.sock"]
        if not gvisor.available:
            socks.append(gvisor.agent_socket())
        for sock in socks:  # one handler: agents are told apart by their connection's peer PID
            with contextlib.suppress(FileNotFoundError):
                sock.unlink()
            self.servers.append(
                await asyncio.start_unix_server(self._on_agent, path=str(sock), limit=HDR.size + (64 << 20))
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
            be = self._be(rec)
            if alive:
                if rec.pause_kind == "freeze":
                    be.thaw(rec.id)
                try:
                    live.link = await self._wake(rec, rec.agent_pid, 5)
                    if rec.pause_kind == "freeze":
                        be.freeze(rec.id)
                    continue
                except TimeoutError:
                    pass
            log.warning("sandbox %s did not survive the restart; removing it", rec.id)
            await self._destroy(live)
        # what no record owns (a crash mid-create, warm-pool sandboxes of a server that died): processes and
        # cgroups first, then writable layers
        for sid in self.host.cgroups.existing() - set(self.live):
            log.warning("removing the cgroups (and processes) of unknown sandbox %s", sid)
            await self.host.cgroups.remove(sid)
        for upper in self.host.uppers_on_disk() - {live.rec.upper for live in self.live.values()}:
            self.host.delete_upper(upper)
        await self._gc()

    async def stop(self) -> None:
        self.stopping = True
        for t in [*self.tasks, *self.pool_tasks.values()]:
            t.cancel()
        for entries in self.pool.values():  # warm sandboxes hold nothing anyone asked for: they just go
            while entries:
                await self._destroy(entries.pop())
        for live in list(self.live.values()):
            if live.rec.state != "running":
                continue
            try:
                if self.on_exit == "pause" and self._can_dump(live.rec.backend):
                    await self.pause(live.rec.id, memory=True, kind="memory")
                elif self.on_exit != "keep":
                    await self.kill(live.rec.id)
            except Exception as e:  # a sandbox that cannot be paused is killed: never leave it behind
                log.warning("could not pause %s on exit (%s); killing it", live.rec.id, e)
                await self.kill(live.rec.id)
        for server in self.servers:
            server.close()
        await self.backends["gvisor"].stop()
        await self.host.stop(unmount=self.on_exit != "keep")

    def _be(self, rec: SandboxRec):
        """The backend running this sandbox's processes."""
        return self.backends[rec.backend]

    def _can_dump(self, backend: str) -> bool:
        return bool(self.host.criu) if backend == "bwrap" else not self.backends[backend].available

    def backend_for(self, requested: str | None) -> str:
        name = requested or self.default_backend
        be = self.backends.get(name)
        if be is None:
            raise ApiError(400, f"unknown sandbox backend {name!r}; valid: {', '.join(self.backends)}")
        if name == "gvisor" and be.available:
            raise ApiError(400, f"the gvisor backend is not available on this server: {be.available}")
        return name

    # ====================================================================================== agents
    async def _on_agent(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        sock = writer.get_extra_info("socket")
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, _, _ = struct.unpack("3i", creds)
        fut = self.expect.pop(pid, None)
        # a freshly booted agent may dial in before the backend has told us its PID (gVisor's runsc returns
        # only once the container runs): give the expectation a moment to appear
        for _ in range(100):
            if fut is not None:
                break
            await asyncio.sleep(0.01)
            fut = self.expect.pop(pid, None)
        if fut is None or fut.done():
            # not an agent we started: a process inside a sandbox poking at the shared socket, or a stale one
            log.info("refused an agent-socket connection from host PID %d", pid)
            writer.close()
            return
        link = AgentLink(reader, writer, pid)
        try:
            head = await asyncio.wait_for(reader.readexactly(HDR.size), AGENT_HELLO_S)
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

    async def _await_agent(self, pid: int, timeout: float = AGENT_CONNECT_S) -> AgentLink:
        fut = self.expect.get(pid)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self.expect[pid] = fut
        try:
            return await asyncio.wait_for(fut, timeout)
        finally:
            self.expect.pop(pid, None)

    async def _wake(self, rec: SandboxRec, pid: int, timeout: float = AGENT_CONNECT_S) -> AgentLink:
        """Wake a held agent (after a restore, or a dump that left its tree running) and wait for it to
        reconnect; wake it again while it does not, since a signal sent while runsc restore is still
        finishing (it returns before the restored tasks run) can be lost."""
        loop = asyncio.get_running_loop()
        fut = self.expect.get(pid)
        if fut is None:
            fut = self.expect[pid] = loop.create_future()
        deadline = loop.time() + timeout
        delay = 0.05
        try:
            while True:
                with contextlib.suppress(HostError):
                    await self._be(rec).wake(rec.id, pid)
                try:
                    return await asyncio.wait_for(asyncio.shield(fut), delay)
                except TimeoutError:
                    if loop.time() > deadline:
                        raise
                    delay = min(2 * delay, 1.0)
        finally:
            self.expect.pop(pid, None)

    async def _launch(self, live: Live, *, image: str | None = None) -> None:
        """Boot (or CRIU-restore) the sandbox's process tree and wait for its agent."""
        async with self.starting:
            await self._start(live, image)

    async def _start(self, live: Live, image: str | None) -> None:
        rec = live.rec
        limits = Limits(**rec.limits)
        be = self._be(rec)
        if image is None:
            pid = await be.boot(rec.id, rec.layers, rec.upper, limits)
        else:
            pid = await be.restore(rec.id, image, rec.layers, rec.upper, limits)
        self.expect[pid] = asyncio.get_running_loop().create_future()
        try:
            live.link = await (self._await_agent(pid) if image is None else self._wake(rec, pid))
        except TimeoutError:
            await be.destroy(rec.id)  # whatever did start must not outlive the failure
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
                f"template '{name}' not found; valid templates: {', '.join(self.template_names())} or a snapshot ID",
            )
        lock = self.template_locks.setdefault(name, asyncio.Lock())
        async with lock:
            parent_layers = [self.base_layer] if spec.parent is None else (await self.template(spec.parent)).layers
            digest = spec.digest(parent_layers)
            have = self.templates.get(name)
            if (
                have is not None
                and have.digest == digest
                and all((self.host.layer_path(la)).exists() for la in have.layers)
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
        limits = Limits(cpu_count=spec.cpu_count, memory_mb=spec.memory_mb, pids=spec.pids, disk_mb=spec.disk_mb)
        parent_envs = {} if spec.parent is None else dict((await self.template(spec.parent)).envs)
        envs = {**parent_envs, **spec.envs}
        if not spec.files and not spec.setup and not spec.host_dirs:
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
        self.host.delete_upper(sid)
        self.host.new_upper(sid, limits)
        try:
            for dst, src in spec.host_dirs.items():
                if not (ROOT / src).is_dir():
                    raise ApiError(
                        500,
                        f"building template '{spec.name}': {src} is missing; run `make system` "
                        "(scripts/setup.d/sandbox.sh fills it)",
                    )
                await asyncio.to_thread(self.host.import_tree, sid, dst, ROOT / src)
            await self._launch(live)
            for path, content in spec.files.items():
                await self._write(live.link, path, content.encode(), "root")
            for cmd in spec.setup:
                code, out = await self._run(live.link, cmd, user="root", timeout=600)
                if code != 0:
                    raise ApiError(
                        500,
                        f"building template '{spec.name}': setup command {cmd!r} exited {code}: {out[-2000:]}",
                    )
        finally:
            if live.link is not None:
                live.link.writer.close()
            await self.host.destroy(sid)
        layer = f"tpl-{spec.name}-{digest}"
        if self.host.layer_path(layer).exists():
            self.host.delete_layer(layer)
        self.host.seal(sid, layer)
        return Template(spec.name, digest, [layer, *parent_layers], envs, asdict(limits))

    async def _write(self, link: AgentLink, path: str, data: bytes, user: str | None) -> dict:
        hdr, _ = await link.request("wopen", path=path, user=user)
        wid = hdr["rid"]
        for i in range(0, len(data), 1 << 20):
            await link.request("wdata", data[i : i + (1 << 20)], wid=wid)
        hdr, _ = await link.request("wclose", wid=wid)
        return hdr["entry"]

    async def _run(self, link: AgentLink, cmd: str, *, user: str = "user", timeout: float = 60) -> tuple[int, str]:
        p = await link.start({"cmd": "/bin/bash", "args": ["-l", "-c", cmd], "envs": {}, "cwd": "", "user": user})
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
        backend: str | None = None,
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
        if snap is not None and snap.image:
            if backend is not None and backend != snap.backend:
                raise ApiError(
                    400,
                    f"snapshot '{template_id}' holds a {snap.backend} memory image and can only start under "
                    f"the {snap.backend} backend, not {backend}",
                )
            backend = snap.backend
        backend = self.backend_for(backend)
        if snap is not None:
            layers, limits, base_envs, image, tpl = snap.layers, snap.limits, snap.envs, snap.image, snap.id
        else:
            t = await self.template(template_id)
            layers, limits, base_envs, image, tpl = t.layers, t.limits, t.envs, None, t.name
            warm = await self._take_warm(t, backend)
            self._refill(t.name, backend)
            if warm is not None:
                rec = warm.rec
                now = time.time()
                rec.envs = {**base_envs, **(envs or {})}
                rec.metadata = dict(metadata or {})
                rec.started_at, rec.end_at = now, now + timeout
                rec.on_timeout, rec.timeout_memory, rec.auto_resume = on_timeout, timeout_memory, auto_resume
                self.live[rec.id] = warm
                async with warm.lock:
                    try:
                        if envs:
                            await warm.link.request("env", envs=envs)
                    except BaseException:
                        await self._destroy(warm)
                        raise
                    self.registry.save("sandboxes", rec.id, rec)
                return rec
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
            backend=backend,
        )
        live = Live(rec)
        self.live[sid] = live
        async with live.lock:
            try:
                self.host.new_upper(rec.upper, Limits(**rec.limits))
                await self._launch(live, image=image)
                if image is not None and envs:
                    await live.link.request("env", envs=envs)
            except BaseException:
                await self._destroy(live)
                raise
            self.registry.save("sandboxes", sid, rec)
        return rec

    async def _take_warm(self, t: Template, backend: str) -> Live | None:
        entries = self.pool.get((t.name, backend), [])
        while entries:
            live = entries.pop(0)
            if live.rec.layers == t.layers and live.link is not None and not live.link.closed.is_set():
                return live
            await self._destroy(live)  # the template was rebuilt, or its agent died
        return None

    def _refill(self, name: str, backend: str) -> None:
        key = (name, backend)
        task = self.pool_tasks.get(key)
        if self.pool_size > 0 and not self.stopping and (task is None or task.done()):
            self.pool_tasks[key] = asyncio.create_task(self._fill(key))

    async def _fill(self, key: tuple[str, str]) -> None:
        """Boot warm sandboxes one at a time (never competing with itself) until the pool is full."""
        entries = self.pool.setdefault(key, [])
        while len(entries) < self.pool_size and not self.stopping:
            t = await self.template(key[0])
            sid, now = new_id("i"), time.time()
            rec = SandboxRec(
                id=sid,
                template_id=t.name,
                layers=list(t.layers),
                upper=f"{sid}-0",
                limits=dict(t.limits),
                envs=dict(t.envs),
                metadata={},
                started_at=now,
                end_at=now,
                backend=key[1],
            )
            live = Live(rec)
            self.warming.add(sid)
            try:
                self.host.new_upper(rec.upper, Limits(**rec.limits))
                await self._launch(live)
            except Exception as e:  # the next create boots cold and retries the fill
                log.warning("warm pool %s: could not boot a sandbox: %s", key, e)
                await self._destroy(live)
                return
            finally:
                self.warming.discard(sid)
            if self.stopping:
                await self._destroy(live)
                return
            entries.append(live)

    def pooled(self) -> dict[str, list[str]]:
        """Warm sandboxes by ``template/backend``."""
        return {f"{t}/{b}": [live.rec.id for live in entries] for (t, b), entries in self.pool.items()}

    async def connect(self, sid: str, *, timeout: int | None = None, memory: bool = True) -> SandboxRec:
        live = self.get(sid)
        async with live.lock:
            rec = live.rec
            if timeout is not None:
                rec.end_at = max(rec.end_at, time.time() + timeout) if rec.state == "running" else time.time() + timeout
            if rec.state == "paused":
                await self._resume(live, reboot=not memory)
            self.registry.save("sandboxes", sid, rec)
            return rec

    async def _resume(self, live: Live, *, reboot: bool = False) -> None:
        rec = live.rec
        kind = rec.pause_kind
        if kind == "freeze" and not reboot:
            self._be(rec).thaw(rec.id)
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
                self._be(rec).freeze(rec.id)
            elif kind == "memory":
                rec.image = await self._checkpoint(live)
                self._release(rec.image)  # the record references it from here on
            else:
                await self._stop_processes(live)
            rec.state, rec.pause_kind = "paused", kind
            self.registry.save("sandboxes", sid, rec)
            return True

    async def _checkpoint(self, live: Live) -> str:
        """Detach the agent, CRIU-dump the tree (which kills it), free the cgroups. Returns the image id."""
        rec = live.rec
        be = self._be(rec)
        image = new_id("m")
        await self._detach(live)
        self.in_flight[image] += 1  # held from _gc until the caller's records reference it; it releases it
        try:
            await be.dump(rec.id, rec.agent_pid, image)
        except HostError:
            self._release(image)
            self.host.delete_image(image)
            # the dump left the tree running: let the agent reconnect
            with contextlib.suppress(Exception):
                live.link = await self._wake(rec, rec.agent_pid, 5)
            raise
        await be.destroy(rec.id)
        rec.agent_pid = rec.agent_start = None
        return image

    async def _stop_processes(self, live: Live) -> None:
        if live.link is not None:
            live.link.writer.close()
            live.link = None
        await self._be(live.rec).destroy(live.rec.id)
        live.rec.agent_pid = live.rec.agent_start = None

    def _disk_copy(self, rec: SandboxRec) -> str:
        """Copy a stopped or frozen sandbox's upper into a new read-only layer (a btrfs snapshot, constant
        time); the sandbox keeps writing to its own upper, so its layer stack never grows."""
        layer = new_id("l")
        subvol_snapshot(self.host.upper_path(rec.upper), self.host.layer_path(layer))
        return layer

    async def _reattach(self, live: Live) -> None:
        """Wake a held agent (after a dump that left its tree running) and wait for it to reconnect."""
        live.link = await self._wake(live.rec, live.rec.agent_pid, 10)

    def _release(self, *ids: str) -> None:
        """Let _gc see ``ids`` again (held in ``in_flight`` while no record referenced them)."""
        self.in_flight.subtract(ids)
        self.in_flight += collections.Counter()  # drops the ids whose count is back to zero

    @contextlib.contextmanager
    def _released(self, *ids: str):
        """Release ``ids`` when the block ends, however it ends."""
        try:
            yield
        finally:
            self._release(*ids)

    async def _copy_running(self, live: Live):
        """A memory image and a disk layer of a running sandbox, taken at one instant, held from _gc until
        the caller releases them (``self.in_flight``), once its records reference them.

        Returns ``(image, layer, relaunch)``: ``relaunch`` is None when the sandbox kept running (the bwrap
        backend: freeze, snapshot, CRIU dump with --leave-running), else a coroutine that restores it from
        the image over its unchanged disk (gVisor: runsc checkpoint stops the container)."""
        rec = live.rec
        be = self._be(rec)
        if be.live_checkpoint:
            image, layer = new_id("m"), new_id("l")
            await self._detach(live)
            self.in_flight.update((image, layer))  # released by the caller once records reference them
            try:
                await be.checkpoint_live(rec.id, rec.agent_pid, image, rec.upper, layer)
            except HostError:
                self._release(image, layer)
                self.host.delete_image(image)
                raise
            finally:
                await self._reattach(live)
            return image, layer, None
        image = await self._checkpoint(live)  # held
        layer = self._disk_copy(rec)
        self.in_flight[layer] += 1  # no await since it was made: nothing could have collected it yet

        async def relaunch() -> None:
            try:
                await self._launch(live, image=image)
            except BaseException as e:
                log.error("sandbox %s failed to come back after its checkpoint: %s", rec.id, e)
                await self._destroy(live)
                raise ApiError(500, f"sandbox {rec.id} could not be restored after its checkpoint: {e}") from e
            finally:
                self.registry.save("sandboxes", rec.id, rec)

        return image, layer, relaunch()

    async def snapshot(self, sid: str, *, name: str | None = None, memory: bool = True) -> SnapshotRec:
        live = self.get(sid)
        async with live.lock:
            rec = live.rec
            be = self._be(rec)
            if rec.state == "paused" and rec.pause_kind != "freeze":
                # stopped: the sandbox keeps its own image, the snapshot shares it
                image, layer = rec.image, self._disk_copy(rec)
            else:
                frozen = rec.state == "paused"
                if frozen:
                    be.thaw(rec.id)
                try:
                    image, layer, relaunch = await self._copy_running(live)
                    with self._released(image, layer):
                        if relaunch is not None:
                            await relaunch
                finally:
                    if frozen and rec.id in self.live:
                        be.freeze(rec.id)
            snap = SnapshotRec(
                id=new_id("s"),
                names=[name] if name else [],
                source=sid,
                template_id=rec.template_id,
                layers=[layer, *rec.layers],
                image=image if memory else None,
                limits=dict(rec.limits),
                envs=dict(rec.envs),
                created_at=time.time(),
                backend=rec.backend,
            )
            self.snapshots[snap.id] = snap
            self.registry.save("snapshots", snap.id, snap)
            self.registry.save("sandboxes", sid, rec)
        await self._gc()
        return snap

    async def fork(self, sid: str, *, count: int = 1, timeout: int | None = None) -> list[SandboxRec | Exception]:
        """``count`` children, each restored from one checkpoint of the source over its own fresh upper
        (above a shared copy of the source's disk); the source carries on unchanged."""
        if not 1 <= count <= MAX_FORK:
            raise ApiError(400, f"count must be between 1 and {MAX_FORK}, got {count}")
        live = self.get(sid)
        children: list[Live] = []
        async with live.lock:
            rec = live.rec
            be = self._be(rec)
            relaunch, held = None, ()
            frozen = rec.state == "paused" and rec.pause_kind == "freeze"
            if rec.state == "paused" and not frozen:
                image, layer = rec.image, self._disk_copy(rec)
            else:
                if frozen:
                    be.thaw(rec.id)
                try:
                    image, layer, relaunch = await self._copy_running(live)
                    held = (image, layer)
                finally:
                    if frozen and relaunch is None:
                        be.freeze(rec.id)
            with self._released(*held):  # until the children have restored from them
                now = time.time()
                for _ in range(count):
                    cid = new_id("i")
                    child = SandboxRec(
                        id=cid,
                        template_id=rec.template_id,
                        layers=[layer, *rec.layers],
                        upper=f"{cid}-0",
                        limits=dict(rec.limits),
                        envs=dict(rec.envs),
                        metadata=dict(rec.metadata),
                        started_at=now,
                        end_at=now + (timeout if timeout is not None else max(rec.end_at - now, 60)),
                        on_timeout=rec.on_timeout,
                        timeout_memory=rec.timeout_memory,
                        auto_resume=rec.auto_resume,
                        backend=rec.backend,
                    )
                    children.append(Live(child))
                    self.live[cid] = children[-1]

                async def bring_up(c: Live) -> SandboxRec:
                    async with c.lock:
                        try:
                            self.host.new_upper(c.rec.upper, Limits(**c.rec.limits))
                            await self._launch(c, image=image)  # a filesystem-paused source has no image: boot
                        except BaseException:
                            await self._destroy(c)
                            raise
                        self.registry.save("sandboxes", c.rec.id, c.rec)
                        return c.rec

                jobs = [bring_up(c) for c in children]
                if relaunch is not None:  # the source comes back while its children start
                    jobs.append(relaunch)
                results = await asyncio.gather(*jobs, return_exceptions=True)
                if relaunch is not None:
                    if isinstance(results[-1], BaseException):
                        raise results[-1]
                    if frozen:
                        be.freeze(rec.id)
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
        await self._be(rec).destroy(rec.id)
        self.host.delete_upper(rec.upper)
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
            for live in [*self.live.values(), *(x for entries in self.pool.values() for x in entries)]:
                layers.update(live.rec.layers)
                if live.rec.image:
                    images.add(live.rec.image)
            for s in self.snapshots.values():
                layers.update(s.layers)
                if s.image:
                    images.add(s.image)
            layers.update(self.in_flight)
            images.update(self.in_flight)
            for layer in self.host.layers_on_disk() - layers:
                self.host.delete_layer(layer)
            for image in self.host.images_on_disk() - images:
                self.host.delete_image(image)
            await self.backends["gvisor"].forget_others(
                set(self.live) | {x.rec.id for entries in self.pool.values() for x in entries} | self.warming
            )

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
            usec = self._be(rec).cpu_usec(sid)
            now = time.monotonic()
            if live.cpu_sample is not None and now > live.cpu_sample[0]:
                cpu_pct = 100.0 * (usec - live.cpu_sample[1]) / ((now - live.cpu_sample[0]) * 1e6) / limits.cpu_count
            live.cpu_sample = (now, usec)
            mem = self._be(rec).memory_bytes(sid)
        disk = _tree_bytes(self.host.upper_path(rec.upper) / "upper")
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
