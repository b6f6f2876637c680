"""Harness test fixtures: a tokenizer trained here (no cache involved) and the real sandbox server of tests/envs."""

from __future__ import annotations

import pytest

from harness.tokenizer import builtin_corpus, train_tokenizer

# the sandbox server fixture (a real `python -m envs.sandbox serve`, driven by the e2b SDK), shared with tests/envs
from tests.envs.conftest import server  # noqa: F401


@pytest.fixture(scope="session")
def tok():
    return train_tokenizer(builtin_corpus(), 4096)
