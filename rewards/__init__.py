"""Reward graders. Every grader assumes the policy cheats and checks from outside its workspace."""
