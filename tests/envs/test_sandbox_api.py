"""Bad input gets E2B-shaped JSON errors; nothing a client sends crashes the server or leaks a sandbox.
Issue 4, item 5: a server restart keeps paused sandboxes and snapshots, and they resume."""

from __future__ import annotations

import asyncio
import http.client
import select
import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from e2b import AsyncSandbox

from envs.sandbox.__main__ import KEEP_ALIVE_S

from .sandboxes import on


def _err(r: httpx.Response, status: int, *words: str) -> None:
    assert r.status_code == status, (r.status_code, r.text)
    body = r.json()
    assert body["code"] == status and isinstance(body["message"], str)
    for w in words:
        assert w in body["message"], body["message"]


def test_bad_input_is_answered_with_e2b_shaped_errors(server, backend):
    sbx = asyncio.run(AsyncSandbox.create(metadata=on(backend)))
    sid = sbx.sandbox_id
    try:
        with server.api() as c:
            before = {s["sandboxID"] for s in c.get("/v2/sandboxes").json()}
            _err(c.post("/v2/sandboxes", json={"templateID": "no-such"}), 404, "no-such", "base", "python")
            _err(c.post("/v2/sandboxes", content=b"{not json"), 400, "not valid JSON")
            _err(c.post("/v2/sandboxes", json=["base"]), 400, "JSON object")
            _err(c.post("/v2/sandboxes", json={}), 400, "templateID")
            _err(c.post("/v2/sandboxes", json={"templateID": 7}), 400, "templateID")
            _err(c.post("/v2/sandboxes", json={"templateID": "base", "timeout": -1}), 400, "timeout")
            _err(c.post("/v2/sandboxes", json={"templateID": "base", "timeout": True}), 400, "timeout")
            _err(c.post("/v2/sandboxes", json={"templateID": "base", "metadata": {"a": 1}}), 400, "metadata")
            bad_backend = {"templateID": "base", "metadata": on("docker")}
            _err(c.post("/v2/sandboxes", json=bad_backend), 400, "docker", "bwrap", "gvisor")
            _err(
                c.post("/v2/sandboxes", json={"templateID": "base", "allow_internet_access": True}),
                400,
                "loopback",
            )
            _err(c.get("/sandboxes/nope"), 404, "nope")
            _err(c.delete("/sandboxes/nope"), 404)
            _err(c.post("/sandboxes/nope/pause"), 404)
            _err(c.post("/sandboxes/nope/connect", json={}), 404)
            for count in (0, 21, "3"):
                _err(c.post(f"/sandboxes/{sid}/fork", json={"count": count}), 400, "count")
            _err(c.post(f"/sandboxes/{sid}/timeout", json={"timeout": "soon"}), 400, "timeout")
            _err(c.post(f"/sandboxes/{sid}/pause", headers={"X-Rlk3-Pause": "nap"}), 400, "freeze")
            _err(c.get("/v2/sandboxes", params={"limit": "many"}), 400, "limit")
            _err(c.get("/v2/sandboxes", params={"state": "zombie"}), 400, "state")
            _err(c.delete("/templates/base"), 404)
            _err(c.get("/no/such/route"), 404, "no route")
            envd = {"E2b-Sandbox-Id": sid}
            _err(c.get("/files", headers=envd), 400, "path")
            _err(c.get("/files", params={"path": "/nope"}, headers=envd), 404)
            _err(c.get("/files", params={"path": "/x\0y"}, headers=envd), 400, "NUL")
            _err(c.get("/files", params={"path": "/tmp"}, headers={"E2b-Sandbox-Id": "nope"}), 502)
            # a declared oversize body is refused before a byte of it is read (raw socket: httpx won't lie)
            port = int(server.url.rsplit(":", 1)[1])
            with socket.create_connection(("127.0.0.1", port)) as raw:
                raw.sendall(
                    f"POST /files?path=/home/user/big HTTP/1.1\r\nHost: x\r\nE2b-Sandbox-Id: {sid}\r\n"
                    f"Content-Type: application/octet-stream\r\nContent-Length: {101 << 20}\r\n\r\n".encode()
                )
                raw.settimeout(10)
                head = b""
                while not head.endswith(b"}") and (part := raw.recv(65536)):
                    head += part
                head = head.decode()
            assert head.startswith("HTTP/1.1 413") and "limit" in head

            def stream():  # no Content-Length: the cap is enforced while streaming
                for _ in range(102):
                    yield b"\0" * (1 << 20)

            r = c.post(
                "/files",
                params={"path": "/home/user/big"},
                headers={**envd, "Content-Type": "application/octet-stream"},
                content=stream(),
            )
            _err(r, 413, "limit")
            r = c.post("/files", headers={**envd, "Content-Type": "multipart/form-data"}, content=b"x")
            _err(r, 400, "boundary")
            r = c.post(
                "/process.Process/Start",
                headers={**envd, "Content-Type": "application/json"},
                content=b'{"process": {"cmd": ""}}',
            )
            assert r.status_code >= 400
            r = c.post("/process.Process/Start", headers={"Content-Type": "application/json"}, content=b"{}")
            _err(r, 400, "E2b-Sandbox-Id")
            # still healthy, still serving, nothing leaked
            assert c.get("/health").status_code == 200
            assert {s["sandboxID"] for s in c.get("/v2/sandboxes").json()} == before
        assert asyncio.run(sbx.commands.run("echo alive")).stdout == "alive\n"
        assert server.proc.poll() is None
    finally:
        asyncio.run(AsyncSandbox.kill(sid))


# a counter that lives in the shell's memory, shown in /tmp/c; renamed into place so that a read, a pause or a
# snapshot never lands between `>`'s truncation and the write and sees an empty file
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c.new; mv -f /tmp/c.new /tmp/c; sleep 0.05; done"


def test_restart_keeps_paused_sandboxes_and_snapshots(tmp_path_factory, server_factory):
    state = tmp_path_factory.mktemp("restart") / "state"
    first = server_factory(state)
    opts = {"api_url": first.url, "sandbox_url": first.url, "api_key": "t"}

    async def before_restart():
        # a gVisor sandbox paused in memory mode survives the restart too (runsc checkpoint on disk)
        g = await AsyncSandbox.create(metadata=on("gvisor"), **opts)
        await g.commands.run(COUNTER, background=True, timeout=0)
        await asyncio.sleep(0.5)
        assert await g.pause()
        a = await AsyncSandbox.create(**opts)
        await a.files.write("/home/user/a.txt", "kept across restarts")
        await a.commands.run(COUNTER, background=True, timeout=0)
        await asyncio.sleep(0.5)
        assert await a.pause()
        b = await AsyncSandbox.create(**opts)
        await b.files.write("/home/user/b.txt", "in the snapshot")
        snap = await b.create_snapshot("before-restart")
        await b.kill()
        return a.sandbox_id, snap.snapshot_id, g.sandbox_id

    def counter_of(sid: str) -> int:
        return int((state / "disk" / "uppers" / first.rec(sid)["upper"] / "upper" / "tmp" / "c").read_text())

    try:
        sid, snap_id, gid = asyncio.run(before_restart())
        counter_at_pause, g_at_pause = counter_of(sid), counter_of(gid)
    finally:
        first.stop()
    assert not first.sandbox_mounts()
    second = server_factory(state)
    opts = {"api_url": second.url, "sandbox_url": second.url, "api_key": "t"}

    async def after_restart():
        listed = {s.sandbox_id: s.state.value for s in await AsyncSandbox.list(**opts).next_items()}
        assert listed.get(sid) == "paused"
        a = await AsyncSandbox.connect(sid, **opts)
        assert await a.files.read("/home/user/a.txt") == "kept across restarts"
        c = int((await a.commands.run("cat /tmp/c")).stdout)
        assert counter_at_pause <= c <= counter_at_pause + 10  # the loop continued from its own memory
        b = await AsyncSandbox.create(snap_id, **opts)
        assert await b.files.read("/home/user/b.txt") == "in the snapshot"
        g = await AsyncSandbox.connect(gid, **opts)
        c = int((await g.commands.run("cat /tmp/c")).stdout)
        assert g_at_pause <= c <= g_at_pause + 20, (g_at_pause, c)
        assert (await g.commands.run("uname -r")).stdout == "4.4.0\n"

    try:
        asyncio.run(after_restart())
        server_factory.kill_all(second)
        with httpx.Client(base_url=second.url) as c:
            c.delete(f"/templates/{snap_id}")
    finally:
        second.stop()
    assert not second.sandbox_mounts()
    assert "Application shutdown complete" in second.log.read_text()  # uvicorn re-raises SIGTERM: rc -15


@pytest.mark.parametrize("template", ["python", "node"])
def test_templates_are_built_once_and_work(server, template):
    async def go():
        sbx = await AsyncSandbox.create(template)
        try:
            if template == "python":
                r = await sbx.commands.run("which python; python -c 'import pytest, sys; print(sys.prefix)'")
                assert r.stdout.split() == ["/opt/venv/bin/python", "/opt/venv"]
            else:
                r = await sbx.commands.run(
                    "mkdir app && cd app && npm init -y >/dev/null && "
                    "npm install /opt/npm-src/rlk3-hello-1.0.0.tgz >/dev/null && "
                    "node -e \"console.log(require('rlk3-hello')())\""
                )
                assert r.stdout.strip() == "hello from the offline cache"
                await _vite_app_builds_offline(sbx)
        finally:
            await sbx.kill()
        layers = sorted(p.name for p in (server.state / "disk" / "layers").iterdir() if p.name.startswith("tpl-"))
        again = await AsyncSandbox.create(template)
        await again.kill()
        assert (
            sorted(p.name for p in (server.state / "disk" / "layers").iterdir() if p.name.startswith("tpl-")) == layers
        )  # cached by content hash: no rebuild

    asyncio.run(go())


def test_gvisor_as_the_server_default_and_what_a_snapshot_can_start_under(tmp_path_factory, server_factory):
    srv = server_factory(tmp_path_factory.mktemp("gvdefault") / "state", "--backend", "gvisor")
    opts = {"api_url": srv.url, "sandbox_url": srv.url, "api_key": "t"}
    assert httpx.get(srv.url + "/health").json()["backend"] == "gvisor"

    async def go():
        g = await AsyncSandbox.create(**opts)  # no metadata: the server's default
        assert (await g.commands.run("uname -r")).stdout == "4.4.0\n"
        b = await AsyncSandbox.create(metadata=on("bwrap"), **opts)  # one request may still pick bwrap
        assert (await b.commands.run("uname -r")).stdout != "4.4.0\n"
        await g.files.write("/home/user/made-in.txt", "gvisor")
        full = await g.create_snapshot()
        disk_only = await g.create_snapshot(mode="filesystem")
        with httpx.Client(base_url=srv.url, headers={"X-API-KEY": "t"}) as c:
            # a gVisor memory image cannot be restored by CRIU: asking for bwrap is refused, clearly
            r = c.post("/v2/sandboxes", json={"templateID": full.snapshot_id, "metadata": on("bwrap")})
            _err(r, 400, "gvisor", "bwrap")
        # a disk-only snapshot has no image: bwrap boots fresh over the disk gVisor wrote (same layers, ids)
        fresh = await AsyncSandbox.create(disk_only.snapshot_id, metadata=on("bwrap"), **opts)
        assert await fresh.files.read("/home/user/made-in.txt") == "gvisor"
        assert (await fresh.commands.run("stat -c %U /home/user/made-in.txt")).stdout == "user\n"
        for s in (g, b, fresh):
            await s.kill()

    asyncio.run(go())


VITE_CONFIG = """import { defineConfig } from 'vite'
import react from '@vitejs/plugin-react'
export default defineConfig({ plugins: [react()] })
"""
MAIN_JSX = """import { createRoot } from 'react-dom/client'
function App() { return <h1>built offline by rlk3</h1> }
createRoot(document.getElementById('root')).render(<App />)
"""
INDEX_HTML = """<!doctype html>
<html><body><div id="root"></div><script type="module" src="/src/main.jsx"></script></body></html>
"""


async def _vite_app_builds_offline(sbx: AsyncSandbox) -> None:
    """The node template's offline cache builds a Vite + React app (sandboxes have no network at all)."""
    await sbx.files.write("/home/user/web/vite.config.js", VITE_CONFIG)
    await sbx.files.write("/home/user/web/src/main.jsx", MAIN_JSX)
    await sbx.files.write("/home/user/web/index.html", INDEX_HTML)
    r = await sbx.commands.run(
        "cd web && cp /opt/rlk3-web/package.json /opt/rlk3-web/package-lock.json . && "
        "npm ci --offline --no-audit --no-fund >/dev/null && npx vite build >/dev/null && "
        "ls dist && grep -l 'built offline by rlk3' dist/assets/*.js",
        timeout=300,
    )
    assert "index.html" in r.stdout and "dist/assets/index-" in r.stdout, r.stdout
    # by name too: the cache holds the registry metadata of every package it carries
    r = await sbx.commands.run(
        "mkdir byname && cd byname && npm init -y >/dev/null && "
        "npm install --offline --no-audit --no-fund react@18.3.1 react-dom@18.3.1 >/dev/null && "
        "node -e \"console.log(require('react-dom/package.json').version)\"",
        timeout=120,
    )
    assert r.stdout.strip() == "18.3.1"


def test_idle_connections_outlive_the_clients_pools(server):
    """The server keeps an idle connection open longer than the e2b SDK keeps one in its pool: had it closed first
    (uvicorn's default: after 5 s), a client reusing the connection in that instant has its request reset — one
    create/exec/kill cycle in a thousand failed so. Behaviourally: a connection idle past 5 s still serves."""
    from e2b.api import pool_idle_timeout

    assert pool_idle_timeout < KEEP_ALIVE_S, (KEEP_ALIVE_S, pool_idle_timeout)
    url = urlsplit(server.url)
    conn = http.client.HTTPConnection(url.hostname, url.port, timeout=10)
    try:
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
        sock = conn.sock
        time.sleep(6)
        readable, _, _ = select.select([sock], [], [], 0)
        assert not readable or sock.recv(1, socket.MSG_PEEK) != b"", "the server closed an idle connection"
        conn.request("GET", "/health")
        r = conn.getresponse()
        assert r.status == 200 and r.read() and conn.sock is sock  # the same connection served it
    finally:
        conn.close()
