"""CPU kernels for the rollout engine: the K3 layers' per-token work fused into single C passes (``kernels.c``).

On a CPU the torch path of a decode step is ~1,000 small ATen calls whose dispatch costs more than their arithmetic;
each kernel here does one of those runs of calls in one pass, and the matmuls stay with torch. They are built on first
use with the machine's C compiler (``cc -O3 -march=native``), cached under ``$RLK3_KERNEL_CACHE`` (default
``~/.cache/rlk3/kernels``) by a hash of the source, the flags, the compiler and the CPU's features, and loaded with
ctypes. Where no compiler works, ``available()`` is False, ``unavailable_reason()`` says why, and callers keep the
torch path; ``RLK3_CPU_KERNELS=0`` turns them off the same way.

Each wrapper names its torch reference, which the tests compare it with (``tests/rlk3/model/ops/test_cpu_kernels.py``).
Inputs are float32 CPU tensors; the wrappers check dtypes, devices, shapes, strides and indices before handing raw
pointers to C, because a wrong stride or slot there writes outside a tensor instead of raising. ``check=False`` skips
those checks (a few microseconds each, as much as a kernel's work in a decode step) for a caller that has made the
same guarantees itself: the engine's CPU runner checks its weights when it derives them and each step's slots, offsets
and block tables once per step (``rlk3.engine.runner_cpu``).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("kernels.c")
# RLK3_KERNEL_MARCH picks another target than this CPU (the tests build for AVX2 and SSE2 too: the vector width, and
# with it the reduction code, depends on it)
FLAGS = ["-O3", f"-march={os.environ.get('RLK3_KERNEL_MARCH', 'native')}", "-fPIC", "-shared", "-fopenmp-simd",
         "-fno-math-errno", "-fno-trapping-math"]

_i64, _f32, _ptr, _int = ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "rlk3_rms_norm": (None, [_i64, _i64, _ptr, _i64, _ptr, _f32, _ptr, _i64]),
    "rlk3_mix_norm": (_int, [_i64, _ptr, _i64, _i64, _ptr, _ptr, _f32, _ptr, _f32, _ptr]),
    "rlk3_kda_recurrent": (
        _int,
        [_i64, _ptr, _ptr, _i64, _i64, _i64, _ptr, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _ptr, _i64, _ptr,
         _ptr, _f32, _f32, _ptr, _f32, _ptr],
    ),
    "rlk3_mla_paged_decode": (
        _int,
        [_i64, _i64, _i64, _i64, _ptr, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _f32, _ptr],
    ),
    "rlk3_mla_decode": (
        _int,
        [_i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _ptr, _i64, _i64, _ptr, _i64, _i64, _ptr, _i64, _ptr,
         _i64, _f32, _ptr, _i64, _ptr],
    ),
    "rlk3_glu": (None, [_i64, _i64, _ptr, _i64, _i64, _i64, _int, _f32, _f32, _ptr, _i64]),
    "rlk3_latent_moe": (
        _int,
        [_i64, _i64, _i64, _i64, _i64, _i64, _ptr, _i64, _ptr, _int, _f32, _ptr, _ptr, _int, _f32, _f32, _ptr, _f32,
         _ptr, _i64],
    ),
    "rlk3_argmax_logprob": (_int, [_i64, _i64, _ptr, _i64, _ptr, _ptr]),
}


class CPUKernelError(ValueError):
    """A CPU kernel got inputs it cannot take; the message names the argument and what it should be."""


def _cache_dir() -> Path:
    return Path(os.environ.get("RLK3_KERNEL_CACHE") or Path.home() / ".cache" / "rlk3" / "kernels")


def cpuinfo_line(*keys: str) -> str | None:
    """The first ``/proc/cpuinfo`` line that starts with one of ``keys`` (None where there is no such file)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(keys):
                return line
    except OSError:
        pass
    return None


def _cpu_features() -> str:
    """What ``-march=native`` compiles for: a library built on one CPU may not run on another (a shared cache)."""
    return cpuinfo_line("flags", "Features") or platform.processor() or platform.machine()


def _build() -> Path:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise RuntimeError("no C compiler (cc or gcc) on PATH")
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256(
        "\0".join([SOURCE.read_text(), " ".join(FLAGS), version, _cpu_features()]).encode()
    ).hexdigest()[:16]
    target = _cache_dir() / f"rlk3_cpu_{key}.so"
    if target.exists():
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError:  # an unwritable home: a per-user directory under the temp dir
        target = Path(tempfile.gettempdir()) / f"rlk3-kernels-{os.getuid()}" / target.name
        if target.exists():
            return target
        target.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: processes that build at once (Ray workers) each see a whole file
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        done = subprocess.run([compiler, *FLAGS, "-o", str(out), str(SOURCE), "-lm"], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {SOURCE.name}: {done.stderr.strip()[-2000:]}")
        os.replace(out, target)
    return target


@functools.cache
def _load() -> tuple[ctypes.CDLL | None, str]:
    if os.environ.get("RLK3_CPU_KERNELS", "1") == "0":
        return None, "turned off by RLK3_CPU_KERNELS=0"
    try:
        lib = ctypes.CDLL(str(_build()))
    except Exception as e:  # no compiler, a failed build, a library that does not load: the torch path stays
        return None, f"{type(e).__name__}: {e}"
    for name, (restype, argtypes) in _SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = restype, argtypes
    return lib, ""


def available() -> bool:
    """Whether the kernels built and loaded here."""
    return _load()[0] is not None


def unavailable_reason() -> str:
    """Why ``available()`` is False ("" when it is True)."""
    return _load()[1]


def _lib() -> ctypes.CDLL:
    lib, why = _load()
    if lib is None:
        raise RuntimeError(f"rlk3 CPU kernels are unavailable: {why}")
    return lib


# ---------------------------------------------------------------------------------------------------- checks


def _f32(name: str, x: torch.Tensor, dim: int | None = None, rows_only: bool = False) -> torch.Tensor:
    """A float32 CPU tensor whose last axis is contiguous (``rows_only``: a matrix with any row stride) or which is
    contiguous as a whole."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or x.device.type != "cpu":
        what = f"{x.dtype} on {x.device}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise CPUKernelError(f"{name} must be a float32 CPU tensor, got {what}")
    if dim is not None and x.dim() != dim:
        raise CPUKernelError(f"{name} must have {dim} dimensions, got shape {list(x.shape)}")
    ok = (x.dim() == 2 and x.stride(1) == 1) if rows_only else x.is_contiguous()
    if not ok:
        raise CPUKernelError(f"{name} must be {'row-contiguous' if rows_only else 'contiguous'}, strides {x.stride()}")
    return x


def _i64(name: str, x: torch.Tensor, n: int, bound: int | None = None) -> torch.Tensor:
    if x.dtype != torch.int64 or x.device.type != "cpu" or x.dim() != 1 or x.numel() != n or not x.is_contiguous():
        raise CPUKernelError(f"{name} must be a contiguous int64 CPU vector of {n}, got {x.dtype} {list(x.shape)}")
    if bound is not None and n and (int(x.min()) < 0 or int(x.max()) >= bound):
        raise CPUKernelError(f"{name} must lie in [0, {bound}), got values in [{int(x.min())}, {int(x.max())}]")
    return x


def _shape(name: str, x: torch.Tensor, shape: tuple[int, ...]) -> None:
    if tuple(x.shape) != shape:
        raise CPUKernelError(f"{name} must be {list(shape)}, got {list(x.shape)}")


def _pages(name: str, pool: torch.Tensor, inner: tuple[int, ...]) -> int:
    """A pool ``[P, *inner]`` strided only along its page axis: returns that stride (in elements)."""
    _f32(name, pool[0] if pool.shape[0] else pool)
    if tuple(pool.shape[1:]) != inner or not pool[0].is_contiguous():
        raise CPUKernelError(f"{name} must be [P, {', '.join(map(str, inner))}] with contiguous pages, "
                             f"got {list(pool.shape)} strides {pool.stride()}")
    return pool.stride(0)


def _ok(fn: str, rc: int) -> None:
    if rc == 2:
        raise MemoryError(f"{fn}: out of memory for its work buffers")
    if rc:
        raise CPUKernelError(f"{fn}: arguments out of range (code {rc})")


def _act(act: str) -> int:
    if act not in ("situ", "silu"):
        raise CPUKernelError(f"act must be 'situ' or 'silu', got {act!r}")
    return 0 if act == "situ" else 1


# ---------------------------------------------------------------------------------------------------- kernels


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, check: bool = True) -> torch.Tensor:
    """``x [T, D]`` (any row stride) → ``weight · x / sqrt(mean(x²) + eps)``. Reference: ``layers.common.RMSNorm``."""
    if check:
        _f32("x", x, 2, rows_only=True)
        _shape("weight", _f32("weight", weight), (x.shape[1],))
    T, D = x.shape
    out = torch.empty(T, D)
    _lib().rlk3_rms_norm(T, D, x.data_ptr(), x.stride(0), weight.data_ptr(), eps, out.data_ptr(), D)
    return out


def mix_norm(sources: list[torch.Tensor], key_weight: torch.Tensor | None, query_weight: torch.Tensor | None,
             mix_eps: float, norm_weight: torch.Tensor | None, norm_eps: float, check: bool = True) -> torch.Tensor:
    """The Attention Residuals mix of ``sources`` (each ``[..., D]`` contiguous, all one shape), then an RMSNorm
    (``norm_weight`` None: none) → ``[T, D]`` for T rows. One source is just the norm. References:
    ``AttnResMixer.mix`` (``key_weight`` its ``norm_weight``, ``query_weight`` its ``proj.weight[0]``), ``RMSNorm``."""
    n = len(sources)
    first = sources[0]
    D = first.shape[-1]
    T = first.numel() // D if D else 0
    if check:
        if not 1 <= n <= 64:
            raise CPUKernelError(f"mix_norm takes 1 to 64 sources, got {n}")
        for i, src in enumerate(sources):
            _shape(f"sources[{i}]", _f32(f"sources[{i}]", src), tuple(first.shape))
        if n > 1:
            _shape("key_weight", _f32("key_weight", key_weight), (D,))
            _shape("query_weight", _f32("query_weight", query_weight), (D,))
        if norm_weight is not None:
            _shape("norm_weight", _f32("norm_weight", norm_weight), (D,))
    out = torch.empty(T, D)
    ptrs = (ctypes.c_void_p * n)(*(src.data_ptr() for src in sources))
    rc = _lib().rlk3_mix_norm(
        n, ptrs, T, D, key_weight.data_ptr() if n > 1 else None, query_weight.data_ptr() if n > 1 else None,
        mix_eps, norm_weight.data_ptr() if norm_weight is not None else None, norm_eps, out.data_ptr(),
    )
    _ok("rlk3_mix_norm", rc)
    return out


def _check_kda(proj, beta_col, gate_col, g, conv_weight_t, conv_pool, state_pool, slots, cu_seqlens, H, K, A_log,
               dt_bias, norm_weight) -> None:
    HK = H * K
    _f32("proj", proj, 2, rows_only=True)
    T = proj.shape[0]
    if proj.shape[1] < 3 * HK or not 0 <= beta_col <= proj.shape[1] - H or not 0 <= gate_col <= proj.shape[1] - HK:
        raise CPUKernelError(f"proj [T, {proj.shape[1]}] must hold q|k|v (3·{HK}) at 0, beta (H={H}) at beta_col="
                             f"{beta_col} and the gate ({HK}) at gate_col={gate_col}")
    _f32("g", g, 2, rows_only=True)
    _shape("g", g, (T, HK))
    _f32("conv_weight_t", conv_weight_t, 2)
    W = conv_weight_t.shape[0]
    _shape("conv_weight_t", conv_weight_t, (W, 3 * HK))
    _pages("conv_pool", conv_pool, (W - 1, 3 * HK))
    _pages("state_pool", state_pool, (H, K, K))
    N = slots.numel()
    _i64("slots", slots, N, bound=min(conv_pool.shape[0], state_pool.shape[0]))
    _i64("cu_seqlens", cu_seqlens, N + 1)
    if N and (int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T or bool((cu_seqlens.diff() < 0).any())):
        raise CPUKernelError(f"cu_seqlens must rise from 0 to T={T}, got {cu_seqlens.tolist()}")
    for name, x, shape in (("A_log", A_log, (H,)), ("dt_bias", dt_bias, (HK,)), ("norm_weight", norm_weight, (K,))):
        _shape(name, _f32(name, x), shape)


def kda_recurrent(
    proj: torch.Tensor, beta_col: int, gate_col: int, g: torch.Tensor, *, conv_weight_t: torch.Tensor,
    conv_pool: torch.Tensor, state_pool: torch.Tensor, slots: torch.Tensor, cu_seqlens: torch.Tensor,
    num_heads: int, head_dim: int, A_log: torch.Tensor, dt_bias: torch.Tensor, lower_bound: float,
    norm_weight: torch.Tensor, norm_eps: float, scale: float | None = None, check: bool = True,
) -> torch.Tensor:
    """K3's KDA layer between its input projections and ``o_proj``, token by token, for packed sequences that each
    continue from a pool slot (advanced in place): the causal short conv + SiLU over the slot's conv cache, the
    bounded gate, the delta-rule recurrence over the slot's V-first state, and the per-head gated RMSNorm.

    ``proj [T, ·]`` (any row stride): q|k|v before the conv at column 0 (``3·H·K``), the beta logits at ``beta_col``
    (H), the output gate at ``gate_col`` (H·K); ``g [T, H·K]``: the forget-gate input (``f_b_proj``'s output);
    ``conv_weight_t [W, 3·H·K]`` (the q, k, v conv weights side by side, transposed); ``conv_pool [P, W − 1, 3·H·K]``
    and ``state_pool [P, H, K, K]`` strided only along P; ``slots [N]`` int64; ``cu_seqlens [N + 1]`` int64 over the T
    tokens. Returns ``[T, H·K]``, ready for ``o_proj``.

    Reference: the runner's torch path (``ModelRunner._kda`` without ``o_proj``): the conv taps, ``chunk_kda`` /
    ``fused_recurrent_kda_pool`` with ``use_gate_in_kernel``, ``use_qk_l2norm_in_kernel``,
    ``use_beta_sigmoid_in_kernel``, ``state_v_first`` and a bounded gate, then ``GatedRMSNorm``."""
    H, K = num_heads, head_dim
    HK, T, W = H * K, proj.shape[0], conv_weight_t.shape[0]
    N = slots.numel()
    if check:
        _check_kda(proj, beta_col, gate_col, g, conv_weight_t, conv_pool, state_pool, slots, cu_seqlens, H, K, A_log,
                   dt_bias, norm_weight)
    conv_page, state_page = conv_pool.stride(0), state_pool.stride(0)
    out = torch.empty(T, HK)
    rc = _lib().rlk3_kda_recurrent(
        N, cu_seqlens.data_ptr(), slots.data_ptr(), H, K, W, proj.data_ptr(), proj.stride(0), beta_col, gate_col,
        g.data_ptr(), g.stride(0), conv_weight_t.data_ptr(), conv_pool.data_ptr(), conv_page, state_pool.data_ptr(),
        state_page, A_log.data_ptr(), dt_bias.data_ptr(), lower_bound, K**-0.5 if scale is None else scale,
        norm_weight.data_ptr(), norm_eps, out.data_ptr(),
    )
    _ok("rlk3_kda_recurrent", rc)
    return out


def _check_pages(latent_pages, rope_pages, block_tables, seq_lens, B, L, R):
    P, bs = latent_pages.shape[:2]
    _pages("latent_pages", latent_pages, (bs, L))
    _pages("rope_pages", rope_pages, (bs, R))
    if block_tables.dtype != torch.int64 or block_tables.dim() != 2 or block_tables.shape[0] != B or \
            block_tables.stride(1) != 1:
        raise CPUKernelError(f"block_tables must be an int64 [B={B}, ·] with contiguous rows, got "
                             f"{block_tables.dtype} {list(block_tables.shape)}")
    _i64("seq_lens", seq_lens, B)
    if B and (int(seq_lens.min()) < 1 or int(seq_lens.max()) > block_tables.shape[1] * bs):
        raise CPUKernelError(f"seq_lens must lie in [1, {block_tables.shape[1] * bs}] (the block table's width x "
                             f"block_size), got {seq_lens.tolist()}")
    used = (seq_lens + bs - 1) // bs
    cols = torch.arange(block_tables.shape[1])[None, :] < used[:, None]
    if B and bool(((block_tables < 0) | (block_tables >= P))[cols].any()):
        raise CPUKernelError(f"block_tables must name pages in [0, {P}) for every block in use")


def mla_paged_decode(q_lat: torch.Tensor, q_rope: torch.Tensor, latent_pages: torch.Tensor, rope_pages: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """One query per sequence over its paged latent cache, absorbed: ``q_lat [B, H, L]``, ``q_rope [B, H, R]``,
    pages ``[P, block_size, L]`` / ``[P, block_size, R]`` (strided only along P), ``block_tables [B, ·]`` int64,
    ``seq_lens [B]`` int64 (each >= 1) → the attended latent ``[B, H, L]``. Reference:
    ``rlk3.model.ops.mla.paged.paged_latent_attention_torch``."""
    _f32("q_lat", q_lat, 3)
    B, H, L = q_lat.shape
    _f32("q_rope", q_rope, 3)
    R = q_rope.shape[2]
    _shape("q_rope", q_rope, (B, H, R))
    _check_pages(latent_pages, rope_pages, block_tables, seq_lens, B, L, R)
    out = torch.empty(B, H, L)
    rc = _lib().rlk3_mla_paged_decode(
        B, H, L, R, q_lat.data_ptr(), q_rope.data_ptr(), latent_pages.data_ptr(), latent_pages.stride(0), L,
        rope_pages.data_ptr(), rope_pages.stride(0), R, block_tables.data_ptr(), block_tables.stride(0),
        seq_lens.data_ptr(), latent_pages.shape[1], scale, out.data_ptr(),
    )
    _ok("rlk3_mla_paged_decode", rc)
    return out


def mla_decode(q: torch.Tensor, kv_b_weight: torch.Tensor, *, num_heads: int, nope_dim: int, rope_dim: int,
               v_dim: int, latent_pages: torch.Tensor, rope_pages: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, scale: float, gate: torch.Tensor | None = None,
               check: bool = True) -> torch.Tensor:
    """An MLA layer's attention for one decode token per sequence, from its queries to ``o_proj``'s input: ``q [B,
    H·(nope + rope)]`` (any row stride), ``kv_b_weight [H·(nope + v), L]`` (``kv_b_proj.weight``), the paged cache
    as in ``mla_paged_decode``, the output gate logits ``gate [B, H·v]`` (any row stride; None: none) → ``[B, H·v]``.
    Reference: ``rlk3.model.ops.mla.paged.paged_mla_decode`` with ``split_kv_b``'s weights, then ``o ·
    sigmoid(gate)`` (``ModelRunner._mla``)."""
    H, Nn, R, V = num_heads, nope_dim, rope_dim, v_dim
    B = q.shape[0]
    L = kv_b_weight.shape[-1]
    if check:
        _f32("q", q, 2, rows_only=True)
        _shape("q", q, (B, H * (Nn + R)))
        _shape("kv_b_weight", _f32("kv_b_weight", kv_b_weight), (H * (Nn + V), L))
        if gate is not None:
            _f32("gate", gate, 2, rows_only=True)
            _shape("gate", gate, (B, H * V))
        _check_pages(latent_pages, rope_pages, block_tables, seq_lens, B, L, R)
    out = torch.empty(B, H * V)
    rc = _lib().rlk3_mla_decode(
        B, H, Nn, R, V, L, q.data_ptr(), q.stride(0), kv_b_weight.data_ptr(), latent_pages.data_ptr(),
        latent_pages.stride(0), L, rope_pages.data_ptr(), rope_pages.stride(0), R, block_tables.data_ptr(),
        block_tables.stride(0), seq_lens.data_ptr(), latent_pages.shape[1], scale,
        gate.data_ptr() if gate is not None else None, gate.stride(0) if gate is not None else 0, out.data_ptr(),
    )
    _ok("rlk3_mla_decode", rc)
    return out


def glu(y: torch.Tensor, gate_col: int, up_col: int, width: int, act: str, beta: float,
        linear_beta: float | None, check: bool = True) -> torch.Tensor:
    """``act(y[:, gate_col:+width], y[:, up_col:+width])`` → ``[T, width]``. Reference: ``layers.common.GLU``."""
    if check:
        _f32("y", y, 2, rows_only=True)
        if not (0 <= gate_col <= y.shape[1] - width and 0 <= up_col <= y.shape[1] - width):
            raise CPUKernelError(f"gate_col={gate_col} / up_col={up_col} + width={width} exceed y's {y.shape[1]} "
                                 "columns")
    T = y.shape[0]
    out = torch.empty(T, width)
    _lib().rlk3_glu(T, width, y.data_ptr(), y.stride(0), gate_col, up_col, _act(act), beta,
                    -1.0 if linear_beta is None else linear_beta, out.data_ptr(), out.stride(0))
    return out


def latent_moe(y: torch.Tensor, *, num_experts: int, top_k: int, latent: int, intermediate: int, shared: int,
               bias: torch.Tensor, renormalize: bool, scaling: float, gate_up_t: torch.Tensor, down_t: torch.Tensor,
               act: str, beta: float, linear_beta: float | None, norm_weight: torch.Tensor | None,
               norm_eps: float, check: bool = True) -> torch.Tensor:
    """A Stable LatentMoE layer between its two matmuls. ``y [T, ·]`` (any row stride): router logits (E), the routed
    input (``latent``), and the shared experts' gate and up halves (``shared`` each; 0: none). Routing as
    ``K3Router`` (sigmoid scores, top-k of scores + ``bias``, renormalised, scaled); experts ``gate_up_t [E, latent,
    2·intermediate]``, ``down_t [E, intermediate, latent]`` (``K3Experts``' weights transposed), summed in expert
    order in fp32; then ``routed_norm`` (``norm_weight``; None: none). Returns ``[T, latent + shared]``: the normed
    routed sum, then the shared activation — so one matmul with ``[routed_up_proj | shared down_proj]`` finishes the
    layer. Reference: ``rlk3.engine.runner.latent_moe`` (without its final projections)."""
    E, k, Dl, I, Is = num_experts, top_k, latent, intermediate, shared
    T = y.shape[0]
    if check:
        _f32("y", y, 2, rows_only=True)
        if y.shape[1] < E + Dl + 2 * Is:
            raise CPUKernelError(f"y needs E + latent + 2·shared = {E + Dl + 2 * Is} columns, got {y.shape[1]}")
        if not 1 <= k <= E:
            raise CPUKernelError(f"top_k must be in [1, {E}], got {k}")
        _shape("bias", _f32("bias", bias), (E,))
        _shape("gate_up_t", _f32("gate_up_t", gate_up_t), (E, Dl, 2 * I))
        _shape("down_t", _f32("down_t", down_t), (E, I, Dl))
        if norm_weight is not None:
            _shape("norm_weight", _f32("norm_weight", norm_weight), (Dl,))
    out = torch.empty(T, Dl + Is)
    rc = _lib().rlk3_latent_moe(
        T, E, k, Dl, I, Is, y.data_ptr(), y.stride(0), bias.data_ptr(), int(renormalize), scaling,
        gate_up_t.data_ptr(), down_t.data_ptr(), _act(act), beta, -1.0 if linear_beta is None else linear_beta,
        norm_weight.data_ptr() if norm_weight is not None else None, norm_eps, out.data_ptr(), out.stride(0),
    )
    _ok("rlk3_latent_moe", rc)
    return out


def argmax_logprob(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy tokens of ``logits [n, V]`` (the first largest entry) and their log-probabilities under
    ``softmax(logits)``. Reference: ``logits.argmax(-1)`` and ``log_softmax(logits).gather``."""
    _f32("logits", logits, 2, rows_only=True)
    n, V = logits.shape
    if V < 1:
        raise CPUKernelError("logits must have at least one column")
    tokens, logprobs = torch.empty(n, dtype=torch.int64), torch.empty(n)
    _ok("rlk3_argmax_logprob",
        _lib().rlk3_argmax_logprob(n, V, logits.data_ptr(), logits.stride(0), tokens.data_ptr(), logprobs.data_ptr()))
    return tokens, logprobs
