"""The paged pool: layout arithmetic, views that never overlap, reference counting, the budget."""

import pytest
import torch

from rlk3.engine.pool import PagedPool, PoolError, PoolLayout
from rlk3.model import K3Config


def test_tiny_layout_and_views_do_not_overlap():
    cfg = K3Config()
    lay = PoolLayout.for_model(cfg, torch.float32)
    # one KDA layer: 4·32·32 fp32 state (16 KiB) + 3·128·3 fp32 conv (4.5 KiB) = 20992 B; 64 MLA tokens = 24 KiB
    assert (lay.block_size, lay.page_bytes, lay.layers_per_page, lay.pages_per_slot) == (64, 24576, 1, 6)
    assert lay.mla_token_bytes == 2 * (32 + 16) * 4
    pool = PagedPool(lay, budget=10 * lay.page_bytes + 100, device="cpu")
    assert pool.num_pages == 10 and pool.allocated_bytes == 10 * lay.page_bytes <= pool.budget
    mla = [pool.latent(0), pool.rope(0), pool.latent(1), pool.rope(1)]
    kda = [pool.kda_state(0), pool.kda_conv(0)]
    assert [tuple(v.shape[1:]) for v in mla + kda] == [(64, 32), (64, 16), (64, 32), (64, 16), (4, 32, 32), (3, 384)]
    # a page is used either as an MLA block or as KDA state: the views of one use never overlap
    for views in (mla, kda):
        for i, v in enumerate(views):  # each view written alone changes only its own bytes of page 3
            before = [w.clone() for w in views]
            v[3] = float(i + 1)
            for j, w in enumerate(views):
                if j == i:
                    assert (w[3] == i + 1).all()
                    assert torch.equal(w[:3], before[j][:3]) and torch.equal(w[4:], before[j][4:])
                else:
                    assert torch.equal(w, before[j]), (i, j)
            pool.zero([3])


@pytest.mark.parametrize("preset,dtype,block", [("k3-small", torch.bfloat16, 512), ("k3-full", torch.bfloat16, 256)])
def test_larger_presets_fit_a_kda_layer_per_page(preset, dtype, block):
    cfg = K3Config.preset(preset)
    lay = PoolLayout.for_model(cfg, dtype)
    kda_layer = cfg.kda_num_heads * cfg.kda_head_dim**2 * 4
    assert lay.block_size == block and lay.page_bytes >= kda_layer and lay.layers_per_page >= 1
    assert lay.page_bytes >= lay.block_size * lay.mla_token_bytes
    assert lay.pages_per_slot == -(-(cfg.num_hidden_layers - len(cfg.full_attn_layers)) // lay.layers_per_page)
    # K3's 576 numbers per token per MLA layer
    if preset == "k3-full":
        assert lay.mla_token_bytes == len(cfg.full_attn_layers) * 576 * 2


def test_allocation_and_reference_counts():
    lay = PoolLayout.for_model(K3Config(), torch.float32)
    pool = PagedPool(lay, budget=8 * lay.page_bytes, device="cpu")
    a = pool.alloc(5)
    assert len(set(a)) == 5 and pool.num_free == 3
    assert pool.alloc(4) is None and pool.num_free == 3  # all or nothing
    pool.incref(a[:2])
    assert pool.decref(a) == 3 and pool.num_free == 6  # the two shared pages survive
    assert pool.decref(a[:2]) == 2 and pool.num_free == 8
    with pytest.raises(PoolError, match="decref of free page"):
        pool.decref([a[0]])
    with pytest.raises(PoolError, match="incref of free page"):
        pool.incref([a[0]])
    pages = pool.alloc(2)
    with pytest.raises(PoolError, match="release with 2 pages still in use"):
        pool.release()
    pool.decref(pages)
    pool.release()
    assert pool.allocated_bytes == 0
    pool.reacquire()
    assert pool.num_free == 8 and pool.allocated_bytes == 8 * lay.page_bytes


def test_block_size_override_and_models_without_one_kind():
    lay = PoolLayout.for_model(K3Config(), torch.float32, block_size=256)
    assert lay.block_size == 256 and lay.page_bytes == 256 * lay.mla_token_bytes and lay.layers_per_page == 4
    assert lay.pages_per_slot == 2  # 6 KDA layers, 4 per page
    pool = PagedPool(lay, budget=4 * lay.page_bytes, device="cpu")
    states = [pool.kda_state(i) for i in range(4)] + [pool.kda_conv(i) for i in range(4)]
    for i, v in enumerate(states):  # four layers' states and conv caches side by side in one page
        v[1] = float(i + 1)
    assert all((v[1] == i + 1).all() for i, v in enumerate(states))
    all_kda = K3Config(num_hidden_layers=3, full_attn_layers=[], final_layer_global=False)
    lay = PoolLayout.for_model(all_kda, torch.float32)
    assert lay.mla_layers == () and lay.pages_per_slot == 3


def test_budget_from_a_fraction_of_free_memory():
    from rlk3.engine.pool import budget_bytes

    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    got = budget_bytes(None, 0.001, torch.device("cpu"))
    assert abs(got - avail * 0.001) <= 0.05 * avail * 0.001  # MemAvailable moves a little between the two reads
    assert budget_bytes(12345, None, torch.device("cpu")) == 12345
