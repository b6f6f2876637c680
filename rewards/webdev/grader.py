"""The webdev grader: build from source with the grader's own build, then drive a real Chromium.

1. fork the trajectory's workspace; `package.json` scripts and dependencies must equal the template's
   (`build_script_modified`, `dependencies_modified`: a no-op or edited build, a pre/post hook, an extra
   package), build config must be the template's (`config_modified`), the visible spec untouched
   (`tests_modified`), no symlinks (`symlink`);
2. copy only source files (index.html, src/**, public/**) into a fresh build directory next to the
   template's pristine package.json/lockfile/vite.config.js; any shipped build output (`dist/`) is left
   behind; node_modules is the grader's offline install, mounted read-only;
3. run the build the grader owns (`vite build`, no network) and check what it produced: dist/index.html
   loading a bundle from dist/assets, and a source map whose sources are the submission's src/ files
   (`entry_missing`, `not_built_from_source`);
4. mount the pristine e2e driver and run a spec with random data in headless Chromium (`e2e_failed`,
   `page_error`, `console_error`, `external_request`).
Score 1.0 when everything passes, else 0.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rewards.base import Grade, GraderConfigError, TrajectoryLike
from rewards.code.grader import sha256
from rewards.workspace import Limits, LocalSandboxes, SandboxProvider, Workspace, grade_in_fork

HERE = Path(__file__).parent
TEMPLATE = HERE / "template"
REPO = HERE.parents[1]
SOURCE_GLOBS = (re.compile(r"^index\.html$"), re.compile(r"^src/.+"), re.compile(r"^public/.+"))
SOURCE_EXT = {
    ".html",
    ".js",
    ".mjs",
    ".jsx",
    ".ts",
    ".tsx",
    ".css",
    ".json",
    ".svg",
    ".png",
    ".jpg",
    ".ico",
    ".txt",
    ".woff",
    ".woff2",
}
CONFIG_FILES = {
    "vite.config.js",
    "vite.config.mjs",
    "vite.config.ts",
    "vite.config.cjs",
    "vite.config.mts",
    "postcss.config.js",
    "tsconfig.json",
    ".npmrc",
    "svelte.config.js",
    "rollup.config.js",
}
MAX_SOURCE_BYTES = 8 << 20


def default_node_modules() -> Path:
    env = os.environ.get("RLK3_WEBDEV_NODE_MODULES")
    return Path(env) if env else REPO / ".cache" / "graders" / "webdev-template" / "node_modules"


@dataclass
class WebdevTask:
    spec: str = "todo"  # key in e2e.SPECS
    protected: dict[str, str] = field(default_factory=dict)  # e.g. the visible spec text -> sha256
    build_timeout_s: float = 120.0
    e2e_timeout_s: float = 90.0
    memory_mb: int = 2048


class WebdevGrader:
    """Reads `trajectory.sandbox_id`; the submission is the project in the workspace root."""

    name = "webdev"

    def __init__(
        self,
        sandboxes: SandboxProvider | None = None,
        node_modules: str | Path | None = None,
        chromium: str | None = None,
        node: str | None = None,
    ):
        self.sandboxes = sandboxes or LocalSandboxes()
        self.node_modules = Path(node_modules) if node_modules else default_node_modules()
        self.chromium = chromium or shutil.which("chromium") or "/usr/bin/chromium"
        self.node = node or shutil.which("node") or "/usr/bin/node"

    def missing_assets(self) -> list[str]:
        need = {
            "template package.json": TEMPLATE / "package.json",
            "template package-lock.json": TEMPLATE / "package-lock.json",
            "template vite.config.js": TEMPLATE / "vite.config.js",
            "e2e driver": HERE / "e2e.py",
            "offline node_modules (scripts/setup.d/graders.sh)": self.node_modules / "vite" / "bin" / "vite.js",
            "chromium": Path(self.chromium),
            "node": Path(self.node),
        }
        return [f"{k} ({v})" for k, v in need.items() if not v.exists()]

    def validate(self, task: Any) -> None:
        missing = self.missing_assets()
        if missing:
            raise GraderConfigError(f"grader 'webdev': pristine assets missing: {'; '.join(missing)}")
        if not isinstance(task, WebdevTask):
            raise GraderConfigError(f"grader 'webdev': task must be a WebdevTask, got {type(task).__name__}")
        specs = ["todo"]
        if task.spec not in specs:
            raise GraderConfigError(f"grader 'webdev': unknown spec {task.spec!r}; valid specs: {', '.join(specs)}")

    def grade(self, task: WebdevTask, trajectory: TrajectoryLike) -> Grade:
        missing = self.missing_assets()
        if missing:
            return Grade.fail(f"grader_error: pristine assets missing: {'; '.join(missing)}")
        return grade_in_fork(self.sandboxes, trajectory.sandbox_id, lambda ws: self._grade_in(ws, task))

    # ------------------------------------------------------------------------------------------------
    def _inspect(self, ws: Workspace, task: WebdevTask, entries) -> list[str]:
        reasons = []
        by_path = {e.path: e for e in entries}
        for path, digest in task.protected.items():
            e = by_path.get(path)
            if e is None or e.kind != "file" or sha256(ws.read_file(path)) != digest:
                reasons.append(f"tests_modified: {path} differs from the pristine copy")
        tpl = json.loads((TEMPLATE / "package.json").read_text())
        if "package.json" in by_path and by_path["package.json"].kind == "file":
            try:
                pkg = json.loads(ws.read_file("package.json", max_bytes=1 << 20))
            except (ValueError, UnicodeDecodeError):
                pkg = None
                reasons.append("build_script_modified: package.json is not valid JSON")
            if isinstance(pkg, dict):
                if pkg.get("scripts") != tpl["scripts"]:
                    changed = sorted(
                        set(pkg.get("scripts") or {}) ^ set(tpl["scripts"])
                        | {k for k in tpl["scripts"] if (pkg.get("scripts") or {}).get(k) != tpl["scripts"][k]}
                    )
                    reasons.append(f"build_script_modified: scripts differ from the template ({', '.join(changed)})")
                for key in ("dependencies", "devDependencies", "optionalDependencies", "overrides"):
                    if (pkg.get(key) or {}) != (tpl.get(key) or {}):
                        reasons.append(f"dependencies_modified: {key} differ from the template (offline build)")
        for e in entries:
            name = e.path.rsplit("/", 1)[-1]
            if e.kind == "symlink":
                reasons.append(f"symlink: {e.path}")
            elif e.kind == "file" and "/" not in e.path and name in CONFIG_FILES:
                tpl_file = TEMPLATE / name
                if not tpl_file.is_file() or tpl_file.read_bytes() != ws.read_file(e.path):
                    reasons.append(f"config_modified: {e.path} differs from the template")
        return reasons

    def _grade_in(self, ws: Workspace, task: WebdevTask) -> Grade:
        entries = ws.list_files()
        reasons = self._inspect(ws, task, entries)
        sources = [
            e
            for e in entries
            if e.kind == "file"
            and any(p.match(e.path) for p in SOURCE_GLOBS)
            and Path(e.path).suffix.lower() in SOURCE_EXT
            and "node_modules/" not in e.path
        ]
        shipped_build = sorted({e.path.split("/")[0] for e in entries if e.path.split("/")[0] in ("dist", "build")})
        details: dict[str, Any] = {
            "sources": [e.path for e in sources][:50],
            "shipped_build_output": shipped_build,
        }
        if sum(e.size for e in sources) > MAX_SOURCE_BYTES:
            reasons.append(f"too_large: sources exceed {MAX_SOURCE_BYTES} bytes")
        if reasons:
            return Grade(0.0, False, reasons, details)

        bdir = f".wbuild-{secrets.token_hex(4)}"
        for name in ("package.json", "package-lock.json", "vite.config.js"):
            ws.write_file(f"{bdir}/{name}", (TEMPLATE / name).read_bytes())
        for e in sources:
            ws.write_file(f"{bdir}/{e.path}", ws.read_file(e.path, max_bytes=MAX_SOURCE_BYTES))
        ws.mount_readonly(self.node_modules, f"{ws.sandbox_root}/{bdir}/node_modules")
        build = ws.exec(
            [self.node, "node_modules/vite/bin/vite.js", "build", "--config", "vite.config.js"],
            cwd=f"{ws.sandbox_root}/{bdir}",
            limits=Limits(timeout_s=task.build_timeout_s, memory_mb=task.memory_mb, pids=256),
            env={"NODE_ENV": "production", "CI": "1"},
        )
        details["build_s"] = round(build.wall_s, 3)
        note = f" (the shipped {', '.join(shipped_build)} was ignored)" if shipped_build else ""
        if build.exit_code != 0:
            err = (build.stderr or build.stdout).decode("utf-8", "replace")[-400:]
            reasons = [f"build_failed: exit {build.exit_code}: {err}"]
            if note:
                reasons.append(f"prebuilt_output: {note.strip(' ()')}")
            return Grade(0.0, False, reasons, details)
        reasons += self._check_entry(ws, bdir, sources)
        if reasons:
            if note:
                reasons.append(f"prebuilt_output: {note.strip(' ()')}")
            return Grade(0.0, False, reasons, details)

        with tempfile.TemporaryDirectory(prefix="rlk3-webdev-grader-") as gdir:
            Path(gdir, "e2e.py").write_bytes((HERE / "e2e.py").read_bytes())
            ws.mount_readonly(gdir, "/grader")
            run = ws.exec(
                ["python3", "-I", "/grader/e2e.py", f"{ws.sandbox_root}/{bdir}/dist", task.spec],
                limits=Limits(timeout_s=task.e2e_timeout_s, memory_mb=task.memory_mb, pids=512),
            )
        details["e2e_s"] = round(run.wall_s, 3)
        try:
            res = json.loads(run.stdout.decode().strip().splitlines()[-1])
        except (ValueError, IndexError):
            how = "timed out" if run.timed_out else f"exit {run.exit_code}"
            return Grade(0.0, False, [f"e2e_failed: driver produced no report ({how})"], details)
        details["e2e_steps_passed"] = len(res["steps"])
        if res["failure"]:
            reasons.append(f"e2e_failed: after {len(res['steps'])} steps: {res['failure']}")
        for msg in res["page_errors"][:3]:
            reasons.append(f"page_error: {msg}")
        for msg in res["console_errors"][:3]:
            reasons.append(f"console_error: {msg}")
        for url in res["external_requests"][:3]:
            reasons.append(f"external_request: {url} (the app must be self-contained)")
        if reasons:
            if note:
                reasons.append(f"prebuilt_output: {note.strip(' ()')}")
            return Grade(0.0, False, reasons, details)
        return Grade(1.0, True, [], details)

    @staticmethod
    def _check_entry(ws: Workspace, bdir: str, sources) -> list[str]:
        dist = f"{bdir}/dist"
        try:
            html = ws.read_file(f"{dist}/index.html", max_bytes=1 << 20).decode("utf-8", "replace")
        except (OSError, ValueError):
            return ["entry_missing: the build produced no dist/index.html"]
        scripts = re.findall(r'<script[^>]+src="/?(assets/[^"]+\.js)"', html)
        if not scripts:
            return ["entry_missing: dist/index.html loads no bundle from dist/assets"]
        src_files = {e.path for e in sources if e.path.startswith("src/")}
        mapped: set[str] = set()
        for js in scripts:
            try:
                smap = json.loads(ws.read_file(f"{dist}/{js}.map", max_bytes=32 << 20))
            except (OSError, ValueError):
                return [f"not_built_from_source: {js} has no source map"]
            for s in smap.get("sources", []):
                s = re.sub(r"^(\.\./)+", "", s)
                if s in src_files:
                    mapped.add(s)
        if not mapped:
            return ["not_built_from_source: the bundle's source map names none of the submission's src/ files"]
        return []
