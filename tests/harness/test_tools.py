"""Tools against a real sandbox (the envs server driven through envs.sandbox.client.SandboxClient), a few
end-to-end turns through the Harness API, and the never-raise guarantee."""

from __future__ import annotations

import asyncio
import json

import pytest

from envs.sandbox.client import SandboxClient, SandboxSettings
from harness import Harness, ToolCall
from harness.harness import ZWSP, Parsed
from harness.tokenizer import IM_ASSISTANT, IM_END


def in_sandbox(server, fn, template: str = "base"):
    """Run ``fn(client, sid)`` against a fresh sandbox of ``template``; the sandbox is killed afterwards."""

    async def main():
        client = SandboxClient(SandboxSettings.local(server.url))
        sid = await client.create(template)
        try:
            return await fn(client, sid)
        finally:
            await client.kill(sid)

    return asyncio.run(main())


def test_claude_code_file_and_shell_tools(server, tok):
    h = Harness("claude_code", tok)
    t = {tool.name: tool for tool in h.tools}

    async def body(client, sid):
        ctx = h.context(client, sid)

        async def run(name, **args):
            return await t[name](args, ctx)

        r = await run("Write", file_path="src/app.py", content="x = 1\ny = 2\nx = 1\n")
        assert r.text == "Wrote 18 bytes (3 lines) to /home/user/src/app.py" and not r.is_error
        assert (await client.read(sid, "/home/user/src/app.py")) == b"x = 1\ny = 2\nx = 1\n"
        r = await run("Read", file_path="/home/user/src/app.py")
        assert r.text == "     1\tx = 1\n     2\ty = 2\n     3\tx = 1"
        r = await run("Read", file_path="src/app.py", offset=2, limit=1)
        assert r.text == "     2\ty = 2\n[lines 2-2 of 3; use offset and limit to read more]"
        r = await run("Read", file_path="src/app.py", offset=9)
        assert r.is_error and "offset must be between 1 and 3" in r.text
        r = await run("Read", file_path="nope.txt")
        assert r.is_error and r.text.startswith("Error: cannot read /home/user/nope.txt") and "No such file" in r.text
        await client.write(sid, "/home/user/blob.bin", b"\x00\x01\x02")
        r = await run("Read", file_path="blob.bin")
        assert r.text == "Error: /home/user/blob.bin is a binary file (3 bytes)"

        # Edit: exact string replace, failing clearly on 0 and on >1 matches
        r = await run("Edit", file_path="src/app.py", old_string="z = 3", new_string="z = 4")
        assert r.is_error and "was not found in /home/user/src/app.py" in r.text
        r = await run("Edit", file_path="src/app.py", old_string="x = 1", new_string="x = 5")
        assert r.is_error and "occurs 2 times" in r.text and "replace_all" in r.text
        assert (await client.read(sid, "/home/user/src/app.py")) == b"x = 1\ny = 2\nx = 1\n"  # unchanged
        r = await run("Edit", file_path="src/app.py", old_string="y = 2", new_string="y = 20")
        assert not r.is_error and "replaced 1 occurrence" in r.text
        r = await run("Edit", file_path="src/app.py", old_string="x = 1", new_string="x = 5", replace_all=True)
        assert "replaced 2 occurrence" in r.text
        assert (await client.read(sid, "/home/user/src/app.py")) == b"x = 5\ny = 20\nx = 5\n"

        await client.write(sid, "/home/user/src/util.py", "def helper():\n    return 'X = 9'\n")
        await client.write(sid, "/home/user/notes.md", "x marks\n")
        r = await run("Glob", pattern="**/*.py")
        assert r.text == "/home/user/src/app.py\n/home/user/src/util.py"
        r = await run("Glob", pattern="*.none")
        assert r.text == "No files match."
        r = await run("Grep", pattern=r"x = \d")
        assert r.text == "/home/user/src/app.py:1:x = 5\n/home/user/src/app.py:3:x = 5"
        r = await run("Grep", pattern="x = ", **{"-i": True, "output_mode": "files_with_matches"})
        assert r.text == "/home/user/src/app.py\n/home/user/src/util.py"
        r = await run("Grep", pattern="x", glob="*.md", output_mode="count")
        assert r.text == "/home/user/notes.md:1"
        r = await run("Grep", pattern="(unclosed")
        assert r.text.startswith("Error: invalid regular expression")

        r = await run("Bash", command="echo out; echo err >&2; exit 3")
        assert r.text == "out\n[stderr]\nerr\n[exit code: 3]"
        r = await run("Bash", command="pwd")
        assert r.text == "/home/user\n"
        r = await run("Bash", command="sleep 30", timeout=1500)
        assert r.is_error and "did not finish within 1.5 s" in r.text
        # a huge output comes back bounded, head and tail kept, with a marker saying how much was cut
        r = await run("Bash", command="python3 -c \"print('A' * 500000); print('TAIL')\"")
        assert len(r.text) <= h.preset.limits.max_output_chars and "characters truncated" in r.text
        assert r.text.startswith("AAAA") and r.text.rstrip().endswith("TAIL")
        r = await run("Submit", answer="42")
        assert r.submitted == "42" and r.text == "Answer submitted."

    in_sandbox(server, body)


def test_codex_shell_argv_and_apply_patch(server, tok):
    h = Harness("codex", tok)
    shell, patch = (next(t for t in h.tools if t.name == n) for n in ("shell", "apply_patch"))

    async def body(client, sid):
        ctx = h.context(client, sid)
        r = await shell({"command": ["bash", "-lc", "mkdir -p proj && echo hi > proj/a.txt && ls proj"]}, ctx)
        assert r.text == "a.txt\n"
        r = await shell({"command": ["cat", "a.txt"], "workdir": "proj"}, ctx)
        assert r.text == "hi\n"
        r = await shell({"command": ["ls", "missing dir"]}, ctx)
        assert "[exit code: 2]" in r.text and "missing dir" in r.text  # argv quoting keeps the space
        await client.write(sid, "/home/user/proj/app.py", "def main():\n    x = 1\n    return x\n")
        good = (
            "*** Begin Patch\n"
            "*** Add File: proj/new.txt\n+first\n+second\n"
            "*** Update File: proj/app.py\n*** Move to: proj/main.py\n@@ def main():\n-    x = 1\n+    x = 2\n"
            "*** Delete File: proj/a.txt\n"
            "*** End Patch"
        )
        r = await patch({"input": good}, ctx)
        assert not r.is_error, r.text
        assert r.text == (
            "Done. Changed files:\nA /home/user/proj/new.txt\nM /home/user/proj/app.py -> /home/user/proj/main.py\n"
            "D /home/user/proj/a.txt"
        )
        assert (await client.read(sid, "/home/user/proj/new.txt")) == b"first\nsecond\n"
        assert (await client.read(sid, "/home/user/proj/main.py")) == b"def main():\n    x = 2\n    return x\n"
        assert sorted(await client.list(sid, "/home/user/proj")) == ["main.py", "new.txt"]
        # a hunk that does not fit changes nothing, not even the files before it in the patch
        bad = (
            "*** Begin Patch\n*** Add File: proj/other.txt\n+x\n"
            "*** Update File: proj/main.py\n@@\n-    y = 7\n+    y = 8\n*** End Patch"
        )
        r = await patch({"input": bad}, ctx)
        assert r.is_error and "hunk 1: could not find these lines" in r.text and "y = 7" in r.text
        assert sorted(await client.list(sid, "/home/user/proj")) == ["main.py", "new.txt"]
        r = await patch({"input": "patch me"}, ctx)
        assert r.text == "Error: invalid patch: a patch must start with the line '*** Begin Patch'"

    in_sandbox(server, body)


def test_hermes_python_skills_memory_and_subagents_across_episodes(server, tok, tmp_path):
    h = Harness("hermes", tok, memory_dir=tmp_path)
    t = {tool.name: tool for tool in h.tools}
    spawned = []

    async def subagent(prompt, description, subagent_type):
        spawned.append((prompt, description))
        return "subagent report: 3 files"

    async def body(client, sid):
        ep1 = h.context(client, sid, group="agentic/locate", subagent=subagent)
        r = await t["execute_code"]({"code": "import sys\nprint(sum(range(10)))\nsys.exit(4)"}, ep1)
        assert r.text == "45\n[exit code: 4]"
        r = await t["skill_view"]({"name": "debugging"}, ep1)
        assert r.text.startswith("# Skill: debugging") and "Reproduce" in r.text
        r = await t["skill_view"]({"name": "nope"}, ep1)
        assert r.is_error and "available skills: debugging, file-search, final-answer, python-testing" in r.text
        r = await t["delegate_task"]({"goal": "count files", "context": "survey"}, ep1)
        assert r.text == "subagent report: 3 files" and spawned == [("count files", "survey")]
        r = await t["memory"]({"action": "add", "content": "configs live in /etc/app"}, ep1)
        assert r.text.startswith("Noted")
        r = await t["memory"]({"action": "add", "content": "x" * 501}, ep1)
        assert r.is_error and "at most 500 characters" in r.text
        r = await t["memory"]({"action": "add"}, ep1)
        assert r.is_error and "needs content" in r.text

        # the next episode of the same task group sees the note, in its system prompt and through the tool
        ep2 = h.context(client, sid, group="agentic/locate")
        assert "- configs live in /etc/app" in h.system_prompt("low", group="agentic/locate")
        assert (await t["memory"]({"action": "view"}, ep2)).text == "- configs live in /etc/app\n"
        r = await t["delegate_task"]({"goal": "x"}, ep2)  # this episode's loop gave no subagent callback
        assert r.text == "Error: subagents are not available in this episode"
        # another group does not
        ep3 = h.context(client, sid, group="coding/fix")
        assert (await t["memory"]({"action": "view"}, ep3)).text == "(no notes yet)"
        assert "(no notes yet)" in h.system_prompt("low", group="coding/fix")

    in_sandbox(server, body)
    # a new Harness (a new process, say) over the same directory sees the same notes
    again = Harness("hermes", tok, memory_dir=tmp_path)
    assert "- configs live in /etc/app" in again.system_prompt("high", group="agentic/locate")


@pytest.mark.parametrize("preset", ["kimi_code", "openclaw", "minimal"])
def test_one_agent_turn_end_to_end(server, tok, tmp_path, preset):
    """start -> render -> (model output) -> parse -> execute -> continuation, as the agent loop runs it."""
    h = Harness(preset, tok, memory_dir=tmp_path)
    shell = next(t for t in h.tools if t.kind.name == "shell")
    msgs = h.start("How many lines does /etc/hostname-copy have?", effort="low", budget=512, group="g")
    prompt_ids = h.render(msgs)
    assert prompt_ids[-1] == tok.convert_tokens_to_ids(IM_ASSISTANT)
    # the "model" writes a call in the preset's syntax; the engine hands back its ids, decoded with specials
    wanted = ToolCall(shell.name, {shell.rename["command"]: "printf 'a\\nb\\n' > f && wc -l < f; echo '<|im_end|>'"})
    call_msg = {"role": "assistant", "content": "Counting.", "tool_calls": [wanted.to_message()]}
    text = h.render_text([*msgs, call_msg], add_generation_prompt=False)
    gen_ids = tok.encode(text, add_special_tokens=False)[len(prompt_ids) :]
    completion = tok.decode(gen_ids, skip_special_tokens=False)
    assert completion.endswith(IM_END)

    async def body(client, sid):
        parsed = h.parse(completion)
        assert parsed.error is None and [(c.name, c.arguments) for c in parsed.calls] == [
            (wanted.name, wanted.arguments)
        ]
        msgs.append(parsed.message())
        n = len(msgs)
        result = await h.execute(parsed, h.context(client, sid, group="g"))
        assert result.submitted is None and result.n_errors == 0
        msgs.extend(result.messages)
        # a special token printed by a tool is defused: it stays text and cannot end the turn early
        assert result.messages[0]["content"] == f"2\n<{ZWSP}|im_end|>\n"
        ids = prompt_ids + gen_ids + h.continuation(msgs, n)
        assert ids == h.render(msgs)  # the loop's incremental ids equal a full render
        assert tok.decode(h.continuation(msgs, n), skip_special_tokens=False).endswith(IM_ASSISTANT)
        json.dumps(msgs)  # Trajectory.messages must serialise

    in_sandbox(server, body)


# -------------------------------------------------------------------------- never raising into the loop


class BrokenSandbox:
    """FAKE (not a sandbox): every call raises. It stands in for a sandbox that has died, to show that the
    harness turns any failure into a result for the model. The sandbox itself is tested above."""

    def __init__(self):
        self.calls = 0

    async def exec(self, sid, cmd, timeout=60):
        self.calls += 1
        raise ConnectionError("sandbox went away")

    async def read(self, sid, path):
        self.calls += 1
        raise ConnectionError("sandbox went away")

    async def write(self, sid, path, data):
        self.calls += 1
        raise ConnectionError("sandbox went away")

    async def list(self, sid, path):
        self.calls += 1
        raise ConnectionError("sandbox went away")


@pytest.mark.parametrize("preset", ["claude_code", "codex", "hermes"])
def test_a_dead_sandbox_gives_error_results_never_exceptions(tok, tmp_path, preset):
    h = Harness(preset, tok, memory_dir=tmp_path)
    sbx = BrokenSandbox()
    ctx = h.context(sbx, "sid", group="g")
    calls = []
    for tool in h.tools:
        args = {}
        for name, schema in tool.parameters()["properties"].items():
            if name in tool.parameters()["required"]:
                args[name] = {"string": name, "array": ["ls"]}.get(schema["type"], 1)
                if "enum" in schema:
                    args[name] = schema["enum"][0]
        if tool.kind.name == "apply_patch":
            args = {"input": "*** Begin Patch\n*** Update File: a\n@@\n-x\n+y\n*** End Patch"}
        calls.append(ToolCall(tool.name, args, f"c{len(calls)}"))
    result = asyncio.run(h.execute(Parsed("", "", None, calls=calls), ctx))
    assert len(result.messages) == len(calls) and sbx.calls > 0
    for m, c in zip(result.messages, calls):
        assert m["tool_call_id"] == c.id and m["name"] == c.name and isinstance(m["content"], str)
    touching = [
        m for m, t in zip(result.messages, h.tools) if t.kind.name not in ("submit", "subagent", "skill", "memory")
    ]
    assert touching and all(
        m["content"].startswith("Error:") and "sandbox went away" in m["content"] for m in touching
    ), touching


def test_cancellation_is_not_swallowed(tok):
    # pausing an episode cancels its task; a tool must let CancelledError through

    class Hang:
        """FAKE: an exec that never returns, so the test can cancel it mid-call."""

        async def exec(self, sid, cmd, timeout=60):
            await asyncio.sleep(3600)

    h = Harness("minimal", tok)
    parsed = h.parse(
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.shell:0<|tool_call_argument_begin|>"
        '{"command": "sleep 1"}<|tool_call_end|><|tool_calls_section_end|>'
    )
    assert parsed.error is None

    async def main():
        task = asyncio.create_task(h.execute(parsed, h.context(Hang(), "sid")))
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_a_parse_error_becomes_one_tool_message(tok):
    h = Harness("claude_code", tok)
    parsed = h.parse('<function_calls><invoke name="Read"><parameter name="file_path">a')
    result = asyncio.run(h.execute(parsed, h.context(BrokenSandbox(), "sid")))
    assert result.n_errors == 1 and len(result.messages) == 1
    m = result.messages[0]
    assert (
        m["role"] == "tool"
        and m["name"] == "error"
        and m["content"].startswith("Error: your tool call could not be used")
    )
