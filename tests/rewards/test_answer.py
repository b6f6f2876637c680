"""Answer grader: the equivalence table, extraction from model formats, and garbage in bounded time."""

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rewards import SimpleTrajectory, get_grader
from rewards.answer import MAX_TEXT, AnswerTask, answers_equivalent, extract_answer

# (model answer, reference, equal?) — equal and unequal forms, units, fractions, LaTeX
TABLE = [
    # integers and decimals
    ("42", "42", True),
    ("42.0", "42", True),
    ("042", "42", True),
    ("-7", "-7", True),
    ("41", "42", False),
    ("4.2", "42", False),
    ("1,000,000", "1000000", True),
    ("1,000", "1001", False),
    ("3.14159", "3.14159", True),
    ("3.1416", "3.14159", False),
    ("1e3", "1000", True),
    ("2.5\\times 10^{3}", "2500", True),
    ("2.5\\times 10^{3}", "250", False),
    # fractions
    ("\\frac{1}{2}", "0.5", True),
    ("1/2", "\\frac{1}{2}", True),
    ("\\dfrac{3}{4}", "0.75", True),
    ("\\tfrac{2}{4}", "\\frac{1}{2}", True),
    ("-\\frac{1}{3}", "\\frac{-1}{3}", True),
    ("1/3", "0.333", False),
    ("\\frac{2}{3}", "\\frac{3}{2}", False),
    ("\\frac{1}{2}", "0.51", False),
    # percentages
    ("50\\%", "50", True),
    ("50%", "0.5", True),
    ("50\\%", "0.05", False),
    # units
    ("5 cm", "5", True),
    ("5\\text{ cm}", "5", True),
    ("5 cm", "5 m", False),
    ("12 \\text{ meters}", "12\\text{ m}", True),
    ("90^\\circ", "90", True),
    ("90°", "90^{\\circ}", True),
    ("45^\\circ", "90", False),
    ("\\$18.90", "18.90", True),
    ("18 dollars", "18", True),
    ("3 hours", "4 hours", False),
    # symbolic (LaTeX and plain)
    ("x^2+2x+1", "(x+1)^2", True),
    ("(x+1)^2", "x^2+2x", False),
    ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}", True),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{\\sqrt{3}}{2}", False),
    ("2\\sqrt{3}", "\\sqrt{12}", True),
    ("\\sqrt{8}", "3", False),
    ("\\pi", "\\pi", True),
    ("2\\pi", "\\pi + \\pi", True),
    ("\\pi", "3.14159", False),
    ("sqrt(2)", "\\sqrt{2}", True),
    ("\\frac{x}{2}+\\frac{x}{2}", "x", True),
    ("\\sin^2 x + \\cos^2 x", "1", True),
    ("e^{2}", "e^2", True),
    ("2^{10}", "1024", True),
    ("2^{10}", "1000", False),
    ("x = 5", "5", True),
    ("y = 2x+1", "1+2x", True),
    ("y = 2x+1", "2x-1", False),
    ("\\infty", "\\infty", True),
    ("\\left(\\frac{1}{2}\\right)", "\\frac{1}{2}", True),
    # sets, intervals, tuples, matrices
    ("\\{1,2,3\\}", "\\{3,2,1\\}", True),
    ("\\{1,2\\}", "\\{1,3\\}", False),
    ("[0,1)", "[0,1)", True),
    ("[0,1)", "(0,1]", False),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}", True),
    ("\\begin{pmatrix}1\\\\2\\end{pmatrix}", "\\begin{pmatrix}2\\\\1\\end{pmatrix}", False),
    # text / multiple choice
    ("(B)", "B", True),
    ("B", "C", False),
    ("\\text{yes}", "Yes", True),
    ("no", "yes", False),
]


def test_table_is_big_enough():
    assert len(TABLE) >= 60
    assert sum(1 for *_, eq in TABLE if not eq) >= 20  # unequal forms are half the point


@pytest.mark.parametrize(("pred", "ref", "equal"), TABLE, ids=[f"{p}|{r}" for p, r, _ in TABLE])
def test_equivalence_table(pred, ref, equal):
    got, how = answers_equivalent(pred, ref)
    assert got is equal, f"{pred!r} vs {ref!r}: got {got} via {how}"


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so the result is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("first \\boxed{3} then corrected: \\boxed{4}", "4"),
        ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{\\sqrt{2}}{2}"),
        ("Working...\nThe final answer is $12$.", "12"),
        ("Answer: 7 apples", "7 apples"),
        ("blah\n#### 1,234", "1,234"),
        ("I computed 3 and then 5 and finally 11", "11"),
        ("no numbers here at all", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extraction(text, expected):
    assert extract_answer(text) == expected


def _traj(text):
    return SimpleTrajectory(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": text}])


def test_grader_end_to_end_and_reasons():
    g = get_grader("answer")
    task = AnswerTask(answer="\\frac{3}{4}")
    ok = g.grade(task, _traj("... therefore \\boxed{0.75}"))
    assert ok.passed and ok.score == 1.0 and ok.details["method"] == "numeric"
    bad = g.grade(task, _traj("\\boxed{0.7}"))
    assert bad.score == 0.0 and bad.reason_codes() == {"wrong_answer"}
    none = g.grade(task, _traj("I don't know"))
    assert none.score == 0.0 and none.reason_codes() == {"no_answer"}
    # content as a list of parts, as bytes (invalid UTF-8), and a trajectory with no assistant turn
    parts = SimpleTrajectory(messages=[{"role": "assistant", "content": [{"type": "text", "text": "\\boxed{3/4}"}]}])
    assert g.grade(task, parts).passed
    raw = SimpleTrajectory(messages=[{"role": "assistant", "content": b"\xff\xfe \\boxed{3/4} \xc3"}])
    assert g.grade(task, raw).passed
    assert g.grade(task, SimpleTrajectory(messages=[{"role": "user", "content": "x"}])).score == 0.0


def test_huge_output_is_bounded():
    g = get_grader("answer")
    task = AnswerTask(answer="5")
    text = ("\\boxed{" * 200_000) + "x" * (4 << 20) + "\\boxed{5}"
    t0 = time.monotonic()
    grade = g.grade(task, _traj(text))
    assert grade.passed  # the answer at the end is still found: only the tail is read
    assert len(text) > MAX_TEXT
    assert time.monotonic() - t0 < 30  # generous bound on a 2-core box; the real limit is per-stage


def test_pathological_symbolic_input_hits_the_limit():
    # a huge power tower makes sympy work without end; the worker process is killed at the limit
    task = AnswerTask(answer="x", symbolic_timeout_s=0.5)
    pred = "(" + "x^{" * 40 + "2" + "}" * 40 + ")!!!"
    eq, how = answers_equivalent(pred, "(x+1)^{99999}", task)
    assert eq is False
    assert how in ("symbolic timeout", "symbolic mismatch") or how.startswith("error")


GARBAGE = st.one_of(
    st.text(max_size=3000),
    st.binary(max_size=3000).map(lambda b: b.decode("utf-8", errors="replace")),
    st.lists(
        st.sampled_from(
            [
                "\\frac{",
                "}",
                "{",
                "\\boxed{",
                "^",
                "\\sqrt",
                "x",
                "9" * 50,
                "(",
                ")",
                "\\left",
                "%",
                "\\text{",
                "$",
                "=",
                "e",
                "!",
                "\\infty",
                ",",
                "\\\\",
            ]
        ),
        max_size=300,
    ).map("".join),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=GARBAGE, ref=st.sampled_from(["42", "\\frac{1}{2}", "x^2+1", "\\{1,2\\}", "B"]))
def test_fuzz_garbage_never_raises_and_stays_within_limit(text, ref):
    g = get_grader("answer")
    task = AnswerTask(answer=ref, symbolic_timeout_s=1.0)
    t0 = time.monotonic()
    grade = g.grade(task, _traj(text))
    elapsed = time.monotonic() - t0
    assert isinstance(grade.score, float) and grade.score in (0.0, 1.0)
    # the symbolic limit plus worker restart and spawn overhead; a hang would blow far past this
    assert elapsed < task.symbolic_timeout_s + 15.0
