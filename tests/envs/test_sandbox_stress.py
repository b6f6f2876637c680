"""Issue 4, item 4: 1,000 create/exec/kill cycles, 50 sandboxes at a time: 0 errors, nothing leaked."""

from __future__ import annotations

import asyncio
import time

import pytest
from e2b import AsyncSandbox


@pytest.mark.slow
def test_thousand_cycles_fifty_concurrent_leave_nothing(server):
    cycles, concurrency = 1000, 50
    errors: list[str] = []
    done = 0

    async def cycle(i: int, gate: asyncio.Semaphore) -> None:
        nonlocal done
        async with gate:
            try:
                sbx = await AsyncSandbox.create(request_timeout=120)
                try:
                    r = await sbx.commands.run(f"echo cycle-{i}", timeout=60)
                    if r.stdout != f"cycle-{i}\n":
                        errors.append(f"cycle {i}: stdout {r.stdout!r}")
                finally:
                    await sbx.kill()
                done += 1
            except Exception as e:
                errors.append(f"cycle {i}: {type(e).__name__}: {e}")

    async def go() -> None:
        gate = asyncio.Semaphore(concurrency)
        await asyncio.gather(*(cycle(i, gate) for i in range(cycles)))

    asyncio.run(go())
    assert errors == [], errors[:10]
    assert done == cycles
    with server.api() as c:
        assert c.get("/v2/sandboxes").json() == []
    # nothing left but the warm pool (booted sandboxes waiting for the next create): no other sandbox
    # cgroup leaf, process, writable layer, nor any mount of a sandbox disk
    for _ in range(300):  # a replacement may still be booting: wait until the pool is at rest
        health = server.health()
        if not health["warming"]:
            break
        time.sleep(0.1)
    pooled = {sid for ids in health["pooled"].values() for sid in ids}
    assert all(len(ids) <= 2 for ids in health["pooled"].values())  # --pool 2 per (template, backend)
    leaves = {p.name for p in server.leaves("x")[0].parent.iterdir() if p.is_dir()}
    assert leaves == pooled
    assert server.sandbox_mounts() == []
    mine = server.leaves("x")[0].parent
    stray = [pid for pid in _pids_under(mine) if not any(f"/{sid}" in _cgroup(pid) for sid in pooled)]
    assert stray == []
    uppers = {p.name for p in (server.state / "disk" / "uppers").iterdir()}
    assert uppers == {f"{sid}-0" for sid in pooled}


def _pids_under(cgroup) -> list[int]:
    out = []
    for leaf in cgroup.iterdir():
        if (leaf / "cgroup.procs").exists():
            out += [int(x) for x in (leaf / "cgroup.procs").read_text().split()]
    return out


def _cgroup(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            return f.read()
    except OSError:
        return ""
