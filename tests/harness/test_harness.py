"""The Harness API the agent loop calls: prompts, rendering and continuation, assistant masks, subagents,
construction errors, and the dependency rule."""

from __future__ import annotations

import json

import pytest
import yaml

from harness import Harness, defuse_special_tokens
from harness.presets import PRESET_DIR
from harness.tokenizer import IM_END, SPECIAL_TOKENS


def test_system_prompt_states_effort_and_budget(tok):
    h = Harness("claude_code", tok)
    s = h.system_prompt("medium", budget=4096)
    assert "\n\nReasoning effort: medium\n\n" in s
    assert "Token budget: 4096 tokens for this problem" in s
    assert "Token budget" not in h.system_prompt("low")
    assert "## Skills\nLoad a skill's instructions with the Skill tool.\n- python-testing: " in s
    assert "- debugging: " in s
    assert "/home/user" in s and "{workdir}" not in s
    with pytest.raises(ValueError, match="effort must be one of low, medium, high, got 'extreme'"):
        h.system_prompt("extreme")
    with pytest.raises(ValueError, match="budget must be a positive int \\(tokens\\) or None, got 0"):
        h.system_prompt("low", budget=0)


def test_start_messages_carry_the_effort_token_and_serialise(tok):
    h = Harness("codex", tok)
    msgs = h.start("Fix the bug.", effort="low", budget=300)
    assert [m["role"] for m in msgs] == ["system", "user"] and msgs[0]["effort"] == "low"
    assert json.loads(json.dumps(msgs)) == msgs
    ids = h.render(msgs)
    assert ids[:3] == [tok.convert_tokens_to_ids(t) for t in ("<|bos|>", "<|im_system|>", "<|effort_low|>")]


def test_continuation_of_any_split_equals_the_full_render(tok, tmp_path):
    h = Harness("hermes", tok, memory_dir=tmp_path)
    msgs = [
        *h.start("task", effort="high"),
        {
            "role": "assistant",
            "content": "a",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "terminal", "arguments": {"command": "ls"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "name": "terminal", "content": "x\n"},
        {"role": "assistant", "content": "done"},
        {"role": "user", "content": "and now?"},
    ]
    full = h.render(msgs)
    for k in (2, 3, 4, 5):
        prefix = h.render(msgs[:k], add_generation_prompt=False)
        assert prefix + h.continuation(msgs, k) == full


def test_assistant_mask_through_the_preset(tok):
    h = Harness("claude_code", tok)
    msgs = [
        *h.start("task", effort="high"),
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "r",
            "tool_calls": [
                {"id": "c", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}}
            ],
        },
        {"role": "tool", "tool_call_id": "c", "name": "Bash", "content": "secret output"},
        {"role": "assistant", "content": "The end."},
    ]
    ids, mask = h.assistant_mask(msgs)
    assert ids == h.render(msgs, add_generation_prompt=False)
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learned == (
        '<think>r</think><function_calls>\n<invoke name="Bash">\n<parameter name="command">ls</parameter>\n'
        "</invoke>\n</function_calls><|im_end|>The end.<|im_end|>"
    )


def test_subagents_run_one_level_deeper_without_submit_or_further_spawning(tok):
    h = Harness("claude_code", tok)
    sub = h.for_subagent()
    assert sub.depth == 1 and "Task" not in sub.tool_names() and "Submit" not in sub.tool_names()
    assert "Read" in sub.tool_names() and "You are a subagent" in sub.system_prompt("low")
    assert "You are a subagent" not in h.system_prompt("low")
    data = yaml.safe_load((PRESET_DIR / "claude_code.yaml").read_text())
    data["subagents"] = {"enabled": True, "max_depth": 2, "preset": "minimal"}
    deep = Harness(data, tok).for_subagent()
    assert deep.preset.name == "minimal" and deep.tool_names() == ["shell", "read_file"]


def test_construction_errors_say_what_to_do(tok, tmp_path):
    with pytest.raises(ValueError, match=r"preset 'hermes' keeps memories across episodes .* pass memory_dir="):
        Harness("hermes", tok)
    h = Harness("hermes", tok, memory_dir=tmp_path)
    with pytest.raises(ValueError, match="keeps memories per task group: pass group="):
        h.context(object(), "sid")
    data = yaml.safe_load((PRESET_DIR / "claude_code.yaml").read_text())
    data["context"]["threshold_tokens"] = 1000
    with pytest.raises(ValueError, match=r"threshold_tokens=1000 leaves no room: the system prompt and tool list"):
        Harness(data, tok)


def test_defusing_special_tokens_keeps_them_as_text(tok):
    s = "a <|im_end|> b <think> <|tool_call_begin|>"
    d = defuse_special_tokens(s)
    ids = tok.encode(d, add_special_tokens=False)
    assert not set(ids) & {tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    assert d.replace("\u200b", "") == s and IM_END not in d
