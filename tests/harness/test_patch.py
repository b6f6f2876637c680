"""The apply_patch format: parsing and applying hunks (pure functions; the tool's sandbox side is in test_tools)."""

from __future__ import annotations

import pytest

from harness.patch import PatchError, apply_hunks, parse_patch

SRC = "import os\n\n\ndef main():\n    x = 1\n    print(x)\n\n\ndef other():\n    x = 1\n    return x\n"


def update(body: str, path: str = "app.py") -> str:
    return f"*** Begin Patch\n*** Update File: {path}\n{body}\n*** End Patch"


def test_add_delete_update_move_are_parsed():
    ops = parse_patch(
        "*** Begin Patch\n*** Add File: a.txt\n+one\n+\n+three\n*** Delete File: b.txt\n"
        "*** Update File: c.py\n*** Move to: d.py\n@@ def f():\n-    pass\n+    return 1\n*** End Patch\n"
    )
    assert [(o.kind, o.path) for o in ops] == [("add", "a.txt"), ("delete", "b.txt"), ("update", "c.py")]
    assert ops[0].content == "one\n\nthree\n"
    assert ops[2].move_to == "d.py" and ops[2].hunks[0].anchor == "def f():"
    assert (ops[2].hunks[0].old, ops[2].hunks[0].new) == (["    pass"], ["    return 1"])


def test_an_anchor_picks_which_of_two_identical_blocks_changes():
    ops = parse_patch(update("@@ def other():\n-    x = 1\n+    x = 2"))
    out = apply_hunks(SRC, ops[0].hunks)
    assert out == SRC.replace("    x = 1\n    return x", "    x = 2\n    return x")
    # without the anchor the first match changes
    ops = parse_patch(update("@@\n-    x = 1\n+    x = 2"))
    assert apply_hunks(SRC, ops[0].hunks) == SRC.replace("    x = 1\n    print", "    x = 2\n    print")


def test_hunks_apply_in_order_with_context_and_tolerate_trailing_whitespace():
    ops = parse_patch(
        update("@@\n def main():\n-    x = 1\n+    x = 10\n@@\n def other():\n-    x = 1   \n+    x = 20")
    )
    out = apply_hunks(SRC, ops[0].hunks)
    assert "    x = 10\n    print(x)" in out and "def other():\n    x = 20\n" in out


def test_end_of_file_hunks_match_at_the_end_and_newline_conventions_are_kept():
    ops = parse_patch(update("@@\n     return x\n+# end\n*** End of File"))
    assert apply_hunks(SRC, ops[0].hunks).endswith("    return x\n# end\n")
    assert apply_hunks("a\nb", parse_patch(update("@@\n-b\n+c"))[0].hunks) == "a\nc"  # no final newline kept
    assert apply_hunks("", parse_patch(update("@@\n+new"))[0].hunks) == "new\n"


@pytest.mark.parametrize(
    ("patch", "match"),
    [
        ("hello", "a patch must start with the line '\\*\\*\\* Begin Patch'"),
        ("*** Begin Patch\n*** Add File: a\n+x", "a patch must end with the line '\\*\\*\\* End Patch'"),
        ("*** Begin Patch\n*** End Patch", "the patch changes no file"),
        ("*** Begin Patch\n*** Add File: a\nno plus\n*** End Patch", "Add File a: every line must start with '\\+'"),
        ("*** Begin Patch\n*** Update File: a\n*** End Patch", "Update File a: no hunks"),
        ("*** Begin Patch\n*** Update File: a\n@@\n?x\n*** End Patch", "hunk lines start with ' ', '-' or '\\+'"),
        ("*** Begin Patch\n*** Frobnicate: a\n*** End Patch", "expected '\\*\\*\\* Add File: PATH'"),
        ("*** Begin Patch\n*** Delete File: \n*** End Patch", "a delete operation has an empty path"),
    ],
)
def test_malformed_patches_are_named(patch, match):
    with pytest.raises(PatchError, match=match):
        parse_patch(patch)


def test_a_hunk_that_does_not_fit_names_the_file_the_hunk_and_the_lines():
    ops = parse_patch(update("@@\n-    y = 3\n+    y = 4"))
    with pytest.raises(PatchError, match=r"app.py: hunk 1: could not find these lines .*\n    y = 3"):
        apply_hunks(SRC, ops[0].hunks, "app.py")
    ops = parse_patch(update("@@ def missing():\n-    x = 1\n+    x = 2"))
    with pytest.raises(PatchError, match="hunk 1: anchor line 'def missing\\(\\):' not found"):
        apply_hunks(SRC, ops[0].hunks, "app.py")
