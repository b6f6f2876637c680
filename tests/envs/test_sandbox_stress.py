"""Issue 4, item 4: 1,000 create/exec/kill cycles, 50 sandboxes at a time: 0 errors, nothing leaked."""

from __future__ import annotations

import asyncio
import subprocess

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
    # nothing left: no sandbox cgroup leaf, no mount of a sandbox disk, no sandbox process
    leaves = [p for p in server.leaves("x")[0].parent.iterdir() if p.is_dir()]
    assert leaves == []
    assert server.sandbox_mounts() == []
    agents = subprocess.run(
        ["pgrep", "-f", "/run/rlk3/agent.py"], capture_output=True, text=True
    ).stdout.split()
    assert agents == []
    uppers = list((server.state / "disk" / "uppers").iterdir())
    assert uppers == []
