"""The report (issue 8): logged metrics and evaluation results → ``report.md``, PNG plots and the slice table.

A small reader of what the pipeline logs, not a second system. Its inputs are a contract (docs/report.md says the
same):

``<run_dir>/metrics.jsonl``, written by every training run, one JSON object per iteration::

    iteration         int                      required
    stage             "rl" | "mopd"            required: "rl" is a teacher, "mopd" the student
    run               str                      required: "teacher-general-high", "student", ...
    domain, effort    str                      the run's own, or "mixed"
    reward/mean, pass_rate, tokens/mean, over_budget_rate     numbers
    budget            int | null               this iteration's token budget
    samples           int                      cumulative trajectories trained on so far
    ...               any other numeric keys (time/rollout_s, loss, kl/<teacher>): kept, unused here

A line that is not a JSON object or lacks a valid ``iteration``/``stage``/``run`` (a killed run leaves a truncated
last line) is skipped with a ``ReportWarning`` naming the file and line; a line without some metric only leaves a
gap in that curve. An iteration logged twice (a run resumed from an earlier checkpoint) keeps its last line.

``eval.json``, written by the eval stage::

    {"models": [{"name": "sft" | "teacher-<domain>-<effort>" | "student",
                 "kind": "sft" | "teacher" | "student",
                 "domain": str | null, "effort": str | null,      (a teacher's own; required for a teacher)
                 "slices": [{"domain": str, "effort": str, "pass_rate": 0..1, "mean_tokens": >= 0,
                             "over_budget_rate": 0..1, "n": int >= 0}, ...]}, ...]}

Every field is checked on load; a bad one raises ``ReportError`` naming the file and the field
(``models[2].slices[0].pass_rate``). A slice row compares SFT, the teacher trained for that (domain, effort) and
the student, each on that slice.

Usage: ``python -m rlk3.report eval.json runs/teacher-* runs/student --out report/``
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

# Figures bound to the Agg canvas directly, never pyplot: no global backend switch, no figure registry to leak into.
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from rlk3.config import DOMAINS, EFFORTS

KINDS = ("sft", "teacher", "student")
EFFORT_COLORS = {"low": "tab:blue", "medium": "tab:orange", "high": "tab:red"}
KIND_MARKERS = {"sft": "o", "teacher": "s", "student": "^"}
KIND_COLORS = {"sft": "0.6", "teacher": "tab:blue", "student": "tab:green"}


class ReportError(ValueError):
    """A missing or malformed input; the message names the file and the field."""


class ReportWarning(UserWarning):
    """A skipped metrics line (truncated or missing its identity keys)."""


# ---------------------------------------------------------------------------------------------- eval.json


@dataclass(frozen=True)
class SliceResult:
    domain: str
    effort: str
    pass_rate: float
    mean_tokens: float
    over_budget_rate: float
    n: int


@dataclass(frozen=True)
class ModelResult:
    name: str
    kind: str  # sft | teacher | student
    domain: str | None  # a teacher's own domain; None (or "mixed") for sft and the student
    effort: str | None
    slices: dict[tuple[str, str], SliceResult]


@dataclass(frozen=True)
class EvalResult:
    models: list[ModelResult]

    def one(self, kind: str) -> ModelResult | None:
        return next((m for m in self.models if m.kind == kind), None)

    def teacher(self, domain: str, effort: str) -> ModelResult | None:
        return next((m for m in self.models if m.kind == "teacher" and (m.domain, m.effort) == (domain, effort)), None)


@dataclass(frozen=True)
class SliceRow:
    """One (domain, effort) slice: SFT, the teacher for that slice and the student, each on it (None: not evaluated)."""

    domain: str
    effort: str
    sft: SliceResult | None
    teacher: SliceResult | None
    student: SliceResult | None

    @property
    def delta(self) -> float | None:  # student − teacher pass rate
        return None if self.student is None or self.teacher is None else self.student.pass_rate - self.teacher.pass_rate

    @property
    def n(self) -> int:  # the student's count where it was evaluated, else the first model's that was
        return next(s.n for s in (self.student, self.teacher, self.sft) if s is not None)


def _field(obj: Mapping, key: str, where: str, source: str, check, want: str):
    name = f"{where}.{key}" if where else key
    if key not in obj:
        raise ReportError(f"{source}: {name} is missing (want {want})")
    if not check(obj[key]):
        raise ReportError(f"{source}: {name} must be {want}, got {obj[key]!r}")
    return obj[key]


def _is_num(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _is_rate(v) -> bool:
    return _is_num(v) and 0 <= v <= 1


def _is_nonneg(v) -> bool:
    return _is_num(v) and v >= 0


def _is_count(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_str(v) -> bool:
    return isinstance(v, str) and v != ""


def parse_eval(data, source: str = "eval.json") -> EvalResult:
    """Validate decoded eval.json; ``source`` names the file in errors."""
    if not isinstance(data, Mapping):
        raise ReportError(f"{source}: the top level must be an object with a 'models' list, got {type(data).__name__}")
    raw_models = _field(data, "models", "", source, lambda v: isinstance(v, list) and v, "a non-empty list")
    models, seen = [], set()
    for i, m in enumerate(raw_models):
        w = f"models[{i}]"
        if not isinstance(m, Mapping):
            raise ReportError(f"{source}: {w} must be an object, got {m!r}")
        name = _field(m, "name", w, source, _is_str, "a non-empty string")
        kind = _field(m, "kind", w, source, lambda v: v in KINDS, f"one of {list(KINDS)}")
        if kind == "teacher":  # a teacher is matched to its slice by its own (domain, effort)
            domain = _field(m, "domain", w, source, _is_str, "a non-empty string (the teacher's own)")
            effort = _field(m, "effort", w, source, _is_str, "a non-empty string (the teacher's own)")
        else:
            domain, effort = m.get("domain"), m.get("effort")
            for k in ("domain", "effort"):
                if k in m:
                    _field(m, k, w, source, lambda v: v is None or _is_str(v), "a string or null")
        key = (kind, domain, effort) if kind == "teacher" else (kind,)
        if key in seen:
            which = f"teacher for ({domain}, {effort})" if kind == "teacher" else f"'{kind}' model"
            raise ReportError(f"{source}: {w} ({name!r}) is a second {which}")
        seen.add(key)
        raw_slices = _field(m, "slices", w, source, lambda v: isinstance(v, list), "a list")
        slices: dict[tuple[str, str], SliceResult] = {}
        for j, s in enumerate(raw_slices):
            ws = f"{w}.slices[{j}]"
            if not isinstance(s, Mapping):
                raise ReportError(f"{source}: {ws} must be an object, got {s!r}")
            sl = SliceResult(
                domain=_field(s, "domain", ws, source, _is_str, "a non-empty string"),
                effort=_field(s, "effort", ws, source, _is_str, "a non-empty string"),
                pass_rate=float(_field(s, "pass_rate", ws, source, _is_rate, "a number in [0, 1]")),
                mean_tokens=float(_field(s, "mean_tokens", ws, source, _is_nonneg, "a number >= 0")),
                over_budget_rate=float(_field(s, "over_budget_rate", ws, source, _is_rate, "a number in [0, 1]")),
                n=_field(s, "n", ws, source, _is_count, "an integer >= 0"),
            )
            if (sl.domain, sl.effort) in slices:
                raise ReportError(f"{source}: {ws} repeats slice ({sl.domain}, {sl.effort})")
            slices[sl.domain, sl.effort] = sl
        models.append(ModelResult(name, kind, domain, effort, slices))
    return EvalResult(models)


def load_eval(path) -> EvalResult:
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file (the eval stage writes eval.json)") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ReportError(f"{path}: not valid JSON ({e})") from None
    return parse_eval(data, str(path))


def _rank(value: str) -> tuple[int, str]:
    """Sort key: known domains and efforts in their canonical order, anything else after, by name."""
    known = [*DOMAINS, *EFFORTS]
    return (known.index(value) if value in known else len(known), value)


def _order(values) -> list[str]:
    return sorted(set(values), key=_rank)


def slice_rows(ev: EvalResult) -> list[SliceRow]:
    sft, student = ev.one("sft"), ev.one("student")
    keys = sorted({k for m in ev.models for k in m.slices}, key=lambda k: (_rank(k[0]), _rank(k[1])))
    rows = []
    for d, e in keys:
        row = SliceRow(d, e, *(m.slices.get((d, e)) if m else None for m in (sft, ev.teacher(d, e), student)))
        if row.sft or row.teacher or row.student:  # not a slice only some other teacher was evaluated on
            rows.append(row)
    return rows


def slice_table(ev: EvalResult | Mapping) -> str:
    """A fixed-width table, one row per (domain, effort) slice; '-' where a model was not evaluated on it."""
    if not isinstance(ev, EvalResult):
        ev = parse_eval(ev, "<eval>")

    def cells(row: SliceRow, attr: str, fmt: str) -> list[str]:
        return [fmt.format(getattr(s, attr)) if s else "-" for s in (row.sft, row.teacher, row.student)]

    head1 = f"{'':<8} {'':<6} {'':>5}  {' pass rate ':-^33}  {' mean tokens ':-^23}  {' over-budget rate ':-^23}"
    three = " ".join(f"{k:>7}" for k in KINDS)
    head2 = f"{'domain':<8} {'effort':<6} {'n':>5}  {three} {'Δ s−t':>9}  {three}  {three}"
    lines = [head1, head2]
    for r in slice_rows(ev):
        delta = "-" if r.delta is None else f"{r.delta:+.3f}"
        lines.append(
            f"{r.domain:<8} {r.effort:<6} {r.n:>5}  " + " ".join(f"{c:>7}" for c in cells(r, "pass_rate", "{:.3f}"))
            + f" {delta:>9}  " + " ".join(f"{c:>7}" for c in cells(r, "mean_tokens", "{:.1f}"))
            + "  " + " ".join(f"{c:>7}" for c in cells(r, "over_budget_rate", "{:.3f}"))
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- metrics.jsonl


def load_metrics(run_dir) -> list[dict]:
    """``run_dir/metrics.jsonl`` as dicts sorted by iteration; bad lines are skipped with a ReportWarning."""
    path = Path(run_dir) / "metrics.jsonl"
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise ReportError(f"{path}: no such file (every training run writes metrics.jsonl in its run dir)") from None
    latest: dict[tuple[str, int], dict] = {}
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            warnings.warn(f"{path}:{lineno}: skipped, not valid JSON ({e.msg})", ReportWarning, stacklevel=2)
            continue
        if problem := _bad_record(rec):
            warnings.warn(f"{path}:{lineno}: skipped, {problem}", ReportWarning, stacklevel=2)
            continue
        latest[rec["run"], rec["iteration"]] = rec  # a resumed run logs an iteration again: the last line wins
    return sorted(latest.values(), key=lambda r: r["iteration"])


def _bad_record(rec) -> str | None:
    if not isinstance(rec, dict):
        return "not a JSON object"
    if not _is_count(rec.get("iteration")):
        return "'iteration' missing or not an integer >= 0"
    for key in ("stage", "run"):
        if not _is_str(rec.get(key)):
            return f"'{key}' missing or not a string"
    return None


def _num(rec: dict, key: str) -> float | None:
    v = rec.get(key)
    return float(v) if _is_num(v) else None


@dataclass(frozen=True)
class Run:
    name: str
    stage: str
    domain: str
    effort: str
    records: list[dict]

    def last(self, key: str) -> float | None:
        return next((v for r in reversed(self.records) if (v := _num(r, key)) is not None), None)


def _runs(run_dirs: Sequence) -> list[Run]:
    runs: dict[str, Run] = {}
    origin: dict[str, Path] = {}
    for run_dir in run_dirs:
        groups: dict[str, list[dict]] = {}
        for rec in load_metrics(run_dir):
            groups.setdefault(rec["run"], []).append(rec)
        for name, recs in groups.items():
            if name in runs:
                raise ReportError(f"run {name!r} is logged in both {origin[name]} and {run_dir}")
            parts = name.split("-")  # "teacher-<domain>-<effort>" when the lines lack domain/effort
            domain = recs[-1].get("domain") or (parts[1] if len(parts) == 3 else "?")
            effort = recs[-1].get("effort") or (parts[2] if len(parts) == 3 else "?")
            runs[name], origin[name] = Run(name, recs[-1]["stage"], str(domain), str(effort), recs), Path(run_dir)
    return list(runs.values())


def samples_used(runs: Sequence[Run]) -> list[str]:
    """The MOPD economics: each student run's trajectories over the sum of all teachers' (``samples``, last value)."""
    teachers = [r for r in runs if r.stage == "rl"]
    students = [r for r in runs if r.stage == "mopd"]
    if not teachers or not students:
        return [f"Samples used: n/a (need teacher runs and a student run; got {len(teachers)} teacher, "
                f"{len(students)} student)"]
    lacking = [r.name for r in (*teachers, *students) if r.last("samples") is None]
    if lacking:
        return [f"Samples used: n/a (no `samples` logged by {', '.join(lacking)})"]
    total = sum(r.last("samples") for r in teachers)
    out = []
    for s in students:
        ratio = f"{s.last('samples') / total:.4f}" if total else "n/a (teachers logged 0 samples)"
        out.append(f"Samples used: {s.name} {s.last('samples'):,.0f} / {len(teachers)} teachers {total:,.0f} = {ratio}")
    return out


# ---------------------------------------------------------------------------------------------- acceptance


@dataclass(frozen=True)
class Check:
    """One of issue 8's acceptance criteria, read off eval.json and the runs' metrics. ``met`` is None where the
    inputs do not cover it (a model or slice not evaluated, no samples logged)."""

    criterion: str
    subject: str
    value: str
    met: bool | None


def _mean_pass(m: ModelResult | None, keys) -> tuple[float, int] | None:
    got = [m.slices[k] for k in keys if m is not None and k in m.slices]
    if not got or len(got) != len(keys) or not sum(s.n for s in got):
        return None
    n = sum(s.n for s in got)
    return sum(s.pass_rate * s.n for s in got) / n, n


def acceptance(ev: EvalResult, runs: Sequence[Run] = (), *, within: float = 0.05, low_vs_high: float = 0.5,
               max_over_budget: float = 0.10, max_samples: float = 1 / 3) -> list[Check]:
    """Issue 8's criteria 1-3 as checks: (1) each teacher's pass rate over its own domain's slices (those the SFT
    base was evaluated on too) above the base's on the same tasks — with the difference in standard errors, since
    a small slice's pass rate is a draw; (2) per domain, the teachers' mean tokens on their own slices ordered
    low < medium < high with low <= ``low_vs_high`` x high, and each teacher's over-budget rate at most
    ``max_over_budget``; (3) the student within ``within`` of each slice's teacher (below it by no more), on at
    most ``max_samples`` of the samples the teachers used together."""
    sft = ev.one("sft")
    out: list[Check] = []
    for t in sorted((m for m in ev.models if m.kind == "teacher"), key=lambda m: (_rank(m.domain), _rank(m.effort))):
        keys = [k for k in t.slices if k[0] == t.domain and sft is not None and k in sft.slices]
        a, b = _mean_pass(t, keys), _mean_pass(sft, keys)
        if a is None or b is None:
            out.append(Check("teacher beats SFT on its domain", t.name, "not evaluated on the same slices", None))
            continue
        se = math.sqrt(a[0] * (1 - a[0]) / a[1] + b[0] * (1 - b[0]) / b[1]) or float("nan")
        out.append(Check("teacher beats SFT on its domain", t.name,
                         f"{a[0]:.3f} vs {b[0]:.3f} ({a[0] - b[0]:+.3f}, {(a[0] - b[0]) / se:+.1f} SE; "
                         f"{len(keys)} slices, {a[1]} tasks)", a[0] > b[0]))
    for d in _order(m.domain for m in ev.models if m.kind == "teacher"):
        own = {e: t.slices.get((d, e)) if (t := ev.teacher(d, e)) else None for e in EFFORTS}
        if any(v is None for v in own.values()):
            out.append(Check("tokens low < medium < high, low <= 0.5 x high", d, "not every effort's teacher "
                             "evaluated on its own slice", None))
        else:
            lo, mid, hi = (own[e].mean_tokens for e in EFFORTS)
            ratio = lo / hi if hi else float("inf")
            out.append(Check(f"tokens low < medium < high, low <= {low_vs_high:g} x high", d,
                             f"{lo:.1f} / {mid:.1f} / {hi:.1f} (low/high {ratio:.2f})",
                             lo < mid < hi and ratio <= low_vs_high))
        for e, sl in own.items():
            if sl is not None:
                out.append(Check(f"over-budget rate <= {max_over_budget:.0%}", f"teacher-{d}-{e}",
                                 f"{sl.over_budget_rate:.3f}", sl.over_budget_rate <= max_over_budget))
    for r in slice_rows(ev):
        if r.teacher is not None:
            d = r.delta
            out.append(Check(f"student within {within * 100:g} points of its teacher", f"{r.domain}/{r.effort}",
                             "not evaluated" if d is None else f"{d * 100:+.1f} points", None if d is None
                             else d >= -within - 1e-9))
    teachers = [r.last("samples") for r in runs if r.stage == "rl"]
    students = [r for r in runs if r.stage == "mopd"]
    for s in students:
        total, mine = sum(v or 0 for v in teachers), s.last("samples")
        ok = None if not total or mine is None or None in teachers else mine / total <= max_samples
        out.append(Check(f"student samples <= {max_samples:.2f} of all teachers'", s.name,
                         f"{mine or 0:,.0f} / {total:,.0f}" + (f" = {mine / total:.2f}" if total and mine else ""), ok))
    return out


def acceptance_summary(eval_path, run_dirs: Sequence) -> str:
    """The acceptance table for an eval.json and the training runs' directories (what the demo prints last)."""
    return acceptance_table(acceptance(load_eval(eval_path), _runs(run_dirs)))


def acceptance_table(checks: Sequence[Check]) -> str:
    mark = {True: "met", False: "MISSED", None: "n/a"}
    width = max((len(c.criterion) for c in checks), default=9)
    lines = [f"{'criterion':<{width}}  {'subject':<22}  {'status':<6}  value"]
    lines += [f"{c.criterion:<{width}}  {c.subject:<22}  {mark[c.met]:<6}  {c.value}" for c in checks]
    met = sum(c.met is True for c in checks)
    lines.append(f"{met} of {len(checks)} checks met, {sum(c.met is False for c in checks)} missed")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- plots


def _save(fig: Figure, path: Path) -> Path:
    FigureCanvasAgg(fig)
    fig.savefig(path, dpi=110)
    return path


def plot_reward_curves(runs: Sequence[Run], path: Path) -> Path | None:
    teachers = [r for r in runs if r.stage == "rl"]
    if not teachers:
        return None
    domains = _order(r.domain for r in teachers)
    fig = Figure(figsize=(4.5 * len(domains), 3.6), layout="constrained")
    axes = fig.subplots(1, len(domains), squeeze=False, sharey=True)[0]
    for ax, d in zip(axes, domains):
        for r in sorted((r for r in teachers if r.domain == d), key=lambda r: _rank(r.effort)):
            pts = [(rec["iteration"], v) for rec in r.records if (v := _num(rec, "reward/mean")) is not None]
            if pts:
                marker = "." if len(pts) < 30 else None
                ax.plot(*zip(*pts), label=r.effort, color=EFFORT_COLORS.get(r.effort), marker=marker)
        ax.set(title=f"teachers: {d}", xlabel="iteration")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        ax.legend(title="effort", fontsize="small")
    axes[0].set_ylabel("reward/mean")
    return _save(fig, path)


def plot_tokens_vs_pass(rows: Sequence[SliceRow], path: Path) -> Path | None:
    efforts = _order(r.effort for r in rows)
    if not efforts:
        return None
    domains = _order(r.domain for r in rows)
    colors = {d: f"C{i}" for i, d in enumerate(domains)}
    fig = Figure(figsize=(4.2 * len(efforts), 3.8), layout="constrained")
    axes = fig.subplots(1, len(efforts), squeeze=False, sharey=True)[0]
    for ax, e in zip(axes, efforts):
        for r in (r for r in rows if r.effort == e):
            for kind in KINDS:
                s = getattr(r, kind)
                if s is not None:
                    ax.scatter(s.mean_tokens, s.pass_rate, marker=KIND_MARKERS[kind], color=colors[r.domain], s=48,
                               edgecolors="black", linewidths=0.5)
        ax.set(title=f"effort: {e}", xlabel="mean tokens", ylim=(-0.03, 1.03))
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("pass rate")
    handles = [axes[0].scatter([], [], marker=KIND_MARKERS[k], color="white", edgecolors="black", label=k)
               for k in KINDS]
    handles += [axes[0].scatter([], [], marker="o", color=colors[d], label=d) for d in domains]
    fig.legend(handles=handles, loc="outside right center", fontsize="small")
    return _save(fig, path)


def plot_pass_bars(rows: Sequence[SliceRow], path: Path) -> Path | None:
    if not rows:
        return None
    kinds = [k for k in KINDS if any(getattr(r, k) is not None for r in rows)]
    width = 0.8 / len(kinds)
    fig = Figure(figsize=(max(6.0, 0.9 * len(rows) + 2), 3.8), layout="constrained")
    ax = fig.subplots()
    for i, kind in enumerate(kinds):
        heights = [getattr(r, kind).pass_rate if getattr(r, kind) else math.nan for r in rows]
        xs = [j + (i - (len(kinds) - 1) / 2) * width for j in range(len(rows))]
        ax.bar(xs, heights, width, label=kind, color=KIND_COLORS[kind])
    ax.set_xticks(range(len(rows)), [f"{r.domain}\n{r.effort}" for r in rows], fontsize="small")
    ax.set(ylabel="pass rate", ylim=(0, 1.05), title="pass rate per slice: the student vs the slice's teacher")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    return _save(fig, path)


# ---------------------------------------------------------------------------------------------- report.md


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def write_report(eval_path, run_dirs: Sequence, out_dir) -> Path:
    """Write ``out_dir/report.md`` and its PNGs; returns the report's path. Inputs are all read before any write."""
    ev = load_eval(eval_path)
    runs = _runs(run_dirs)
    rows = slice_rows(ev)
    kinds = [m.kind for m in ev.models]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    plots = [
        ("Reward per teacher, one panel per domain", plot_reward_curves(runs, out / "reward_curves.png")),
        ("Mean tokens vs pass rate, per effort level", plot_tokens_vs_pass(rows, out / "tokens_vs_pass.png")),
        ("Student vs teacher pass rate per slice", plot_pass_bars(rows, out / "pass_by_slice.png")),
    ]
    md = [
        "# rlk3 report", "",
        f"Evaluation: `{eval_path}` ({', '.join(f'{n} {k}' for k in KINDS if (n := kinds.count(k)))} models).", "",
        "## Held-out slices", "",
        "Teacher = the teacher trained for the row's (domain, effort); Δ s−t = student − teacher pass rate; "
        "n = the student's count on the slice.", "",
        "```text", slice_table(ev), "```", "",
        *[f"- {line}" for line in samples_used(runs)], "",
        "The MOPD economics: trajectories the student trained on over the sum of those the teachers trained on "
        "(each run's last logged `samples`).", "",
        "## Acceptance", "",
        "Issue 8's criteria read off this evaluation and the runs' metrics (rlk3/report.py, `acceptance`). A "
        "teacher's domain pass rate pools its domain's slices; SE is the standard error of the difference, so a "
        "gap under ~2 SE is within the draw of the held-out tasks.", "",
        "```text", acceptance_table(acceptance(ev, runs)), "```", "",
        "## Training runs", "",
    ]
    if runs:
        md += ["| run | stage | domain | effort | iterations | reward/mean | pass_rate | tokens/mean "
               "| over_budget_rate | budget | samples |", "|" + "---|" * 11]
        for r in runs:
            md.append(f"| {r.name} | {r.stage} | {r.domain} | {r.effort} | {len(r.records)} | "
                      f"{_fmt(r.last('reward/mean'), '.3f')} | {_fmt(r.last('pass_rate'), '.3f')} | "
                      f"{_fmt(r.last('tokens/mean'), '.1f')} | {_fmt(r.last('over_budget_rate'), '.3f')} | "
                      f"{_fmt(r.last('budget'), '.0f')} | {_fmt(r.last('samples'), ',.0f')} |")
        md += ["", "Last logged value of each metric."]
    else:
        md.append("No run directories given.")
    md += ["", "## Plots", ""]
    for title, png in plots:
        md += [f"### {title}", "", f"![{title}]({png.name})" if png else "(no data)", ""]
    path = out / "report.md"
    path.write_text("\n".join(md))
    return path


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rlk3.report", description=__doc__.splitlines()[0])
    ap.add_argument("eval_json", help="eval.json from the eval stage")
    ap.add_argument("run_dirs", nargs="*", help="training run directories, each holding metrics.jsonl")
    ap.add_argument("--out", required=True, help="directory for report.md and the PNGs")
    args = ap.parse_args(argv)
    try:
        with warnings.catch_warnings(record=True) as skipped:
            warnings.simplefilter("always", ReportWarning)
            path = write_report(args.eval_json, args.run_dirs, args.out)
        for w in skipped:
            print(f"warning: {w.message}", file=sys.stderr)
        print(slice_table(load_eval(args.eval_json)))
    except ReportError as e:
        print(f"report error: {e}", file=sys.stderr)
        return 2
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
