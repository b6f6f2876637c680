"""Memories (bounded notes per task group, persistent, safe under concurrent writers) and skills (parsed,
listed, loaded by name)."""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.memory import MemoryStore
from harness.skills import BUILTIN_DIR, SkillLibrary, parse_skill


def test_notes_persist_per_group_and_respect_their_bounds(tmp_path):
    store = MemoryStore(tmp_path, max_chars=60, max_note_chars=20)
    a = store.notes("agentic/locate-value")
    assert a.view() == "(no notes yet)"
    assert a.add("  look in conf.d  ").startswith("Noted (17/60")
    assert a.read() == "- look in conf.d\n"
    assert a.add("x" * 21) == "Error: a note may have at most 20 characters; this one has 21"
    assert a.add("   ") == "Error: the note is empty"
    assert a.add("b" * 20).startswith("Noted")
    assert a.add("c" * 20).startswith("Error: the notes would grow to 63 characters, over the limit of 60")
    assert a.read() == "- look in conf.d\n- " + "b" * 20 + "\n"  # the refused note changed nothing
    assert a.replace("y" * 61) == "Error: notes may have at most 60 characters; the replacement has 61"
    assert a.replace("short summary\n").startswith("Notes replaced (14/60")
    # another store over the same directory (a later process) sees the same notes; other groups do not
    assert MemoryStore(tmp_path).notes("agentic/locate-value").read() == "short summary\n"
    assert MemoryStore(tmp_path).notes("agentic/locate_value").read() == ""  # similar names never collide
    with pytest.raises(ValueError, match="a memory group must be a non-empty string, got ''"):
        store.notes("")


def test_excerpt_keeps_the_most_recent_whole_lines(tmp_path):
    n = MemoryStore(tmp_path, max_chars=1000).notes("g")
    for i in range(10):
        n.add(f"note number {i}")
    ex = n.excerpt(40)
    assert ex == "- note number 8\n- note number 9\n" and len(ex) <= 40


def _add_many(args):
    root, worker = args
    notes = MemoryStore(root, max_chars=100_000).notes("shared")
    for i in range(25):
        assert notes.add(f"w{worker}-{i}").startswith("Noted")


def test_concurrent_writers_lose_no_note(tmp_path):
    # threads in one process and separate processes, all adding to the same group's notes at once
    with ThreadPoolExecutor(4) as ex:
        list(ex.map(_add_many, [(tmp_path, w) for w in range(4)]))
    # fork: the workers need only the memory module, and re-importing the harness in each would be slow
    with mp.get_context("fork").Pool(2) as pool:
        pool.map(_add_many, [(tmp_path, w) for w in range(4, 6)])
    lines = MemoryStore(tmp_path).notes("shared").read().splitlines()
    assert sorted(lines) == sorted(f"- w{w}-{i}" for w in range(6) for i in range(25))


def test_builtin_skills_parse_and_load_by_name():
    lib = SkillLibrary.load()
    assert {"python-testing", "debugging", "file-search", "apply-patch", "final-answer"} <= set(lib.names())
    assert len(list(BUILTIN_DIR.glob("*.md"))) == len(lib.names())
    sub = lib.subset(["debugging", "final-answer"])
    assert sub.index().splitlines() == [
        "- debugging: A short loop for finding why a program or command fails",
        "- final-answer: How to report a final answer so that it is graded correctly",
    ]
    assert sub.get("debugging").startswith("# Skill: debugging\n\n1. Reproduce")
    assert sub.get("python-testing") == (
        "Error: no skill named 'python-testing'; available skills: debugging, final-answer"
    )


def test_extra_skill_directories_add_and_override(tmp_path):
    (tmp_path / "mine.md").write_text("---\nname: debugging\ndescription: my own way\n---\nPrint everything.\n")
    (tmp_path / "new.md").write_text("---\nname: sql\ndescription: query tips\n---\nUse EXPLAIN.\n")
    lib = SkillLibrary.load(tmp_path)
    assert lib.get("debugging") == "# Skill: debugging\n\nPrint everything." and "sql" in lib.names()
    with pytest.raises(ValueError, match=r"skills directory .*/absent does not exist"):
        SkillLibrary.load(tmp_path / "absent")


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("no header", "starts with a '---' YAML header"),
        ("---\nname: a\n", "the YAML header is not closed"),
        ("---\nname: a\ndescription: d\nauthor: me\n---\nbody", r"unknown header key\(s\) \['author'\]"),
        ("---\nname: Bad Name\ndescription: d\n---\nbody", "name must be lowercase letters, digits"),
        ("---\nname: ok\ndescription: ''\n---\nbody", "description must be a non-empty string"),
        ("---\nname: ok\ndescription: d\n---\n  \n", "the skill has no body"),
    ],
)
def test_malformed_skill_files_are_named(text, match):
    with pytest.raises(ValueError, match=match):
        parse_skill(text, "x.md")
