"""Memories: a notes file per task group that persists across episodes.

An episode sees the group's notes in its system prompt (the most recent part, up to ``inject_chars``) and can
view, add or replace them with the memory tool. Notes are bounded (``max_chars`` in all, ``max_note_chars`` per
added note), and a write that would exceed the bound is refused with a message saying so, rather than silently
dropping old notes. Files live under one directory, ``<dir>/<group>.md``; writes take an exclusive ``flock`` and
replace the file atomically, so concurrent episodes (threads, asyncio tasks or processes on one machine) never
see a half-written file and never lose a note to a lost update.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

_SAFE = re.compile(r"[^A-Za-z0-9_.\-]+")


def _file_name(group: str) -> str:
    # readable and collision-free: a sanitized prefix plus a hash of the exact group name
    stem = _SAFE.sub("_", group)[:60].strip("._") or "group"
    return f"{stem}-{hashlib.sha1(group.encode()).hexdigest()[:8]}.md"


@dataclass
class MemoryNotes:
    path: Path
    max_chars: int = 4000
    max_note_chars: int = 1000

    @contextmanager
    def _locked(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path.with_suffix(".lock"), "a") as lk:
            fcntl.flock(lk, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lk, fcntl.LOCK_UN)

    def read(self) -> str:
        try:
            return self.path.read_text()
        except FileNotFoundError:
            return ""

    def _write(self, text: str) -> None:
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, self.path)

    def view(self) -> str:
        text = self.read()
        return text if text else "(no notes yet)"

    def add(self, note: str) -> str:
        note = note.strip()
        if not note:
            return "Error: the note is empty"
        if len(note) > self.max_note_chars:
            return f"Error: a note may have at most {self.max_note_chars} characters; this one has {len(note)}"
        with self._locked():
            cur = self.read()
            new = cur + ("" if not cur or cur.endswith("\n") else "\n") + f"- {note}\n"
            if len(new) > self.max_chars:
                return (
                    f"Error: the notes would grow to {len(new)} characters, over the limit of {self.max_chars}; "
                    "replace them with a shorter version first"
                )
            self._write(new)
        return f"Noted ({len(new)}/{self.max_chars} characters used)."

    def replace(self, text: str) -> str:
        if len(text) > self.max_chars:
            return f"Error: notes may have at most {self.max_chars} characters; the replacement has {len(text)}"
        with self._locked():
            self._write(text)
        return f"Notes replaced ({len(text)}/{self.max_chars} characters used)."

    def excerpt(self, n: int) -> str:
        """The last ``n`` characters of the notes, cut at a line start, for the system prompt."""
        text = self.read()
        if len(text) <= n:
            return text
        tail = text[-n:]
        cut = tail.find("\n")
        return tail[cut + 1 :] if 0 <= cut < len(tail) - 1 else tail


class MemoryStore:
    """One directory of notes files, one per task group."""

    def __init__(self, root: str | os.PathLike, max_chars: int = 4000, max_note_chars: int = 1000) -> None:
        self.root = Path(root)
        self.max_chars = max_chars
        self.max_note_chars = max_note_chars

    def notes(self, group: str) -> MemoryNotes:
        if not isinstance(group, str) or not group:
            raise ValueError(f"a memory group must be a non-empty string, got {group!r}")
        return MemoryNotes(self.root / _file_name(group), self.max_chars, self.max_note_chars)
