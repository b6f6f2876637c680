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


GiB, MiB = 2**30, 2**20


def _fake_machine(tmp_path, monkeypatch, available: int, cgroup_lines: list[str], files: dict[str, object]):
    """Points the CPU memory reader (pool.MEMINFO, PROC_CGROUP, CGROUP_ROOT) at fake files: this machine's own
    cgroup, whatever it is, plays no part. (``raising=False``: before the reader had them, the real files were read
    and the sizes below came out wrong, not as a missing attribute.)"""
    from rlk3.engine import pool

    (tmp_path / "meminfo").write_text(f"MemTotal: 99999999 kB\nMemAvailable: {available // 1024} kB\n")
    (tmp_path / "cgroup").write_text("".join(line + "\n" for line in cgroup_lines))
    root = tmp_path / "sys_fs_cgroup"
    root.mkdir()
    for rel, value in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(f"{value}\n")
    monkeypatch.setattr(pool, "MEMINFO", str(tmp_path / "meminfo"), raising=False)
    monkeypatch.setattr(pool, "PROC_CGROUP", str(tmp_path / "cgroup"), raising=False)
    monkeypatch.setattr(pool, "CGROUP_ROOT", str(root), raising=False)


def test_budget_from_a_fraction_of_free_memory(tmp_path, monkeypatch):
    from rlk3.engine.pool import budget_bytes

    _fake_machine(tmp_path, monkeypatch, 8 * GiB, ["0::/"], {})  # no limit anywhere: MemAvailable
    assert budget_bytes(None, 0.25, torch.device("cpu")) == 2 * GiB
    assert budget_bytes(12345, None, torch.device("cpu")) == 12345


@pytest.mark.parametrize("case", ["v2", "v2-parent", "v2-container-root", "v2-high", "v1", "v1-unlimited",
                                  "host-smaller"])
def test_memory_fraction_on_the_cpu_respects_the_cgroup_limit(tmp_path, monkeypatch, case):
    """In a container MemAvailable is the host's: a pool sized from it (or checked against it at construction and
    reacquire_memory) passes and gets the container OOM-killed once its pages are touched. The CPU's free memory is
    the smaller of MemAvailable and the headroom of the process's memory cgroup and its ancestors (limit less
    usage, the inactive file cache not counted as used: the kernel reclaims it first)."""
    from rlk3.engine.pool import budget_bytes, device_free_bytes

    stat = f"anon 1\ninactive_file {100 * MiB}\nactive_file 5\n"
    v2 = ["0::/kubepods/pod1/ctr"]
    cases = {  # (MemAvailable, /proc/self/cgroup, files under the cgroup root, expected free bytes)
        "v2": (8 * GiB, v2, {"kubepods/pod1/ctr/memory.max": GiB, "kubepods/pod1/ctr/memory.current": 300 * MiB,
                             "kubepods/pod1/ctr/memory.stat": stat, "kubepods/memory.max": "max"},
               GiB - 200 * MiB),
        # a parent's tighter limit bounds the child
        "v2-parent": (8 * GiB, v2, {"kubepods/pod1/ctr/memory.max": GiB, "kubepods/pod1/ctr/memory.current": 0,
                                    "kubepods/pod1/memory.max": 512 * MiB, "kubepods/pod1/memory.current": 400 * MiB},
                      112 * MiB),
        # a container with its own cgroup namespace: the path names the host's hierarchy, the root is its own
        "v2-container-root": (8 * GiB, v2, {"memory.max": 2 * GiB, "memory.current": GiB}, GiB),
        "v2-high": (8 * GiB, ["0::/"], {"memory.max": "max", "memory.high": 3 * GiB, "memory.current": GiB},
                    2 * GiB),
        # v1 (this kind of VM: named and v1 hierarchies beside an empty unified one)
        "v1": (8 * GiB, ["4:memory:/process_api/x", "1:cpu:/", "0::/"],
               {"memory/process_api/x/memory.limit_in_bytes": 2 * GiB,
                "memory/process_api/x/memory.usage_in_bytes": 1536 * MiB,
                "memory/process_api/x/memory.stat": f"cache 9\ntotal_inactive_file {36 * MiB}\n",
                "memory/memory.limit_in_bytes": 9223372036854771712}, 548 * MiB),
        "v1-unlimited": (8 * GiB, ["4:memory:/process_api/x"],
                         {"memory/process_api/x/memory.limit_in_bytes": 9223372036854771712,
                          "memory/process_api/x/memory.usage_in_bytes": GiB}, 8 * GiB),
        "host-smaller": (256 * MiB, v2, {"memory.max": 2 * GiB, "memory.current": 0}, 256 * MiB),
    }
    available, lines, files, expected = cases[case]
    _fake_machine(tmp_path, monkeypatch, available, lines, files)
    assert device_free_bytes(torch.device("cpu")) == expected
    assert budget_bytes(None, 0.5, torch.device("cpu")) == expected // 2


def test_a_pool_over_the_cgroup_limit_is_refused_with_both_sizes(tiny, tmp_path, monkeypatch):
    """The engine's own check at construction reads the same number: a pool the host could hold but the container
    cannot is refused, naming both sizes, instead of being OOM-killed when its pages are touched."""
    from rlk3.engine import EngineConfig, RolloutEngine

    _fake_machine(tmp_path, monkeypatch, 64 * GiB, ["0::/"], {"memory.max": 40 * MiB, "memory.current": 30 * MiB})
    with pytest.raises(PoolError, match=rf"the pool needs \d+ bytes \(0.02 GiB\) but cpu has {10 * MiB} bytes "):
        RolloutEngine(tiny, EngineConfig(memory_bytes=16 * MiB))
    engine = RolloutEngine(tiny, EngineConfig(memory_fraction=0.5))  # 5 MiB
    assert engine.stats().pool.budget_bytes == 5 * MiB
