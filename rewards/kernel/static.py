"""Static checks on a kernel submission's source (AST, not regex: comments and strings do not count).

Static analysis is the first net, not the last: obfuscated calls (getattr with built strings) pass it and
are caught at run time by the profiler, the judge's clock and the frozen-output check.
"""

from __future__ import annotations

import ast

TIMER_TARGETS = {
    ("time", "perf_counter"),
    ("time", "perf_counter_ns"),
    ("time", "time"),
    ("time", "monotonic"),
    ("time", "time_ns"),
    ("cuda", "synchronize"),
    ("cuda", "Event"),
    ("Event", "record"),
    ("Event", "elapsed_time"),
    ("Event", "synchronize"),
}
CONCURRENCY_MODULES = {"threading", "_thread", "multiprocessing", "concurrent", "subprocess", "asyncio"}
INTROSPECTION_MODULES = {"ctypes", "gc", "inspect", "cffi", "mmap"}
GRAPH_NAMES = {"CUDAGraph", "graph", "make_graphed_callables", "graphs"}
STREAM_NAMES = {"Stream", "stream", "wait_stream", "record_stream", "ExternalStream"}
LOW_PRECISION = {"half", "bfloat16", "float16", "set_float32_matmul_precision", "allow_tf32", "float8_e4m3fn"}
SUBCLASS_HOOKS = {"_make_subclass", "__torch_function__", "__torch_dispatch__", "_make_wrapper_subclass"}


def _dotted(node: ast.AST) -> str:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
    return ".".join(reversed(parts))


def static_findings(source: str, forbidden_names: list[str], filename: str = "solution.py") -> list[str]:
    """Reasons (`code: detail`) for one source file; a syntax error is itself a finding."""
    try:
        tree = ast.parse(source, filename=filename)
    except (SyntaxError, ValueError) as e:
        return [f"syntax_error: {filename}: {e}"]
    found: list[str] = []

    def add(code: str, detail: str) -> None:
        msg = f"{code}: {filename}:{detail}"
        if msg not in found:
            found.append(msg)

    forbidden = set(forbidden_names)
    for node in ast.walk(tree):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import | ast.ImportFrom):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            names = [a.name for a in node.names]
            for m in mods:
                root = m.split(".")[0]
                if root in ("reference", "tasks", "judge", "worker"):
                    add("calls_reference", f"{line} imports the grader's reference/harness module {m!r}")
                if root in CONCURRENCY_MODULES:
                    add("thread_injection", f"{line} imports {m!r}")
                if root in INTROSPECTION_MODULES:
                    add("introspection", f"{line} imports {m!r}")
                if m in ("torch.cuda.graphs",):
                    add("cuda_graph", f"{line} imports {m!r}")
            for n in names:
                if n in forbidden:
                    add("forbidden_op", f"{line} imports forbidden op {n!r}")
        elif isinstance(node, ast.Attribute):
            if node.attr in forbidden:
                add("forbidden_op", f"{line} uses forbidden op {_dotted(node) or node.attr!r}")
            if node.attr in GRAPH_NAMES and "cuda" in _dotted(node):
                add("cuda_graph", f"{line} uses {_dotted(node)}")
            if node.attr in STREAM_NAMES and "cuda" in _dotted(node):
                add("side_stream", f"{line} uses {_dotted(node)}")
            if node.attr in LOW_PRECISION:
                add("precision_reduction", f"{line} uses {node.attr}")
            if node.attr in SUBCLASS_HOOKS:
                add("tensor_subclass", f"{line} uses {node.attr}")
            if node.attr in ("fork", "forkpty", "system", "popen", "spawnv") and _dotted(node).startswith("os"):
                add("process_injection", f"{line} calls {_dotted(node)}")
            if node.attr in ("set_num_threads", "set_num_interop_threads"):
                add("thread_injection", f"{line} calls {node.attr}")
        elif isinstance(node, ast.FunctionDef) and node.name in SUBCLASS_HOOKS:
            add("tensor_subclass", f"{line} defines {node.name}")
        elif isinstance(node, ast.ClassDef):
            for b in node.bases:
                d = _dotted(b)
                if d.endswith("Tensor"):
                    add("tensor_subclass", f"{line} subclasses {d}")
                if d in ("Model", "Reference") or d.endswith(".Model"):
                    add("calls_reference", f"{line} inherits the reference class {d}")
        elif isinstance(node, ast.Try):
            # a handler that computes something is a fallback path: the fast path may never run
            for h in node.handlers:
                if any(isinstance(n, ast.Call | ast.Return) for stmt in h.body for n in ast.walk(stmt)):
                    add("try_except_fallback", f"{line} try/except with a computing fallback")
        elif isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                if isinstance(t, ast.Attribute):
                    owner = _dotted(t.value).split(".")[-1]
                    if (owner, t.attr) in TIMER_TARGETS:
                        add("timer_patch", f"{line} assigns {_dotted(t)}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            if node.args and _dotted(node.args[0]).split(".")[-1] in ("time", "cuda", "Event", "torch"):
                add("timer_patch", f"{line} setattr on {_dotted(node.args[0])}")
        elif isinstance(node, ast.Call) and _dotted(node.func) in ("torch.compile",):
            for kw in node.keywords:
                if kw.arg == "mode" and isinstance(kw.value, ast.Constant) and "reduce-overhead" in str(kw.value.value):
                    add("cuda_graph", f"{line} torch.compile(mode='reduce-overhead') replays CUDA graphs")
    return found
