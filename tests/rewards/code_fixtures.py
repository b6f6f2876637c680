"""A small coding task (integer -> Roman numeral) with visible examples, held-out cases and a stateful
case, shared by the code grader's tests and the benchmark."""

from rewards.code.grader import CodeCase, CodeTask, sha256

VISIBLE_TESTS = """from solution import roman


def test_examples():
    assert roman(3) == "III"
    assert roman(4) == "IV"
    assert roman(9) == "IX"
    assert roman(58) == "LVIII"
"""

VISIBLE = [(3, "III"), (4, "IV"), (9, "IX"), (58, "LVIII")]
HIDDEN = [(1994, "MCMXCIV"), (3999, "MMMCMXCIX"), (444, "CDXLIV"), (1, "I"), (2024, "MMXXIV"), (40, "XL")]


def roman_task(**overrides) -> CodeTask:
    visible = [CodeCase(id=f"v{n}", call="roman", args=[n], expected=s) for n, s in VISIBLE]
    hidden = [CodeCase(id=f"h{n}", call="roman", args=[n], expected=s) for n, s in HIDDEN]
    hidden.append(
        CodeCase(
            id="h-batch",
            script="result = tuple(solution.roman(i) for i in (14, 90, 400))",
            expected=("XIV", "XC", "CD"),
        )
    )
    kw = dict(
        visible=visible,
        hidden=hidden,
        protected={"tests/test_visible.py": sha256(VISIBLE_TESTS)},
        timeout_s=3.0,
    )
    kw.update(overrides)
    return CodeTask(**kw)


def workspace_files(solution: str, **extra) -> dict:
    files = {"tests/test_visible.py": VISIBLE_TESTS, "README.md": "Implement roman(n) in solution.py\n"}
    if solution is not None:
        files["solution.py"] = solution
    files.update(extra)
    return files


HONEST = """def roman(n: int) -> str:
    table = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"),
             (50, "L"), (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]
    out = []
    for value, sym in table:
        while n >= value:
            out.append(sym)
            n -= value
    return "".join(out)
"""
