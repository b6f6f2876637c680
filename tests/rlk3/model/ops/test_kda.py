"""KDA ops: the chunkwise torch path against the naive recurrence, and our naive against FLA's."""

import functools
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rlk3.model.ops.kda import IDENTITY_LOGIT, chunk_kda, fused_recurrent_kda, naive_recurrent_kda, torch_chunk_kda
from tests._util import rel_err

TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def make_inputs(B, T, H, K, V, dtype, HV=None, decay=1.0, h0=False, raw=False):
    """Random KDA inputs. ``raw``: gate/beta logits and un-normalised q, k for the in-kernel options."""
    HV = HV or H
    q = torch.randn(B, T, H, K, dtype=dtype)
    k = torch.randn(B, T, H, K, dtype=dtype)
    if not raw:
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
    v = torch.randn(B, T, HV, V, dtype=dtype)
    g = torch.randn(B, T, HV, K, dtype=dtype) if raw else F.logsigmoid(torch.randn(B, T, HV, K, dtype=dtype)) * decay
    beta = torch.randn(B, T, HV, dtype=dtype) if raw else torch.rand(B, T, HV, dtype=dtype)
    state = torch.randn(B, HV, K, V, dtype=dtype) if h0 else None
    return q, k, v, g, beta, state


def run_both(fn_a, fn_b, inputs, kwargs, grads=True):
    """Runs two implementations on cloned leaf inputs; returns [(name, a, b)] for outputs, state and grads."""
    leaves_a = [None if t is None else t.clone().requires_grad_(grads) for t in inputs]
    leaves_b = [None if t is None else t.clone().requires_grad_(grads) for t in inputs]
    q, k, v, g, beta, h0 = leaves_a
    o_a, s_a = fn_a(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kwargs)
    q2, k2, v2, g2, b2, h02 = leaves_b
    o_b, s_b = fn_b(q2, k2, v2, g2, b2, initial_state=h02, output_final_state=True, **kwargs)
    pairs = [("o", o_a, o_b), ("state", s_a, s_b)]
    if grads:
        do, ds = torch.randn_like(o_a), torch.randn_like(s_a)
        ((o_a * do).sum() + (s_a * ds).sum()).backward()
        ((o_b * do).sum() + (s_b * ds).sum()).backward()
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), leaves_a, leaves_b):
            if a is not None:
                pairs.append((name, a.grad, b.grad))
    return pairs


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
@pytest.mark.parametrize("T", [1, 37, 64, 150, 257])
@pytest.mark.parametrize("h0", [False, True], ids=["no_h0", "h0"])
def test_chunk_equals_naive_outputs_states_and_grads(dtype, T, h0):
    inputs = make_inputs(2, T, 3, 16, 12, dtype, h0=h0)
    for chunk_size in (16, 64):
        chunked = functools.partial(torch_chunk_kda, chunk_size=chunk_size)
        for name, a, b in run_both(chunked, naive_recurrent_kda, inputs, {}):
            err = rel_err(a, b)
            assert err <= TOL[dtype], f"{name} T={T} chunk={chunk_size} {dtype}: rel err {err:.2e}"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_chunk_equals_naive_varlen(dtype):
    lengths = [5, 64, 0, 131, 1, 70]
    offs = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    T = int(offs[-1])
    q, k, v, g, beta, _ = make_inputs(1, T, 2, 16, 8, dtype)
    h0 = torch.randn(len(lengths), 2, 16, 8, dtype=dtype)
    pairs = run_both(torch_chunk_kda, naive_recurrent_kda, (q, k, v, g, beta, h0), {"cu_seqlens": offs})
    for name, a, b in pairs:
        assert rel_err(a, b) <= TOL[dtype], f"{name}: rel err {rel_err(a, b):.2e}"
    # and varlen equals running each sequence on its own
    o_var, s_var = torch_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=offs)
    for n, (a, b) in enumerate(zip(offs.tolist(), offs.tolist()[1:])):
        o_n, s_n = naive_recurrent_kda(
            q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b], initial_state=h0[n : n + 1],
            output_final_state=True,
        )
        assert rel_err(o_var[:, a:b], o_n) <= TOL[dtype]
        assert rel_err(s_var[n : n + 1], s_n) <= TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["fp64", "fp32"])
def test_in_kernel_options_gva_and_v_first(dtype):
    """Gate, l2norm and beta-sigmoid applied in the op, grouped value heads and the V-first state layout."""
    q, k, v, g, beta, _ = make_inputs(2, 45, 2, 16, 8, dtype, HV=4, raw=True)
    h0 = torch.randn(2, 4, 8, 16, dtype=dtype)  # V-first
    A_log = torch.randn(4, dtype=dtype) * 0.5
    dt_bias = torch.randn(4 * 16, dtype=dtype)
    for gate in ({"lower_bound": -5.0, "safe_gate": True}, {"lower_bound": None}):
        kwargs = dict(
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
            state_v_first=True, A_log=A_log, dt_bias=dt_bias, **gate,
        )
        for name, a, b in run_both(torch_chunk_kda, naive_recurrent_kda, (q, k, v, g, beta, h0), kwargs):
            assert rel_err(a, b) <= TOL[dtype], f"{name} {gate}: rel err {rel_err(a, b):.2e}"


def test_extreme_decay_stays_finite_and_exact():
    """A softplus gate can decay a chunk by hundreds of nats: the chunk path must not overflow."""
    q, k, v, g, beta, h0 = make_inputs(1, 128, 2, 16, 8, torch.float32, h0=True)
    g = -torch.rand_like(g) * 40  # up to -40 per token, ~-2500 nats over a chunk
    o_c, s_c = torch_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o_n, s_n = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert torch.isfinite(o_c).all() and torch.isfinite(s_c).all()
    # the state is dominated by the last few tokens; fp32 rounding of both paths sets the tolerance
    assert rel_err(o_c, o_n) <= 5e-5 and rel_err(s_c, s_n) <= 5e-5


def test_dispatch_on_cpu_runs_torch_paths():
    inputs = make_inputs(1, 40, 2, 16, 8, torch.float32, h0=True)
    q, k, v, g, beta, h0 = inputs
    o1, s1 = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o2, s2 = fused_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    o3, s3 = naive_recurrent_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    assert rel_err(o1, o3) <= 1e-5 and rel_err(s1, s3) <= 1e-5
    assert torch.equal(o2, o3) and torch.equal(s2, s3)
    with pytest.raises(RuntimeError, match="backend='fla' requested"):
        chunk_kda(q, k, v, g, beta, backend="fla")


def _load_fla_naive():
    """FLA's reference module, loaded by file path: `fla.ops` itself does not import without triton."""
    spec = importlib.util.find_spec("fla")
    assert spec is not None and spec.origin, "fla-core must be installed (test extra)"
    path = Path(spec.origin).parent / "ops" / "kda" / "naive.py"
    mod_spec = importlib.util.spec_from_file_location("fla_kda_naive_reference", path)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("HV", [3, 6], ids=["mha", "gva"])
@pytest.mark.parametrize("h0", [False, True], ids=["no_h0", "h0"])
def test_our_naive_equals_flas_naive(HV, h0):
    fla_naive = _load_fla_naive()
    q, k, v, g, beta, state = make_inputs(2, 50, 3, 16, 12, torch.float32, HV=HV, h0=h0)
    o_ref, s_ref = fla_naive.naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=state,
                                                 output_final_state=True)
    o, s = naive_recurrent_kda(q, k, v, g, beta, scale=0.3, initial_state=state, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-6 and rel_err(s, s_ref) <= 1e-6
    # and FLA's chunk reference (T a multiple of its chunk) agrees with our chunkwise form
    q, k, v, g, beta, state = make_inputs(1, 128, 3, 16, 12, torch.float32, HV=HV, h0=h0)
    o_ref, s_ref = fla_naive.naive_chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    o, s = torch_chunk_kda(q, k, v, g, beta, initial_state=state, output_final_state=True)
    assert rel_err(o, o_ref) <= 1e-5 and rel_err(s, s_ref) <= 1e-5


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda a: a.update(q=a["q"][0]), r"`q` must be \[B, T, H, K\]"),
        (lambda a: a.update(k=a["k"][:, :-1]), r"`k` must have q's shape"),
        (lambda a: a.update(v=a["v"][:, :, :1].expand(-1, -1, 5, -1)), r"multiple of H=2"),
        (lambda a: a.update(g=a["g"][..., :-1]), r"`g` must be \[B, T, HV, K\]"),
        (lambda a: a.update(beta=a["beta"][..., None]), r"`beta` must be \[B, T, HV\]"),
        (lambda a: a.update(q=a["q"].long()), r"`q` must be a floating-point tensor"),
        (lambda a: a.update(initial_state=torch.zeros(1, 2, 16, 8)), r"`initial_state` must be \[N, HV, K, V\]"),
        (lambda a: a.update(initial_state=torch.zeros(2, 2, 16, 8, dtype=torch.bfloat16)), r"must be float32"),
        (lambda a: a.update(cu_seqlens=torch.tensor([0, 10])), r"flattened to B=1"),
        (lambda a: a.update(use_gate_in_kernel=True), r"`A_log` \[HV\] is required"),
        (lambda a: a.update(use_gate_in_kernel=True, safe_gate=True, lower_bound=-7.0), r"safe range \[-5, 0\)"),
        (lambda a: a.update(chunk_size=48), r"`chunk_size` must be one of"),
    ],
)
def test_bad_inputs_name_the_argument(mutate, match):
    q, k, v, g, beta, _ = make_inputs(2, 20, 2, 16, 8, torch.float32)
    args = dict(q=q, k=k, v=v, g=g, beta=beta)
    mutate(args)
    with pytest.raises((ValueError, TypeError), match=match):
        chunk_kda(**args)


def test_bad_cu_seqlens():
    q, k, v, g, beta, _ = make_inputs(1, 20, 2, 16, 8, torch.float32)
    with pytest.raises(ValueError, match=r"end at T=20"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 19]))
    with pytest.raises(ValueError, match=r"1-D int32/int64"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0.0, 20.0]))
    # the host copy of the offsets is what gets validated when it is given (a device tensor would wait for the GPU)
    with pytest.raises(ValueError, match=r"end at T=20"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 20]), cu_seqlens_cpu=torch.tensor([0, 5, 19]))
    with pytest.raises(ValueError, match=r"`cu_seqlens_cpu` must be cu_seqlens' offsets on the host"):
        chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 20]), cu_seqlens_cpu=torch.tensor([0, 20]))
    o, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 20]), cu_seqlens_cpu=torch.tensor([0, 5, 20]))
    assert torch.equal(o, chunk_kda(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5, 20]))[0])


GATES = [{"lower_bound": -5.0, "safe_gate": True}, {"lower_bound": None}]


def _in_kernel(gate, HV, K, dtype):
    g = torch.Generator().manual_seed(1)
    return dict(use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
                state_v_first=True, A_log=torch.randn(HV, generator=g, dtype=dtype) * 0.5,
                dt_bias=torch.randn(HV * K, generator=g, dtype=dtype), **gate)


@pytest.mark.parametrize("gate", GATES, ids=["safe_gate", "softplus"])
@pytest.mark.parametrize("chunk_size", [16, 64])
def test_intermediate_states_are_the_states_entering_each_chunk(gate, chunk_size):
    """``h`` in FLA's varlen layout: sequence n's chunk j at Σ_{m<n} ceil(T_m / C) + j holds the state after its
    first j·C tokens (the naive recurrence over that prefix), even for sequences shorter than one chunk."""
    dtype, lengths = torch.float64, [5, 64, 0, 131, 1, 70]
    offs = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta, _ = make_inputs(1, int(offs[-1]), 2, 16, 8, dtype, HV=4, raw=True)
    h0 = torch.randn(len(lengths), 4, 8, 16, dtype=dtype)
    kw = _in_kernel(gate, 4, 16, dtype)
    o, s, h = torch_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=offs,
                              chunk_size=chunk_size, return_intermediate_states=True, **kw)
    o2, s2 = torch_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=offs,
                             chunk_size=chunk_size, **kw)
    assert torch.equal(o, o2) and torch.equal(s, s2)
    chunks = [-(-n // chunk_size) for n in lengths]
    assert h.shape == (1, sum(chunks), 4, 8, 16) and h.dtype == k.dtype
    at = 0
    for n, a in enumerate(offs.tolist()[:-1]):
        for j in range(chunks[n]):
            e = a + j * chunk_size
            want = h0[n : n + 1] if j == 0 else naive_recurrent_kda(
                q[:, a:e], k[:, a:e], v[:, a:e], g[:, a:e], beta[:, a:e], initial_state=h0[n : n + 1],
                output_final_state=True, **kw)[1]
            assert rel_err(h[0, at + j], want[0]) <= TOL[dtype], f"sequence {n} chunk {j}"
        at += chunks[n]
    # equal-length batches: [B, ceil(T / C)]
    q, k, v, g, beta, h0 = make_inputs(2, 100, 2, 16, 8, dtype, HV=4, raw=True)
    h0 = torch.randn(2, 4, 8, 16, dtype=dtype)
    _, _, h = torch_chunk_kda(q, k, v, g, beta, initial_state=h0, chunk_size=chunk_size,
                              return_intermediate_states=True, **kw)
    assert h.shape == (2, -(-100 // chunk_size), 4, 8, 16)
    want = naive_recurrent_kda(q[:, :chunk_size], k[:, :chunk_size], v[:, :chunk_size], g[:, :chunk_size],
                               beta[:, :chunk_size], initial_state=h0, output_final_state=True, **kw)[1]
    assert rel_err(h[:, 1], want) <= TOL[dtype]


def test_intermediate_states_refuse_inputs_that_want_gradients():
    """FLA computes ``h`` in inference mode, where nothing is differentiable: the dispatch refuses rather than
    hand back outputs that silently lose their gradients on a GPU (and keep them on the CPU)."""
    q, k, v, g, beta, h0 = make_inputs(1, 40, 2, 16, 8, torch.float32, h0=True)
    with pytest.raises(ValueError, match="return_intermediate_states` is for inference"):
        chunk_kda(q.requires_grad_(), k, v, g, beta, initial_state=h0, return_intermediate_states=True)
    with torch.no_grad():
        _, _, h = chunk_kda(q, k, v, g, beta, initial_state=h0, return_intermediate_states=True)
    assert h.shape == (1, 1, 2, 16, 8) and torch.equal(h[0, 0], h0[0])


@pytest.mark.parametrize("gate", GATES, ids=["safe_gate", "softplus"])
def test_identity_rows_leave_the_state_and_the_other_rows_alone(gate):
    """Rows with gate and beta logits ``IDENTITY_LOGIT`` are identity steps, whatever their q, k and v: inserted
    anywhere in a sequence (here: in front, and in the middle) they change neither its other rows' outputs nor its
    final state (with q = k = v = 0 they output 0). The engine aligns a KDA checkpoint to the chunk grid with
    them, their q, k, v copied from a real row (runner.KdaSplit)."""
    dtype = torch.float64
    q, k, v, g, beta, _ = make_inputs(1, 90, 2, 16, 8, dtype, HV=4, raw=True)
    h0 = torch.randn(1, 4, 8, 16, dtype=dtype)
    kw = _in_kernel(gate, 4, 16, dtype)
    o, s = torch_chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, **kw)
    real = torch.cat([torch.arange(7, 47), torch.arange(60, 110)])  # 7 rows in front, 13 after row 40
    mask = torch.ones(110, dtype=torch.bool)
    mask[real] = False
    for qkv in ("zero", "random"):
        pad = [(torch.zeros if qkv == "zero" else torch.randn)(1, 110, *t.shape[2:], dtype=dtype) * 3
               for t in (q, k, v)]
        pad += [torch.full((1, 110, *t.shape[2:]), IDENTITY_LOGIT, dtype=dtype) for t in (g, beta)]
        for p, t in zip(pad, (q, k, v, g, beta)):
            p[:, real] = t
        for fn in (torch_chunk_kda, naive_recurrent_kda):
            o_p, s_p = fn(*pad, initial_state=h0, output_final_state=True, **kw)
            assert rel_err(o_p[:, real], o) <= TOL[dtype] and rel_err(s_p, s) <= TOL[dtype], (fn.__name__, qkv)
            if qkv == "zero":
                assert torch.equal(o_p[:, mask], torch.zeros_like(o_p[:, mask])), fn.__name__


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graph-mode"])
def test_fla_intermediate_states_and_identity_rows_equal_the_torch_path(graph):
    """On FLA (eager varlen, and graph mode: offsets padded with empty sequences), ``h`` equals the torch path's,
    and identity rows in front of a sequence change neither its outputs nor its final state (what
    runner.KdaSplit relies on)."""
    dev, dtype, C = "cuda", torch.float32, 64
    lengths = [5, 130, 64, 71]
    offs = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta, _ = (t if t is None else t.to(dev) for t in make_inputs(1, int(offs[-1]), 2, 64, 64, dtype,
                                                                              raw=True))
    h0 = torch.randn(len(lengths), 2, 64, 64, device=dev)
    kw = {n: (t.to(dev) if torch.is_tensor(t) else t) for n, t in _in_kernel(GATES[0], 2, 64, dtype).items()}
    cu_cpu, init = offs, h0
    extra = {}
    if graph:  # two empty sequences at the end, as a padded engine step has
        cu_cpu = torch.cat([offs, offs[-1:].repeat(2)])
        init = torch.cat([h0, torch.zeros(2, 2, 64, 64, device=dev)])
        extra = dict(use_graph=True, max_num_seqs=len(lengths) + 2)
    outs = {}
    for backend in ("fla", "torch"):
        o, s, h = chunk_kda(q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu_cpu.to(dev),
                            cu_seqlens_cpu=cu_cpu if backend == "torch" or not graph else None, chunk_size=C,
                            backend=backend, return_intermediate_states=True,
                            **(extra if backend == "fla" else {}), **kw)
        outs[backend] = o, s[: len(lengths)], h[:, : sum(-(-n // C) for n in lengths)]
    for name, a, b in zip(("o", "final", "h"), outs["fla"], outs["torch"]):
        assert rel_err(a, b) <= 2e-3, f"{name}: rel err {rel_err(a, b):.2e}"
    # 23 identity rows in front of the second sequence: its boundary 41 rows in lands on the grid (chunk 1); their
    # q, k, v are copies of real rows (what the engine gives them), their gate and beta logits IDENTITY_LOGIT
    a, b = int(offs[1]), int(offs[2])
    pad = [torch.cat([t[:, :23] if f is None else torch.full((1, 23, *t.shape[2:]), f, device=dev), t[:, a:b]], 1)
           for t, f in zip((q, k, v, g, beta), (None, None, None, IDENTITY_LOGIT, IDENTITY_LOGIT))]
    o_p, s_p, h_p = chunk_kda(*pad, initial_state=h0[1:2], output_final_state=True, chunk_size=C, backend="fla",
                              return_intermediate_states=True, **kw)
    assert rel_err(o_p[:, 23:], outs["fla"][0][:, a:b]) <= 2e-3 and rel_err(s_p, outs["fla"][1][1:2]) <= 2e-3
    want = naive_recurrent_kda(*(t[:, a : a + 41].cpu() for t in (q, k, v, g, beta)), initial_state=h0[1:2].cpu(),
                               output_final_state=True, **{n: (t.cpu() if torch.is_tensor(t) else t)
                                                           for n, t in kw.items()})[1]
    assert rel_err(h_p[0, 1].cpu(), want[0]) <= 2e-3
