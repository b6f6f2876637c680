"""Skills: named instruction snippets the model loads on demand through a tool.

A skill is a Markdown file with a small YAML header::

    ---
    name: python-testing
    description: Write and run pytest tests in the sandbox
    ---
    (the instructions)

The system prompt lists the enabled skills by name and description only; the body enters the context when
the model asks for it, which is what keeps many skills cheap. Built-in skills live in ``harness/skills/``;
more directories can be added (later ones override earlier ones by name).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

BUILTIN_DIR = Path(__file__).with_name("skills")
_NAME = re.compile(r"[a-z0-9][a-z0-9_\-]{0,63}\Z")


@dataclass(frozen=True)
class Skill:
    name: str
    description: str
    body: str


def parse_skill(text: str, source: str) -> Skill:
    if not text.startswith("---\n"):
        raise ValueError(f"{source}: a skill file starts with a '---' YAML header (name, description)")
    end = text.find("\n---\n", 4)
    if end < 0:
        raise ValueError(f"{source}: the YAML header is not closed by a '---' line")
    head = yaml.safe_load(text[4:end]) or {}
    if not isinstance(head, dict):
        raise ValueError(f"{source}: the header must be a mapping with name and description")
    unknown = sorted(set(head) - {"name", "description"})
    if unknown:
        raise ValueError(f"{source}: unknown header key(s) {unknown}; valid: name, description")
    name, desc = head.get("name"), head.get("description")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"{source}: name must be lowercase letters, digits, '-' or '_' (got {name!r})")
    if not isinstance(desc, str) or not desc.strip():
        raise ValueError(f"{source}: description must be a non-empty string (got {desc!r})")
    body = text[end + len("\n---\n") :].strip()
    if not body:
        raise ValueError(f"{source}: the skill has no body")
    return Skill(name, desc.strip(), body)


class SkillLibrary:
    """Skills by name, loaded from directories of ``*.md`` files."""

    def __init__(self, skills: dict[str, Skill] | None = None) -> None:
        self.skills: dict[str, Skill] = dict(skills or {})

    @classmethod
    def load(cls, *dirs: str | Path) -> SkillLibrary:
        lib: dict[str, Skill] = {}
        for d in (BUILTIN_DIR, *dirs):
            d = Path(d)
            if not d.is_dir():
                raise ValueError(f"skills directory {d} does not exist")
            for f in sorted(d.glob("*.md")):
                s = parse_skill(f.read_text(), str(f))
                lib[s.name] = s
        return cls(lib)

    def names(self) -> list[str]:
        return sorted(self.skills)

    def subset(self, names: list[str]) -> SkillLibrary:
        missing = [n for n in names if n not in self.skills]
        if missing:
            raise ValueError(f"unknown skill(s) {missing}; available: {', '.join(self.names()) or 'none'}")
        return SkillLibrary({n: self.skills[n] for n in names})

    def index(self) -> str:
        """The lines the system prompt shows: one per skill."""
        return "\n".join(f"- {s.name}: {s.description}" for s in self.skills.values())

    def get(self, name: str) -> str:
        """The body of skill ``name``, or an error message for the model naming the valid skills."""
        s = self.skills.get(name)
        if s is None:
            return f"Error: no skill named {name[:80]!r}; available skills: {', '.join(self.names()) or 'none'}"
        return f"# Skill: {s.name}\n\n{s.body}"
