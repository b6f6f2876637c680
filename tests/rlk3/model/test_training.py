"""k3-tiny learns on CPU through the chunkwise KDA path."""

import torch

from rlk3.model import K3Config, K3ForCausalLM


def arithmetic_batch(generator, batch=4, length=32, modulus=64, offset=10):
    """Sequences ``(a + s·t) mod M``: each next token follows from the previous two, which the short convs and
    the KDA state must learn to read."""
    a = torch.randint(0, modulus, (batch, 1), generator=generator)
    s = torch.randint(1, 5, (batch, 1), generator=generator)
    return (a + s * torch.arange(length)) % modulus + offset


def test_k3_tiny_loss_halves_in_200_adamw_steps():
    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny")).train()
    assert model.model.layers[0].self_attn.cpu_chunk_size == 16
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(200):
        x = arithmetic_batch(gen)
        loss = model(x, labels=x, use_cache=False).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:5]) / 5, sum(losses[-10:]) / 10
    assert all(torch.isfinite(torch.tensor(losses)))
    assert last <= 0.5 * first, (first, last)
