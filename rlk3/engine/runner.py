"""One forward pass of the K3 model over a step's packed tokens, reading and writing the paged pool.

The tokens of every scheduled sequence are packed end to end (no padding). Everything per token — embeddings,
norms, Attention Residuals, the feed-forward and MoE, the LM head — runs once over the packed tokens with the
model's own modules. Only attention needs to know the sequences:

* **single-token sequences** (decode steps, and one-token prefill chunks) run as one batch: KDA through the
  state-pool recurrence that updates each sequence's slot in place (FLA's fused recurrent kernel on CUDA), MLA
  through the paged absorbed decode (a Triton kernel on CUDA) after the new latents are written to their pages;
* **multi-token sequences** (prefill chunks, extensions after a prefix hit) run KDA through ``chunk_kda`` over
  all of them at once (``cu_seqlens`` with per-sequence initial states from the pool), and MLA per sequence over
  its gathered pages with a causal mask offset by what was already cached.

The layers' weights are read from the model at call time, so an in-place weight update is seen by the next step;
the only derived tensors (q/k/v projections and conv weights side by side) are refreshed by ``refresh_weights``.
The single-token path makes no host synchronisation, so it can be captured in a CUDA graph (``cuda_graphs.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.bias import causal_lower_right

from rlk3.engine.pool import PagedPool, PoolLayout
from rlk3.model.layers.attn_res import AttnResStream, ResidualStream
from rlk3.model.layers.mla import ABSORB_MAX_QUERY_LEN
from rlk3.model.layers.moe import StableLatentMoE, add_slots, sum_in_expert_order
from rlk3.model.ops.kda import IDENTITY_LOGIT, chunk_kda, fused_recurrent_kda_pool
from rlk3.model.ops.mla import mla_attention, paged_mla_decode, split_kv_b

# Up to this many tokens a MoE layer batches its experts into one matmul per projection (``grouped_experts``; under
# CUDA-graph capture ``dense_experts``) instead of the model's loop over experts, whose per-expert overhead dominates
# a decode step. Larger batches (prefill) use the model's own dispatch on CPU, where padding every expert to the
# busiest one's count costs more than the loop saves; on CUDA the loop's ~8 launches per expert per layer (and its
# host synchronisations) are most of a prefill step's host time, so batching applies at any size there. In bf16 on
# CUDA the model's own dispatch is Hopper's grouped GEMM, which needs no host synchronisation and is used instead at
# any size (the prefill graphs capture it).
SMALL_MOE_MAX_TOKENS = 256


@dataclass
class PackedPrefill:
    """Multi-token sequences ``first .. last - 1`` (indices into ``prefill_lens``) in one masked MLA attention: their
    cached + new tokens gathered end to end, and which of those each new token may attend to."""

    first: int
    last: int
    pages: torch.Tensor  # [ΣS] page of each gathered token
    offsets: torch.Tensor  # [ΣS] its position in the page
    mask: torch.Tensor  # [Σ new tokens, ΣS] bool


@dataclass
class ForwardBatch:
    """The step's sequences: ``num_decode`` single-token sequences first, then the multi-token ones."""

    input_ids: torch.Tensor  # [T] packed tokens
    num_decode: int
    prefill_starts: list[int]  # per multi-token sequence: tokens already in the cache
    prefill_lens: list[int]  # per multi-token sequence: new tokens
    slot_pages: torch.Tensor  # [N, pages_per_slot] KDA state pages of each sequence
    block_tables: torch.Tensor  # [N, max_blocks] MLA pages of each sequence (rows padded with any page)
    seq_lens: torch.Tensor  # [N] cached + new tokens
    write_pages: torch.Tensor  # [T] page of each new token's MLA entry
    write_offsets: torch.Tensor  # [T] its position inside the page
    logit_rows: torch.Tensor  # rows of input_ids whose next-token logits are wanted
    # KDA short conv over every sequence at once, on the buffer [the N gathered conv caches (kernel − 1 rows each);
    # the T new rows]: conv_src[t, j] is the buffer row tap j of token t reads; conv_new[n] the rows that become
    # sequence n's cache
    conv_src: torch.Tensor | None = None  # [T, kernel]
    conv_new: torch.Tensor | None = None  # [N, kernel − 1]
    # MLA over runs of consecutive multi-token sequences at once (the others attend one at a time)
    packed: list[PackedPrefill] = field(default_factory=list)
    # the multi-token sequences' offsets (cu_seqlens) on the device and on the host, set by ``ModelRunner.forward``
    # (or by the builder of a padded batch)
    prefill_offsets: tuple[torch.Tensor, torch.Tensor] | None = None
    # set when the step is padded to a prefill graph's static shape (``GraphPad``)
    pad: GraphPad | None = None
    # set when a KDA checkpoint is taken inside a multi-token chunk (``KdaSplit``)
    kda_split: KdaSplit | None = None


@dataclass
class KdaSplit:
    """KDA checkpoints inside a prefill chunk (``EngineConfig.checkpoint_in_step``): a sequence whose chunk crosses a
    block boundary that wants a checkpoint runs on past it, and the checkpoint is read off the chunked kernel's
    intermediate states (the state entering each chunk of ``chunk_size`` rows, counted from the sequence's first
    row). Identity rows (gate and beta logits ``IDENTITY_LOGIT``: decay e⁰ and β = 0 leave the state as it was
    and add nothing to any other row, whatever their q, k and v) in front of a split sequence,
    ``(start − boundary) mod chunk_size`` of them, put its boundary on that grid. So a step with checkpoints is one
    KDA call per layer, like a step without: the extra work is the padded copies of the inputs (one gather of the
    conv'd q, k, v, whose identity rows repeat a real row, and a gather and a fill each for the gate and beta), a
    gather of the outputs and two small copies per checkpoint, where taking the state in a second call over the
    rows after the boundary cost ~40 more kernels per layer (docs/BENCHMARKS.md). The checkpoint is
    in the kernel's dtype for ``h``: FLA keeps its states in fp32 registers and writes ``h`` in the inputs' dtype,
    so a bf16 model's in-step checkpoints are rounded to bf16 (an fp32 model's are exact).
    Rows are indices into the step's multi-token rows; slot tensors are ``[n, pages_per_slot]`` like
    ``ForwardBatch.slot_pages``."""

    rows: torch.Tensor  # [P] each multi-token row's row in the padded KDA input (the rest: identity rows)
    src: torch.Tensor  # [R] each padded row's multi-token row (an identity row's: any real one, its q, k, v unused)
    ident: torch.Tensor  # [R − P] the identity rows among the padded ones
    kda_cu: torch.Tensor  # [M + 1] the multi-token sequences' offsets in the padded input
    hidx: torch.Tensor  # [S] each checkpoint's chunk among the kernel's intermediate states
    # [N + S, kernel − 1] rows of the conv buffer (ForwardBatch.conv_src's): every sequence's new conv cache
    # (ForwardBatch.conv_new), then the inputs before each boundary (the checkpoint's), gathered in the same pass
    conv_rows: torch.Tensor
    ckpt: torch.Tensor  # [S, pps] the checkpoint slots, which also take those conv rows
    padded_rows: int = 0  # the padded input's length
    cu_cpu: torch.Tensor | None = None  # host copy of ``kda_cu`` (the torch path and FLA's eager mode read it)
    # host, per multi-token sequence: its rows up to its boundary (all of them when it has none) and after it; the
    # CPU kernels' runner (runner_cpu.py) runs the rows before first, copies the states at the boundaries, then the
    # rows after them
    lens_before: list[int] | None = None
    lens_after: list[int] | None = None


def split_parts(P: int, M: int, S: int, layout: PoolLayout, C: int) -> list[tuple[str, tuple[int, ...]]]:
    """``KdaSplit``'s tensors (all int64) and shapes for ``P`` multi-token rows, ``M`` multi-token sequences and
    ``S`` checkpoints in a padded step, whose KDA input has room for ``C`` (the chunk size) identity rows per
    checkpoint: the order of the step's host-to-device buffer."""
    pps, W = layout.pages_per_slot, layout.conv_width
    return [("rows", (P,)), ("src", (P + C * S,)), ("ident", (C * S,)), ("kda_cu", (M + 1,)), ("hidx", (S,)),
            ("conv_rows", (M + S, W)), ("ckpt", (S, pps))]


@dataclass
class GraphPad:
    """An all-prefill step padded to a static shape (``cuda_graphs.PrefillGraphs``): ``tokens`` real tokens then
    padding up to ``input_ids``' length, ``seqs`` sequences (the real ones, one padding sequence over the padding
    tokens, then empty ones; all of them past the real ones on a scratch KDA slot and MLA page), ``logits`` real
    logit rows then rows pointing at token 0. ``prefill_starts`` / ``prefill_lens`` / ``block_tables`` / ``packed``
    describe the real sequences only: MLA attention, which runs outside the graphs, reads them. ``static`` is the
    fixed-layout head of the step's one host-to-device buffer (input ids, slot pages, MLA write pages and offsets,
    logit rows, conv gather indices, offsets), which a graph's inputs copy in one operation."""

    tokens: int
    seqs: int
    logits: int
    static: torch.Tensor
    splits: int = 0  # KdaSplit's S (the static head then holds its tensors: ``split_parts``)


def static_parts(T: int, N: int, layout: PoolLayout, S: int = 0, C: int = 0) -> list[tuple[str, tuple[int, ...]]]:
    """The fixed-layout head of a padded step's host-to-device buffer (``GraphPad.static``): each part's name and
    shape for ``T`` tokens and ``N`` sequences (and ``S`` KDA checkpoints, with KDA chunks of ``C`` rows:
    ``split_parts``). Its size depends only on (T, N, S), so a prefill graph's inputs are one buffer of that size and
    a step's are copied into it at once."""
    W, mla = layout.conv_width, bool(layout.mla_layers)
    parts = [
        ("input_ids", (T,)), ("slot_pages", (N, layout.pages_per_slot)), ("write_pages", (T if mla else 0,)),
        ("write_offsets", (T if mla else 0,)), ("logit_rows", (N,)), ("conv_src", (T, W + 1)), ("conv_new", (N, W)),
        ("cu", (N + 1,)),
    ]
    return parts + (split_parts(T, N, S, layout, C) if S else [])


def split_static(static: torch.Tensor, T: int, N: int, layout: PoolLayout, S: int = 0,
                 C: int = 0) -> dict[str, torch.Tensor]:
    """``static_parts``' views of a flat buffer."""
    parts = static_parts(T, N, layout, S, C)
    sizes = [math.prod(shape) for _, shape in parts]
    return {name: x.view(shape) for (name, shape), x in zip(parts, static.split(sizes))}


def decode_conv_indices(n: int, kernel: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``ForwardBatch.conv_src`` / ``conv_new`` of a batch of ``n`` single-token sequences, which depend only on
    ``n``: sequence t's taps read its kernel − 1 cached rows, then its new row."""
    t = torch.arange(n, device=device)[:, None]
    cache_rows = t * kernel + torch.arange(kernel, device=device)[None, :]
    return torch.cat([cache_rows, n * kernel + t], dim=1), torch.cat([cache_rows[:, 1:], n * kernel + t], dim=1)


# Under ``compile``, a MoE layer computes every expert for every token (``dense_experts``: static shapes, no host
# synchronisation, so the whole block compiles into a few fused kernels) while tokens × experts stays under this;
# larger steps batch the experts eagerly (``grouped_experts``).
DENSE_MAX_PAIRS = 1 << 16


def mix_norm(mixer, norm, stacked: torch.Tensor) -> torch.Tensor:
    """A sub-layer's input when it mixes several sources: the Attention Residuals mix, then its pre-norm."""
    return norm(mixer.mix(stacked))


def norm_only(norm, x: torch.Tensor) -> torch.Tensor:
    """A sub-layer's input when it has one source."""
    return norm(x)


def feed_forward_dense(layer, h: torch.Tensor) -> torch.Tensor:
    """The feed-forward of a normed input: the dense MLP, or the latent MoE with every expert computed."""
    if isinstance(layer.mlp, StableLatentMoE):
        return latent_moe(layer.mlp, h, dense_experts)
    return layer.mlp(h)


def kda_input(attn, qkv: torch.Tensor, f_a: torch.Tensor, cache: torch.Tensor, w_conv: torch.Tensor,
              src: torch.Tensor | None, new: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KDA's inputs after the fused projection: the causal short conv of q, k, v side by side (taps in the model's
    order) with SiLU, and the forget gate's second projection. ``qkv [T, C]`` the new rows, ``cache [N, kernel − 1,
    C]`` each sequence's previous rows. ``src`` None: one token per sequence (decode), whose window is its cache and
    the token; otherwise each tap gathers from [caches; new rows] by ``src`` and the new caches by ``new``
    (``ForwardBatch.conv_src`` / ``conv_new``). Returns (silu(conv) ``[T, C]``, ``g [T, H·K]``, new caches). One
    function so that ``compile`` fuses the taps' gathers, products and sums (12 passes over ``[T, C]`` eagerly)."""
    cache = cache.to(qkv.dtype)
    if src is None:
        buf = torch.cat([cache, qkv[:, None]], dim=1)
        taps, new_cache = [buf[:, j] for j in range(w_conv.shape[1])], buf[:, 1:]
    else:
        buf = torch.cat([cache.reshape(-1, cache.shape[-1]), qkv])
        taps, new_cache = [buf[src[:, j]] for j in range(w_conv.shape[1])], buf[new]
    y = torch.zeros_like(qkv)
    for j, tap in enumerate(taps):
        y = y + tap * w_conv[:, j].to(qkv.dtype)
    return F.silu(y), attn.f_b_proj(f_a), new_cache


def mla_input(attn, q: torch.Tensor, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MLA's query (through its low-rank half's norm and up-projection, when it has one) and the normed KV latent,
    from the fused projection's slices: one compiled block instead of two eager norms."""
    if not hasattr(attn, "q_proj"):
        q = attn.q_b_proj(attn.q_a_layernorm(q))
    return q, attn.kv_a_layernorm(latent)


def kda_output(attn, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """KDA's gated output norm and projection: ``o [T, H, K]``, the gate input ``[T, ·]``."""
    T, H, K = o.shape
    if not hasattr(attn, "g_proj"):  # Kimi Linear's low-rank output gate
        gate = attn.g_b_proj(gate)
    return attn.o_proj(attn.o_norm(o, gate.view(T, H, K)).reshape(T, H * K))


def mla_output(attn, o: torch.Tensor, gate: torch.Tensor | None) -> torch.Tensor:
    """MLA's output gate and projection: ``o [T, H, v]``."""
    T, H, V = o.shape
    if gate is not None:
        o = o * torch.sigmoid(gate).view(T, H, V)
    return attn.o_proj(o.reshape(T, H * V))


class ModelRunner:
    """``compile``: the per-token blocks between the attention kernels (the Attention Residuals mix and pre-norms,
    the feed-forward, the attention inputs after their fused projection — KDA's short conv and forget-gate
    projection, MLA's query and latent norms — and the attention outputs) run through ``torch.compile`` with dynamic
    shapes (the layers share compiled code; new step sizes may still compile once). Each block becomes a few fused
    kernels instead of tens of small ones: on an H200 a captured k3-small decode step took half the GPU time
    (docs/BENCHMARKS.md). Off (the engine's default on CPU, where compiling gains nothing measurable), everything
    runs eagerly with the model's own modules."""

    def __init__(self, model, layout: PoolLayout, backend: str = "auto", compile: bool = False,
                 cudnn: bool = False):
        self.model = model
        self.config = model.config
        self.layers = model.model.layers
        self.layout = layout
        self.backend = "torch" if backend == "torch" else None  # None: the ops pick FLA/Triton on CUDA
        self.kda_ordinal = {layer: i for i, layer in enumerate(layout.kda_layers)}
        self.mla_ordinal = {layer: i for i, layer in enumerate(layout.mla_layers)}
        self._fused: dict[int, list[torch.Tensor]] = {}
        self._splits: dict[int, list[int]] = {}
        self.sync_ok = True  # False while a CUDA graph is being captured: no host synchronisation then
        self.kda_chunk_size = model.config.kda_chunk_size  # every KDA layer's chunk: KdaSplit aligns to its grid
        self.compiled = compile
        self.cudnn = cudnn  # EngineConfig.cudnn_attention
        fns = (mix_norm, norm_only, feed_forward_dense, kda_input, kda_output, mla_input, mla_output)
        if compile:
            fns = tuple(torch.compile(f, dynamic=True) for f in fns)
        (self._mix_norm, self._norm, self._ffn_dense, self._kda_input, self._kda_output, self._mla_input,
         self._mla_output) = fns
        self.refresh_weights()

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """Rebuilds the derived weights after a weight update, in place (captured CUDA graphs stay valid): every
        projection a layer applies to its input, side by side (one matmul instead of five), and KDA's q/k/v conv
        weights side by side."""
        for idx, layer in enumerate(self.layers):
            attn = layer.self_attn
            if layer.kind == "kda":
                gate = attn.g_proj.weight if hasattr(attn, "g_proj") else attn.g_a_proj.weight
                w_in = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.f_a_proj.weight,
                        attn.b_proj.weight, gate]
                derived = [torch.cat(w_in), torch.cat([attn.q_conv.weight, attn.k_conv.weight, attn.v_conv.weight])]
            else:
                q = attn.q_proj.weight if hasattr(attn, "q_proj") else attn.q_a_proj.weight
                w_in = [q, attn.kv_a_proj_with_mqa.weight] + ([attn.g_proj.weight] if attn.g_proj is not None else [])
                derived = [torch.cat(w_in)]
            if idx in self._fused:
                for old, new in zip(self._fused[idx], derived):
                    old.copy_(new)
            else:
                self._fused[idx] = derived
            sizes = [w.shape[0] for w in w_in]
            self._splits[idx] = [sum(sizes[:3]), *sizes[3:]] if layer.kind == "kda" else sizes

    @torch.no_grad()
    def forward(self, pool: PagedPool, batch: ForwardBatch, attend=None) -> torch.Tensor:
        """Runs the model over the batch, updating the pool; returns logits ``[len(logit_rows), vocab]``.
        ``attend(idx, attn, q_nope, q_rope, pool, batch) -> [T, H, v]``: how each MLA layer's attention core runs
        (default ``mla_attend``); the prefill graphs end one captured piece and begin the next there."""
        core = self.model.model
        if batch.prefill_lens and batch.prefill_offsets is None:  # once per step, for every KDA layer: the host
            # copy spares FLA a device read each
            cu = torch.tensor([0, *itertools.accumulate(batch.prefill_lens)])
            batch.prefill_offsets = (cu.to(batch.input_ids.device), cu)
        x = core.embed_tokens(batch.input_ids)[None]  # [1, T, hidden]
        if self.config.attn_res_block_size > 0:
            stream = AttnResStream(x, self.config.attn_res_block_size)
        else:
            stream = ResidualStream(x)
        for i, layer in enumerate(self.layers):
            stream.begin_layer(i)
            h = self._read(stream, layer.attn_res, layer.input_layernorm)[0]
            if layer.kind == "kda":
                out = self._kda(i, layer.self_attn, h, pool, batch)
            else:
                out = self._mla(i, layer.self_attn, h, pool, batch, attend or self.mla_attend)
            stream.write(out[None])
            stream.write(self._feed_forward(layer, self._read(stream, layer.mlp_res, layer.post_attention_layernorm)))
        return self.model.lm_head(self._final(stream, batch.logit_rows))

    def _final(self, stream, rows: torch.Tensor) -> torch.Tensor:
        """The final norm of the stream's last read (the output mix) at the rows whose logits are wanted."""
        core = self.model.model
        return core.norm(stream.final(core.output_res)[0, rows])

    def _read(self, stream, mixer, norm) -> torch.Tensor:
        """``norm(stream.read(mixer))``, the same operations, with the stacking outside the compiled part."""
        sources = stream.sources()
        if len(sources) == 1:
            return self._norm(norm, sources[0])
        return self._mix_norm(mixer, norm, torch.stack(sources, dim=-2))

    # -- KDA

    def _kda(self, idx: int, attn, h: torch.Tensor, pool: PagedPool, b: ForwardBatch) -> torch.Tensor:
        T = h.shape[0]
        H, K = attn.num_heads, attn.head_dim
        w_in, w_conv = self._fused[idx]
        page_col, position = self.layout.kda_position(self.kda_ordinal[idx])
        states, convs = pool.kda_state(position), pool.kda_conv(position)
        pages = b.slot_pages[:, page_col]
        nd = b.num_decode

        # q, k, v (conv'd together), the forget-gate input, beta, the output gate: one matmul
        qkv, f_a, beta, gate = F.linear(h, w_in).split(self._splits[idx], dim=-1)
        sp = b.kda_split
        # with checkpoints the conv gathers also take the conv caches at the boundaries (KdaSplit.conv_rows)
        src, new = (None, None) if nd == T else (b.conv_src, b.conv_new if sp is None else sp.conv_rows)
        conv, g, cache = self._kda_input(attn, qkv, f_a, convs[pages], w_conv, src, new)
        if sp is not None:
            convs[sp.ckpt[:, page_col]] = cache[pages.shape[0] :].to(convs.dtype)
            cache = cache[: pages.shape[0]]
        convs[pages] = cache.to(convs.dtype)
        q, k, v = (t.view(T, H, K) for t in conv.chunk(3, dim=-1))
        g = g.view(T, H, K)
        kwargs = dict(
            A_log=attn.A_log, dt_bias=attn.dt_bias, lower_bound=attn.lower_bound, use_gate_in_kernel=True,
            use_qk_l2norm_in_kernel=True, use_beta_sigmoid_in_kernel=True, state_v_first=True, backend=self.backend,
        )
        outs = []
        if nd:
            o = fused_recurrent_kda_pool(
                q[:nd, None], k[:nd, None], v[:nd, None], g[:nd, None], beta[:nd, None], states, pages[:nd],
                check_unique=False, **kwargs,
            )
            outs.append(o[:, 0])
        if b.prefill_lens or b.pad is not None:
            x = (q[nd:], k[nd:], v[nd:], g[nd:], beta[nd:])
            if sp is None:
                outs.append(self._chunk(attn, x, states, page_col, *b.prefill_offsets, b, kwargs))
            else:  # the rows in their padded places, identity rows around them; the states at the boundaries from h
                qkv_p = conv[nd:].index_select(0, sp.src).view(-1, 3, H, K)  # identity rows: copies of a real row
                g_p, beta_p = (t.index_select(0, sp.src).index_fill_(0, sp.ident, IDENTITY_LOGIT) for t in x[3:])
                x = (qkv_p[:, 0], qkv_p[:, 1], qkv_p[:, 2], g_p, beta_p)
                o, h = self._chunk(attn, x, states, page_col, sp.kda_cu, sp.cu_cpu, b, kwargs, intermediate=True)
                states[sp.ckpt[:, page_col]] = h[0, sp.hidx].to(states.dtype)
                outs.append(o[sp.rows])
        o = torch.cat(outs) if len(outs) > 1 else outs[0]
        return self._kda_output(attn, o, gate)

    def _chunk(self, attn, x, states, col: int, cu, cu_cpu, b: ForwardBatch, kwargs, intermediate: bool = False):
        """``chunk_kda`` over rows ``x = (q, k, v, g, beta)`` in segments ``cu``, the step's multi-token sequences, each
        from the state in its slot and back into it (this layer's column ``col``); returns the output ``[rows, H, V]``
        (and with ``intermediate`` the states entering each chunk, ``chunk_kda``'s ``h``). A padded step indexes its
        chunks on the device over a fixed number of segments (FLA's graph mode: no host read, capturable)."""
        graph = dict(use_graph=True, max_num_seqs=cu.shape[0] - 1) if b.pad is not None else {}
        q, k, v, g, beta = (t[None] for t in x)
        slots = b.slot_pages[b.num_decode :, col]
        o, last, *h = chunk_kda(q, k, v, g, beta, initial_state=states[slots], output_final_state=True,
                                cu_seqlens=cu, cu_seqlens_cpu=cu_cpu, safe_gate=attn.bounded,
                                chunk_size=attn.chunk_size, return_intermediate_states=intermediate, **graph, **kwargs)
        states[slots] = last
        return (o[0], h[0]) if intermediate else o[0]

    # -- MLA

    def _mla(self, idx: int, attn, h: torch.Tensor, pool: PagedPool, b: ForwardBatch, attend) -> torch.Tensor:
        T = h.shape[0]
        H = attn.num_heads
        # the query (or its low-rank half), the KV latent + rope slice, the output gate: one matmul
        q, kv, *gate = F.linear(h, self._fused[idx][0]).split(self._splits[idx], dim=-1)
        latent, k_rope = kv.split([attn.kv_lora_rank, attn.rope_dim], dim=-1)
        q, latent = self._mla_input(attn, q, latent)
        q_nope, q_rope = q.view(T, H, -1).split([attn.nope_dim, attn.rope_dim], dim=-1)
        m = self.mla_ordinal[idx]
        latent_pages, rope_pages = pool.latent(m), pool.rope(m)
        # the new tokens' entries first: a decode token attends to itself through its page
        latent_pages[b.write_pages, b.write_offsets] = latent.to(latent_pages.dtype)
        rope_pages[b.write_pages, b.write_offsets] = k_rope.to(rope_pages.dtype)
        o = attend(idx, attn, q_nope, q_rope, pool, b)  # [T, H, v]
        return self._mla_output(attn, o, gate[0] if gate else None)

    def mla_attend(self, idx: int, attn, q_nope: torch.Tensor, q_rope: torch.Tensor, pool: PagedPool,
                   b: ForwardBatch) -> torch.Tensor:
        """An MLA layer's attention core over the step's sequences, their new entries already in the pages:
        ``[T, H, v]`` for the queries ``q_nope [T, H, nope]``, ``q_rope [T, H, rope]`` of ``b``'s tokens."""
        H = attn.num_heads
        m = self.mla_ordinal[idx]
        latent_pages, rope_pages = pool.latent(m), pool.rope(m)
        h = q_nope  # the activations' device and dtype
        w_uk, w_uv = split_kv_b(attn.kv_b_proj.weight, H, attn.nope_dim, attn.v_dim)
        nd = b.num_decode
        outs = []
        if nd:
            outs.append(self._paged_decode(q_nope[:nd], q_rope[:nd], latent_pages, rope_pages, b.block_tables[:nd],
                                           b.seq_lens[:nd], w_uk, w_uv, attn.scale))
        packed = {group.first: group for group in b.packed}
        offset, bs, j = nd, self.layout.block_size, 0
        while j < len(b.prefill_lens):
            group = packed.get(j)
            if group is not None:  # a run of sequences in one masked attention
                n = sum(b.prefill_lens[group.first : group.last])
                lat = latent_pages[group.pages, group.offsets][None].to(h.dtype)
                rope = rope_pages[group.pages, group.offsets][None].to(h.dtype)
                qn, qr = q_nope[None, offset : offset + n], q_rope[None, offset : offset + n]
                outs.append(prefill_attention(qn, qr, lat, rope, w_uk, w_uv, attn.scale, group.mask[None])[0])
                offset, j = offset + n, group.last
                continue
            start, n = b.prefill_starts[j], b.prefill_lens[j]
            S = start + n
            table = b.block_tables[nd + j, : math.ceil(S / bs)]
            lat = latent_pages[table].reshape(-1, latent_pages.shape[-1])[:S][None].to(h.dtype)
            rope = rope_pages[table].reshape(-1, rope_pages.shape[-1])[:S][None].to(h.dtype)
            qn, qr = q_nope[None, offset : offset + n], q_rope[None, offset : offset + n]
            if start == 0:  # a fresh prefill: plain causal attention, the same call the model makes
                o = prefill_attention(qn, qr, lat, rope, w_uk, w_uv, attn.scale, causal=True, cudnn=self.cudnn)
            elif n <= ABSORB_MAX_QUERY_LEN:  # a short extension: the absorbed form, as the model does
                q_pos = torch.arange(start, S, device=h.device)
                mask = (torch.arange(S, device=h.device)[None, :] <= q_pos[:, None])[None]
                o = mla_attention(qn, qr, lat, rope, w_uk, w_uv, attn.scale, mask, absorbed=True)
            else:  # a long extension of a cached prefix (the next turn of an episode)
                o = prefill_attention(qn, qr, lat, rope, w_uk, w_uv, attn.scale, prefix=start, cudnn=self.cudnn)
            outs.append(o[0])
            offset, j = offset + n, j + 1
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def _paged_decode(self, q_nope, q_rope, latent_pages, rope_pages, tables, seq_lens, w_uk, w_uv, scale):
        """The single-token rows' attention over their paged latents (``paged_mla_decode``): ``[nd, H, v]``."""
        return paged_mla_decode(q_nope, q_rope, latent_pages, rope_pages, tables, seq_lens, w_uk, w_uv, scale,
                                backend=self.backend)

    # -- feed-forward

    def _feed_forward(self, layer, h: torch.Tensor) -> torch.Tensor:
        """The feed-forward of the normed input ``h [1, T, D]``."""
        tokens = h.shape[0] * h.shape[1]
        if not isinstance(layer.mlp, StableLatentMoE):
            return self._ffn_dense(layer, h)
        experts = layer.mlp.experts
        if self.compiled and tokens * experts.num_experts <= DENSE_MAX_PAIRS:
            return self._ffn_dense(layer, h)
        if experts._grouped_ok(h):  # Hopper's grouped GEMM (bf16): no host synchronisation, so also under capture
            return latent_moe(layer.mlp, h, model_experts)
        if self.compiled and not self.sync_ok:
            return self._ffn_dense(layer, h)
        if tokens <= SMALL_MOE_MAX_TOKENS or h.is_cuda:
            return latent_moe(layer.mlp, h, grouped_experts if self.sync_ok else dense_experts)
        return layer.mlp(h)


# cuDNN's fused attention builds an execution plan for every new shape (on an H200, 40-100 ms for a causal call,
# ~1.1 s with a boolean mask), and PyTorch's SDPA picks it for half-precision causal and masked calls there. An RL
# engine sees new lengths every step, so unpadded calls never go to cuDNN (NO_CUDNN: FlashAttention-2, or the
# memory-efficient kernel for masks). ``EngineConfig.cudnn_attention`` opts in to cuDNN for causal calls padded to a
# few shapes: each length to the next multiple of 1/16-1/32 of its magnitude (at least CUDNN_MIN_QUANTUM), under
# 6.25% more work. Below CUDNN_MIN_QUERIES new tokens an extension keeps FlashAttention-2, which splits the keys
# across the GPU where cuDNN leaves most of it idle (4x slower for 128 queries over 20K keys). docs/BENCHMARKS.md has
# the measurements, and why it is not the default.
CUDNN_MIN_QUANTUM = 128
CUDNN_MIN_QUERIES = 512
NO_CUDNN = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def attention_bucket(n: int) -> int:
    """The padded length of ``n`` rows in a cuDNN attention call."""
    q = max(CUDNN_MIN_QUANTUM, 1 << max(0, (n - 1).bit_length() - 5))
    return -(-n // q) * q


def decompress_kv(latent: torch.Tensor, k_rope: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor):
    """Cached MLA entries decompressed straight into SDPA's padded heads: keys ``[B, H, S, D]`` =
    ``[W_UK_h·latent ; k_rope ; 0]``, values ``[W_UV_h·latent ; 0]``, D = max(nope + rope, v). Each per-head matmul
    writes its columns of the padded tensor in place (``bmm`` into a strided view: BLAS takes the row stride as its
    leading dimension, and the latent is broadcast over the heads with a zero batch stride, not copied), the rope
    slice and the padding are filled around it. The decompress-concatenate-pad sequence it replaces kept three
    intermediates of a long prefix's size alive; this allocates only the keys and values (0.60-0.63 of the peak memory,
    docs/BENCHMARKS.md, ``bench/prefill_kv.py``). Inference only: an ``out=`` matmul has no autograd, so weights that
    require grad (the model's own parameters, sliced) are detached."""
    (B, S, L), (H, nope, _), R, v_dim = latent.shape, w_uk.shape, k_rope.shape[-1], w_uv.shape[1]
    D = max(nope + R, v_dim)
    k, v = latent.new_empty(B, H, S, D), latent.new_empty(B, H, S, D)
    w_k, w_v = (w.detach().to(latent.dtype).transpose(1, 2) for w in (w_uk, w_uv))
    for b in range(B):
        lat = latent[b].expand(H, S, L)
        torch.bmm(lat, w_k, out=k[b, :, :, :nope])
        torch.bmm(lat, w_v, out=v[b, :, :, :v_dim])
    k[..., nope : nope + R] = k_rope[:, None]
    if nope + R < D:
        k[..., nope + R :] = 0
    if v_dim < D:
        v[..., v_dim:] = 0
    return k, v


def prefill_attention(q_nope, q_rope, latent, k_rope, w_uk, w_uv, scale, mask=None, causal=False,
                      prefix: int = 0, cudnn: bool = False) -> torch.Tensor:
    """``mla_attention(..., absorbed=False)`` (decompress K/V, then SDPA) with the value heads zero-padded to the
    query/key head dim (or the reverse): PyTorch's fused CPU attention kernel needs one head dim for q, k and v and
    otherwise falls back to a path that materialises every score (3-5x slower at long context). Zero columns change
    nothing: padded query/key dims add 0 to every score, padded value dims are sliced off (``decompress_kv``).
    ``[B, T, H, v]``.

    ``prefix`` > 0: the queries are the last ``T`` of ``S = prefix + T`` positions and attend causally (a cached
    prefix and its extension). On CPU that runs as two fused flash calls merged by their log-sum-exps
    (``_prefix_causal``: a ``[T, S]`` mask would send it to a slower path). On CUDA it is one call with PyTorch's
    lower-right causal bias, which the fused kernels (FlashAttention-2) apply without a mask tensor: 1.10-1.27x
    faster than a boolean ``[T, S]`` mask. ``cudnn`` (CUDA, half precision): causal calls go to cuDNN at padded
    shapes instead (``_cudnn_causal``); otherwise CUDA calls never reach cuDNN (NO_CUDNN, above)."""
    k, v = decompress_kv(latent, k_rope, w_uk, w_uv)
    D, qk_dim, v_dim = k.shape[-1], q_nope.shape[-1] + q_rope.shape[-1], w_uv.shape[1]
    q = torch.cat([q_nope, q_rope], dim=-1)
    q = (F.pad(q, (0, D - qk_dim)) if qk_dim < D else q).transpose(1, 2)
    if cudnn and mask is None and (causal or prefix) and _cudnn_takes(q, qk_dim, prefix):
        o = _cudnn_causal(q, k, v, prefix, scale, qk_dim)
    elif prefix and q.device.type == "cpu":
        o = _prefix_causal(q, k, v, prefix, scale)
    elif prefix:  # the bias never dispatches to cuDNN
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2]), scale=scale)
    else:
        with sdpa_kernel(NO_CUDNN) if q.is_cuda else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None if mask is None else mask[:, None], is_causal=causal, scale=scale
            )
    return o[..., :v_dim].transpose(1, 2)


_CUDNN = {"ok": True}  # False once cuDNN's attention has refused a call (an older GPU): SDPA's other kernels then


def _cudnn_takes(q: torch.Tensor, qk_dim: int, prefix: int) -> bool:
    """Whether ``_cudnn_causal`` runs this call: CUDA, half precision, cuDNN's attention usable; an extension needs
    ``CUDNN_MIN_QUERIES`` queries, and a spare query/key column to mask its padded prefix keys unless the prefix
    needs no padding."""
    if not (q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and _CUDNN["ok"]):
        return False
    if not prefix:
        return True
    return q.shape[2] >= CUDNN_MIN_QUERIES and (qk_dim < q.shape[-1] or attention_bucket(prefix) == prefix)


def _cudnn_causal(q, k, v, prefix: int, scale: float, qk_dim: int) -> torch.Tensor:
    """Causal attention of ``q [B, H, T, D]``, the last ``T`` of ``prefix + T`` positions, through cuDNN at padded
    shapes (``attention_bucket``). The new rows (queries, and their own keys and values) are zero-padded at the end:
    causally no real query sees a later row, so the padding changes nothing real. The prefix's keys attend unmasked
    in a second call, merged by log-sum-exp; its padded keys are masked through column ``qk_dim`` (zero in every
    real query and key: the head dim's own padding): 1 in every query, a huge negative number in the padded keys
    only, so their scores vanish in the softmax. Falls back to the other kernels for good if cuDNN refuses."""
    T, P = q.shape[2], prefix
    Tb = attention_bucket(T)

    def rows(x, n):
        return F.pad(x, (0, 0, 0, n - x.shape[2])) if n > x.shape[2] else x

    try:
        qb = rows(q, Tb)
        o, lse = _attend_lse(qb, rows(k[:, :, P:], Tb), rows(v[:, :, P:], Tb), True, scale, lse=bool(P))
        if not P:
            return o[:, :, :T]
        Pb = attention_bucket(P)
        kp, vp = k[:, :, :P], v[:, :, :P]
        if Pb > P:
            kp, vp, qb = rows(kp, Pb), rows(vp, Pb), qb.clone()
            kp[:, :, P:, qk_dim] = torch.finfo(q.dtype).min / 4
            qb[..., qk_dim] = 1
        o1, lse1 = _attend_lse(qb, kp, vp, False, scale)
    except torch.OutOfMemoryError:
        raise
    except RuntimeError:  # no cuDNN attention for this device or build
        _CUDNN["ok"] = False
        if P:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_lower_right(T, k.shape[2]), scale=scale)
        with sdpa_kernel(NO_CUDNN):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    return _merge(o1, lse1, o, lse)[:, :, :T]


def _prefix_causal(q, k, v, prefix: int, scale: float) -> torch.Tensor:
    """Attention of the last ``T`` positions over ``prefix + T`` keys, causal, on CPU: every query sees the whole
    prefix (no mask) and the new keys causally (a square ``is_causal``), each one call of the fused flash kernel,
    merged exactly through their log-sum-exps. One call with a boolean ``[T, S]`` mask costs 1.5x the time at
    T = 2K, S = 20K (0.62 vs 0.42 s per layer at k3-tiny's head dims, one thread): an episode's next turn."""
    o1, lse1 = _attend_lse(q, k[:, :, :prefix], v[:, :, :prefix], False, scale)
    o2, lse2 = _attend_lse(q, k[:, :, prefix:], v[:, :, prefix:], True, scale)
    return _merge(o1, lse1, o2, lse2)


def _merge(o1, lse1, o2, lse2) -> torch.Tensor:
    """Two attentions of the same queries over disjoint keys, merged exactly by their log-sum-exps."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = (lse1 - m).exp(), (lse2 - m).exp()
    return ((o1 * w1[..., None] + o2 * w2[..., None]) / (w1 + w2)[..., None]).to(o1.dtype)


def _attend_lse(q, k, v, causal: bool, scale: float, lse: bool = True):
    """One fused attention call ``[B, H, T, D]`` and its log-sum-exps ``[B, H, T]`` (fp32; None unless ``lse``):
    PyTorch's flash kernel on CPU, cuDNN's on CUDA (half precision)."""
    if q.device.type == "cpu":
        o, out_lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=causal,
                                                                                scale=scale)
    else:
        o, out_lse = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, lse, is_causal=causal,
                                                                        scale=scale)[:2]
    return o, (out_lse.reshape(q.shape[:3]).float() if lse else None)


def latent_moe(moe: StableLatentMoE, x: torch.Tensor, experts_fn) -> torch.Tensor:
    """``StableLatentMoE.forward`` with the routed experts computed by ``experts_fn`` (same router, latent
    projections, norm and shared experts: only how the expert matmuls are batched differs)."""
    shape = x.shape
    flat = x.reshape(-1, shape[-1])
    idx, w = moe.router(flat)
    h = moe.routed_down_proj(flat) if moe.latent_dim is not None else flat
    y = experts_fn(moe.experts, h, idx, w)
    if moe.latent_dim is not None:
        if moe.routed_norm is not None:
            y = moe.routed_norm(y)
        y = moe.routed_up_proj(y)
    if moe.shared_experts is not None:
        y = y + moe.shared_experts(flat)
    return y.view(shape)


def model_experts(experts, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The model's own expert dispatch (``K3Experts.forward``)."""
    return experts(h, idx, w)


def grouped_experts(experts, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``K3Experts.forward`` as two batched matmuls: the (token, expert) pairs are sorted by expert into an
    ``[E, C, D]`` buffer (C = the busiest expert's count, the rest zero rows), so each projection is one ``bmm``
    instead of a loop over experts. Pairs are added per token in expert order in fp32, as the loop does."""
    N, k = idx.shape
    E = experts.num_experts
    flat = idx.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=E)
    C = int(counts.max())  # a host sync: this path is for CPU / eager execution
    sorted_expert = flat[order]
    rank = torch.arange(N * k, device=h.device) - (counts.cumsum(0) - counts)[sorted_expert]
    rows = sorted_expert * C + rank  # each pair's row in the [E * C] buffer
    tokens = order // k
    buf = h.new_zeros(E * C, h.shape[-1])
    buf[rows] = h[tokens]
    gate, up = torch.bmm(buf.view(E, C, -1), experts.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)
    y = torch.bmm(experts.act(gate, up), experts.down_proj.transpose(1, 2)).view(E * C, -1)[rows]
    return sum_in_expert_order(y.float() * w.flatten()[order, None], order, k).to(h.dtype)


def dense_experts(experts, h: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``K3Experts.forward`` with every expert applied to every token, then each token's k selected outputs
    weighted and added in expert order, as ``grouped_experts`` adds them: E/k times the FLOPs, but static shapes
    and no host sync (CUDA graphs)."""
    gate, up = torch.einsum("nd,efd->nef", h, experts.gate_up_proj).chunk(2, dim=-1)
    y = torch.einsum("nei,edi->ned", experts.act(gate, up), experts.down_proj)  # [N, E, D]
    chosen, slot = idx.sort(dim=1)
    picked = y.gather(1, chosen[..., None].expand(-1, -1, y.shape[-1])).float() * w.gather(1, slot)[..., None]
    return add_slots(picked).to(h.dtype)
