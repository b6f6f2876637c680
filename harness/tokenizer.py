"""Byte-level BPE tokenizer with rlk3's special tokens and chat template, saved as a standard HF tokenizer.

    tok = train_tokenizer(texts, vocab_size=4096, out_dir="ckpt/tokenizer")   # the real synthetic corpus
    tok = default_tokenizer()                                                # built-in corpus, cached on disk
    tok.apply_chat_template(messages, tools=tools, add_generation_prompt=True)
    ids, mask = assistant_mask(tok, messages, tools=tools)                   # loss only on assistant tokens

Byte-level means every string round-trips (``decode(encode(s)) == s``) and nothing is ever unknown. Digits are
split one per token first, so numbers tokenize the same way wherever they appear (the arithmetic tasks need
that more than they need compression). Special tokens take the first ids in a fixed order, so a tokenizer
trained on any corpus agrees with every other on them. Training is deterministic: same texts, same vocab size
-> same vocab and merges.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import os
import random
from collections.abc import Iterable, Sequence
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD = "<|pad|>"
BOS = "<|bos|>"
EOT = "<|endoftext|>"  # ends a raw (non-chat) document
IM_SYSTEM = "<|im_system|>"
IM_USER = "<|im_user|>"
IM_ASSISTANT = "<|im_assistant|>"
IM_TOOL = "<|im_tool|>"
IM_MIDDLE = "<|im_middle|>"  # separates a tool turn's header (the tool name) from its body
IM_END = "<|im_end|>"  # ends every turn; the token generation stops on (the tokenizer's eos_token)
THINK = "<think>"
THINK_END = "</think>"
TOOL_CALLS_BEGIN = "<|tool_calls_section_begin|>"
TOOL_CALLS_END = "<|tool_calls_section_end|>"
TOOL_CALL_BEGIN = "<|tool_call_begin|>"
TOOL_CALL_ARGS = "<|tool_call_argument_begin|>"
TOOL_CALL_END = "<|tool_call_end|>"
EFFORTS = ("low", "medium", "high")
EFFORT_TOKENS = {e: f"<|effort_{e}|>" for e in EFFORTS}
# spare ids so that a later need (say, an image placeholder) does not renumber anything
RESERVED = tuple(f"<|reserved_{i}|>" for i in range(8))

SPECIAL_TOKENS: tuple[str, ...] = (
    PAD,
    BOS,
    EOT,
    IM_SYSTEM,
    IM_USER,
    IM_ASSISTANT,
    IM_TOOL,
    IM_MIDDLE,
    IM_END,
    THINK,
    THINK_END,
    TOOL_CALLS_BEGIN,
    TOOL_CALLS_END,
    TOOL_CALL_BEGIN,
    TOOL_CALL_ARGS,
    TOOL_CALL_END,
    *EFFORT_TOKENS.values(),
    *RESERVED,
)
ROLE_TOKENS = {"system": IM_SYSTEM, "user": IM_USER, "assistant": IM_ASSISTANT, "tool": IM_TOOL}
CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
DEFAULT_VOCAB_SIZE = 4096  # k3-tiny's vocab_size
# the smallest vocab that holds the special tokens and the 256 byte symbols
MIN_VOCAB_SIZE = len(SPECIAL_TOKENS) + 256


def chat_template() -> str:
    return CHAT_TEMPLATE_PATH.read_text()


def _check_vocab_size(vocab_size: int) -> None:
    if not isinstance(vocab_size, int) or isinstance(vocab_size, bool) or vocab_size < MIN_VOCAB_SIZE:
        raise ValueError(
            f"vocab_size must be an int >= {MIN_VOCAB_SIZE} (the {len(SPECIAL_TOKENS)} special tokens plus the "
            f"256 byte symbols), got {vocab_size!r}"
        )


def wrap(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """A raw ``tokenizers.Tokenizer`` as the HF tokenizer rlk3 uses everywhere (special tokens + chat template)."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=IM_END,
        pad_token=PAD,
        extra_special_tokens=[t for t in SPECIAL_TOKENS if t not in (BOS, IM_END, PAD)],
        chat_template=chat_template(),
        # exact round trips: no "clean up" of spaces before punctuation on decode
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 30,
    )


def train_tokenizer(
    texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, out_dir: str | os.PathLike | None = None
) -> PreTrainedTokenizerFast:
    """Train byte-level BPE on ``texts``; save to ``out_dir`` (``save_pretrained`` layout) when given.

    The result has at most ``vocab_size`` ids (fewer when the corpus has too few distinct pairs to merge).
    """
    _check_vocab_size(vocab_size)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    hf = wrap(tok)
    if out_dir is not None:
        hf.save_pretrained(str(out_dir))
    return hf


def load_tokenizer(path: str | os.PathLike) -> PreTrainedTokenizerFast:
    """Load a tokenizer saved by :func:`train_tokenizer` (or any ``save_pretrained`` copy of one)."""
    tok = AutoTokenizer.from_pretrained(str(path))
    missing = [t for t in SPECIAL_TOKENS if t not in tok.get_vocab()]
    if missing:
        raise ValueError(f"{path} is not an rlk3 tokenizer: special tokens {missing} are missing")
    return tok


# ---------------------------------------------------------------------------------------------------------
# The built-in corpus: small, generated from a fixed seed, shaped like what the model reads (chat markup, JSON
# tool calls in every syntax, shell, Python, arithmetic, prose, some non-Latin text). It makes the default
# tokenizer for tests and debugging; real runs train on the synthetic task corpus instead.

_WORDS = (
    "the", "a", "an", "of", "to", "in", "and", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from",
    "it", "this", "be", "are", "or", "which", "file", "function", "value", "test", "run", "output", "error",
    "result", "number", "answer", "total", "each", "step", "first", "then", "next", "finally", "compute", "check",
    "read", "write", "list", "find", "line", "path", "name", "config", "command", "python", "code", "return",
    "print", "import", "def", "class", "if", "else", "for", "while", "try", "except", "true", "false", "none",
    "count", "sum", "add", "subtract", "multiply", "divide", "apples", "boxes", "train", "miles", "hours", "price",
    "cost", "workers", "days", "pages", "book", "store", "left", "right", "more", "less", "than", "equal", "twice",
    "half", "three", "four", "five", "dozen", "percent", "tool", "call", "argument", "result", "sandbox",
    "directory", "search", "pattern", "match", "replace", "edit", "patch", "shell", "bash", "user", "system",
    "assistant", "reasoning", "effort", "budget", "tokens", "memory", "skill", "subagent", "task", "submit", "done",
    "fixed", "bug", "failing", "passes",
)
_NAMES = ("Alice", "Bob", "Carla", "Dmitri", "Eve", "Farah", "Gus", "Hana", "Ivan", "Juno")
_UNICODE = (
    "数学题：小明有 12 个苹果。",
    "Größe, Straße, naïve café — résumé.",
    "Привет, мир! Ответ: 42.",
    "こんにちは世界。答えは 7 です。",
    "emoji ✅ ❌ 🚀 → ≤ ≥ ∑ π",
    "مرحبا بالعالم",
)


_ONSETS = ("", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v", "w", "st", "tr", "pl", "ch")
_VOWELS = ("a", "e", "i", "o", "u", "ea", "ou", "io", "y")
_CODAS = ("", "", "n", "r", "s", "t", "l", "nd", "st", "ng", "rk", "ck", "x")


def _lexicon(rng: random.Random, n: int = 3000) -> list[str]:
    """Pseudo-words from syllables: a large Zipf-distributed vocabulary gives BPE realistic merges to learn."""
    words = set()
    while len(words) < n:
        k = rng.choice((1, 2, 2, 3, 3, 4))
        words.add("".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(k)))
    return sorted(words)


def _prose(rng: random.Random, lexicon: list[str], cum: list[float]) -> str:
    n = rng.randint(6, 30)
    # half real words, half pseudo-words with Zipf weights (the word of rank r has weight 1/r)
    pseudo = rng.choices(lexicon, cum_weights=cum, k=n)
    words = [rng.choice(_WORDS) if rng.random() < 0.5 else pseudo[i] for i in range(n)]
    words[0] = words[0].capitalize()
    return " ".join(words) + rng.choice(".?!:")


def _arith(rng: random.Random) -> str:
    a, b, c = rng.randint(1, 999), rng.randint(1, 99), rng.randint(2, 12)
    who = rng.choice(_NAMES)
    return (
        f"{who} has {a} apples and buys {b} more, then splits them into {c} boxes. "
        f"Step 1: {a} + {b} = {a + b}. Step 2: {a + b} // {c} = {(a + b) // c}, remainder {(a + b) % c}.\n"
        f"Answer: {(a + b) // c}"
    )


def _python(rng: random.Random) -> str:
    f, x, y = rng.choice(["solve", "count_words", "merge", "parse_line", "total"]), "xs", rng.randint(0, 9)
    return (
        f"def {f}({x}: list[int], k: int = {y}) -> int:\n"
        f'    """Return the {rng.choice(_WORDS)} of {x}."""\n'
        f"    result = 0\n"
        f"    for i, v in enumerate({x}):\n"
        f"        if v % {rng.randint(2, 7)} == 0:\n"
        f"            result += v * k\n"
        f"    return result\n\n\n"
        f"def test_{f}():\n    assert {f}([1, 2, 3]) == {rng.randint(0, 50)}\n"
    )


def _shell(rng: random.Random) -> str:
    p = rng.choice(["src/app.py", "config.yaml", "data/input.txt", "tests/test_main.py", "README.md"])
    return rng.choice(
        [
            f"$ cat {p}\n$ grep -rn 'TODO' . | head -20\n$ python3 -m pytest -q tests\n",
            f"$ ls -la /home/user\n$ sed -n '1,40p' {p}\n$ echo $? && wc -l {p}\n",
            f"*** Begin Patch\n*** Update File: {p}\n@@ def main():\n-    x = 1\n+    x = 2\n*** End Patch\n",
        ]
    )


def _json_call(rng: random.Random) -> str:
    name = rng.choice(["Bash", "Read", "Edit", "shell", "read_file", "terminal", "exec", "ReadFile", "Grep"])
    args = {
        rng.choice(["command", "path", "file_path", "pattern"]): rng.choice(
            ["ls -la", "src/app.py", "/home/user/notes.txt", "def .*\\(", "python3 main.py"]
        )
    }
    a = json.dumps(args, ensure_ascii=False)
    return rng.choice(
        [
            f'<tool_call>\n{{"name": "{name}", "arguments": {a}}}\n</tool_call>',
            f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}functions.{name}:0{TOOL_CALL_ARGS}{a}{TOOL_CALL_END}{TOOL_CALLS_END}",
            f'<function_calls>\n<invoke name="{name}">\n<parameter name="{next(iter(args))}">'
            f"{next(iter(args.values()))}</parameter>\n</invoke>\n</function_calls>",
            f"<|channel|>commentary to=functions.{name}<|message|>{a}<|call|>",
        ]
    )


def builtin_corpus(n: int = 6000, seed: int = 0) -> list[str]:
    """A deterministic mixed corpus of ``n`` short documents (about 1.5 MB at the default size)."""
    rng = random.Random(seed)
    lexicon = _lexicon(rng)
    cum = list(itertools.accumulate(1.0 / r for r in range(1, len(lexicon) + 1)))
    makers = (_prose, _prose, _prose, _arith, _python, _shell, _json_call)
    docs = []
    for i in range(n):
        make = rng.choice(makers)
        doc = make(rng, lexicon, cum) if make is _prose else make(rng)
        if i % 50 == 0:
            doc += "\n" + rng.choice(_UNICODE)
        docs.append(doc)
    return docs


def _cache_root() -> Path:
    return Path(os.environ.get("RLK3_CACHE_DIR", Path.home() / ".cache" / "rlk3"))


@lru_cache(maxsize=4)
def default_tokenizer(vocab_size: int = DEFAULT_VOCAB_SIZE) -> PreTrainedTokenizerFast:
    """The tokenizer trained on :func:`builtin_corpus`, built once and cached under ``$RLK3_CACHE_DIR``.

    The cache key hashes everything the result depends on (corpus, vocab size, special tokens, chat template), so
    a change to any of them builds a fresh one instead of loading a stale copy.
    """
    _check_vocab_size(vocab_size)
    corpus = builtin_corpus()
    key = hashlib.sha256(
        json.dumps([corpus, vocab_size, SPECIAL_TOKENS, chat_template()], ensure_ascii=False).encode()
    ).hexdigest()[:16]
    path = _cache_root() / "tokenizers" / f"builtin-{vocab_size}-{key}"
    if (path / "tokenizer.json").exists():
        return load_tokenizer(path)
    tok = train_tokenizer(corpus, vocab_size)
    # write to a private directory and rename into place, so concurrent builders never see a half-written copy
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tok.save_pretrained(str(tmp))
    with contextlib.suppress(OSError):  # another process finished first: theirs is identical
        tmp.rename(path)
    return load_tokenizer(path) if path.exists() else tok


def special_token_ids(tok: PreTrainedTokenizerFast) -> dict[str, int]:
    return {t: tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def stop_token_ids(tok: PreTrainedTokenizerFast) -> list[int]:
    """Generation ends on these: the end of the assistant turn (and a document end, should the model emit one)."""
    return [tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(EOT)]


def assistant_mask(
    tok: PreTrainedTokenizerFast, messages: Sequence[dict], tools: Sequence[dict] | None = None, **template_kwargs
) -> tuple[list[int], list[int]]:
    """Token ids of a rendered conversation and a 0/1 mask that is 1 exactly on assistant-generated tokens.

    The mask covers each assistant turn's body and its closing ``<|im_end|>`` (the model must learn to stop), not
    the ``<|im_assistant|>`` header the prompt supplies. It comes from the template's ``{% generation %}`` blocks,
    which is also what TRL's ``SFTConfig(assistant_only_loss=True)`` reads.
    """
    out = tok.apply_chat_template(
        list(messages),
        tools=list(tools) if tools else None,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
        **template_kwargs,
    )
    return list(out["input_ids"]), list(out["assistant_masks"])
