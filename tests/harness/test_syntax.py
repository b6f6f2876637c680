"""Tool-call syntaxes: every preset renders and parses back identically, parsing is total on 10,000 fuzzed
outputs within a time bound, adversarial inputs stay linear, and each malformed call gets a clear message."""

from __future__ import annotations

import json
import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness import Harness, ToolCall, registered_presets
from harness.syntax import SYNTAXES, get_syntax
from harness.tokenizer import EOT, IM_ASSISTANT, IM_END, SPECIAL_TOKENS, THINK, THINK_END

PRESETS = registered_presets()
# strings that must not occur inside generated text for a round trip to be exact: the openers of every syntax
# (content is scanned for them), the think markers, and the closers of raw (non-JSON) payloads
FORBIDDEN = (
    "<tool_call>",
    "<|tool_calls_section_begin|>",
    "<function_calls>",
    "<|channel|>commentary to=functions.",
    "</parameter>",
    "<|call|>",
    THINK,
    THINK_END,
    IM_END,
)
ALPHABET = st.characters(codec="utf-8", exclude_categories=["Cs"]) | st.sampled_from(list('<>/|"{}[]\\\n '))
TEXT = st.text(ALPHABET, max_size=30).filter(lambda s: not any(f in s for f in FORBIDDEN))


@pytest.fixture(scope="module")
def harnesses(tok, tmp_path_factory):
    mem = tmp_path_factory.mktemp("mem")
    return {name: Harness(name, tok, memory_dir=mem) for name in PRESETS}


def _value(draw, schema: dict):
    t = schema.get("type")
    if "enum" in schema:
        return draw(st.sampled_from(schema["enum"]))
    if t == "string":
        return draw(TEXT)
    if t == "integer":
        return draw(st.integers(-(10**9), 10**9))
    if t == "number":
        return draw(st.integers(-1000, 1000) | st.floats(allow_nan=False, allow_infinity=False, width=32))
    if t == "boolean":
        return draw(st.booleans())
    if t == "array":
        return draw(st.lists(TEXT, max_size=3))
    raise AssertionError(f"no strategy for {schema}")


@st.composite
def assistant_turns(draw, h: Harness):
    calls = []
    for _ in range(draw(st.integers(0, 3 if h.tools else 0))):  # a tool-less preset (chat) answers in text
        tool = draw(st.sampled_from(h.tools))
        params = tool.parameters()
        args = {}
        for name, schema in params["properties"].items():
            if name in params["required"] or draw(st.booleans()):
                args[name] = _value(draw, schema)
        calls.append(ToolCall(tool.name, args))
    content = draw(TEXT)
    reasoning = draw(st.none() | TEXT)
    msg = {"role": "assistant", "content": content}
    if reasoning:
        msg["reasoning_content"] = reasoning
    if calls:
        msg["tool_calls"] = [c.to_message() for c in calls]
    return msg, calls


def assistant_text(h: Harness, msg: dict) -> str:
    """What the model would have generated for ``msg``; checked against the plain slice of a full render."""
    text = h.assistant_text(msg)
    full = h.render_text([{"role": "user", "content": "task"}, msg], add_generation_prompt=False)
    assert full.endswith(IM_ASSISTANT + text)
    return text


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_renders_and_parses_its_calls_back_identically(harnesses, preset):
    h = harnesses[preset]

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck))
    @given(assistant_turns(h))
    def check(turn):
        msg, calls = turn
        text = assistant_text(h, msg)
        assert text.endswith(IM_END)
        # through the tokenizer as the engine would produce it: sampled ids decoded with special tokens kept
        decoded = h.tokenizer.decode(h.tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=False)
        assert decoded == text
        p = h.parse(decoded)
        assert p.error is None, p.error
        assert [(c.name, c.arguments) for c in p.calls] == [(c.name, c.arguments) for c in calls]
        assert p.content == msg["content"].strip()
        assert (p.reasoning or None) == (msg.get("reasoning_content") or None)
        assert len({c.id for c in p.calls}) == len(p.calls)
        # and the message built from the parse renders to the same text: the conversation record is faithful
        assert assistant_text(h, p.message()) == text

    check()


def test_hermes_and_kimi_json_strings_may_contain_their_own_closing_tags(harnesses):
    for preset, closer in (("hermes", "</tool_call>"), ("kimi_code", "<|tool_call_end|><|tool_calls_section_end|>")):
        h = harnesses[preset]
        shell = next(t for t in h.tools if t.kind.name == "shell")
        call = ToolCall(shell.name, {shell.rename["command"]: f"echo '{closer}' done"})
        p = h.parse(assistant_text(h, {"role": "assistant", "content": "", "tool_calls": [call.to_message()]}))
        assert p.error is None and p.calls[0].arguments == call.arguments


# ------------------------------------------------------------------------------------------- fuzzing


def _pool(harnesses, n: int = 60) -> list[tuple[str, str]]:
    """Valid assistant texts per preset (rendered once), the seeds the fuzzer truncates and corrupts."""
    rng = random.Random(0)
    pool = []
    for name, h in harnesses.items():
        for _ in range(n):
            calls = []
            for _ in range(rng.randint(1, 3) if h.tools else 0):  # a tool-less preset contributes plain text
                tool = rng.choice(h.tools)
                params = tool.parameters()
                args = {}
                for k, sch in params["properties"].items():
                    if k in params["required"]:
                        t = sch["type"]
                        args[k] = (
                            rng.choice(sch["enum"])
                            if "enum" in sch
                            else {"string": 'x <y> "z"', "integer": 7, "number": 1.5, "boolean": True}.get(t, ["a"])
                        )
                calls.append(ToolCall(tool.name, args).to_message())
            msg = {"role": "assistant", "content": "ok", "reasoning_content": "why", "tool_calls": calls}
            pool.append((name, assistant_text(h, msg)))
    return pool


MARKERS = [*SPECIAL_TOKENS, *FORBIDDEN, "</tool_call>", "</function_calls>", '<invoke name="', '">', "</invoke>"]
MARKERS += ['<parameter name="', "<|message|>", "functions.", ":0", "{", "}", '"', "[", "]", ",", ":", "\\", "\n"]


@st.composite
def fuzzed_outputs(draw, pool):
    preset, seed = draw(st.sampled_from(pool))
    kind = draw(st.sampled_from(["bytes", "text", "truncated", "mutated", "bad_utf8", "soup", "huge"]))
    if kind == "bytes":
        out = draw(st.binary(max_size=3000))
    elif kind == "text":
        out = draw(st.text(max_size=3000))
    elif kind == "truncated":
        out = seed[: draw(st.integers(0, len(seed)))]
    elif kind == "mutated":
        s = list(seed)
        for _ in range(draw(st.integers(1, 6))):
            i = draw(st.integers(0, len(s) - 1))
            op = draw(st.sampled_from(["del", "sub", "ins"]))
            ch = draw(st.sampled_from(['"', "{", "}", ":", ",", "<", ">", "x", "\\", "\x00", "é"]))
            if op == "del":
                del s[i]
            elif op == "sub":
                s[i] = ch
            else:
                s.insert(i, ch)
        out = "".join(s)
    elif kind == "bad_utf8":
        b = bytearray(seed.encode())
        for _ in range(draw(st.integers(1, 5))):
            junk = draw(st.sampled_from([b"\x80", b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"]))
            i = draw(st.integers(0, len(b)))
            b[i:i] = junk
        out = bytes(b)
    elif kind == "soup":
        out = "".join(draw(st.lists(st.sampled_from(MARKERS) | st.text(max_size=5), max_size=60)))
    else:  # about 1 MB: a fragment of a valid call, or of marker soup, repeated
        frag = draw(st.sampled_from([seed, seed[: len(seed) // 2], "".join(MARKERS), '<tool_call>{"a": [']))
        out = frag * (1_000_000 // max(1, len(frag)) + 1)
    return preset, kind, out


def test_parsing_10000_fuzzed_outputs_never_raises_and_stays_within_a_time_bound(harnesses):
    pool = _pool(harnesses)
    stats = {"n": 0, "max_s": 0.0, "kinds": {}, "calls": 0, "errors": 0, "huge": 0}
    t0 = time.perf_counter()

    @settings(max_examples=10_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(fuzzed_outputs(pool))
    def check(case):
        preset, kind, out = case
        h = harnesses[preset]
        t = time.perf_counter()
        p = h.parse(out)  # must not raise
        dt = time.perf_counter() - t
        stats["n"] += 1
        stats["max_s"] = max(stats["max_s"], dt)
        stats["kinds"][kind] = stats["kinds"].get(kind, 0) + 1
        stats["huge"] += len(out) >= 1_000_000
        # a generous bound per call: a quadratic parse of 1 MB takes minutes, a linear one milliseconds
        assert dt < 2.0, f"{kind} input of {len(out)} chars took {dt:.2f} s to parse"
        # the result is well formed: calls xor error, the error written for the model and bounded
        assert (p.error is None) or not p.calls
        if p.error is not None:
            stats["errors"] += 1
            assert p.error.startswith("Error: your tool call could not be used: ") and len(p.error) < 4000
            assert "Available tools:" in p.error
        stats["calls"] += len(p.calls)
        for c in p.calls:
            assert c.name in h.tool_names() and isinstance(c.arguments, dict)
        json.dumps(p.message())  # the conversation record stays serialisable
        if isinstance(out, bytes):
            return
        expected = out.encode("utf-8", "replace").decode()
        for end in (IM_END, EOT):
            expected = expected.removesuffix(end)
        assert p.text == expected

    check()
    total = time.perf_counter() - t0
    print("fuzz stats", stats, f"{total:.1f} s")
    assert stats["n"] >= 10_000, stats
    assert set(stats["kinds"]) == {"bytes", "text", "truncated", "mutated", "bad_utf8", "soup", "huge"}
    assert stats["huge"] > 100 and stats["errors"] > 1000 and stats["calls"] > 100, stats
    assert total < 600, f"10,000 parses took {total:.0f} s"


ADVERSARIAL = {
    "hermes": ["<tool_call>" * 100_000, "<tool_call>" + "[" * 1_000_000, '<tool_call>{"name": "' + "a" * 1_000_000],
    "kimi_code": [
        "<|tool_calls_section_begin|>" * 50_000,
        "<|tool_calls_section_begin|><|tool_call_begin|>" + "x" * 1_000_000,
        "<|tool_calls_section_begin|><|tool_call_begin|>functions.Shell:0<|tool_call_argument_begin|>" + "{" * 10**6,
    ],
    "claude_code": [
        "<function_calls>" + '<invoke name="Bash">' * 50_000,
        '<function_calls><invoke name="Bash">' + '<parameter name="command">' * 40_000,
        '<function_calls><invoke name="' + "B" * 1_000_000,
    ],
    "codex": [
        "<|channel|>commentary to=functions." * 30_000,
        "<|channel|>commentary to=functions.shell<|message|>" + "[" * 1_000_000,
        "<|channel|>commentary to=functions.apply_patch<|message|>" + "*** Begin Patch\n" * 60_000,
    ],
}


@pytest.mark.parametrize(("preset", "text"), [(p, t) for p, ts in ADVERSARIAL.items() for t in ts])
def test_adversarial_inputs_parse_in_linear_time(harnesses, preset, text):
    t = time.perf_counter()
    p = harnesses[preset].parse(text)
    assert time.perf_counter() - t < 2.0
    assert p.error is not None and not p.calls


CASES = [
    # (syntax, text, expected fragment of the error)
    ("hermes", '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}} and', "expected </tool_call>"),
    ("hermes", '<tool_call>\n{"name": "shell", "arguments": {"command": "ls"}', "ends inside the JSON (was it cut"),
    ("hermes", '<tool_call>\n{"name": "shell", "arguments": {"command": "ls}\n</tool_call>', "invalid JSON"),
    ("hermes", "<tool_call>\n[1, 2]\n</tool_call>", 'expected a JSON object {"name"'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', 'needs a "name" string'),
    ("hermes", '<tool_call>\n{"name": "shell", "args": {}}\n</tool_call>', "unexpected key(s) args"),
    ("hermes", '<tool_call>\n{"name": "shell", "arguments": 5}\n</tool_call>', "arguments must be a JSON object"),
    ("hermes", "<tool_call>", "ends right after <tool_call>"),
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>functions.shell:0", "expected functions.NAME:INDEX"),
    ("kimi", "<|tool_calls_section_begin|>hello", "expected <|tool_call_begin|> or <|tool_calls_section_end|>"),
    (
        "kimi",
        '<|tool_calls_section_begin|><|tool_call_begin|>functions.shell:0<|tool_call_argument_begin|>{"a": 1}',
        "expected <|tool_call_end|>",
    ),
    ("kimi", "<|tool_calls_section_begin|><|tool_call_begin|>bad name!<|tool_call_argument_begin|>{}", "not a valid"),
    ("claude", '<function_calls>\n<invoke name="shell">\n<parameter name="command">ls', "has no closing </parameter>"),
    ("claude", "<function_calls>\nhello", 'expected <invoke name="..."> or </function_calls>'),
    ("claude", '<function_calls><invoke name="shell"><oops/>', 'expected <parameter name="..."> or </invoke>'),
    (
        "claude",
        '<function_calls><invoke name="shell"><parameter name="n">1</parameter><parameter name="n">2</parameter>',
        "given twice",
    ),
    ("codex", "<|channel|>commentary to=functions.shell<|message|>{}", "no closing <|call|>"),
    ("codex", "<|channel|>commentary to=functions.shell", "expected to=functions.NAME<|message|>"),
    ("codex", '<|channel|>commentary to=functions.shell<|message|>{"a": 1} trailing<|call|>', "unexpected text"),
]


@pytest.mark.parametrize(("syntax", "text", "fragment"), CASES)
def test_malformed_calls_get_a_message_naming_the_problem(syntax, text, fragment):
    r = get_syntax(syntax).parse("Sure. " + text)
    assert r.error is not None and fragment in r.error and not r.calls
    assert r.content.startswith("Sure.")  # the raw text is kept as the assistant's content


def test_call_validation_names_the_tool_the_parameter_and_the_valid_choices(harnesses):
    h = harnesses["claude_code"]

    def call(name, **params):
        body = "".join(f'<parameter name="{k}">{v}</parameter>' for k, v in params.items())
        return h.parse(f'<function_calls><invoke name="{name}">{body}</invoke></function_calls>')

    assert "there is no tool named 'Bogus'" in call("Bogus").error
    assert "Available tools: Bash, Read, Write, Edit, Glob, Grep, Task, Skill, Submit." in call("Bogus").error
    assert "missing required parameter(s) file_path" in call("Read").error
    assert (
        "unknown parameter(s) 'path'; valid parameters: file_path, offset, limit"
        in call("Read", file_path="a", path="b").error
    )
    err = call("Read", file_path="a", offset="ten").error
    assert "parameter 'offset' must be integer written as JSON, got 'ten'" in err
    assert "parameter 'offset' must be integer, got float 1.5" in call("Read", file_path="a", offset="1.5").error
    err = call("Grep", pattern="x", output_mode="lines").error
    assert "parameter 'output_mode' must be one of 'content', 'files_with_matches', 'count', got 'lines'" in err
    ok = call("Read", file_path="/a b", offset="3")
    assert ok.error is None and ok.calls[0].arguments == {"file_path": "/a b", "offset": 3}


def test_too_many_calls_in_one_turn_is_an_error(harnesses):
    h = harnesses["hermes"]
    one = '<tool_call>\n{"name": "terminal", "arguments": {"command": "ls"}}\n</tool_call>'
    limit = h.preset.limits.max_calls_per_turn
    assert len(h.parse(one * limit).calls) == limit
    assert f"too many tool calls in one turn (the limit is {limit})" in h.parse(one * (limit + 1)).error


def test_reasoning_is_split_off_in_its_three_forms(harnesses):
    h = harnesses["hermes"]
    p = h.parse("<think>plan</think>The answer is 4.<|im_end|>")
    assert (p.reasoning, p.content, p.finished) == ("plan", "The answer is 4.", True)
    p = h.parse("<think>still thinking when the budget ran out")  # cut off mid-thought: no answer, no error
    assert (p.reasoning, p.content, p.calls, p.error) == ("still thinking when the budget ran out", "", [], None)
    p = h.parse("opened by the prompt</think>done")
    assert (p.reasoning, p.content) == ("opened by the prompt", "done")
    p = h.parse("no reasoning at all")
    assert (p.reasoning, p.content) == (None, "no reasoning at all")


def test_over_long_outputs_are_refused_not_parsed(tok):
    h = Harness("codex", tok)
    n = h.preset.limits.max_parse_chars
    p = h.parse("a" * (n + 1))
    assert f"outputs longer than {n} are not parsed" in p.error


def test_every_syntax_is_registered_and_unknown_ones_are_named():
    assert set(SYNTAXES) == {"kimi", "hermes", "claude", "codex"}
    with pytest.raises(ValueError, match="unknown tool syntax 'xml'; valid: kimi, hermes, claude, codex"):
        get_syntax("xml")
