"""Helpers shared by the sandbox tests (fixtures live in conftest.py)."""

from __future__ import annotations

BACKENDS = ("bwrap", "gvisor")
BACKEND_KEY = "rlk3.backend"  # the create request's metadata key that picks the backend


def on(backend: str, **metadata: str) -> dict[str, str]:
    """Sandbox metadata asking the server for ``backend``."""
    return {BACKEND_KEY: backend, **metadata}
