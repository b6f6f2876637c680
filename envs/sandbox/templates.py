"""Declarative templates: host system directories read-only, plus files, plus setup commands run once.

A template is built by booting a sandbox on its parent's layers, writing its files, running its setup
commands as root, and sealing the resulting upper as one more read-only layer. The layer's name carries the
hash of the spec (and of its parent's layers), so a changed spec builds anew and an unchanged one is reused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    parent: str | None = None  # None: the base skeleton (host /usr read-only, a copied /etc)
    files: dict[str, str] = field(default_factory=dict)  # absolute path in the sandbox -> content
    setup: tuple[
        str, ...
    ] = ()  # shell commands run once, as root, in order; any non-zero exit fails the build
    envs: dict[str, str] = field(default_factory=dict)  # environment of every process in sandboxes of it
    cpu_count: float = 1.0
    memory_mb: int = 512
    disk_mb: int = 1024
    pids: int = 512

    def digest(self, parent_layers: list[str]) -> str:
        blob = json.dumps({"spec": asdict(self), "parent": parent_layers}, sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


NPM_DEMO_PACKAGE = json.dumps({"name": "rlk3-hello", "version": "1.0.0", "main": "index.js"})

BUILTIN: dict[str, TemplateSpec] = {
    # the SDK's default template name: a shell and python3
    "base": TemplateSpec(name="base"),
    # coding tasks: a venv on top of the system python (which carries pytest), first on PATH
    "python": TemplateSpec(
        name="python",
        parent="base",
        # login shells (commands.run uses `bash -l`) reset PATH in /etc/profile; profile.d puts the venv back
        files={
            "/etc/profile.d/rlk3-venv.sh": "export VIRTUAL_ENV=/opt/venv\nexport PATH=/opt/venv/bin:$PATH\n"
        },
        setup=("python3 -m venv --system-site-packages /opt/venv", "/opt/venv/bin/python -c 'import pytest'"),
        envs={
            "PATH": "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "VIRTUAL_ENV": "/opt/venv",
        },
    ),
    # web tasks: node from the host, an npm cache that works offline (sandboxes have no network). The cache
    # holds package tarballs; installing a package *by registry name* offline would also need its registry
    # metadata, which this demo cache does not carry: tasks install from the shipped tarballs.
    "node": TemplateSpec(
        name="node",
        parent="base",
        files={
            "/opt/npm-src/rlk3-hello/package.json": NPM_DEMO_PACKAGE,
            "/opt/npm-src/rlk3-hello/index.js": "module.exports = () => 'hello from the offline cache';\n",
        },
        setup=(
            "command -v node && command -v npm",
            "cd /opt/npm-src && npm pack ./rlk3-hello --cache /opt/npm-cache --offline >/dev/null",
            "npm cache add /opt/npm-src/rlk3-hello-1.0.0.tgz --cache /opt/npm-cache --offline",
            "chmod -R a+rwX /opt/npm-cache /opt/npm-src",
        ),
        envs={
            "npm_config_cache": "/opt/npm-cache",
            "npm_config_offline": "true",
            "npm_config_update_notifier": "false",
        },
        memory_mb=1024,
    ),
}
