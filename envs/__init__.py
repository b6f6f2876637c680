"""Sandbox runtime (E2B-compatible API) and task environments for agentic rollouts."""
