"""The answer grader (general / math): extract the final answer, decide equivalence.

Stages, cheapest first: normalised string match; exact numeric match (ints, decimals, fractions,
percentages, scientific notation, with units split off); symbolic equivalence (LaTeX or plain maths parsed
by `latex2sympy2_extended`, an ANTLR parser that never `eval`s model text, then compared by evaluating
at random points and, failing that, `sympy.simplify`). The symbolic stage runs in a worker process with a
hard wall limit: sympy can take unbounded time on adversarial input, and a limit enforced inside the same
process (signals, threads) cannot stop C-level loops. Model text is capped before any parsing.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import re
import threading
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from rewards.base import Grade, GraderConfigError, TrajectoryLike, final_assistant_text

MAX_TEXT = 1 << 20  # characters of the final message that are looked at (the answer is at the end)
MAX_ANSWER = 400  # characters of an extracted answer passed to the parsers


@dataclass
class AnswerTask:
    answer: str  # the reference final answer (LaTeX or plain)
    kind: str = "auto"  # auto | numeric | symbolic | text (text: normalised string match only)
    rel_tol: float = 1e-9  # numeric tolerance when either side is a decimal approximation
    symbolic_timeout_s: float = 2.0


# ----------------------------------------------------------------------------------------- extraction

_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_MARKERS = [
    re.compile(r"(?:final answer|the answer)\s*(?:is|:)\s*(.+)", re.I),
    re.compile(r"^\s*answer\s*[:：]\s*(.+)", re.I | re.M),
    re.compile(r"####\s*(.+)"),
]
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?(?:\s*/\s*\d+)?")


def _braced(text: str, start: int) -> str | None:
    """Contents of the brace group opening at text[start-1] (bounded by the text length)."""
    depth = 1
    i = start
    while i < len(text):
        c = text[i]
        if c == "\\":
            i += 2
            continue
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
        i += 1
    return None


def extract_answer(text: str) -> str | None:
    """The model's final answer: the last \\boxed{...}, else an 'answer is / Answer: / ####' line, else the
    last number. None when nothing answer-like is present."""
    text = text[-MAX_TEXT:]
    boxes = list(_BOXED.finditer(text))
    for m in reversed(boxes[-32:]):
        inner = _braced(text, m.end())
        if inner is not None and inner.strip():
            return inner.strip()
    for pat in _MARKERS:
        found = pat.findall(text[-20000:])
        if found:
            ans = found[-1].strip().splitlines()[0] if found[-1].strip() else ""
            ans = ans.strip().rstrip(".").strip()
            if ans:
                return ans.strip("$ ")
    nums = _NUMBER.findall(text[-20000:])
    return nums[-1] if nums else None


# --------------------------------------------------------------------------------------- normalisation

_UNIT_WORDS = (
    "cm|mm|km|m|kg|g|mg|s|sec|seconds?|minutes?|min|hours?|hrs?|h|days?|weeks?|years?|"
    "dollars?|cents?|inches|inch|in|feet|foot|ft|miles?|meters?|metres?|liters?|litres?|l|ml|"
    "degrees?|units?|square units|sq units|mph|km/h|m/s|cm\\^2|m\\^2|cm\\^3|m\\^3|points?|people|students?"
)
_UNIT_TAIL = re.compile(rf"^(?P<val>.*?\d[^a-zA-Z]*?)\s*(?P<unit>(?:{_UNIT_WORDS}))\.?$", re.I)


@dataclass
class Parsed:
    text: str  # normalised string
    unit: str | None
    percent: bool


def normalize(ans: str) -> Parsed:
    s = ans[:MAX_ANSWER].strip()
    s = s.strip("$").strip()
    s = re.sub(r"^\\\(|\\\)$", "", s).strip()
    for a, b in (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\left", ""), ("\\right", ""), ("−", "-")):
        s = s.replace(a, b)
    s = re.sub(r"\\[,;:! ]", "", s)
    s = re.sub(r"\\(?:mathrm|textbf|mathbf|operatorname)\{([^{}]*)\}", r"\1", s)
    unit = None
    m = re.search(r"\\(?:text|mbox)\{\s*([^{}]*)\}\s*$", s)
    if m and re.search(r"\d", s[: m.start()]):
        unit = m.group(1).strip().lower() or None
        s = s[: m.start()].strip()
    s = re.sub(r"\\(?:text|mbox)\{([^{}]*)\}", r"\1", s)
    if re.search(r"(\^\s*\{?\\circ\}?|°)$", s):
        unit = unit or "degree"
        s = re.sub(r"(\^\s*\{?\\circ\}?|°)$", "", s).strip()
    percent = False
    if re.search(r"\\?%$", s):
        percent = True
        s = re.sub(r"\\?%$", "", s).strip()
    if unit is None:
        m = _UNIT_TAIL.match(s)
        if m:
            unit = m.group("unit").lower()
            s = m.group("val").strip()
    s = re.sub(r"^[a-zA-Z]\s*=\s*(?=[^=])", "", s)  # "x = 5" -> "5"
    s = re.sub(r"^\\\$\s*|^\$", "", s).strip()  # currency sign
    if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", s):
        s = s.replace(",", "")  # thousands separators
    s = s.rstrip(".").strip()
    s = re.sub(r"^\((\w)\)$", r"\1", s)  # "(B)" -> "B"
    return Parsed(s, _canon_unit(unit), percent)


def _canon_unit(u: str | None) -> str | None:
    if not u:
        return None
    u = u.strip().lower().rstrip("s")
    aliases = {
        "sec": "second",
        "secon": "second",
        "minute": "min",
        "hour": "h",
        "hr": "h",
        "dollar": "$",
        "degree": "degree",
        "meter": "m",
        "metre": "m",
        "inche": "inch",
        "foot": "ft",
        "feet": "ft",
    }
    return aliases.get(u, u)


_NUM_FULL = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d{1,3})?")
_FRAC_LATEX = re.compile(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}")
_FRAC_PLAIN = re.compile(r"(-?\d+)\s*/\s*(-?\d+)")
_SCI_LATEX = re.compile(r"(-?\d+(?:\.\d+)?)\s*\\times\s*10\^\{?(-?\d{1,3})\}?")


def as_number(s: str) -> tuple[Fraction, bool] | None:
    """(value, exact) for plain numeric strings, None otherwise. `exact` is False for decimals with a
    fractional part (approximations get a relative tolerance). Exponents are capped so '1e999999' cannot
    build a giant integer."""
    s = s.replace(" ", "")
    if len(s) > 64:
        return None
    if _NUM_FULL.fullmatch(s):
        return Fraction(s), "." not in s and "e" not in s.lower()
    m = _FRAC_LATEX.fullmatch(s)
    if m and int(m.group(3)) != 0:
        v = Fraction(int(m.group(2)), int(m.group(3)))
        return (-v if m.group(1) else v), True
    m = _FRAC_PLAIN.fullmatch(s)
    if m and int(m.group(2)) != 0:
        return Fraction(int(m.group(1)), int(m.group(2))), True
    m = _SCI_LATEX.fullmatch(s)
    if m:
        return Fraction(m.group(1)) * Fraction(10) ** int(m.group(2)), "." not in m.group(1)
    return None


def _close(a: Fraction, b: Fraction, exact: bool, rel_tol: float) -> bool:
    if exact:
        return a == b
    return abs(a - b) <= Fraction(rel_tol) * max(abs(a), abs(b), Fraction(1, 10**12))


# ----------------------------------------------------------------------------- symbolic worker process


def _symbolic_worker(conn) -> None:  # pragma: no cover - runs in the worker process
    import random

    import sympy
    from latex2sympy2_extended import latex2sympy

    def parse(s: str):
        s = re.sub(r"\bsqrt\s*\(([^()]*)\)", r"\\sqrt{\1}", s)
        s = re.sub(r"(?<![\\a-zA-Z])pi\b", r"\\pi", s)
        e = latex2sympy(s)
        if isinstance(e, sympy.Eq) and isinstance(e.lhs, sympy.Symbol):
            e = e.rhs  # "x = 2y" -> "2y"
        return e

    def numeric_equal(a, b) -> bool | None:
        syms = sorted((a.free_symbols | b.free_symbols), key=str)
        rng = random.Random(0)
        for _ in range(4):
            sub = {s: sympy.Float(rng.uniform(0.5, 2.5)) for s in syms}
            va, vb = complex(a.evalf(30, subs=sub)), complex(b.evalf(30, subs=sub))
            if abs(va - vb) > 1e-9 * max(1.0, abs(va), abs(vb)):
                return False
        return True

    def equal(x: str, y: str) -> bool:
        a, b = parse(x), parse(y)
        if a == b:
            return True
        if isinstance(a, sympy.Basic) and isinstance(b, sympy.Basic):
            if isinstance(a, sympy.Set) or isinstance(b, sympy.Set) or isinstance(a, sympy.MatrixBase):
                if a == b:
                    return True
                return isinstance(a, sympy.Set) and a.symmetric_difference(b) == sympy.S.EmptySet
            if isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr):
                with contextlib.suppress(TypeError, ValueError, ArithmeticError):
                    r = numeric_equal(a, b)
                    if r is not None:
                        return r
                return bool(sympy.simplify(a - b) == 0)
        return False

    while True:
        try:
            x, y = conn.recv()
        except EOFError:
            return
        try:
            res: Any = equal(x, y)
        except Exception as e:  # unparsable maths is an answer that does not match, never a crash
            res = f"error: {type(e).__name__}"
        conn.send(res)


class _Worker:
    """One long-lived worker; killed and restarted when a comparison overruns its limit."""

    _lock = threading.Lock()
    _proc = None
    _conn = None

    @classmethod
    def compare(cls, a: str, b: str, timeout_s: float) -> bool | str:
        with cls._lock:
            if cls._proc is None or not cls._proc.is_alive():
                ctx = mp.get_context("spawn")  # no fork of a process that may hold torch/thread state
                parent, child = ctx.Pipe()
                cls._proc = ctx.Process(target=_symbolic_worker, args=(child,), daemon=True)
                cls._proc.start()
                child.close()
                cls._conn = parent
                cls._conn.send(("1", "1"))  # warm-up: imports happen outside any grading limit
                cls._conn.poll(120)
                cls._conn.recv()
            cls._conn.send((a, b))
            if cls._conn.poll(timeout_s):
                return cls._conn.recv()
            cls._proc.kill()
            cls._proc.join()
            cls._proc = None
            return "timeout"


# ------------------------------------------------------------------------------------------- the grader


def answers_equivalent(pred: str, ref: str, task: AnswerTask | None = None) -> tuple[bool, str]:
    """(equal, how) for two answer strings."""
    task = task or AnswerTask(answer=ref)
    p, r = normalize(pred), normalize(ref)
    if p.unit and r.unit and p.unit != r.unit:
        return False, f"unit mismatch: {p.unit} vs {r.unit}"
    if p.text == r.text and p.percent == r.percent:
        return True, "string"
    if p.text.lower() == r.text.lower() and re.fullmatch(r"[A-Za-z ]+", p.text):
        return True, "string"
    if task.kind == "text":
        return False, "string mismatch"
    pn, rn = as_number(p.text), as_number(r.text)
    if pn is not None and rn is not None:
        (pv, pe), (rv, re_) = pn, rn
        exact = pe and re_
        candidates = [pv]
        if p.percent != r.percent:  # "50%" matches both 50 and 0.5
            candidates.append(pv / 100 if p.percent else pv * 100)
        ok = any(_close(c, rv, exact, task.rel_tol) for c in candidates)
        return ok, "numeric"
    if task.kind == "numeric" or not p.text or not r.text:
        return False, "not numeric"
    res = _Worker.compare(p.text, r.text, task.symbolic_timeout_s)
    if res is True:
        return True, "symbolic"
    if res == "timeout":
        return False, "symbolic timeout"
    return False, "symbolic mismatch" if res is False else str(res)


class AnswerGrader:
    """Reads `trajectory.messages` (the last assistant message) only."""

    name = "answer"

    def validate(self, task: Any) -> None:
        ans = getattr(task, "answer", None)
        if not isinstance(ans, str) or not ans.strip():
            raise GraderConfigError("grader 'answer': task needs a non-empty string field 'answer'")
        if getattr(task, "kind", "auto") not in ("auto", "numeric", "symbolic", "text"):
            raise GraderConfigError(f"grader 'answer': kind {task.kind!r} is not one of auto, numeric, symbolic, text")

    def grade(self, task: AnswerTask, trajectory: TrajectoryLike) -> Grade:
        text = final_assistant_text(trajectory, MAX_TEXT)
        pred = extract_answer(text)
        if pred is None:
            return Grade.fail("no_answer: no final answer found in the last assistant message")
        ok, how = answers_equivalent(pred, task.answer, task)
        details = {"extracted": pred[:MAX_ANSWER], "method": how}
        if ok:
            return Grade(1.0, True, [], details)
        return Grade(0.0, False, [f"wrong_answer: {how}"], details)
