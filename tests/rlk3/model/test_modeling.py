"""The K3 model end to end on CPU: cached decoding, generate(), packing, save/load, parameter counts."""

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM

from rlk3.model import K3Cache, K3Config, K3ForCausalLM


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config()).eval()


@torch.no_grad()
@pytest.mark.parametrize("prompt_len", [1, 15, 16, 17, 63, 64, 65, 129])
def test_incremental_decoding_equals_full_forward(tiny, prompt_len):
    """Prefill a prompt, then feed one token at a time through the cache: the logits must match a full
    forward at every position (prompt lengths crossing the 16-token sub-chunk and 64-token chunk borders)."""
    total = prompt_len + 20
    x = torch.randint(0, tiny.config.vocab_size, (2, total))
    full = tiny(x, use_cache=False).logits
    cache = K3Cache(tiny.config)
    pieces = [tiny(x[:, :prompt_len], cache=cache, use_cache=True).logits]
    for t in range(prompt_len, total):
        pieces.append(tiny(x[:, t : t + 1], cache=cache, use_cache=True).logits)
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= 1e-4
    assert cache.get_seq_length() == total
    # the cache holds what K3Config.cache_bytes says (fp32 model, fp32 state), per request
    assert cache.nbytes() == 2 * tiny.config.cache_bytes(total, torch.float32, torch.float32)


@torch.no_grad()
def test_multi_token_extends_equal_full_forward(tiny):
    """Chunks of new tokens on top of a cache (the multi-turn pattern): absorbed MLA for short extends,
    decompressed for long ones."""
    x = torch.randint(0, tiny.config.vocab_size, (1, 200))
    full = tiny(x, use_cache=False).logits
    cache, pieces, start = K3Cache(tiny.config), [], 0
    for step in (37, 5, 16, 70, 1, 71):
        pieces.append(tiny(x[:, start : start + step], cache=cache, use_cache=True).logits)
        start += step
    assert (torch.cat(pieces, dim=1) - full).abs().max() <= 1e-4


@torch.no_grad()
def test_hf_generate_greedy_equals_argmax_of_full_forward(tiny):
    x = torch.randint(0, tiny.config.vocab_size, (3, 23))
    out = tiny.generate(x, max_new_tokens=25, do_sample=False, pad_token_id=0)
    seq = x
    for _ in range(25):
        seq = torch.cat([seq, tiny(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)


@torch.no_grad()
def test_generate_with_left_padding_matches_unpadded(tiny):
    """A padded batch decodes each row as if it were alone: pads never reach a KDA state or an MLA key."""
    prompts = [torch.randint(1, tiny.config.vocab_size, (n,)) for n in (9, 30, 17)]
    width = max(len(p) for p in prompts)
    ids = torch.zeros(3, width, dtype=torch.long)
    mask = torch.zeros(3, width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = p, 1
    batched = tiny.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0)
    for i, p in enumerate(prompts):
        alone = tiny.generate(p[None], max_new_tokens=12, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[i, width:], alone[0, len(p) :])


@torch.no_grad()
def test_packed_sequences_equal_separate_forwards(tiny):
    lengths = [7, 64, 1, 40]
    seqs = [torch.randint(0, tiny.config.vocab_size, (n,)) for n in lengths]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    packed = tiny(torch.cat(seqs)[None], cu_seqlens=cu, use_cache=False).logits[0]
    for s, a, b in zip(seqs, cu.tolist(), cu.tolist()[1:]):
        alone = tiny(s[None], use_cache=False).logits[0]
        assert (packed[a:b] - alone).abs().max() <= 1e-4


def test_every_parameter_receives_gradient():
    torch.manual_seed(1)
    model = K3ForCausalLM(K3Config())
    x = torch.randint(0, model.config.vocab_size, (4, 40))
    # one step first: an AttnRes key-norm weight multiplies the zero-initialised pseudo-query, so its gradient is
    # exactly zero until the query has moved
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x, labels=x, use_cache=False).loss.backward()
    opt.step()
    opt.zero_grad()
    model(x, labels=x, use_cache=False).loss.backward()
    silent = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert silent == [], silent


def test_save_and_load_through_auto_classes(tmp_path, tiny):
    tiny.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    tensors = load_file(tmp_path / "model.safetensors")
    assert "model.layers.1.mlp.router.e_score_correction_bias" in tensors  # the QB bias travels with the weights
    assert AutoConfig.from_pretrained(tmp_path).model_type == "k3"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert type(loaded) is K3ForCausalLM
    for (n1, p1), (n2, p2) in zip(tiny.state_dict().items(), loaded.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2), n1
    x = torch.randint(0, tiny.config.vocab_size, (1, 30))
    with torch.no_grad():
        # equal weights; the loaded tensors live in other (memory-mapped) buffers, so kernels may round differently
        diff = tiny(x, use_cache=False).logits - loaded.eval()(x, use_cache=False).logits
    assert diff.abs().max() <= 1e-5


def test_k3_full_on_meta_matches_the_published_sizes():
    with torch.device("meta"):
        model = K3ForCausalLM(K3Config.preset("k3-full"))
    total = sum(p.numel() for p in model.parameters())
    active = model.num_activated_parameters()
    assert abs(total / 2.78e12 - 1) <= 0.015, total
    assert abs(active / 104.2e9 - 1) <= 0.015, active
    assert next(model.parameters()).device.type == "meta"


def test_bad_inputs_raise_clear_errors(tiny):
    with pytest.raises(ValueError, match=r"token ids must be in \[0, vocab_size=4096\), got min 0 max 5000"):
        tiny(torch.tensor([[0, 5000]]))
    with pytest.raises(ValueError, match=r"`attention_mask` must be a 2-D padding mask"):
        tiny(torch.tensor([[1, 2, 3]]), attention_mask=torch.ones(1, 5))
    with pytest.raises(ValueError, match=r"`cu_seqlens` .* cannot be combined with a cache"):
        tiny(torch.tensor([[1, 2, 3]]), cu_seqlens=torch.tensor([0, 3]), cache=K3Cache(tiny.config), use_cache=True)
    with pytest.raises(ValueError, match=r"must be 1-D offsets from 0 to T=3"):
        tiny(torch.tensor([[1, 2, 3]]), cu_seqlens=torch.tensor([0, 2]), use_cache=False)
    with pytest.raises(TypeError, match=r"the cache must be a K3Cache"):
        tiny(torch.tensor([[1, 2, 3]]), cache=object())
    cache = K3Cache(tiny.config)
    with pytest.raises(NotImplementedError, match="cannot be cropped"):
        cache.seen_tokens = 5
        cache.crop(2)
