"""Sandbox lifecycle latencies, density and exec throughput, measured through the real e2b SDK.

    sudo .venv/bin/python bench/sandbox.py [--reps 10] [--density 200] [--backends bwrap,gvisor]

It starts its own servers on fresh state directories and stops them afterwards: one with the defaults (a
warm pool of 2 booted sandboxes per template and backend) for the lifecycle, density and throughput, and one
with ``--pool 0`` for cold creates. Prints tables (p50/p95 in ms, beside AgentENV's reported numbers and the
issue's goals) and writes bench/results/sandbox.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
from e2b import AsyncSandbox

ROOT = Path(__file__).resolve().parents[1]
AGENTENV = {"pause (memory)": 133.0, "resume (memory)": 49.0}  # reported checkpoint / resume, ms
GOALS = {"create": 50.0, "create (cold)": 50.0, "fork x8": 300.0}
OPS = (
    "create",
    "create (cold)",
    "exec true",
    "pause (freeze)",
    "resume (freeze)",
    "pause (memory)",
    "resume (memory)",
    "snapshot",
    "fork x8",
    "kill",
)


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round(q * (len(xs) - 1)))]


async def timed(fn) -> float:
    t = time.perf_counter()
    await fn()
    return (time.perf_counter() - t) * 1000


async def lifecycle(reps: int, opts: dict, backend: str) -> dict[str, list[float]]:
    meta = {"rlk3.backend": backend}
    out: dict[str, list[float]] = {k: [] for k in OPS if k != "create (cold)"}
    await (await AsyncSandbox.create(metadata=meta, **opts)).kill()  # the template's first use fills its pool
    await asyncio.sleep(3)
    for _ in range(reps):
        t = time.perf_counter()
        sbx = await AsyncSandbox.create(metadata=meta, **opts)
        out["create"].append((time.perf_counter() - t) * 1000)
        await sbx.commands.run(
            "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.1; done", background=True, timeout=0
        )
        for _ in range(3):
            out["exec true"].append(await timed(lambda s=sbx: s.commands.run("true")))
        out["pause (freeze)"].append(await timed(lambda s=sbx: s.pause(api_headers={"X-Rlk3-Pause": "freeze"})))
        out["resume (freeze)"].append(await timed(lambda s=sbx: AsyncSandbox.connect(s.sandbox_id, **opts)))
        out["pause (memory)"].append(await timed(lambda s=sbx: s.pause()))
        out["resume (memory)"].append(await timed(lambda s=sbx: AsyncSandbox.connect(s.sandbox_id, **opts)))
        snap = None

        async def take(s=sbx):
            nonlocal snap
            snap = await s.create_snapshot()

        out["snapshot"].append(await timed(take))
        kids: list = []

        async def fork(s=sbx):
            nonlocal kids
            kids = await s.fork(count=8)

        out["fork x8"].append(await timed(fork))
        if not all(isinstance(k, AsyncSandbox) for k in kids):
            raise RuntimeError(f"fork failed: {kids}")
        await asyncio.gather(*(k.kill() for k in kids))
        await AsyncSandbox.delete_snapshot(snap.snapshot_id, **opts)
        out["kill"].append(await timed(lambda s=sbx: s.kill()))
        await asyncio.sleep(1)  # let the pool refill, as it would between a trainer's requests
    return out


async def cold_creates(reps: int, opts: dict, backend: str) -> list[float]:
    """Creates on a server without a warm pool: every one boots its sandbox."""
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        sbx = await AsyncSandbox.create(metadata={"rlk3.backend": backend}, **opts)
        out.append((time.perf_counter() - t) * 1000)
        await sbx.kill()
    return out


async def density(n: int, opts: dict) -> dict:
    ids = []
    t = time.perf_counter()
    mem0 = _mem_available()
    try:
        for _ in range(n):
            ids.append((await AsyncSandbox.create(**opts)).sandbox_id)
        per = (mem0 - _mem_available()) / max(1, len(ids))
        ok = 0
        for sid in ids[:: max(1, len(ids) // 20)]:  # spot-check that they all still answer
            s = await AsyncSandbox.connect(sid, **opts)
            ok += (await s.commands.run("echo ok")).stdout == "ok\n"
        return {
            "idle sandboxes": len(ids),
            "seconds to create": time.perf_counter() - t,
            "MiB per idle sandbox": per / 2**20,
            "spot checks ok": ok,
            "MiB available after": _mem_available() / 2**20,
        }
    finally:
        await asyncio.gather(*(AsyncSandbox.kill(sid, **opts) for sid in ids))


async def throughput(conc: int, per: int, opts: dict) -> dict:
    boxes = await asyncio.gather(*(AsyncSandbox.create(**opts) for _ in range(conc)))
    lat: list[float] = []

    async def worker(s):
        for _ in range(per):
            lat.append(await timed(lambda: s.commands.run("true")))

    t = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in boxes))
    wall = time.perf_counter() - t
    await asyncio.gather(*(s.kill() for s in boxes))
    return {
        "concurrent sandboxes": conc,
        "execs": len(lat),
        "execs/s": len(lat) / wall,
        "p50 ms": pct(lat, 0.5),
        "p95 ms": pct(lat, 0.95),
    }


def _mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def serve(*extra: str) -> tuple[subprocess.Popen, dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    state = Path(tempfile.mkdtemp(prefix="rlk3-bench-")) / "state"
    url = f"http://127.0.0.1:{port}"
    argv = [sys.executable, "-m", "envs.sandbox", "serve", "--port", str(port), "--state", str(state)]
    proc = subprocess.Popen([*argv, "--log-level", "warning", *extra], cwd=ROOT)
    for _ in range(1200):
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            time.sleep(0.1)
    else:
        proc.kill()
        raise RuntimeError("the sandbox server did not come up")
    return proc, {"api_url": url, "sandbox_url": url, "api_key": os.environ.get("E2B_API_KEY", "bench")}


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(180)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--gvisor-reps", type=int, default=5, help="gVisor is slower: fewer repetitions")
    ap.add_argument("--density", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=50)
    ap.add_argument("--backends", default="bwrap,gvisor")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "sandbox.json")
    args = ap.parse_args()
    backends = args.backends.split(",")
    reps = {b: args.reps if b == "bwrap" else args.gvisor_reps for b in backends}
    lat: dict[str, dict[str, list[float]]] = {}

    proc, opts = serve("--pool", "0", "--max-sandboxes", "100")
    try:
        for b in backends:
            asyncio.run(cold_creates(1, opts, b))  # builds the base template once, outside the timing
            lat[b] = {"create (cold)": asyncio.run(cold_creates(reps[b], opts, b))}
    finally:
        stop(proc)
    proc, opts = serve("--max-sandboxes", str(args.density + 100))
    try:
        for b in backends:
            lat[b].update(asyncio.run(lifecycle(reps[b], opts, b)))
        dens = asyncio.run(density(args.density, opts)) if args.density else {}
        thr = asyncio.run(throughput(args.concurrency, 10, opts)) if args.concurrency else {}
    finally:
        stop(proc)

    rows = {
        b: {k: {"p50": pct(v, 0.5), "p95": pct(v, 0.95), "n": len(v)} for k, v in lat[b].items()}
        for b in backends
    }
    for b in backends:
        print(f"\n{b}\n{'operation':<18}{'p50 ms':>9}{'p95 ms':>9}   reference")
        for k in OPS:
            r = rows[b][k]
            ref = (
                f"AgentENV {AGENTENV[k]:.0f} ms"
                if k in AGENTENV
                else (f"goal <= {GOALS[k]:.0f} ms" if k in GOALS else "")
            )
            print(f"{k:<18}{r['p50']:>9.1f}{r['p95']:>9.1f}   {ref}")
    print("density (bwrap):", json.dumps(dens, default=float))
    print("throughput (bwrap):", json.dumps(thr, default=float))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "latency_ms": rows,
                "density": dens,
                "throughput": thr,
                "reps": reps,
                "machine": f"{os.cpu_count()} cores",
                "loadavg_at_end": Path("/proc/loadavg").read_text().split()[:3],
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
