"""Tools: canonical kinds with JSON schemas and sandbox-backed implementations, exposed under each preset's names.

A *kind* (shell, read, edit, ...) is one implementation with canonical parameter names. A preset exposes a kind as
a :class:`Tool` with its own public name, description and parameter names, e.g. Claude Code's
``Read(file_path, offset, limit)`` and Hermes' ``read_file(path, offset, limit)`` are both the ``read`` kind.

Every tool runs against the small async :class:`SandboxAPI` protocol (exec / read / write / list), which
``envs.sandbox.client.SandboxClient`` satisfies. A tool never raises into the agent loop: any failure (bad
arguments, a sandbox error, a timeout) becomes an ``Error: ...`` result for the model, and every result is
bounded to ``max_output_chars`` (head and tail kept, the middle replaced by a marker). Cancellation
(``asyncio.CancelledError``, used to pause an episode) is not an ``Exception`` and does propagate.
"""

from __future__ import annotations

import json
import posixpath
import shlex
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from harness.memory import MemoryNotes
from harness.patch import PatchError, apply_hunks, parse_patch
from harness.schema import check_object
from harness.skills import SkillLibrary


class ExecResultLike(Protocol):
    exit_code: int
    stdout: str
    stderr: str


class SandboxAPI(Protocol):
    """What the tools need from a sandbox; ``envs.sandbox.client.SandboxClient`` provides it."""

    async def exec(self, sid: str, cmd: str, timeout: float = 60) -> ExecResultLike: ...
    async def read(self, sid: str, path: str) -> bytes: ...
    async def write(self, sid: str, path: str, data: str | bytes) -> None: ...
    async def list(self, sid: str, path: str) -> list[str]: ...


# The agent loop's callback for the subagent tool: run a sub-episode on ``prompt`` with a fresh context
# (same sandbox) and return its final message.
SubagentFn = Callable[..., Awaitable[str]]


@dataclass
class ToolContext:
    """Everything a tool call may touch during one episode."""

    sandbox: SandboxAPI
    sid: str
    workdir: str = "/home/user"
    max_output_chars: int = 16000
    exec_timeout_s: float = 60.0
    max_timeout_s: float = 600.0
    read_max_lines: int = 2000
    skills: SkillLibrary | None = None
    memory: MemoryNotes | None = None
    subagent: SubagentFn | None = None
    subagent_type: str | None = None  # recorded for the loop; the harness does not interpret it

    def path(self, p: str) -> str:
        """Relative paths are relative to the working directory."""
        return posixpath.normpath(p if p.startswith("/") else posixpath.join(self.workdir, p))

    def timeout(self, seconds: float | None) -> float:
        t = self.exec_timeout_s if seconds is None else float(seconds)
        return max(1.0, min(t, self.max_timeout_s))


@dataclass
class ToolOutput:
    text: str
    is_error: bool = False
    submitted: str | None = None  # set by the submit tool: the episode's final answer


def truncate(text: str, limit: int) -> str:
    """At most ``limit`` characters: the head and the tail, with a marker saying how much was cut."""
    if len(text) <= limit:
        return text
    marker = f"\n[... {len(text) - limit} characters truncated ...]\n"
    keep = max(0, limit - len(marker) - 16)  # the marker's count can grow by a few digits: leave room
    head = (keep * 3) // 5
    tail = keep - head
    cut = len(text) - head - tail
    marker = f"\n[... {cut} characters truncated ...]\n"
    return text[:head] + marker + (text[len(text) - tail :] if tail else "")


def _err(msg: str) -> ToolOutput:
    return ToolOutput(f"Error: {msg}", is_error=True)


# ------------------------------------------------------------------------------------------------ kinds


@dataclass(frozen=True)
class Param:
    schema: dict
    required: bool = False


@dataclass(frozen=True)
class Kind:
    name: str
    description: str
    params: dict[str, Param]
    run: Callable[[dict, ToolContext], Awaitable[ToolOutput]]


def _format_exec(r: ExecResultLike) -> str:
    out = r.stdout or ""
    if r.stderr:
        out += ("" if not out or out.endswith("\n") else "\n") + "[stderr]\n" + r.stderr
    if r.exit_code != 0:
        out += ("" if not out or out.endswith("\n") else "\n") + f"[exit code: {r.exit_code}]"
    return out if out else "(no output)"


async def _exec(ctx: ToolContext, cmd: str, timeout: float) -> ToolOutput:
    try:
        r = await ctx.sandbox.exec(ctx.sid, cmd, timeout)
    except Exception as e:  # the SDK reports a timeout as an exception: name it for the model
        if "timeout" in type(e).__name__.lower():
            return _err(f"the command did not finish within {timeout:g} s and was stopped")
        raise
    return ToolOutput(_format_exec(r), is_error=False)


def _in_dir(workdir: str, cmd: str) -> str:
    # a missing working directory is reported by cd itself ("No such file or directory") and stops the command
    return f"cd {shlex.quote(workdir)} || exit 1\n{cmd}"


async def run_shell(a: dict, ctx: ToolContext) -> ToolOutput:
    if "timeout_ms" in a:
        t = a["timeout_ms"] / 1000
    else:
        t = a.get("timeout_s")
    wd = ctx.path(a["workdir"]) if a.get("workdir") else ctx.workdir
    return await _exec(ctx, _in_dir(wd, a["command"]), ctx.timeout(t))


async def run_shell_argv(a: dict, ctx: ToolContext) -> ToolOutput:
    argv = a["command"]
    if not argv:
        return _err('command must be a non-empty list of strings, e.g. ["bash", "-lc", "ls"]')
    t = a["timeout_ms"] / 1000 if "timeout_ms" in a else None
    wd = ctx.path(a["workdir"]) if a.get("workdir") else ctx.workdir
    return await _exec(ctx, _in_dir(wd, shlex.join(argv)), ctx.timeout(t))


async def _read_text(ctx: ToolContext, path: str) -> str | ToolOutput:
    try:
        data = await ctx.sandbox.read(ctx.sid, path)
    except Exception as e:
        return _err(f"cannot read {path}: {e}")
    if b"\0" in data[:8192]:
        return _err(f"{path} is a binary file ({len(data)} bytes)")
    return data.decode("utf-8", "replace")


async def run_read(a: dict, ctx: ToolContext) -> ToolOutput:
    path = ctx.path(a["path"])
    text = await _read_text(ctx, path)
    if isinstance(text, ToolOutput):
        return text
    lines = text.splitlines()
    if not lines:
        return ToolOutput(f"({path} is empty)")
    offset = a.get("offset") or 1
    if offset < 1 or offset > len(lines):
        return _err(f"offset must be between 1 and {len(lines)} (the file's line count), got {offset}")
    limit = a.get("limit") or ctx.read_max_lines
    if limit < 1:
        return _err(f"limit must be at least 1, got {limit}")
    limit = min(limit, ctx.read_max_lines)
    shown = lines[offset - 1 : offset - 1 + limit]
    # cat -n style, long lines cut: what Claude Code's and Kimi's read tools show
    out = "\n".join(
        f"{i:6d}\t{ln if len(ln) <= 2000 else ln[:2000] + ' [line truncated]'}" for i, ln in enumerate(shown, offset)
    )
    end = offset + len(shown) - 1
    if offset > 1 or end < len(lines):
        out += f"\n[lines {offset}-{end} of {len(lines)}; use offset and limit to read more]"
    return ToolOutput(out)


async def run_write(a: dict, ctx: ToolContext) -> ToolOutput:
    path = ctx.path(a["path"])
    content = a["content"]
    try:
        await ctx.sandbox.write(ctx.sid, path, content)
    except Exception as e:
        return _err(f"cannot write {path}: {e}")
    return ToolOutput(f"Wrote {len(content.encode())} bytes ({len(content.splitlines())} lines) to {path}")


async def run_edit(a: dict, ctx: ToolContext) -> ToolOutput:
    path = ctx.path(a["path"])
    old, new = a["old"], a["new"]
    if old == "":
        return _err("the string to replace is empty; to create or overwrite a file use the write tool")
    if old == new:
        return _err("the replacement is identical to the original string: nothing to change")
    text = await _read_text(ctx, path)
    if isinstance(text, ToolOutput):
        return text
    n = text.count(old)
    if n == 0:
        return _err(
            f"the string to replace was not found in {path}. It must match exactly, including whitespace and "
            "indentation; read the file to copy the exact text"
        )
    if n > 1 and not a.get("replace_all"):
        return _err(
            f"the string to replace occurs {n} times in {path}; include more surrounding lines to make it unique, "
            "or set replace_all to replace every occurrence"
        )
    text = text.replace(old, new) if a.get("replace_all") else text.replace(old, new, 1)
    try:
        await ctx.sandbox.write(ctx.sid, path, text)
    except Exception as e:
        return _err(f"cannot write {path}: {e}")
    return ToolOutput(f"Edited {path}: replaced {n if a.get('replace_all') else 1} occurrence(s)")


async def run_apply_patch(a: dict, ctx: ToolContext) -> ToolOutput:
    try:
        ops = parse_patch(a["input"])
    except PatchError as e:
        return _err(f"invalid patch: {e}")
    # compute every new file first, write only when all hunks fit: a failed patch changes nothing
    writes: dict[str, str] = {}
    deletes: list[str] = []
    summary = []
    try:
        for op in ops:
            path = ctx.path(op.path)
            if op.kind == "add":
                writes[path] = op.content
                summary.append(f"A {path}")
            elif op.kind == "delete":
                deletes.append(path)
                summary.append(f"D {path}")
            else:
                text = writes.get(path)
                if text is None:
                    text = await _read_text(ctx, path)
                    if isinstance(text, ToolOutput):
                        return text
                new = apply_hunks(text, op.hunks, path)
                if op.move_to:
                    dest = ctx.path(op.move_to)
                    writes[dest] = new
                    deletes.append(path)
                    summary.append(f"M {path} -> {dest}")
                else:
                    writes[path] = new
                    summary.append(f"M {path}")
    except PatchError as e:
        return _err(f"patch not applied: {e}")
    for path, text in writes.items():
        await ctx.sandbox.write(ctx.sid, path, text)
    if deletes:
        r = await ctx.sandbox.exec(ctx.sid, "rm -f -- " + " ".join(shlex.quote(p) for p in deletes), 30)
        if r.exit_code != 0:
            return _err(f"could not delete files: {r.stderr.strip()}")
    return ToolOutput("Done. Changed files:\n" + "\n".join(summary))


# glob and grep run as small Python programs inside the sandbox: every rlk3 template has python3, and one exec
# call beats listing a tree file by file over the files API
_GLOB_PY = r"""
import glob, json, os, sys
a = json.loads(sys.argv[1])
try:
    os.chdir(a["path"])
except OSError as e:
    print(f"Error: cannot search in {a['path']}: {e.strerror}"); sys.exit(0)
hits = []
for h in glob.iglob(a["pattern"], recursive=True):
    if os.path.isfile(h):
        hits.append(os.path.normpath(os.path.join(a["path"], h)))
        if len(hits) > 20000:
            break
hits.sort()
n = a["limit"]
print("\n".join(hits[:n]) if hits else "No files match.")
if len(hits) > n:
    print(f"[{len(hits) - n} more files not shown; narrow the pattern]")
"""

_GREP_PY = r"""
import fnmatch, json, os, re, sys
a = json.loads(sys.argv[1])
try:
    rx = re.compile(a["pattern"], re.IGNORECASE if a["ignore_case"] else 0)
except re.error as e:
    print(f"Error: invalid regular expression: {e}"); sys.exit(0)
root = a["path"]
if os.path.isfile(root):
    files = [root]
elif os.path.isdir(root):
    files = []
    for d, sub, names in os.walk(root):
        sub[:] = sorted(s for s in sub if s not in (".git", "node_modules", "__pycache__", ".venv"))
        files += [os.path.join(d, n) for n in sorted(names)]
else:
    print(f"Error: no such file or directory: {root}"); sys.exit(0)
inc = a["include"]
out, n_files = [], 0
for f in files:
    if inc and not fnmatch.fnmatch(os.path.basename(f), inc) and not fnmatch.fnmatch(f, inc):
        continue
    try:
        if os.path.getsize(f) > 5_000_000:
            continue
        with open(f, "rb") as fh:
            data = fh.read()
    except OSError:
        continue
    if b"\0" in data[:8192]:
        continue
    count = 0
    for i, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
        if rx.search(line):
            count += 1
            if a["mode"] == "content":
                out.append(f"{f}:{i}:{line[:500]}")
    if count:
        n_files += 1
        if a["mode"] == "files_with_matches":
            out.append(f)
        elif a["mode"] == "count":
            out.append(f"{f}:{count}")
    if len(out) > a["limit"]:
        break
n = a["limit"]
print("\n".join(out[:n]) if out else "No matches.")
if len(out) > n:
    print(f"[more than {n} results; narrow the pattern or the path]")
"""


async def _py_helper(ctx: ToolContext, script: str, args: dict) -> ToolOutput:
    cmd = f"python3 -c {shlex.quote(script)} {shlex.quote(json.dumps(args))}"
    out = await _exec(ctx, cmd, ctx.timeout(None))
    out.text = out.text.rstrip("\n")  # a listing, not program output: no trailing newline
    out.is_error = out.is_error or out.text.startswith("Error:")
    return out


async def run_glob(a: dict, ctx: ToolContext) -> ToolOutput:
    path = ctx.path(a.get("path") or ctx.workdir)
    return await _py_helper(ctx, _GLOB_PY, {"pattern": a["pattern"], "path": path, "limit": 200})


async def run_grep(a: dict, ctx: ToolContext) -> ToolOutput:
    path = ctx.path(a.get("path") or ctx.workdir)
    args = {
        "pattern": a["pattern"],
        "path": path,
        "include": a.get("include") or "",
        "mode": a.get("mode") or "content",
        "ignore_case": bool(a.get("ignore_case")),
        "limit": 300,
    }
    return await _py_helper(ctx, _GREP_PY, args)


async def run_python(a: dict, ctx: ToolContext) -> ToolOutput:
    f = f"/tmp/rlk3_{uuid.uuid4().hex[:12]}.py"
    try:
        await ctx.sandbox.write(ctx.sid, f, a["code"])
    except Exception as e:
        return _err(f"cannot stage the program: {e}")
    cmd = _in_dir(ctx.workdir, f"python3 {f}; rc=$?; rm -f {f}; exit $rc")
    return await _exec(ctx, cmd, ctx.timeout(a.get("timeout_s")))


async def run_submit(a: dict, ctx: ToolContext) -> ToolOutput:
    answer = a["answer"]
    return ToolOutput("Answer submitted.", submitted=answer if isinstance(answer, str) else json.dumps(answer))


async def run_subagent(a: dict, ctx: ToolContext) -> ToolOutput:
    if ctx.subagent is None:
        return _err("subagents are not available in this episode")
    result = await ctx.subagent(
        prompt=a["prompt"], description=a.get("description") or "", subagent_type=a.get("subagent_type")
    )
    return ToolOutput(result if isinstance(result, str) and result else "(the subagent returned no message)")


async def run_skill(a: dict, ctx: ToolContext) -> ToolOutput:
    if ctx.skills is None or not ctx.skills.skills:
        return _err("no skills are available in this episode")
    text = ctx.skills.get(a["name"])
    return ToolOutput(text, is_error=text.startswith("Error:"))


async def run_memory(a: dict, ctx: ToolContext) -> ToolOutput:
    if ctx.memory is None:
        return _err("memory is not available in this episode")
    action, content = a["action"], a.get("content")
    if action == "view":
        return ToolOutput(ctx.memory.view())
    if content is None:
        return _err(f"action {action!r} needs content")
    text = ctx.memory.add(content) if action == "add" else ctx.memory.replace(content)
    return ToolOutput(text, is_error=text.startswith("Error:"))


def _p(t: str, desc: str, required: bool = False, **extra: Any) -> Param:
    return Param({"type": t, "description": desc, **extra}, required)


KINDS: dict[str, Kind] = {
    k.name: k
    for k in (
        Kind(
            "shell",
            "Run a bash command in the sandbox and return its output (stdout, then stderr, then the exit code "
            "when it is not 0).",
            {
                "command": _p("string", "The command to run.", True),
                "timeout_s": _p("number", "Timeout in seconds."),
                "timeout_ms": _p("integer", "Timeout in milliseconds."),
                "workdir": _p("string", "Directory to run in (default: the working directory)."),
                "description": _p("string", "A few words on what the command does."),
            },
            run_shell,
        ),
        Kind(
            "shell_argv",
            'Run a command given as an argument vector, e.g. ["bash", "-lc", "ls -la"].',
            {
                "command": _p("array", "The command and its arguments.", True, items={"type": "string"}),
                "workdir": _p("string", "Directory to run in (default: the working directory)."),
                "timeout_ms": _p("integer", "Timeout in milliseconds."),
            },
            run_shell_argv,
        ),
        Kind(
            "read",
            "Read a text file. Lines are numbered from 1; use offset and limit for long files.",
            {
                "path": _p("string", "Path of the file (absolute, or relative to the working directory).", True),
                "offset": _p("integer", "First line to show (1-based)."),
                "limit": _p("integer", "Number of lines to show."),
            },
            run_read,
        ),
        Kind(
            "write",
            "Create or overwrite a file with the given content (parent directories are created).",
            {
                "path": _p("string", "Path of the file.", True),
                "content": _p("string", "The full new content of the file.", True),
            },
            run_write,
        ),
        Kind(
            "edit",
            "Replace an exact string in a file. The string must occur exactly once unless replace_all is set.",
            {
                "path": _p("string", "Path of the file.", True),
                "old": _p("string", "The exact text to replace, including whitespace.", True),
                "new": _p("string", "The text to put in its place.", True),
                "replace_all": _p("boolean", "Replace every occurrence."),
            },
            run_edit,
        ),
        Kind(
            "apply_patch",
            "Apply a patch in the *** Begin Patch / *** End Patch format to add, delete, update or move files.",
            {"input": _p("string", "The whole patch.", True)},
            run_apply_patch,
        ),
        Kind(
            "glob",
            "List files whose path matches a glob pattern such as **/*.py (sorted, at most 200).",
            {
                "pattern": _p("string", "Glob pattern; ** matches any number of directories.", True),
                "path": _p("string", "Directory to search in (default: the working directory)."),
            },
            run_glob,
        ),
        Kind(
            "grep",
            "Search file contents with a regular expression (Python syntax).",
            {
                "pattern": _p("string", "The regular expression.", True),
                "path": _p("string", "File or directory to search (default: the working directory)."),
                "include": _p("string", "Only files whose name matches this glob, e.g. *.py."),
                "mode": _p(
                    "string",
                    "content: matching lines (default); files_with_matches: file names; count: matches per file.",
                    enum=["content", "files_with_matches", "count"],
                ),
                "ignore_case": _p("boolean", "Case-insensitive search."),
            },
            run_grep,
        ),
        Kind(
            "python",
            "Run a Python program in the sandbox and return its output.",
            {
                "code": _p("string", "The program.", True),
                "timeout_s": _p("number", "Timeout in seconds."),
            },
            run_python,
        ),
        Kind(
            "submit",
            "Submit the final answer. Call it once, when you are done.",
            {"answer": _p("string", "The final answer.", True)},
            run_submit,
        ),
        Kind(
            "subagent",
            "Start a subagent with a fresh context on a self-contained task; it returns its final report.",
            {
                "prompt": _p("string", "The full task for the subagent, with everything it needs to know.", True),
                "description": _p("string", "A short (3-5 word) label for the task."),
                "subagent_type": _p("string", "Which kind of subagent to start."),
            },
            run_subagent,
        ),
        Kind(
            "skill",
            "Load the instructions of a skill by name (the available skills are listed in the system prompt).",
            {"name": _p("string", "Name of the skill.", True)},
            run_skill,
        ),
        Kind(
            "memory",
            "Notes kept across episodes of this task group: view them, add a note, or replace them all.",
            {
                "action": _p("string", "view, add or replace.", True, enum=["view", "add", "replace"]),
                "content": _p("string", "The note to add, or the full replacement."),
            },
            run_memory,
        ),
    )
}


@dataclass(frozen=True)
class Tool:
    """A kind exposed under a preset's name, description and parameter names."""

    kind: Kind
    name: str
    description: str
    rename: dict[str, str] = field(default_factory=dict)  # canonical parameter -> public name; others hidden

    @classmethod
    def make(
        cls, kind: str, name: str | None = None, description: str | None = None, params: dict[str, str] | None = None
    ) -> Tool:
        if kind not in KINDS:
            raise ValueError(f"unknown tool kind {kind!r}; valid: {', '.join(KINDS)}")
        k = KINDS[kind]
        rename = dict(params) if params is not None else {p: p for p in k.params}
        bad = [p for p in rename if p not in k.params]
        if bad:
            raise ValueError(
                f"tool {name or kind}: kind {kind!r} has no parameter(s) {bad}; valid: {', '.join(k.params)}"
            )
        hidden_required = [p for p, spec in k.params.items() if spec.required and p not in rename]
        if hidden_required:
            raise ValueError(
                f"tool {name or kind}: required parameter(s) {hidden_required} of kind {kind!r} must be exposed"
            )
        publics = list(rename.values())
        dup = sorted({x for x in publics if publics.count(x) > 1})
        if dup:
            raise ValueError(f"tool {name or kind}: public parameter name(s) {dup} used twice")
        return cls(k, name or kind, description or k.description, rename)

    def parameters(self) -> dict:
        props = {pub: dict(self.kind.params[can].schema) for can, pub in self.rename.items()}
        required = [pub for can, pub in self.rename.items() if self.kind.params[can].required]
        return {"type": "object", "properties": props, "required": required, "additionalProperties": False}

    def schema(self) -> dict:
        """The OpenAI-style tool entry, as ``apply_chat_template(tools=...)`` takes it."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters()},
        }

    async def __call__(self, args: dict, ctx: ToolContext) -> ToolOutput:
        """Run with public-named ``args``; every failure becomes an error result, bounded like any output."""
        try:
            err = check_object(self.parameters(), args, f"{self.name} arguments")
            if err:
                out = _err(err)
            else:
                back = {can: args[pub] for can, pub in self.rename.items() if pub in args}
                out = await self.kind.run(back, ctx)
        except Exception as e:
            out = _err(f"{self.name} failed: {type(e).__name__}: {e}")
        out.text = truncate(out.text, ctx.max_output_chars)
        return out
