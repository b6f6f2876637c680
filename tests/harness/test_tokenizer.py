"""Tokenizer and chat template: special tokens, byte-level round trips, determinism, save/load, tools in the
system turn, effort, the assistant mask, and the prefix property the agent loop relies on."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import harness.tokenizer as T
from harness.tokenizer import (
    IM_ASSISTANT,
    IM_END,
    SPECIAL_TOKENS,
    assistant_mask,
    builtin_corpus,
    chat_template,
    default_tokenizer,
    load_tokenizer,
    train_tokenizer,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "Bash",
            "description": "Run a command",
            "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
        },
    },
    {"name": "submit", "description": "Final answer", "parameters": {"type": "object", "properties": {}}},
]

CONV = [
    {"role": "system", "content": "You are helpful.", "effort": "medium"},
    {"role": "user", "content": "How many files?"},
    {
        "role": "assistant",
        "reasoning_content": "List them first.",
        "content": "Let me look.",
        "tool_calls": [{"id": "c0", "type": "function", "function": {"name": "Bash", "arguments": {"command": "ls"}}}],
    },
    {"role": "tool", "tool_call_id": "c0", "name": "Bash", "content": "a.txt\nb.txt"},
    {"role": "assistant", "content": "There are 2 files."},
    {"role": "user", "content": "Thanks. And 3 + 4?"},
    {"role": "assistant", "content": "7"},
]


def test_special_tokens_take_the_first_ids_in_order_and_encode_as_single_ids(tok):
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.convert_tokens_to_ids(t) == i
        assert tok.encode(t, add_special_tokens=False) == [i], t
        # inside text too: never split, never merged with neighbours
        ids = tok.encode(f"abc{t}def 12", add_special_tokens=False)
        assert ids.count(i) == 1 and tok.decode(ids) == f"abc{t}def 12"
    assert tok.eos_token == IM_END and tok.pad_token == "<|pad|>" and tok.bos_token == "<|bos|>"
    assert set(SPECIAL_TOKENS) <= set(tok.all_special_tokens)


def test_vocab_size_is_what_was_asked_and_bad_sizes_are_refused(tok):
    assert len(tok) == 4096
    with pytest.raises(ValueError, match=r"vocab_size must be an int >= 283 \(the 27 special tokens.*got 100"):
        train_tokenizer(["hello"], 100)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=200))
def test_byte_level_round_trip_of_arbitrary_unicode(tok, s):
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_digits_are_one_token_each(tok):
    ids = tok.encode("1234567", add_special_tokens=False)
    assert [tok.decode([i]) for i in ids] == list("1234567")


def test_training_is_deterministic_and_depends_on_the_corpus():
    corpus = builtin_corpus(n=1500, seed=1)
    a = json.loads(train_tokenizer(corpus, 1024).backend_tokenizer.to_str())
    b = json.loads(train_tokenizer(corpus, 1024).backend_tokenizer.to_str())
    assert a["model"]["vocab"] == b["model"]["vocab"] and a["model"]["merges"] == b["model"]["merges"]
    c = json.loads(train_tokenizer(builtin_corpus(n=1500, seed=2), 1024).backend_tokenizer.to_str())
    assert c["model"]["merges"] != a["model"]["merges"]


def test_save_pretrained_and_auto_tokenizer_round_trip(tok, tmp_path):
    tok.save_pretrained(tmp_path)
    back = AutoTokenizer.from_pretrained(tmp_path)
    text = "Ünïcode ✓ <think>hm</think> 42 <|im_end|>"
    assert back.encode(text, add_special_tokens=False) == tok.encode(text, add_special_tokens=False)
    assert back.chat_template == chat_template()
    assert back.apply_chat_template(CONV, tools=TOOLS, tokenize=False) == tok.apply_chat_template(
        CONV, tools=TOOLS, tokenize=False
    )
    assert load_tokenizer(tmp_path).get_vocab() == tok.get_vocab()


def test_load_tokenizer_rejects_a_tokenizer_without_rlk3_special_tokens(tmp_path):
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=raw).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"not an rlk3 tokenizer: special tokens \['<\|pad\|>'"):
        load_tokenizer(tmp_path)


def test_default_tokenizer_is_built_once_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("RLK3_CACHE_DIR", str(tmp_path))
    default_tokenizer.cache_clear()
    try:
        first = default_tokenizer()
        built = list((tmp_path / "tokenizers").iterdir())
        assert len(built) == 1 and (built[0] / "tokenizer.json").exists()
        mtime = (built[0] / "tokenizer.json").stat().st_mtime_ns
        default_tokenizer.cache_clear()
        second = default_tokenizer()
        assert (built[0] / "tokenizer.json").stat().st_mtime_ns == mtime  # loaded, not rebuilt
        assert second.get_vocab() == first.get_vocab() and len(second) == 4096
    finally:
        default_tokenizer.cache_clear()


def _system_turn(text: str) -> str:
    return text[text.index("<|im_system|>") : text.index(IM_END) + len(IM_END)]


@pytest.mark.parametrize("syntax", ["kimi", "hermes", "claude", "codex"])
def test_chat_template_lists_tools_in_the_system_turn(tok, syntax):
    text = tok.apply_chat_template(CONV, tools=TOOLS, tokenize=False, add_generation_prompt=True, tool_syntax=syntax)
    sys_turn = _system_turn(text)
    assert sys_turn.startswith("<|im_system|><|effort_medium|>You are helpful.")
    for t in TOOLS:
        f = t.get("function", t)
        assert json.dumps(f, ensure_ascii=False) in sys_turn
    assert text.startswith("<|bos|>") and text.endswith(IM_ASSISTANT)
    # and through the tokenizer: the ids are the text's ids, every special token one id
    ids = tok.apply_chat_template(CONV, tools=TOOLS, add_generation_prompt=True, tool_syntax=syntax)["input_ids"]
    assert ids == tok.encode(text, add_special_tokens=False)
    assert ids[-1] == tok.convert_tokens_to_ids(IM_ASSISTANT)


def test_chat_template_without_tools_or_system_has_no_system_turn(tok):
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|im_user|>hi<|im_end|><|im_assistant|>"
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, effort="low")
    assert text == "<|bos|><|im_system|><|effort_low|><|im_end|><|im_user|>hi<|im_end|>"


@pytest.mark.parametrize(
    ("kwargs", "messages", "match"),
    [
        ({"effort": "max"}, CONV, "effort must be one of low, medium, high; got max"),
        ({"tool_syntax": "xml"}, CONV, "tool_syntax must be one of kimi, hermes, claude, codex; got xml"),
        ({}, [{"role": "bot", "content": "x"}], "message role must be one of system, user, assistant, tool; got bot"),
    ],
)
def test_chat_template_rejects_bad_input_by_name(tok, kwargs, messages, match):
    with pytest.raises(Exception, match=match):
        tok.apply_chat_template(messages, tokenize=False, **kwargs)


def test_assistant_mask_covers_exactly_the_assistant_turns(tok):
    ids, mask = assistant_mask(tok, CONV, tools=TOOLS)
    assert len(ids) == len(mask) and set(mask) == {0, 1}
    # the masked tokens, run by run, are each assistant body plus its closing <|im_end|>
    runs, cur = [], []
    for i, m in zip(ids, mask):
        if m:
            cur.append(i)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    got = [tok.decode(r) for r in runs]
    assert got == [
        "<think>List them first.</think>Let me look.<|tool_calls_section_begin|><|tool_call_begin|>functions.Bash:0"
        '<|tool_call_argument_begin|>{"command": "ls"}<|tool_call_end|><|tool_calls_section_end|><|im_end|>',
        "There are 2 files.<|im_end|>",
        "7<|im_end|>",
    ]
    # every token right before a run is the assistant header the prompt supplies, never masked
    a = tok.convert_tokens_to_ids(IM_ASSISTANT)
    starts = [k for k in range(1, len(ids)) if mask[k] and not mask[k - 1]]
    assert len(starts) == 3 and all(ids[k - 1] == a for k in starts)
    unmasked = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "Let me look" not in unmasked and "How many files?" in unmasked and "a.txt" in unmasked


_text = st.text(alphabet=st.characters(codec="utf-8", exclude_characters="<>|"), max_size=40)
_message = st.one_of(
    st.builds(lambda c: {"role": "user", "content": c}, _text),
    st.builds(lambda c, r: {"role": "assistant", "content": c, "reasoning_content": r}, _text, _text),
    st.builds(
        lambda c, cmd: {
            "role": "assistant",
            "content": c,
            "tool_calls": [{"type": "function", "function": {"name": "Bash", "arguments": {"command": cmd}}}],
        },
        _text,
        _text,
    ),
    st.builds(lambda c: {"role": "tool", "name": "Bash", "content": c}, _text),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(_message, min_size=1, max_size=8), st.sampled_from(["kimi", "hermes", "claude", "codex"]))
def test_rendering_is_prefix_stable(tok, messages, syntax):
    # the loop appends tokens turn by turn; that is sound only if rendering a conversation is a prefix of
    # rendering any continuation of it
    conv = [{"role": "system", "content": "s"}, *messages]
    kw = {"tools": TOOLS, "tokenize": False, "tool_syntax": syntax}
    full = tok.apply_chat_template(conv, add_generation_prompt=True, **kw)
    for k in range(1, len(conv)):
        assert full.startswith(tok.apply_chat_template(conv[:k], **kw))


def test_builtin_corpus_is_deterministic_and_covers_the_markup():
    a, b = builtin_corpus(), builtin_corpus()
    assert a == b and len(a) == 6000
    joined = "".join(a)
    for marker in ("<tool_call>", T.TOOL_CALLS_BEGIN, "<function_calls>", "<|channel|>", "def ", "Answer:"):
        assert marker in joined


def test_trl_sees_generation_markers_and_trains_the_stop_token(tok):
    # what TRL's SFTTrainer(assistant_only_loss=True) checks before it trusts a template's assistant mask
    from trl.chat_template_utils import has_generation_markers, is_chat_template_stop_token_trained

    assert has_generation_markers(tok.chat_template)
    assert is_chat_template_stop_token_trained(tok)
