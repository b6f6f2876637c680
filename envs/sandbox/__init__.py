"""Sandbox runtime (placeholder docstring, replaced below)."""
