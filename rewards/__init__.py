"""Reward graders. Every grader assumes the policy cheats and checks from outside its workspace.

`get_grader(name)` is the one entry point task configs use; `validate_task` checks a task at config time.
"""

from rewards.base import Grade, Grader, GraderConfigError, SimpleTrajectory, TrajectoryLike
from rewards.registry import get_grader, grader_names, validate_task

__all__ = [
    "Grade",
    "Grader",
    "GraderConfigError",
    "SimpleTrajectory",
    "TrajectoryLike",
    "get_grader",
    "grader_names",
    "validate_task",
]
