"""Harness test fixtures: a tokenizer trained here (no cache involved) and a real sandbox server."""

from __future__ import annotations

import os

import pytest

from harness.tokenizer import builtin_corpus, train_tokenizer

# the sandbox tests' own server launcher: a real `python -m envs.sandbox serve`, driven through the e2b SDK
from tests.envs.conftest import kill_all, start_server


@pytest.fixture(scope="session")
def tok():
    return train_tokenizer(builtin_corpus(), 4096)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    # tests/envs' fixture of the same name also points the process's E2B_* variables at its server; this one
    # changes no environment (the harness tests pass the URL explicitly), so the two never interfere
    if os.geteuid() != 0:
        pytest.fail("the sandbox tests need root (namespaces, cgroups, mounts): run them as root, as CI does")
    srv = start_server(tmp_path_factory.mktemp("harness-sbx") / "state")
    yield srv
    kill_all(srv)
    srv.stop()
