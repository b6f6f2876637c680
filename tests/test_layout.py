"""The one-way dependency rules of DESIGN.md §1, checked on the source by parsing imports."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROJECT = ("rlk3", "envs", "rewards", "harness")


def _project_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if n.split(".")[0] in PROJECT}


def _files(package: str) -> list[Path]:
    return sorted((ROOT / package.replace(".", "/")).rglob("*.py"))


# (package whose files are checked, forbidden import prefixes, allowed exceptions)
RULES = [
    ("rlk3.model", ("rlk3", "envs", "rewards", "harness"), ("rlk3.model",)),
    ("rlk3.engine", ("rlk3", "envs", "rewards", "harness"), ("rlk3.model", "rlk3.engine")),
    ("harness", ("rlk3.cluster", "rlk3.train"), ()),
    ("rewards", ("rlk3.cluster", "rlk3.train"), ()),
    ("envs", ("rlk3.cluster", "rlk3.train"), ()),
]


@pytest.mark.parametrize(("package", "forbidden", "allowed"), RULES, ids=[r[0] for r in RULES])
def test_dependencies_point_one_way(package, forbidden, allowed):
    offenders = []
    for f in _files(package):
        for name in _project_imports(f):
            if any(name == a or name.startswith(a + ".") for a in allowed):
                continue
            if any(name == p or name.startswith(p + ".") for p in forbidden):
                offenders.append(f"{f.relative_to(ROOT)} imports {name}")
    assert not offenders, "DESIGN.md §1 dependency rule broken:\n" + "\n".join(offenders)


def test_rule_checker_sees_a_violation(tmp_path):
    # the checker itself must be able to fail: a file importing rlk3.train is caught
    bad = tmp_path / "bad.py"
    bad.write_text("from rlk3.train import trainer\nimport os\n")
    assert "rlk3.train" in _project_imports(bad)
