"""Context compaction: under the threshold afterwards, never a call without its result (or the reverse), the
task and the recent turns kept when they fit, nothing touched when under the threshold; and no compaction."""

from __future__ import annotations

import json

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import Harness
from harness.context import MARKER, Compaction, NoCompaction, units_of
from harness.presets import PRESET_DIR


@pytest.fixture(scope="module")
def h(tok):
    # the minimal preset with compaction switched on: its small system turn allows small test thresholds
    data = yaml.safe_load((PRESET_DIR / "minimal.yaml").read_text())
    data["context"] = {"policy": "compact", "threshold_tokens": 1500, "keep_last_turns": 2, "stub_chars": 40}
    return Harness(data, tok)


def call(i: str, command: str = "ls") -> dict:
    return {"id": i, "type": "function", "function": {"name": "shell", "arguments": {"command": command}}}


WORDS = ["alpha", "beta", "gamma", "delta", "file.txt", "42", "error:", "ok", "\n", "def f(x):", "return"]


@st.composite
def conversations(draw):
    msgs = [
        {"role": "system", "content": "You are an agent.", "effort": "high"},
        {"role": "user", "content": "Task: " + " ".join(draw(st.lists(st.sampled_from(WORDS), max_size=20)))},
    ]
    n_call = 0
    for _ in range(draw(st.integers(1, 14))):
        kind = draw(st.sampled_from(["calls", "calls", "calls", "text", "user"]))
        if kind == "user":
            msgs.append({"role": "user", "content": "More: " + " ".join(draw(st.lists(st.sampled_from(WORDS))))})
            continue
        reasoning = " ".join(draw(st.lists(st.sampled_from(WORDS), max_size=60)))
        msg = {"role": "assistant", "content": "Step.", "reasoning_content": reasoning}
        if kind == "text":
            msgs.append(msg)
            continue
        k = draw(st.integers(1, 3))
        ids = [f"call_{n_call + i}" for i in range(k)]
        n_call += k
        msg["tool_calls"] = [call(i, "cat " * draw(st.integers(1, 50))) for i in ids]
        msgs.append(msg)
        for i in ids:
            size = draw(st.integers(0, 400))
            msgs.append({"role": "tool", "tool_call_id": i, "name": "shell", "content": " ".join(["out"] * size)})
    return msgs


def assert_calls_paired(msgs: list[dict]) -> None:
    """Every assistant call is answered right after it, in order, and every result answers such a call."""
    i = 0
    while i < len(msgs):
        m = msgs[i]
        if m["role"] == "assistant" and m.get("tool_calls"):
            want = [c["id"] for c in m["tool_calls"]]
            got = [x.get("tool_call_id") for x in msgs[i + 1 : i + 1 + len(want)]]
            assert got == want, f"call(s) {want} split from their results (found {got})"
            i += 1 + len(want)
            continue
        assert m["role"] != "tool", f"a tool result without its call at position {i}"
        i += 1


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(conversations(), st.integers(0, 3000), st.integers(1, 4), st.sampled_from([0, 40]))
def test_compaction_fits_the_threshold_and_never_splits_a_call_from_its_result(h, msgs, extra, keep, stub):
    assert_calls_paired(msgs)  # the generator's conversations are well formed to begin with
    head_tokens = h.count_tokens([*msgs[:2], {"role": "user", "content": MARKER.format(n=999)}])
    threshold = head_tokens + 50 + extra
    policy = Compaction(threshold, keep_last_turns=keep, stub_chars=stub)
    before = json.dumps(msgs)
    out = policy.compact(msgs, h.count_tokens)
    assert json.dumps(msgs) == before  # the input is never modified
    n = h.count_tokens(out)
    assert n == len(h.render(out)) and h.count_tokens(msgs) == len(h.render(msgs))  # the cached count is exact
    assert n <= threshold, f"{n} tokens after compaction, threshold {threshold}"
    assert_calls_paired(out)
    if h.count_tokens(msgs) <= threshold:
        assert out is msgs
        return
    assert out[:2] == msgs[:2]  # the system prompt and the task survive: the threshold leaves room for them
    # a tool result is either intact or a compaction note, never a silently cut copy
    originals = {m.get("tool_call_id"): m["content"] for m in msgs if m["role"] == "tool"}
    for m in out:
        if m["role"] == "tool" and m["content"] != originals[m["tool_call_id"]]:
            assert (
                m["content"].startswith("[output cleared by context compaction")
                or "characters truncated" in m["content"]
            )
    # the recent turns survive untouched whenever compacting the older ones was enough
    _, units = units_of(msgs)
    recent = [m for u in units[-keep:] for m in u]
    if h.count_tokens([*msgs[:2], {"role": "user", "content": MARKER.format(n=999)}, *recent]) <= threshold:
        assert out[-len(recent) :] == recent


def test_compaction_takes_the_least_that_fits_where_a_stub_or_the_marker_costs_tokens(h):
    """A counterexample the property test found in CI: dropping the first unit adds the marker message, which costs
    more tokens than that small unit, and stubbing a short repetitive output ("out out …", 83 characters) gives a
    note that is shorter but counts more tokens. Compaction's search assumed the count falls with each step, skipped
    the level that drops the two old units and keeps the last one whole, and dropped everything instead."""
    msgs = [{"role": "system", "content": "You are an agent.", "effort": "high"}, {"role": "user", "content": "Task: "}]
    for n in range(3):
        msgs.append({"role": "assistant", "content": "Step.", "reasoning_content": "",
                     "tool_calls": [call(f"call_{n}", "cat ")]})
        msgs.append({"role": "tool", "tool_call_id": f"call_{n}", "name": "shell",
                     "content": " ".join(["out"] * (21 if n == 2 else 0))})
    kept = [*msgs[:2], {"role": "user", "content": MARKER.format(n=4)}, *msgs[-2:]]
    threshold = h.count_tokens(kept)
    out = Compaction(threshold, keep_last_turns=1, stub_chars=0).compact(msgs, h.count_tokens)
    assert out == kept
    assert h.count_tokens(out) <= threshold


def test_dropped_turns_leave_one_marker_and_a_second_compaction_counts_all_of_them(h):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    for i in range(12):
        msgs.append(
            {
                "role": "assistant",
                "content": f"step {i}",
                "tool_calls": [call(f"c{i}", "ls")],
            }
        )
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "name": "shell", "content": "x " * 300})
    policy = Compaction(h.count_tokens(msgs[:2]) + 500, keep_last_turns=2, stub_chars=0)
    out = policy.compact(msgs, h.count_tokens)
    markers = [m for m in out if m["content"].startswith("[Context compacted:")]
    assert len(markers) == 1 and out[2] is markers[0]
    n1 = int(markers[0]["content"].split()[2])
    assert n1 + len(out) - 3 == len(msgs) - 2  # removed + kept units = all units
    assert_calls_paired(out)
    # the conversation goes on and is compacted again: the new marker counts every message removed so far
    more = list(out)
    for i in range(12, 20):
        more.append({"role": "assistant", "content": f"step {i}", "tool_calls": [call(f"c{i}", "ls")]})
        more.append({"role": "tool", "tool_call_id": f"c{i}", "name": "shell", "content": "y " * 300})
    out2 = policy.compact(more, h.count_tokens)
    markers2 = [m for m in out2 if m["content"].startswith("[Context compacted:")]
    assert len(markers2) == 1
    total_removed = int(markers2[0]["content"].split()[2])
    kept_original = len(out2) - 3
    assert total_removed + kept_original == 2 * 20  # 20 call/result pairs in all, each either kept or counted


def test_stubs_keep_the_beginning_of_an_old_output(h):
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "cat log")]},
        {"role": "tool", "tool_call_id": "a", "name": "shell", "content": "FIRST LINE of the log\n" + "noise " * 800},
        {"role": "assistant", "content": "done"},
    ]
    limit = h.count_tokens(msgs) - 200
    out = Compaction(limit, keep_last_turns=1, stub_chars=21).compact(msgs, h.count_tokens)
    assert out[3]["content"] == (
        f"[output cleared by context compaction; it had {len(msgs[3]['content'])} characters. "
        "It began: FIRST LINE of the log]"
    )
    assert out[4] == msgs[4] and h.count_tokens(out) <= limit


def test_an_oversized_last_turn_is_cut_rather_than_left_over_the_threshold(h):
    msgs = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "task"},
        {"role": "assistant", "content": "", "tool_calls": [call("a", "cat big")]},
        {"role": "tool", "tool_call_id": "a", "name": "shell", "content": "data " * 5000},
    ]
    limit = h.count_tokens(msgs[:2]) + 300
    out = Compaction(limit, keep_last_turns=4).compact(msgs, h.count_tokens)
    assert h.count_tokens(out) <= limit
    assert_calls_paired(out)


def test_the_harness_compacts_with_its_preset_policy_and_no_compaction_leaves_all(h, tok):
    msgs = [{"role": "system", "content": "sys"}, {"role": "user", "content": "task"}]
    for i in range(10):
        msgs.append({"role": "assistant", "content": "", "tool_calls": [call(f"c{i}", "ls")]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "name": "shell", "content": "z " * 200})
    assert h.count_tokens(msgs) > 1500
    out = h.compact(msgs)
    assert out is not msgs and h.count_tokens(out) <= 1500
    assert h.compact(out) is out  # under the threshold: the same object, nothing to re-render
    assert h.compact(msgs, n_tokens=10) is msgs  # the caller's count says it fits: not even rendered
    assert NoCompaction().compact(msgs, h.count_tokens) is msgs
    assert Harness("minimal", tok).compact(msgs) is msgs  # the preset's policy is "none"


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"threshold_tokens": 0}, "threshold_tokens must be a positive int, got 0"),
        ({"threshold_tokens": 10, "keep_last_turns": 0}, "keep_last_turns must be an int >= 1, got 0"),
        ({"threshold_tokens": 10, "stub_chars": -1}, "stub_chars must be an int >= 0, got -1"),
    ],
)
def test_bad_compaction_settings_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        Compaction(**kwargs)
