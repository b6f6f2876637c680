"""Acceptance items 1 and 2: greedy equals HF generate() and the full forward; seeded sampling, pause/resume and
extend give the same tokens as the uninterrupted computation."""

import pytest
import torch

from rlk3.engine import EngineConfig, FinishReason, RequestStatus, RolloutEngine, SamplingParams
from tests.rlk3.engine._oracle import full_forward_logprobs, hf_greedy, hf_greedy_batch, prompt

LENGTHS = [5, 9, 17, 33, 64, 65, 100, 128, 200, 257, 300, 384, 450, 513, 600, 700]


@pytest.mark.parametrize("backend", ["auto", "torch"], ids=["cpu-kernels", "torch-path"])
def test_greedy_equals_hf_generate_with_chunked_prefill_and_continuous_batching(tiny, backend):
    """16 prompts of 5-700 tokens; prefill in chunks (a 160-token budget, 48-token fair shares), at most 6
    sequences per step, requests arriving while others run and finishing at different steps. Both runners: the CPU
    kernels (the default here) and the torch path (backend="torch", the reference)."""
    cfg = EngineConfig(memory_bytes=32 * 2**20, max_tokens_per_step=160, prefill_chunk=48, max_num_seqs=6,
                       backend=backend)
    engine = RolloutEngine(tiny, cfg)
    assert engine.stats().kernels == ("cpu" if backend == "auto" else "torch")
    prompts = [prompt(n, seed=i) for i, n in enumerate(LENGTHS)]
    max_tokens = [6 + (i * 5) % 17 for i in range(len(prompts))]
    ids, results, chunked, mixed = {}, {}, False, False
    pending = list(range(len(prompts)))
    while pending or engine.has_unfinished():
        if pending and engine._steps % 3 == 0:  # arrivals while the batch runs
            for i in pending[:3]:
                ids[engine.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i], temperature=0))] = i
            pending = pending[3:]
        before = {k: r.num_computed for k, r in engine.requests.items()}
        for res in engine.step():
            results[ids[res.request_id]] = res
        grew = {k: r.num_computed - before.get(k, 0) for k, r in engine.requests.items()}
        # a prompt prefilled over several steps, and single-token decodes in the same step as a prefill chunk
        reqs = engine.requests
        chunked |= any(g > 1 and reqs[k].num_computed < reqs[k].turn_start for k, g in grew.items())
        mixed |= 1 in grew.values() and any(g > 1 for g in grew.values())
    assert chunked and mixed, "the run must have chunked a prefill and mixed decode with prefill in one step"
    hf = hf_greedy_batch(tiny, prompts, max(max_tokens))  # the same 16 prompts as one HF batch
    for i, p in enumerate(prompts):
        res = results[i]
        assert res.finish_reason == FinishReason.LENGTH and len(res.token_ids) == max_tokens[i]
        assert res.token_ids == hf[i][: max_tokens[i]], f"prompt {i} ({len(p)} tokens)"
        ref = full_forward_logprobs(tiny, p, res.token_ids)
        assert max(abs(a - b) for a, b in zip(res.logprobs, ref)) <= 1e-5, f"prompt {i}"
        assert res.versions == [0] * max_tokens[i]
        assert res.prompt_token_ids == p


def _run_alone(model, p, sampling, cfg=None, sampler="generator"):
    engine = RolloutEngine(model, cfg or EngineConfig(memory_bytes=16 * 2**20, sampler=sampler))
    return engine.generate([p], sampling)[0]


@pytest.mark.parametrize("sampler", ["generator", "counter"])  # sampling.py: both keep these guarantees
@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (50, 0.9)])
def test_seeded_sampling_is_reproducible_whatever_the_batch(tiny, sampler, top_k, top_p):
    p = prompt(40, seed=1)
    sp = SamplingParams(max_tokens=20, temperature=0.8, top_k=top_k, top_p=top_p, seed=1234)
    alone = _run_alone(tiny, p, sp, sampler=sampler)
    engine = RolloutEngine(tiny, EngineConfig(sampler=sampler, memory_bytes=16 * 2**20))
    others = [prompt(n, seed=10 + n) for n in (3, 70, 25)]
    params = [SamplingParams(max_tokens=9, temperature=1.0), sp, SamplingParams(max_tokens=30), SamplingParams()]
    batch = engine.generate([others[0], p, others[1], others[2]], params)
    assert batch[1].token_ids == alone.token_ids
    assert max(abs(a - b) for a, b in zip(batch[1].logprobs, alone.logprobs)) <= 1e-5
    other_seed = _run_alone(tiny, p, SamplingParams(**{**sp.__dict__, "seed": 99}), sampler=sampler)
    assert other_seed.token_ids != alone.token_ids  # the seed matters: this test can fail
    # the reported logprob is under softmax(logits / T) over the whole vocabulary, before top-k/top-p
    ref = full_forward_logprobs(tiny, p, alone.token_ids, temperature=0.8)
    assert max(abs(a - b) for a, b in zip(alone.logprobs, ref)) <= 1e-5


@pytest.mark.parametrize("sampler", ["generator", "counter"])  # sampling.py: both keep these guarantees
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_pause_then_resume_continues_as_if_never_paused(tiny, sampler, greedy):
    p = prompt(90, seed=2)
    sp = SamplingParams(max_tokens=24, temperature=0.0 if greedy else 1.0, seed=7)
    straight = _run_alone(tiny, p, sp, sampler=sampler)
    engine = RolloutEngine(
        tiny, EngineConfig(sampler=sampler, memory_bytes=16 * 2**20, max_tokens_per_step=24, prefill_chunk=16)
    )
    rid = engine.add_request(p, sp)
    other = engine.add_request(prompt(30, seed=3), SamplingParams(max_tokens=40))
    engine.step()  # paused in the middle of its prefill ...
    assert 0 < engine.requests[rid].num_computed < len(p)
    engine.pause(rid)
    for _ in range(3):
        engine.step()
    engine.resume(rid)
    while len(engine.result(rid).token_ids) < 10:
        engine.step()
    partial = engine.pause([rid])[0]  # ... and in the middle of decoding
    assert partial.status == RequestStatus.PAUSED and partial.finish_reason is None
    kept = engine.requests[rid].num_computed
    for _ in range(4):
        engine.step()
    assert engine.requests[rid].num_computed == kept  # nothing of it ran, and its cache is still there
    assert engine.requests[rid].has_cache
    engine.resume(rid)
    while engine.requests[rid].status != RequestStatus.FINISHED:
        engine.step()
    res = engine.result(rid)
    assert res.token_ids == straight.token_ids
    assert max(abs(a - b) for a, b in zip(res.logprobs, straight.logprobs)) <= 1e-5
    engine.abort([other])


@pytest.mark.parametrize("sampler", ["generator", "counter"])  # sampling.py: both keep these guarantees
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "seeded"])
def test_extend_equals_prefilling_the_whole_conversation(tiny, sampler, greedy):
    """Turn 1, then tool output appended with extend(): the second turn's tokens and logprobs equal a fresh
    request whose prompt is the whole conversation, and the full forward pass."""
    p, tool = prompt(150, seed=4), prompt(37, seed=5)
    t = 0.0 if greedy else 0.9
    engine = RolloutEngine(tiny, EngineConfig(sampler=sampler, memory_bytes=16 * 2**20))
    rid = engine.add_request(p, SamplingParams(max_tokens=12, temperature=t, seed=11))
    while engine.requests[rid].status != RequestStatus.FINISHED:
        engine.step()
    turn1 = engine.result(rid)
    computed_before = engine.stats().prefill_tokens
    engine.extend(rid, tool, SamplingParams(max_tokens=15, temperature=t, seed=12))
    while engine.requests[rid].status != RequestStatus.FINISHED:
        engine.step()
    turn2 = engine.result(rid)
    assert turn2.turn == 1 and turn2.prompt_token_ids == p + turn1.token_ids + tool
    assert turn2.num_cached_tokens == len(p) + len(turn1.token_ids) - 1  # all but turn 1's last token
    # only the tool output and turn 1's last token were computed: the cache was reused
    assert engine.stats().prefill_tokens - computed_before == len(tool) + 1
    fresh = _run_alone(tiny, p + turn1.token_ids + tool, SamplingParams(max_tokens=15, temperature=t, seed=12),
                       sampler=sampler)
    assert turn2.token_ids == fresh.token_ids
    assert max(abs(a - b) for a, b in zip(turn2.logprobs, fresh.logprobs)) <= 1e-5
    ref = full_forward_logprobs(tiny, turn2.prompt_token_ids, turn2.token_ids, temperature=1.0 if greedy else t)
    assert max(abs(a - b) for a, b in zip(turn2.logprobs, ref)) <= 1e-5


def test_stop_tokens_and_stop_strings(tiny):
    class Letters:  # a real (if small) detokeniser: token i is the letter chr(97 + i % 26)
        def decode(self, ids):
            return "".join(chr(97 + i % 26) for i in ids)

    p = prompt(20, seed=6)
    free = _run_alone(tiny, p, SamplingParams(max_tokens=30, temperature=0))
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20), tokenizer=Letters())
    stop_tok = free.token_ids[7]
    first = free.token_ids.index(stop_tok)
    res = engine.generate([p], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert res.finish_reason == FinishReason.STOP and res.token_ids == free.token_ids[: first + 1]
    text = Letters().decode(free.token_ids)
    target = text[10:13]
    end = text.index(target) + len(target)
    res = engine.generate([p], SamplingParams(max_tokens=30, temperature=0, stop=[target]))[0]
    assert res.finish_reason == FinishReason.STOP and res.token_ids == free.token_ids[:end]

    # every stop check decodes a bounded window of this turn's tokens; while the window reaches the turn's start,
    # after the prompt's last 4 tokens as context, twice: the context alone, then with the window
    # (engine._turn_tail_text)
    class Recording(Letters):
        windows: list[list[int]] = []

        def decode(self, ids):
            self.windows.append(list(ids))
            return super().decode(ids)

    rec = Recording()
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20), tokenizer=rec)
    res = engine.generate([p], SamplingParams(max_tokens=30, temperature=0, stop=["0"]))[0]  # never in the text
    assert res.finish_reason == FinishReason.LENGTH and res.token_ids == free.token_ids
    full, window = p + free.token_ids, 4 * 1 + 8
    expected = [[full[len(p) - 4 : len(p)], full[len(p) - 4 : len(p) + n]] for n in range(1, window + 1)]
    expected += [[free.token_ids[n - window : n]] for n in range(window + 1, 31)]
    assert rec.windows == [w for pair in expected for w in pair]


@pytest.mark.parametrize("sampler", ["generator", "counter"])  # sampling.py: both keep these guarantees
def test_top_k_one_is_greedy_and_top_p_restricts_support(tiny, sampler):
    p = prompt(30, seed=8)
    greedy = _run_alone(tiny, p, SamplingParams(max_tokens=12, temperature=0), sampler=sampler)
    k1 = _run_alone(tiny, p, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=3), sampler=sampler)
    assert k1.token_ids == greedy.token_ids
    # top-p small enough to keep only the argmax at every step: greedy again, logprobs still at T=1.5
    p1 = _run_alone(tiny, p, SamplingParams(max_tokens=12, temperature=1.5, top_p=1e-6, seed=3), sampler=sampler)
    assert p1.token_ids == greedy.token_ids
    ref = full_forward_logprobs(tiny, p, p1.token_ids, temperature=1.5)
    assert max(abs(a - b) for a, b in zip(p1.logprobs, ref)) <= 1e-5
    wide = _run_alone(tiny, p, SamplingParams(max_tokens=12, temperature=1.5, seed=3), sampler=sampler)
    assert wide.token_ids != greedy.token_ids


def test_generate_accepts_tensors_and_one_sampling_for_all(tiny):
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20))
    ps = [torch.tensor(prompt(12, seed=9)), prompt(7, seed=10)]
    out = engine.generate(ps, SamplingParams(max_tokens=5, temperature=0))
    assert [len(r.token_ids) for r in out] == [5, 5]
    assert out[0].token_ids == hf_greedy(tiny, ps[0].tolist(), 5)
    assert engine.stats().num_finished == 0  # generate() releases its requests


def test_one_token_prefill_steps_beside_decodes(tiny):
    """With a 2-token budget a 12-token prompt is prefilled one token a step while a 1-token prompt, admitted after
    it, decodes: every step has one token per sequence, and the row before the decoding one has no logits wanted (a
    regression: the all-decode batch builder once returned logits for every row, so the samples were taken from the
    wrong rows)."""
    engine = RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20, max_tokens_per_step=2, prefill_chunk=1))
    long, short = prompt(12, seed=8), prompt(1, seed=7)
    first = engine.add_request(long, SamplingParams(max_tokens=4, temperature=0))
    second = engine.add_request(short, SamplingParams(max_tokens=8, temperature=0))
    rows = []
    build = engine._decode_batch
    engine._decode_batch = lambda reqs: rows.append(build(reqs).logit_rows.tolist()) or build(reqs)
    while engine.has_unfinished():
        engine.step()
    assert [1] in rows  # an all-one-token step whose first row (the long prompt's) has no logits wanted
    for rid, p in ((first, long), (second, short)):
        res = engine.result(rid)
        assert res.token_ids == hf_greedy(tiny, p, len(res.token_ids))
        ref = full_forward_logprobs(tiny, p, res.token_ids)
        assert max(abs(x - y) for x, y in zip(res.logprobs, ref)) <= 1e-5


# -- stop strings against real tokenizers (built here from a few strings: no model hub)

_CORPUS = ["Question: what is 6 times 7? Answer: 42. Observation: the tool said 42.",
           "Thought: call the tool. Observation: done. Final answer: 42 €uro, naïve café 日本語."] * 8


def _metaspace_tokenizer():
    """A SentencePiece-style tokenizer (Llama's: BPE over Metaspace, a word's leading space is its first piece's
    "▁", which the decoder drops at the start of whatever it decodes), wrapped as the HF tokenizer a caller would
    pass. Trained to 120 pieces, " Observation:" is one token, "▁Observation:"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"],
                                                         show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def _byte_level_tokenizer():
    """A byte-level BPE tokenizer (GPT-2 style, as harness/tokenizer.py builds rlk3's): a multi-byte character may
    span several tokens, and decoding part of it gives U+FFFD."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_CORPUS, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                         initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _scripted(monkeypatch, sequences: dict[int, list[int]]):
    """Makes every draw return the token at its position of ``sequences[seed]`` (the whole sequence, prompt
    included): the counter sampler's keys carry (seed, position). The model still runs; only the draw is scripted,
    so a test can make a request generate exactly the tokens a tokenizer gives for a chosen text."""
    import rlk3.engine.engine as engine_module
    from rlk3.engine.sampling import counter_key

    by_key = {counter_key(seed): seq for seed, seq in sequences.items()}

    def draws(keys):
        return [by_key[int(seed)][int(pos)] for seed, pos in keys.tolist()]

    def sample(logits, params, generators, keys=None, cpu_kernels=False):
        return draws(keys), [0.0] * len(params)

    def sample_tensors(logits, params, generators, keys=None):
        return torch.tensor(draws(keys)), torch.zeros(len(params))

    monkeypatch.setattr(engine_module, "sample", sample)
    monkeypatch.setattr(engine_module, "sample_tensors", sample_tensors)


def _stop_engine(tiny, tokenizer, async_decode=False):
    return RolloutEngine(tiny, EngineConfig(memory_bytes=16 * 2**20, sampler="counter", async_decode=async_decode),
                         tokenizer=tokenizer)


def _run_scripted(tiny, monkeypatch, tokenizer, prompt_ids, generated, stop, max_tokens=None, async_decode=False,
                  stop_token_ids=()):
    _scripted(monkeypatch, {7: list(prompt_ids) + list(generated) + [0] * 4})  # (the look-ahead draws past the end)
    engine = _stop_engine(tiny, tokenizer, async_decode)
    sp = SamplingParams(max_tokens=max_tokens or len(generated), temperature=0, seed=7, stop=stop,
                        stop_token_ids=list(stop_token_ids))
    return engine.generate([prompt_ids], sp)[0]


@pytest.mark.parametrize("async_decode", [False, True])
def test_a_stop_string_with_a_leading_space_at_the_start_of_a_turn(tiny, monkeypatch, async_decode):
    """Metaspace: the turn's first token "▁Observation" decoded alone is "Observation" — the decoder drops the
    leading space of the first piece it is given. The stop check decoded the turn's tokens from the turn's start, so
    " Observation" was never found there (the request ran to max_tokens). vLLM's incremental detokenizer decodes
    with the prompt's last tokens as context and finds it; so must this: the turn's text is the text its tokens add
    after the context, " Observation: 42" here."""
    tok = _metaspace_tokenizer()
    prompt_ids = tok.encode("Thought: call the tool.")
    generated = tok.encode(" Observation: the tool said 42.")
    assert tok.convert_ids_to_tokens(generated[:1]) == ["▁Observation:"]  # the premise: the space is in that token
    assert tok.decode(generated[:1]) == "Observation:"  # ... which the decoder drops when it comes first
    res = _run_scripted(tiny, monkeypatch, tok, prompt_ids, generated, [" Observation"], async_decode=async_decode)
    end = next(n for n in range(1, len(generated) + 1) if "Observation" in tok.decode(generated[:n]))
    assert res.finish_reason == FinishReason.STOP and res.token_ids == generated[:end]
    # deep in a turn (the window no longer reaches its start, and is decoded without context) as well
    monkeypatch.undo()
    generated = tok.encode(" the tool said 42." * 12 + " Observation: done.")
    assert generated.index(tok.encode(" Observation:")[0]) > 4 * len(" Observation") + 8
    res = _run_scripted(tiny, monkeypatch, tok, prompt_ids, generated, [" Observation"], async_decode=async_decode)
    end = next(n for n in range(1, len(generated) + 1) if " Observation" in tok.decode(generated[:n]))
    assert res.finish_reason == FinishReason.STOP and res.token_ids == generated[:end]


def test_a_stop_string_with_a_leading_space_after_extend(tiny, monkeypatch):
    """The same at the start of a later turn: extend's appended tokens are the context the turn's first token is
    decoded after (and a stop string inside them does not end the turn: only generated text counts)."""
    tok = _metaspace_tokenizer()
    prompt_ids = tok.encode("Question: what is 6 times 7?")
    turn1 = tok.encode(" Thought: call the tool.")
    tool = tok.encode(" Observation: 42.")  # holds the stop string; it must not count
    turn2 = tok.encode(" Answer: 42. Observation: done.")
    _scripted(monkeypatch, {7: prompt_ids + turn1 + tool + turn2 + [0] * 4})
    engine = _stop_engine(tiny, tok)
    sp = SamplingParams(max_tokens=len(turn1), temperature=0, seed=7, stop=[" Observation", " Answer"])
    rid = engine.add_request(prompt_ids, sp)
    while engine.has_unfinished():
        engine.step()
    first = engine.result(rid)
    assert first.finish_reason == FinishReason.LENGTH and first.token_ids == turn1
    engine.extend(rid, tool, SamplingParams(max_tokens=len(turn2), temperature=0, seed=7, stop=[" Answer"]))
    assert tok.convert_ids_to_tokens(turn2[:1]) == ["▁Answer:"]
    engine.step()  # the extension's prefill draws the turn's first token, " Answer:"
    second = engine.result(rid)
    assert second.finish_reason == FinishReason.STOP and second.token_ids == turn2[:1]


def test_a_stop_string_completed_by_a_character_begun_in_the_prompt(tiny, monkeypatch):
    """Byte-level BPE: a prompt cut inside "€" (its first byte the prompt's last token) and a turn whose first two
    tokens complete it. Decoded from the turn's start those two bytes are U+FFFD, so "€uro" was never seen; decoded
    after the prompt's last tokens, the turn adds "€uro" (the character its tokens completed counts as the turn's, as
    vLLM's incremental detokenizer emits it with them)."""
    tok = _byte_level_tokenizer()
    e2, x82, xac = (tok.token_to_id(c) for c in "âĤ¬")  # "€" = E2 82 AC: the byte-level alphabet's symbols
    prompt_ids = [*tok.encode("Final answer: 42 ").ids, e2]
    generated = [x82, xac, *tok.encode("uro, naïve").ids]
    assert tok.decode(prompt_ids + generated).endswith("42 €uro, naïve") and "€" not in tok.decode(generated)
    res = _run_scripted(tiny, monkeypatch, tok, prompt_ids, generated, ["€uro"])
    end = next(n for n in range(1, len(generated) + 1) if "uro" in tok.decode(generated[:n]))
    assert res.finish_reason == FinishReason.STOP and res.token_ids == generated[:end]


def _completes(tok, generated, stop):
    """How many of ``generated`` end the turn on ``stop``: the first prefix whose text holds it."""
    decode = tok.decode
    return next(n for n in range(1, len(generated) + 1) if stop in decode(generated[:n]))


@pytest.mark.parametrize("async_decode", [False, True])
def test_only_this_turns_generated_text_holds_a_stop_string(tiny, monkeypatch, async_decode):
    """A stop string in the prompt, or begun in the prompt and finished by the turn, does not end the turn (vLLM
    matches only the generated text); one spanning two generated tokens does, at the token that completes it, and
    that token is kept whole in ``token_ids`` though its text runs past the stop string (vLLM keeps the token ids
    and cuts only its text)."""
    tok = _byte_level_tokenizer()
    prompt_ids = tok.encode("Observation: done. Thought: call the tool. Obs").ids  # both stops in the prompt
    generated = tok.encode("ervation: done. Final answer").ids
    res = _run_scripted(tiny, monkeypatch, tok, prompt_ids, generated, ["Observation: do", "Thought"],
                        async_decode=async_decode)
    assert res.finish_reason == FinishReason.LENGTH and res.token_ids == generated
    monkeypatch.undo()
    generated = tok.encode("ervation: done. Observation: done.").ids  # (the first "Observation: do" straddles)
    end = _completes(tok, generated, "Observation: do")
    assert [tok.decode([t]) for t in generated[end - 4 : end]] == [" Observation", ":", " ", "don"]
    res = _run_scripted(tiny, monkeypatch, tok, prompt_ids, generated, ["Observation: do"],
                        async_decode=async_decode)
    assert res.finish_reason == FinishReason.STOP and res.token_ids == generated[:end]


@pytest.mark.parametrize("async_decode", [False, True])
def test_a_stop_on_the_last_token_max_tokens_allows_is_a_stop(tiny, monkeypatch, async_decode):
    """The token that completes a stop string, or is a stop token, and is also the max_tokens-th: finish reason stop
    (the turn ended where the model meant it to; vLLM's stop strings and its V0 stop tokens say so too), with the
    step launched ahead of it (asynchronous decode) not drawing past max_tokens."""
    tok = _byte_level_tokenizer()
    prompt_ids = tok.encode("Thought: call the tool.").ids
    generated = tok.encode(" Observation: done. Final answer: 42").ids
    end = _completes(tok, generated, "answer")
    res = _run_scripted(tiny, monkeypatch, tok, prompt_ids, generated, ["answer"], max_tokens=end,
                        async_decode=async_decode)
    assert res.finish_reason == FinishReason.STOP and res.token_ids == generated[:end]
    monkeypatch.undo()
    last = generated[end - 1]
    assert last not in generated[: end - 1]
    res = _run_scripted(tiny, monkeypatch, tok, prompt_ids, generated, [], max_tokens=end,
                        async_decode=async_decode, stop_token_ids=[last])
    assert res.finish_reason == FinishReason.STOP and res.token_ids == generated[:end]
    monkeypatch.undo()
    res = _run_scripted(tiny, monkeypatch, tok, prompt_ids, generated, ["answer"], max_tokens=end - 1,
                        async_decode=async_decode)
    assert res.finish_reason == FinishReason.LENGTH and res.token_ids == generated[: end - 1]


def test_a_stop_string_with_asynchronous_decode_drops_the_token_drawn_ahead(tiny, monkeypatch):
    """Several requests, each stopping on a string mid-turn: with asynchronous decode the step launched before the
    stop was read back computed the stop's token and drew one more for it; that draw is dropped (the scripted draws
    go on past the stop, so a kept one would show), and the results equal the synchronous engine's, one more token
    cached (docs/engine.md, "Asynchronous decode")."""
    tok = _byte_level_tokenizer()
    texts = [" Observation: done. Final answer: 42", " Final answer: 42 €uro, naïve café", " the tool said 42."]
    stops = [["answer"], ["naïve"], ["never"]]
    prompts = [tok.encode(f"Question {i}: what is 6 times 7?").ids for i in range(3)]
    gens = [tok.encode(t).ids for t in texts]
    _scripted(monkeypatch, {100 + i: p + g + [0] * 4 for i, (p, g) in enumerate(zip(prompts, gens))})
    results = {}
    for async_decode in (False, True):
        engine = _stop_engine(tiny, tok, async_decode)
        params = [SamplingParams(max_tokens=len(g), temperature=0, seed=100 + i, stop=s)
                  for i, (g, s) in enumerate(zip(gens, stops))]
        ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        while engine.has_unfinished():
            engine.step()
        results[async_decode] = [engine.result(i) for i in ids]
        if async_decode:
            assert engine.stats().overlapped_steps > 0  # steps really ran ahead
        engine.check_invariants()
    for i, (sync, ahead) in enumerate(zip(results[False], results[True])):
        end = _completes(tok, gens[i], stops[i][0]) if i < 2 else len(gens[i])
        assert sync.token_ids == ahead.token_ids == gens[i][:end]
        assert sync.finish_reason == ahead.finish_reason == (FinishReason.STOP if i < 2 else FinishReason.LENGTH)
