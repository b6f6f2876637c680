"""The report reader: the slice table and sample ratio equal what the inputs say; bad inputs fail naming the field."""

import json

import matplotlib.image
import pytest

from rlk3.report import ReportError, ReportWarning, load_eval, load_metrics, main, slice_table, write_report

DOMAINS = ("general", "agentic", "coding")
EFFORTS = ("low", "medium", "high")
SLICES = [(d, e) for d in DOMAINS for e in EFFORTS]


def sl(domain, effort, pass_rate, tokens, over, n=64):
    return {"domain": domain, "effort": effort, "pass_rate": pass_rate, "mean_tokens": tokens,
            "over_budget_rate": over, "n": n}


def expected():
    """Per slice i: (sft, own teacher, student) as (pass, tokens, over), values exact at the table's precision."""
    out = {}
    for i, key in enumerate(SLICES):
        teacher = 0.5 + 0.04 * i
        out[key] = {"sft": (0.1 + 0.025 * i, 900.0 + 10 * i, 0.3),
                    "teacher": (teacher, 400.0 - 20 * i, 0.05 + 0.01 * i),
                    "student": (teacher - 0.03 + 0.01 * i, 410.5 - 20 * i, 0.06),
                    "delta": -0.03 + 0.01 * i}
    return out


def make_eval(student_skips=()):
    exp = expected()
    models = [{"name": "sft", "kind": "sft", "domain": None, "effort": None,
               "slices": [sl(*k, *exp[k]["sft"]) for k in SLICES]}]
    for d, e in SLICES:  # every teacher is evaluated on every slice; off its own slice it scores 0.01
        slices = [sl(*k, *exp[k]["teacher"]) if k == (d, e) else sl(*k, 0.01, 5.0, 1.0) for k in SLICES]
        models.append({"name": f"teacher-{d}-{e}", "kind": "teacher", "domain": d, "effort": e, "slices": slices})
    models.append({"name": "student", "kind": "student", "domain": "mixed", "effort": "mixed",
                   "slices": [sl(*k, *exp[k]["student"], n=32) for k in SLICES if k not in student_skips]})
    return {"models": models}


def write_runs(tmp_path, teacher_iters=20, student_iters=30, truncate=True):
    """Nine teacher runs (64 trajectories per iteration) and one student run (32 per iteration)."""
    dirs = []
    for d, e in SLICES:
        run = tmp_path / "runs" / f"teacher-{d}-{e}"
        run.mkdir(parents=True)
        lines = [json.dumps({"iteration": it, "stage": "rl", "run": run.name, "domain": d, "effort": e,
                             "reward/mean": -0.5 + it / teacher_iters, "pass_rate": it / teacher_iters,
                             "tokens/mean": 500 - it, "over_budget_rate": 0.1, "budget": 512,
                             "samples": 64 * (it + 1), "time/rollout_s": 1.5, "loss": 0.1})
                 for it in range(teacher_iters)]
        if truncate:
            lines.append(lines[-1][:25])  # killed mid-write
        (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        dirs.append(run)
    run = tmp_path / "runs" / "student"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(
        json.dumps({"iteration": it, "stage": "mopd", "run": "student", "domain": "mixed", "effort": "mixed",
                    "reward/mean": -1 + it / student_iters, "pass_rate": 0.5, "tokens/mean": 300,
                    "over_budget_rate": 0.0, "budget": None, "samples": 32 * (it + 1), "kl/teacher-general-high": 0.2})
        + "\n" for it in range(student_iters)))
    return [*dirs, run]


def parse_rows(table):
    rows = {}
    for line in table.splitlines()[2:]:
        cells = line.split()
        assert len(cells) == 13, line
        rows[cells[0], cells[1]] = cells[2:]
    return rows


def num(cell):
    return None if cell == "-" else float(cell)


def test_slice_table_numbers_equal_inputs():
    rows = parse_rows(slice_table(make_eval()))
    assert list(rows) == SLICES  # canonical domain and effort order
    for key, exp in expected().items():
        n, *pass3, delta, tok_sft, tok_t, tok_s, over_sft, over_t, over_s = map(num, rows[key])
        assert n == 32  # the student's count
        assert pass3 == pytest.approx([exp[k][0] for k in ("sft", "teacher", "student")], abs=5e-4)
        assert [tok_sft, tok_t, tok_s] == pytest.approx([exp[k][1] for k in ("sft", "teacher", "student")], abs=0.05)
        assert [over_sft, over_t, over_s] == pytest.approx([exp[k][2] for k in ("sft", "teacher", "student")],
                                                           abs=5e-4)
        assert delta == pytest.approx(exp["delta"], abs=5e-4)  # the slice's own teacher, not the off-slice 0.01
        assert delta == pytest.approx(pass3[2] - pass3[1], abs=1e-3)


def test_slice_table_marks_what_was_not_evaluated():
    rows = parse_rows(slice_table(make_eval(student_skips=[("coding", "high")])))
    n, _sft, teacher, student, delta, *_ = rows["coding", "high"]
    assert (student, delta, n) == ("-", "-", "64")  # n falls back to the teacher's count
    assert num(teacher) == pytest.approx(expected()["coding", "high"]["teacher"][0], abs=5e-4)
    # a teacher alone, evaluated off its slice too: only its own slice makes a row
    only = {"models": [m for m in make_eval()["models"] if m["name"] == "teacher-agentic-low"]}
    rows = parse_rows(slice_table(only))
    assert list(rows) == [("agentic", "low")] and rows["agentic", "low"][:5] == ["64", "-", "0.620", "-", "-"]


def test_load_metrics_skips_bad_lines(tmp_path):
    good = [{"iteration": i, "stage": "rl", "run": "t", "reward/mean": float(i)} for i in range(4)]
    lines = [json.dumps(good[0]), json.dumps(good[1]), "[1, 2]", json.dumps({"stage": "rl", "run": "t"}),
             json.dumps(good[2]), json.dumps({**good[1], "reward/mean": 9.0}),  # iteration 1 again: a resumed run
             json.dumps({"iteration": 5, "run": "t"}), json.dumps(good[3])[:20]]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines))
    with pytest.warns(ReportWarning) as caught:
        recs = load_metrics(tmp_path)
    msgs = [str(w.message) for w in caught]
    assert [m.split(": skipped")[0].rsplit(":", 1)[1] for m in msgs] == ["3", "4", "7", "8"]
    assert "not a JSON object" in msgs[0] and "'iteration'" in msgs[1] and "'stage'" in msgs[2]
    assert "not valid JSON" in msgs[3] and str(tmp_path / "metrics.jsonl") in msgs[3]
    assert [(r["iteration"], r["reward/mean"]) for r in recs] == [(0, 0.0), (1, 9.0), (2, 2.0)]


def assert_png(path):
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", path
    assert len(data) > 10_000, (path, len(data))
    img = matplotlib.image.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 400
    assert img[..., :3].std() > 0.05  # something was drawn


def test_write_report(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps(make_eval()))
    with pytest.warns(ReportWarning, match="skipped, not valid JSON"):
        path = write_report(tmp_path / "eval.json", write_runs(tmp_path), tmp_path / "out")
    assert path == tmp_path / "out" / "report.md"
    md = path.read_text()
    for png in ("reward_curves.png", "tokens_vs_pass.png", "pass_by_slice.png"):
        assert_png(tmp_path / "out" / png)
        assert f"]({png})" in md
    assert slice_table(load_eval(tmp_path / "eval.json")) in md
    # 30 student iterations × 32 over 9 teachers × 20 iterations × 64 (the truncated lines are not counted)
    assert "Samples used: student 960 / 9 teachers 11,520 = 0.0833" in md
    assert "| teacher-coding-high | rl | coding | high | 20 | 0.450 | 0.950 | 481.0 | 0.100 | 512 | 1,280 |" in md


def test_samples_line_says_why_it_is_missing(tmp_path):
    (tmp_path / "eval.json").write_text(json.dumps(make_eval()))
    runs = write_runs(tmp_path, truncate=False)
    md = write_report(tmp_path / "eval.json", runs[:-1], tmp_path / "a").read_text()
    assert "Samples used: n/a (need teacher runs and a student run; got 9 teacher, 0 student)" in md
    student = runs[-1] / "metrics.jsonl"
    student.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "samples"}) + "\n"
                               for line in student.read_text().splitlines()))
    md = write_report(tmp_path / "eval.json", runs, tmp_path / "b").read_text()
    assert "Samples used: n/a (no `samples` logged by student)" in md


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda ev: ev.pop("models"), r"eval.json: models is missing"),
        (lambda ev: ev["models"][1].update(kind="teachr"), r"models\[1\]\.kind must be one of \['sft', 'teacher'"),
        (lambda ev: ev["models"][2].pop("effort"), r"models\[2\]\.effort is missing"),
        (lambda ev: ev["models"][0]["slices"][4].update(pass_rate=1.5), r"models\[0\]\.slices\[4\]\.pass_rate must be"),
        (lambda ev: ev["models"][3]["slices"][0].update(n="64"), r"models\[3\]\.slices\[0\]\.n must be an integer"),
        (lambda ev: ev["models"][10]["slices"][2].pop("mean_tokens"), r"models\[10\]\.slices\[2\]\.mean_tokens is"),
        (lambda ev: ev["models"][10]["slices"].append(ev["models"][10]["slices"][0]),
         r"models\[10\]\.slices\[9\] repeats slice \(general, low\)"),
        (lambda ev: ev["models"].append(ev["models"][1]),
         r"models\[11\] \('teacher-general-low'\) is a second teacher for \(general, low\)"),
    ],
)
def test_bad_eval_names_file_and_field(tmp_path, mutate, match):
    ev = make_eval()
    mutate(ev)
    (tmp_path / "eval.json").write_text(json.dumps(ev))
    with pytest.raises(ReportError, match=match) as e:
        load_eval(tmp_path / "eval.json")
    assert str(e.value).startswith(str(tmp_path / "eval.json"))


def test_missing_and_unreadable_inputs(tmp_path):
    with pytest.raises(ReportError, match=r"nope\.json: no such file"):
        load_eval(tmp_path / "nope.json")
    (tmp_path / "eval.json").write_text('{"models": [')
    with pytest.raises(ReportError, match=r"eval\.json: not valid JSON"):
        load_eval(tmp_path / "eval.json")
    with pytest.raises(ReportError, match=r"empty/metrics\.jsonl: no such file"):
        load_metrics(tmp_path / "empty")


def test_cli(tmp_path, capsys):
    (tmp_path / "eval.json").write_text(json.dumps(make_eval()))
    runs = [str(r) for r in write_runs(tmp_path)]
    assert main([str(tmp_path / "eval.json"), *runs, "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert out.startswith(slice_table(make_eval())) and "report.md" in out
    assert err.count("warning: ") == 9 and "teacher-coding-high/metrics.jsonl:21: skipped, not valid JSON" in err
    assert main([str(tmp_path / "missing.json"), "--out", str(tmp_path / "x")]) == 2
    assert "report error:" in capsys.readouterr().err and not (tmp_path / "x").exists()


def test_acceptance_reads_each_criterion_off_the_inputs(tmp_path):
    """Issue 8's criteria: a teacher beats the base pooled over its own domain's slices; per domain the teachers'
    tokens are ordered with low <= 0.5 x high; over-budget rates <= 10%; the student is at most 5 points below each
    slice's teacher; the samples ratio <= 1/3. Each check here is built to land on a known side."""
    from rlk3.report import _runs, acceptance, acceptance_table, load_eval

    def model(name, kind, d, e, slices):
        return {"name": name, "kind": kind, "domain": d, "effort": e, "slices": slices}

    sft = [sl("general", e, p, 10.0, 0.0, n=100) for e, p in (("low", 0.2), ("medium", 0.3), ("high", 0.4))]
    sft += [sl("agentic", e, 0.5, 90.0, 0.2, n=100) for e in EFFORTS]
    own = {  # teacher -> (pass on its domain's three slices, tokens on its own slice, over-budget on its own)
        ("general", "high"): ((0.2, 0.35, 0.5), 40.0, 0.0),  # pooled 0.35 > 0.30: beats
        ("general", "medium"): ((0.2, 0.3, 0.4), 30.0, 0.0),  # pooled 0.30 = 0.30: does not beat
        ("general", "low"): ((0.25, 0.3, 0.4), 6.0, 0.0),  # tokens 6 / 30 / 40: ordered, 0.15 x high
        ("agentic", "high"): ((0.6, 0.6, 0.6), 130.0, 0.0),
        ("agentic", "medium"): ((0.6, 0.6, 0.6), 110.0, 0.0),
        ("agentic", "low"): ((0.6, 0.6, 0.6), 95.0, 0.2),  # 0.73 x high, 20% over budget: both missed
    }
    models = [model("sft", "sft", None, None, sft)]
    for (d, e), (passes, tokens, over) in own.items():
        slices = [sl(d, ee, p, tokens if ee == e else 1.0, over if ee == e else 0.0, n=100)
                  for ee, p in zip(EFFORTS, passes)]
        models.append(model(f"teacher-{d}-{e}", "teacher", d, e, slices))
    student = [sl("general", e, p, 10.0, 0.0, n=100) for e, p in (("low", 0.2), ("medium", 0.3), ("high", 0.46))]
    student += [sl("agentic", e, 0.55, 90.0, 0.0, n=100) for e in EFFORTS]  # 5.0 points below: within
    models.append(model("student", "student", "mixed", "mixed", student))
    (tmp_path / "eval.json").write_text(json.dumps({"models": models}))
    runs = []
    for name, stage, samples in [("teacher-general-high", "rl", 300), ("teacher-agentic-low", "rl", 300),
                                 ("student", "mopd", 201)]:
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(json.dumps(
            {"iteration": 0, "stage": stage, "run": name, "samples": samples}) + "\n")
        runs.append(tmp_path / name)

    checks = {(c.criterion.split(" ")[0] + ":" + c.subject): c for c in acceptance(load_eval(tmp_path / "eval.json"),
                                                                                 _runs(runs))}
    beats = {k.split(":")[1]: c.met for k, c in checks.items() if k.startswith("teacher:")}
    assert beats == {"teacher-general-low": True, "teacher-general-medium": False, "teacher-general-high": True,
                     "teacher-agentic-low": True, "teacher-agentic-medium": True, "teacher-agentic-high": True}
    assert checks["teacher:teacher-general-high"].value == "0.350 vs 0.300 (+0.050, +1.3 SE; 3 slices, 300 tasks)"
    assert checks["tokens:general"].met is True
    assert checks["tokens:general"].value == "6.0 / 30.0 / 40.0 (low/high 0.15)"
    assert checks["tokens:agentic"].met is False and "(low/high 0.73)" in checks["tokens:agentic"].value
    assert checks["over-budget:teacher-agentic-low"].met is False
    assert checks["over-budget:teacher-agentic-high"].met is True
    # student vs the slice's own teacher: general/high 0.46 vs 0.5 (-4 points), general/low 0.2 vs 0.25 (-5)
    assert checks["student:general/high"].met is True and checks["student:general/high"].value == "-4.0 points"
    assert checks["student:general/low"].met is True and checks["student:general/low"].value == "-5.0 points"
    assert checks["student:agentic/low"].met is True
    assert checks["student:student"].met is False and checks["student:student"].value == "201 / 600 = 0.34"
    table = acceptance_table(list(checks.values()))
    met = sum(c.met is True for c in checks.values())
    assert table.splitlines()[-1] == f"{met} of {len(checks)} checks met, 4 missed"
    md = write_report(tmp_path / "eval.json", runs, tmp_path / "report").read_text()
    assert "## Acceptance" in md and "MISSED" in md and "teacher-general-medium" in md
