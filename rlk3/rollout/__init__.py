"""Trajectories, the multi-turn agent loop, and the partial-rollout scheduler."""

from rlk3.rollout.trajectory import Status, Trajectory

__all__ = ["Status", "Trajectory"]
