"""``python -m envs.sandbox serve --host 127.0.0.1 --port 3000``: the E2B-compatible sandbox server."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

# How long an idle client connection stays open. Longer than any client keeps an idle pooled connection (the e2b
# SDK: 300 s, E2B_KEEPALIVE_EXPIRY; httpx: 5 s): a server that closes first races a client reusing the connection,
# whose request then meets a reset (uvicorn's default of 5 s failed about one create/exec/kill cycle in a thousand).
KEEP_ALIVE_S = 330


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m envs.sandbox", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("serve", help="serve E2B's REST API and envd API on one port")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=3000)
    s.add_argument(
        "--state",
        type=Path,
        default=Path(os.environ.get("RLK3_SANDBOX_STATE", "/var/lib/rlk3-sandbox")),
        help="registry, disk image and CRIU images live here; a restart with the same --state keeps "
        "paused sandboxes and snapshots",
    )
    s.add_argument(
        "--backend",
        choices=("bwrap", "gvisor"),
        default="bwrap",
        help="what runs sandboxes by default: bubblewrap on the host kernel, or gVisor's user-space kernel "
        '(runsc); one create request picks the other with metadata {"rlk3.backend": "gvisor"}',
    )
    s.add_argument("--disk-gb", type=int, default=64, help="size of the sparse btrfs image holding all layers")
    s.add_argument("--criu", default=None, help="path of the criu binary (default: .cache/criu/criu, then PATH)")
    s.add_argument("--runsc", default=None, help="path of runsc (default: .cache/runsc/usr/bin/runsc, then PATH)")
    s.add_argument(
        "--gvisor-platform",
        choices=("systrap", "ptrace"),
        default="systrap",
        help="gVisor's way of intercepting system calls (systrap: faster syscalls; ptrace: faster fork/exec)",
    )
    s.add_argument(
        "--pause",
        choices=("memory", "freeze"),
        default="memory",
        help="what a memory-mode pause does: CRIU dump (0 CPU, ~0 memory) or cgroup freeze (0 CPU)",
    )
    s.add_argument(
        "--on-exit",
        choices=("pause", "kill", "keep"),
        default="pause",
        help="what happens to running sandboxes when the server stops",
    )
    s.add_argument("--max-sandboxes", type=int, default=1000)
    s.add_argument(
        "--pool",
        type=int,
        default=2,
        help="warm sandboxes kept booted per (template, backend) once used, so create only hands one out "
        "(0: boot on every create)",
    )
    s.add_argument(
        "--max-starting",
        type=int,
        default=None,
        help="sandboxes booting or restoring at once (default: 2 per core, at least 4); more creates wait their "
        "turn rather than time out",
    )
    s.add_argument("--max-upload-mb", type=int, default=100)
    s.add_argument(
        "--api-key",
        default=os.environ.get("RLK3_SANDBOX_API_KEY"),
        help="require this X-API-KEY on REST calls (default: accept any)",
    )
    s.add_argument(
        "--keep-alive",
        type=float,
        default=KEEP_ALIVE_S,
        help="seconds an idle client connection stays open; keep it above the clients' pool idle expiry "
        "(e2b SDK: 300 s) or their reused connections meet resets",
    )
    s.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)

    if os.geteuid() != 0:
        print("the sandbox server needs root (namespaces, cgroups, mounts, CRIU)", file=sys.stderr)
        return 2
    import uvicorn

    from .runtime import Manager
    from .server import build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    manager = Manager(
        args.state,
        backend=args.backend,
        disk_gb=args.disk_gb,
        criu=args.criu,
        runsc=args.runsc,
        gvisor_platform=args.gvisor_platform,
        default_pause=args.pause,
        on_exit=args.on_exit,
        max_sandboxes=args.max_sandboxes,
        pool=args.pool,
        max_starting=args.max_starting,
    )
    app = build_app(manager, api_key=args.api_key, max_upload_mb=args.max_upload_mb)
    uvicorn.run(
        app,
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        lifespan="on",
        timeout_graceful_shutdown=30,
        timeout_keep_alive=args.keep_alive,
        limit_concurrency=None,
        http="h11",
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
