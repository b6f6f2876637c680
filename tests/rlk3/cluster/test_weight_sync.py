"""Trainer → engine weight transfer (rlk3/cluster/weight_sync.py) between real processes: the broadcast group
(gloo here, NCCL on two GPUs in the gpu test) and CUDA IPC handles (gpu). The Ray path is in test_driver.py."""

from __future__ import annotations

import io
import socket

import pytest
import torch
import torch.multiprocessing as mp

from rlk3.cluster.weight_sync import WeightGroup, _buckets, share_cuda


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(device: str = "cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {
        "embed.weight": torch.randn(300, 64, generator=g),  # larger than the test's bucket: goes alone
        "layers.0.norm.weight": torch.randn(64, generator=g),
        "layers.0.bias_bf16": torch.randn(7, 3, generator=g).bfloat16(),
        "layers.0.mlp.gate.e_score_correction_bias": torch.randn(16, generator=g),
        "step": torch.tensor(41),  # a 0-dim int buffer
        "mask": torch.rand(5, generator=g) > 0.5,
        "lm_head.weight": torch.randn(64, 300, generator=g).half(),
    }
    return {k: v.to(device) for k, v in w.items()}


def _receive(port: int, device: str, rounds: int, q) -> None:
    torch.set_num_threads(1)
    group = WeightGroup("127.0.0.1", port, 1, device=device, bucket_bytes=4096)
    got = []
    for _ in range(rounds):
        got.append({n: t.cpu().clone() for n, t in group.recv()})
    buf = io.BytesIO()
    torch.save(got, buf)
    q.put(buf.getvalue())


def _run(device: str, recv_device: str) -> tuple[list[dict], list[int]]:
    port = _port()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_receive, args=(port, recv_device, 2, q))
    child.start()
    try:
        group = WeightGroup("127.0.0.1", port, 0, device=device, bucket_bytes=4096)
        sent = [group.send(_weights(device))]
        w2 = {k: (v * 2 if v.is_floating_point() else v) for k, v in _weights(device).items()}  # a second version
        sent.append(group.send(w2))
        got = torch.load(io.BytesIO(q.get(timeout=120)))
    finally:
        child.join(60)
    assert child.exitcode == 0
    return got, sent


def test_broadcast_delivers_every_tensor_exactly_in_two_rounds():
    got, sent = _run("cpu", "cpu")
    w = _weights()
    nbytes = sum(t.numel() * t.element_size() for t in w.values())
    assert sent == [nbytes, nbytes]
    for r, scale in enumerate((1, 2)):
        assert list(got[r]) == list(w)  # names, in send order
        for k, t in w.items():
            want = t * scale if t.is_floating_point() else t
            assert got[r][k].dtype == t.dtype and got[r][k].shape == t.shape, k
            assert torch.equal(got[r][k], want), k


def test_buckets_are_same_dtype_runs_under_the_cap():
    layout = [[k, list(t.shape), str(t.dtype)] for k, t in _weights().items()]
    buckets = list(_buckets(layout, 4096))
    assert [e for b in buckets for e in b] == layout  # every tensor once, in order
    for b in buckets:
        assert len({e[2] for e in b}) == 1
        size = sum(torch.empty(e[1], dtype=getattr(torch, e[2].split(".")[1])).nbytes for e in b)
        assert size <= 4096 or len(b) == 1
    assert len(buckets[0]) == 1  # the 76.8 KB embedding alone


def test_share_cuda_refuses_what_it_cannot_share():
    with pytest.raises(ValueError, match="'w' is on cpu; CUDA IPC needs CUDA tensors"):
        share_cuda({"w": torch.zeros(2)})


def _open_ipc(handles_bytes: bytes, q) -> None:
    import pickle

    from rlk3.cluster.weight_sync import open_cuda

    handles = pickle.loads(handles_bytes)
    out = {n: t.clone().cpu() for n, t in open_cuda(handles)}
    buf = io.BytesIO()
    torch.save(out, buf)
    q.put(buf.getvalue())


@pytest.mark.gpu
def test_cuda_ipc_handles_map_the_trainers_memory_in_another_process():
    import pickle

    w = {k: v.contiguous() for k, v in _weights("cuda").items()}
    handles = share_cuda(w)
    assert max(len(pickle.dumps(h)) for h in handles.values()) < 1024  # handles, not data
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_open_ipc, args=(pickle.dumps(handles), q))
    child.start()
    got = torch.load(io.BytesIO(q.get(timeout=120)))
    child.join(60)
    assert child.exitcode == 0
    for k, t in w.items():
        assert torch.equal(got[k], t.cpu()), k
    with pytest.raises(ValueError, match="not contiguous"):
        share_cuda({"t": torch.zeros(4, 4, device="cuda").t()})


@pytest.mark.gpu
def test_nccl_broadcast_between_two_gpus():
    if torch.cuda.device_count() < 2:
        pytest.fail("needs two GPUs (NCCL refuses two ranks on one device): run on nvidia-h200-x2")
    got, _ = _run("cuda:0", "cuda:1")
    w = _weights()
    for k, t in w.items():
        assert torch.equal(got[0][k], t) and torch.equal(got[1][k], t * 2 if t.is_floating_point() else t), k


def test_a_refused_update_still_takes_the_whole_broadcast():
    """The engine refuses a version that is not newer before it reads the stream; the rollout worker used to return
    there with the buckets unread, and the trainer's send blocked until the group's timeout (600 s by default). It
    must drain the broadcast so that the send returns at once and the next send/recv pair is in step."""
    import copy
    import threading
    import time

    from rlk3.cluster.workers import RolloutWorker
    from rlk3.engine import EngineConfig, RolloutEngine
    from rlk3.model import K3Config, K3ForCausalLM

    torch.manual_seed(0)
    model = K3ForCausalLM(K3Config.preset("k3-tiny", vocab_size=300))
    w1 = {k: v.clone() for k, v in model.state_dict().items()}
    w2 = {k: (v + 1 if v.is_floating_point() else v) for k, v in w1.items()}
    worker = RolloutWorker.__new__(RolloutWorker)  # the parts recv_weights uses, without Ray or a config tree
    worker.engine = RolloutEngine(copy.deepcopy(model).eval(), EngineConfig(memory_bytes=32 << 20))
    port, errors = _port(), []

    def receive():
        try:
            worker.wgroup = WeightGroup("127.0.0.1", port, 1, timeout_s=5, bucket_bytes=4096)
            worker.recv_weights(1)
            with pytest.raises(ValueError, match="version must be an int greater than the current 1, got 1"):
                worker.recv_weights(1)
            worker.recv_weights(2)
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    t = threading.Thread(target=receive, daemon=True)
    t.start()
    group = WeightGroup("127.0.0.1", port, 0, timeout_s=5, bucket_bytes=4096)
    start = time.monotonic()
    for w in (w1, w1, w2):  # the second is refused (version 1 again)
        group.send(w)
    t.join(30)
    assert not errors, errors
    assert time.monotonic() - start < 5  # well inside the timeout: nothing waited for it
    assert worker.engine.version == 2
    got = worker.engine.model.state_dict()
    assert all(torch.equal(got[k], w2[k]) for k in w2)
