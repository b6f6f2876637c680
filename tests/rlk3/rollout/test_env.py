"""RolloutEnv against a real sandbox server that requires an API key (``cluster.sandbox_api_key``)."""

import asyncio

import pytest

from envs.sandbox.launch import LocalServer
from envs.tasks.base import Task
from harness.tokenizer import default_tokenizer
from rlk3.rollout.env import RolloutEnv


@pytest.fixture(scope="module")
def keyed_server(tmp_path_factory):
    server = LocalServer(tmp_path_factory.mktemp("keyed") / "state", pool=0, extra=("--api-key", "s3cret")).start()
    yield server
    server.stop()


def _create(env: RolloutEnv) -> str:
    async def go():
        task = Task(task_id="t", domain="coding", prompt="p", grader="code", grading={}, template="python")
        sid = await env.sandboxes.create(task, "/workspace")
        await env.sandboxes.client.kill(sid)
        return sid

    return asyncio.run(go())


def test_the_sandbox_api_key_reaches_the_tools_client_and_the_graders(keyed_server, monkeypatch):
    """``cluster.sandbox_api_key`` was in the schema but read by nothing: the client sent $E2B_API_KEY (or a
    placeholder), so a server that requires a key refused every sandbox."""
    monkeypatch.delenv("E2B_API_KEY", raising=False)
    tok = default_tokenizer()
    with RolloutEnv(tok, domains=("coding",), sandbox_url=keyed_server.url) as env, \
            pytest.raises(Exception, match=r"401|X-API-KEY|nauthori"):
        _create(env)
    with RolloutEnv(tok, domains=("coding",), sandbox_url=keyed_server.url, sandbox_api_key="s3cret") as env:
        assert _create(env)
        provider = env.grading.kwargs["code"]["sandboxes"]
        assert provider.cfg.api_key == "s3cret"
