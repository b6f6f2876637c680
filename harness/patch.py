"""The apply_patch format Codex-style agents write, parsed and applied to file contents (pure functions).

    *** Begin Patch
    *** Add File: path/new.py          every following line starts with "+"
    +print("hi")
    *** Delete File: path/old.py
    *** Update File: path/app.py
    *** Move to: path/renamed.py       optional
    @@ def main():                     optional anchor: the hunk is searched after this line
     context line                      " " keeps, "-" removes, "+" adds
    -    x = 1
    +    x = 2
    *** End of File                    optional: the hunk must match at the end of the file
    *** End Patch

Hunks are located in order, each after the previous one, first by exact lines, then ignoring trailing
whitespace, then ignoring surrounding whitespace. Errors say which file and hunk failed and why.
"""

from __future__ import annotations

from dataclasses import dataclass, field

BEGIN, END = "*** Begin Patch", "*** End Patch"
ADD, DELETE, UPDATE, MOVE = "*** Add File: ", "*** Delete File: ", "*** Update File: ", "*** Move to: "
EOF_MARK = "*** End of File"


class PatchError(ValueError):
    pass


@dataclass
class Hunk:
    anchor: str | None
    old: list[str] = field(default_factory=list)
    new: list[str] = field(default_factory=list)
    at_eof: bool = False


@dataclass
class FileOp:
    kind: str  # add | delete | update
    path: str
    content: str = ""  # add: the new file
    move_to: str | None = None  # update: rename target
    hunks: list[Hunk] = field(default_factory=list)


def parse_patch(text: str) -> list[FileOp]:
    lines = text.strip("\n").split("\n")
    if not lines or lines[0].strip() != BEGIN:
        raise PatchError(f"a patch must start with the line {BEGIN!r}")
    if lines[-1].strip() != END:
        raise PatchError(f"a patch must end with the line {END!r}")
    ops: list[FileOp] = []
    i, n = 1, len(lines) - 1
    while i < n:
        line = lines[i]
        if line.startswith(ADD):
            op = FileOp("add", line[len(ADD) :].strip())
            i += 1
            body = []
            while i < n and not lines[i].startswith("*** "):
                if not lines[i].startswith("+"):
                    raise PatchError(f"Add File {op.path}: every line must start with '+', got {lines[i][:60]!r}")
                body.append(lines[i][1:])
                i += 1
            op.content = "\n".join(body) + ("\n" if body else "")
            ops.append(op)
        elif line.startswith(DELETE):
            ops.append(FileOp("delete", line[len(DELETE) :].strip()))
            i += 1
        elif line.startswith(UPDATE):
            op = FileOp("update", line[len(UPDATE) :].strip())
            i += 1
            if i < n and lines[i].startswith(MOVE):
                op.move_to = lines[i][len(MOVE) :].strip()
                i += 1
            hunk: Hunk | None = None
            while i < n and (not lines[i].startswith("*** ") or lines[i].strip() == EOF_MARK):
                ln = lines[i]
                if ln.strip() == EOF_MARK:
                    if hunk is None:
                        raise PatchError(f"Update File {op.path}: {EOF_MARK} before any hunk")
                    hunk.at_eof = True
                elif ln.startswith("@@"):
                    hunk = Hunk(ln[2:].strip() or None)
                    op.hunks.append(hunk)
                else:
                    if hunk is None:  # the first hunk's @@ line may be left out
                        hunk = Hunk(None)
                        op.hunks.append(hunk)
                    tag, rest = (ln[:1], ln[1:]) if ln else (" ", "")
                    if tag == " ":
                        hunk.old.append(rest)
                        hunk.new.append(rest)
                    elif tag == "-":
                        hunk.old.append(rest)
                    elif tag == "+":
                        hunk.new.append(rest)
                    else:
                        raise PatchError(
                            f"Update File {op.path}: hunk lines start with ' ', '-' or '+', got {ln[:60]!r}"
                        )
                i += 1
            if not op.hunks and op.move_to is None:
                raise PatchError(f"Update File {op.path}: no hunks")
            ops.append(op)
        elif not line.strip():
            i += 1
        else:
            raise PatchError(f"expected '{ADD}PATH', '{DELETE}PATH', '{UPDATE}PATH' or '{END}', got {line[:60]!r}")
    for op in ops:
        if not op.path:
            raise PatchError(f"a {op.kind} operation has an empty path")
    if not ops:
        raise PatchError("the patch changes no file")
    return ops


def _find(lines: list[str], block: list[str], start: int, at_eof: bool) -> int:
    if not block:
        return len(lines) if at_eof else start
    for norm in (lambda s: s, str.rstrip, str.strip):
        want = [norm(b) for b in block]
        last = len(lines) - len(block)
        candidates = [last] if at_eof else range(start, last + 1)
        for k in candidates:
            if k >= start and all(norm(lines[k + j]) == want[j] for j in range(len(block))):
                return k
    return -1


def apply_hunks(text: str, hunks: list[Hunk], path: str = "file") -> str:
    """Apply ``hunks`` to ``text`` in order; raise :class:`PatchError` naming the first hunk that does not fit."""
    ends_nl = text.endswith("\n")
    lines = text.split("\n") if text else []
    if ends_nl:
        lines.pop()
    cursor = 0
    for h_i, h in enumerate(hunks, 1):
        if h.anchor is not None:
            a = _find(lines, [h.anchor], cursor, False)
            if a < 0:
                raise PatchError(f"{path}: hunk {h_i}: anchor line {h.anchor!r} not found")
            cursor = a + 1
        k = _find(lines, h.old, cursor, h.at_eof)
        if k < 0:
            shown = "\n".join(h.old[:8]) + ("\n..." if len(h.old) > 8 else "")
            raise PatchError(
                f"{path}: hunk {h_i}: could not find these lines (in order, after the previous hunk):\n{shown}"
            )
        lines[k : k + len(h.old)] = h.new
        cursor = k + len(h.new)
    # keep the file's final-newline convention; a file that was empty gets one
    return "\n".join(lines) + ("\n" if lines and (ends_nl or not text) else "")
