"""Task suites for the three domains, synthetic by default, plus loaders for public formats.

``get_tasks(domain, split, n)`` returns the first n tasks of a suite's split (deterministic; train and held-out
never overlap). ``files`` (domain → (path, format) or (path, format, held-out path), a run's ``tasks.files``)
replaces those domains' suites with a task file's split (``envs.tasks.loaders``), or with the train file and the
held-out file where a dataset ships both: a file is finite, so its split may hold fewer than ``start + n`` tasks.
"""

from __future__ import annotations

from collections.abc import Mapping

from envs.tasks import agentic, coding, general
from envs.tasks.base import DOMAINS, SPLITS, Task, TaskError

SUITES = {"general": general, "agentic": agentic, "coding": coding}


def get_tasks(domain: str, split: str, n: int, start: int = 0,
              files: Mapping[str, tuple[str, ...]] | None = None) -> list[Task]:
    if domain not in SUITES:
        raise TaskError(f"unknown domain {domain!r}; valid domains: {list(DOMAINS)}")
    if n < 0 or start < 0:
        raise TaskError(f"n and start must be >= 0, got n={n} start={start}")
    if files and domain in files:
        return file_tasks(files, domain, split)[start:start + n]
    return [SUITES[domain].task(split, i) for i in range(start, start + n)]


def file_tasks(files: Mapping[str, tuple[str, ...]], domain: str, split: str) -> list[Task]:
    """Every task of ``domain``'s file in ``split``, in file order: the question-hash split of one file, or every
    record of the train file or of the held-out file where the entry names one, less the held-out records whose
    prompt the train file also holds (``heldout_overlap``)."""
    return _file_split(files, domain, split)[0]


def heldout_overlap(files: Mapping[str, tuple[str, ...]], domain: str) -> tuple[int, int]:
    """``(dropped, records)``: how many of ``domain``'s held-out file's records were left out of its held-out tasks
    because the train file holds the same prompt, of how many. A dataset's own split is taken as shipped, but a
    duplicated question on both sides would be evaluated after training on it; the question-hash split of one file
    can never do that (``envs.tasks.loaders``), and the own split now keeps the same promise. (0, 0) without one."""
    return _file_split(files, domain, "heldout")[1:]


def _file_split(files: Mapping[str, tuple[str, ...]], domain: str, split: str) -> tuple[list[Task], int, int]:
    from envs.tasks.loaders import DOMAIN_OF, load_split

    path, fmt, *rest = files[domain]
    heldout = rest[0] if rest else None
    if DOMAIN_OF.get(fmt) != domain:
        raise TaskError(f"task file {path}: format {fmt!r} makes {DOMAIN_OF.get(fmt)} tasks, not {domain} ones")
    if not heldout:
        return load_split(path, fmt, split), 0, 0
    if split == "train":
        return load_split(path, fmt, split, whole=split), 0, 0
    held = load_split(heldout, fmt, split, whole=split)
    trained = {_same(t.prompt) for t in load_split(path, fmt, "train", whole="train")}
    kept = [t for t in held if _same(t.prompt) not in trained]  # ids still name each record's row in its file
    return kept, len(held) - len(kept), len(held)


def _same(prompt: str) -> str:
    """A prompt as compared across the two files: whitespace runs are one space (a re-export that re-wraps or strips
    lines is still the same question)."""
    return " ".join(prompt.split())


__all__ = ["DOMAINS", "SPLITS", "SUITES", "Task", "TaskError", "file_tasks", "get_tasks", "heldout_overlap"]
