"""One registry: task configs name a grader, `get_grader(name)` builds it.

Built-in graders are registered by dotted path and imported on first use, so naming `answer` does not
import torch (kernel) or probe Chromium (webdev). A name containing ':' is a dotted path to a custom grader
class (`package.module:Class`), loaded by the same helper.
"""

from __future__ import annotations

import importlib
from typing import Any

from rewards.base import Grader, GraderConfigError

BUILTIN: dict[str, str] = {
    "answer": "rewards.answer:AnswerGrader",
    "code": "rewards.code.grader:CodeGrader",
    "command": "rewards.command:CommandGrader",
    "kernel": "rewards.kernel.grader:KernelGrader",
    "webdev": "rewards.webdev.grader:WebdevGrader",
    "effort": "rewards.effort:EffortGrader",
}


def grader_names() -> list[str]:
    return sorted(BUILTIN)


def load_dotted(path: str) -> Any:
    """`package.module:Attr` -> the attribute."""
    module, _, attr = path.partition(":")
    if not module or not attr:
        raise GraderConfigError(f"dotted path {path!r} must look like 'package.module:Name'")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as e:
        raise GraderConfigError(f"cannot load grader {path!r}: {e}") from e


def get_grader(name: str, **kwargs: Any) -> Grader:
    """Build the grader registered as `name` (or at dotted path `name`). Unknown names fail here, with
    the list of valid ones."""
    if not isinstance(name, str) or not name:
        raise GraderConfigError(
            f"grader name must be a non-empty string, got {name!r}; valid graders: {', '.join(grader_names())}"
        )
    if name in BUILTIN:
        cls = load_dotted(BUILTIN[name])
    elif ":" in name:
        cls = load_dotted(name)
    else:
        raise GraderConfigError(
            f"unknown grader {name!r}; valid graders: {', '.join(grader_names())} "
            "(or a dotted path 'package.module:Class')"
        )
    return cls(**kwargs)


def validate_task(grader_name: str, task: Any, **grader_kwargs: Any) -> Grader:
    """Config-time check of one task: the grader exists, its pristine assets are present and the task's
    fields are usable. Returns the built grader. Raises `GraderConfigError` naming what is wrong."""
    grader = get_grader(grader_name, **grader_kwargs)
    try:
        grader.validate(task)
    except GraderConfigError:
        raise
    except Exception as e:  # a validator bug must still surface as a config error with the grader's name
        raise GraderConfigError(f"grader {grader_name!r}: task validation failed: {e}") from e
    return grader
