"""Declarative templates: host system directories read-only, plus files, plus setup commands run once.

A template is built by booting a sandbox on its parent's layers, writing its files, running its setup
commands as root, and sealing the resulting upper as one more read-only layer. The layer's name carries the
hash of the spec (and of its parent's layers), so a changed spec builds anew and an unchanged one is reused.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    parent: str | None = None  # None: the base skeleton (host /usr read-only, a copied /etc)
    files: dict[str, str] = field(default_factory=dict)  # absolute path in the sandbox -> content
    # absolute path in the sandbox -> a directory on the host (relative to the repository root) copied there
    # before the setup commands run: what a sandbox cannot fetch itself (it has no network)
    host_dirs: dict[str, str] = field(default_factory=dict)
    setup: tuple[str, ...] = ()  # shell commands run once, as root, in order; any non-zero exit fails the build
    envs: dict[str, str] = field(default_factory=dict)  # environment of every process in sandboxes of it
    cpu_count: float = 1.0
    memory_mb: int = 512
    disk_mb: int = 1024
    pids: int = 512

    def digest(self, parent_layers: list[str]) -> str:
        copied = {dst: _tree_listing(ROOT / src) for dst, src in self.host_dirs.items()}
        blob = json.dumps({"spec": asdict(self), "parent": parent_layers, "copied": copied}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:12]


def _tree_listing(root: Path) -> str:
    """What a copied host directory holds (names and sizes): a changed directory builds the template anew."""
    if not root.is_dir():
        return "missing"
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            p = os.path.join(dirpath, name)
            h.update(f"{os.path.relpath(p, root)}\0{os.lstat(p).st_size}\n".encode())
    return h.hexdigest()


NPM_DEMO_PACKAGE = json.dumps({"name": "rlk3-hello", "version": "1.0.0", "main": "index.js"})
WEB = ROOT / "envs" / "sandbox" / "node-web"  # a Vite + React app's package.json and lockfile

BUILTIN: dict[str, TemplateSpec] = {
    # the SDK's default template name: a shell and python3
    "base": TemplateSpec(name="base"),
    # coding tasks: a venv on top of the system python (which carries pytest), first on PATH
    "python": TemplateSpec(
        name="python",
        parent="base",
        # login shells (commands.run uses `bash -l`) reset PATH in /etc/profile; profile.d puts the venv back
        files={"/etc/profile.d/rlk3-venv.sh": "export VIRTUAL_ENV=/opt/venv\nexport PATH=/opt/venv/bin:$PATH\n"},
        setup=("python3 -m venv --system-site-packages /opt/venv", "/opt/venv/bin/python -c 'import pytest'"),
        envs={
            "PATH": "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "VIRTUAL_ENV": "/opt/venv",
        },
    ),
    # web tasks: node and npm from the host, and an offline npm cache (sandboxes have no network) holding
    # every package of envs/sandbox/node-web (vite 5.4, @vitejs/plugin-react 4.7, react and react-dom 18.3,
    # and their dependencies: tarballs and registry metadata), filled on the host by scripts/setup.d/
    # sandbox.sh. `npm ci --offline` with /opt/rlk3-web's lockfile, or `npm install --offline name@version`
    # for those versions, work inside; see docs/sandbox.md. Plus a local demo package, rlk3-hello.
    "node": TemplateSpec(
        name="node",
        parent="base",
        files={
            "/opt/npm-src/rlk3-hello/package.json": NPM_DEMO_PACKAGE,
            "/opt/npm-src/rlk3-hello/index.js": "module.exports = () => 'hello from the offline cache';\n",
            "/opt/rlk3-web/package.json": (WEB / "package.json").read_text(),
            "/opt/rlk3-web/package-lock.json": (WEB / "package-lock.json").read_text(),
        },
        host_dirs={"/opt/npm-cache": ".cache/npm-web/cache"},
        setup=(
            "command -v node && command -v npm",
            "cd /opt/npm-src && npm pack ./rlk3-hello --cache /opt/npm-cache --offline >/dev/null",
            "npm cache add /opt/npm-src/rlk3-hello-1.0.0.tgz --cache /opt/npm-cache --offline",
            "chmod -R a+rwX /opt/npm-cache /opt/npm-src /opt/rlk3-web",
        ),
        envs={
            "npm_config_cache": "/opt/npm-cache",
            "npm_config_offline": "true",
            "npm_config_update_notifier": "false",
        },
        memory_mb=1024,
    ),
}
