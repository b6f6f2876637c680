"""The model runner on the CPU kernels (``rlk3.model.ops.cpu``): ``ModelRunner``'s forward with each layer's
per-token work in one C call between torch's matmuls. ``ModelRunner`` is its reference (``EngineConfig(backend=
"torch")`` runs it; the tests compare the two).

Per layer of a step:

* the sub-layer input (Attention Residuals mix + pre-norm): one call;
* KDA: the input projections (one matmul) and the forget gate's second projection, then one call for the short
  conv, the gates, the delta-rule recurrence of every sequence from its pool slot (decode rows and prefill chunks
  alike: token by token, which at these head sizes costs less on a CPU than the chunked form's small matmuls) and
  the gated output norm, then ``o_proj``;
* Stable LatentMoE: one matmul for the router, the routed down-projection and the shared experts' gate and up
  halves; one call for routing, the experts (grouped by expert), the routed norm and the shared activation; one
  matmul for ``[routed_up_proj | shared down_proj]``, which adds the two paths. The dense MLP likewise;
* MLA: in a decode-only step, one call from the queries to ``o_proj``'s input (absorption, attention over the paged
  latents, the lift, the output gate); decode rows beside prefill chunks take torch ``bmm``s around one call over the
  paged latents, and prefill attention stays with torch's fused SDPA.

A layer the kernels do not cover (Kimi Linear's softplus gate, experts at the full width, a router recording scores
for Quantile Balancing) runs ``ModelRunner``'s code for that part.
"""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from rlk3.engine.runner import ModelRunner
from rlk3.model.layers.attn_res import AttnResMixer
from rlk3.model.layers.common import MLP
from rlk3.model.layers.moe import StableLatentMoE
from rlk3.model.ops import cpu


def supported(model) -> bool:
    """Whether the CPU kernels can run this model here: float32 weights on the CPU, and the kernels built."""
    p = model.model.embed_tokens.weight
    return p.device.type == "cpu" and p.dtype == torch.float32 and cpu.available()


class CPURunner(ModelRunner):
    def __init__(self, model, layout, backend: str = "auto", compile: bool = False):
        self._derived: dict[int, dict[str, torch.Tensor]] = {}
        self._index = {layer: i for i, layer in enumerate(model.model.layers)}
        super().__init__(model, layout, backend, compile=compile)

    @torch.no_grad()
    def refresh_weights(self) -> None:
        """``ModelRunner``'s derived weights, and the kernels' own: the conv weights transposed, each feed-forward's
        input and output projections side by side, the experts' weights transposed. Rebuilt in place after a weight
        update."""
        super().refresh_weights()
        # the kernels run unchecked (check=False) on the model's tensors: float32 and contiguous, checked here once
        for name, t in itertools.chain(self.model.named_parameters(), self.model.named_buffers()):
            if t.dtype != torch.float32 or not t.is_contiguous():
                raise ValueError(f"CPURunner: {name} must be a contiguous float32 tensor, got {t.dtype} strides "
                                 f"{t.stride()}")
        # each Attention Residuals mixer's pseudo-query, as the [D] view the kernel reads
        self._query = {m: m.proj.weight[0] for m in self.model.modules() if isinstance(m, AttnResMixer)}
        for idx, layer in enumerate(self.layers):
            derived = {}
            if layer.kind == "kda":
                derived["conv_t"] = self._fused[idx][1].t()
            mlp = layer.mlp
            if isinstance(mlp, MLP):
                derived["ffn_in"] = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])
            elif self._moe_ok(mlp):
                shared = mlp.shared_experts
                w_in = [mlp.router.weight.float(), mlp.routed_down_proj.weight]
                w_out = [mlp.routed_up_proj.weight]
                if shared is not None:
                    w_in += [shared.gate_proj.weight, shared.up_proj.weight]
                    w_out.append(shared.down_proj.weight)
                derived["ffn_in"] = torch.cat(w_in)
                derived["ffn_out"] = torch.cat(w_out, dim=1)
                derived["gate_up_t"] = mlp.experts.gate_up_proj.transpose(1, 2)
                derived["down_t"] = mlp.experts.down_proj.transpose(1, 2)
            derived = {name: w.contiguous() for name, w in derived.items()}
            if idx in self._derived:
                for name, w in derived.items():
                    self._derived[idx][name].copy_(w)
            else:
                self._derived[idx] = derived

    @staticmethod
    def _moe_ok(mlp) -> bool:
        return isinstance(mlp, StableLatentMoE) and mlp.latent_dim is not None

    def forward(self, pool, batch, attend=None) -> torch.Tensor:
        self._check_step(pool, batch)
        return super().forward(pool, batch, attend)

    @staticmethod
    def _check_step(pool, b) -> None:
        """What the unchecked kernels take on trust, once per step: every slot and page index inside the pool, the
        token offsets covering the step, the decode rows' lengths inside their block tables."""
        P, T = pool.num_pages, b.input_ids.shape[0]
        for name, idx in (("slot_pages", b.slot_pages), ("block_tables", b.block_tables)):
            if idx.numel() and (idx.dtype != torch.int64 or int(idx.min()) < 0 or int(idx.max()) >= P):
                raise RuntimeError(f"CPURunner: {name} must be int64 pages in [0, {P}), got {idx.dtype} values in "
                                   f"[{int(idx.min())}, {int(idx.max())}]")
        cu = CPURunner._step_cu(b)
        if int(cu[-1]) != T or len(cu) != b.slot_pages.shape[0] + 1:
            raise RuntimeError(f"CPURunner: the step's {len(cu) - 1} sequences cover {int(cu[-1])} tokens, not {T}")
        nd = b.num_decode
        if nd:
            lens, width = b.seq_lens[:nd], b.block_tables.shape[1] * pool.layout.block_size
            if int(lens.min()) < 1 or int(lens.max()) > width:
                raise RuntimeError(f"CPURunner: decode lengths must lie in [1, {width}], got {lens.tolist()}")

    # -- the sub-layer inputs and the final norm

    def _read(self, stream, mixer, norm) -> torch.Tensor:
        sources = [src if src.is_contiguous() else src.contiguous() for src in stream.sources()]  # [1, T, D] each
        if len(sources) > 1:
            out = cpu.mix_norm(sources, mixer.norm_weight, self._query[mixer], mixer.eps, norm.weight, norm.eps,
                               check=False)
        else:
            out = cpu.mix_norm(sources, None, None, 0.0, norm.weight, norm.eps, check=False)
        return out[None]

    def _final(self, stream, rows: torch.Tensor) -> torch.Tensor:
        """Only the wanted rows are mixed and normed (a prefill step wants one row per sequence)."""
        core = self.model.model
        sources = [*stream.blocks, stream.partial] if hasattr(stream, "blocks") else [stream.h]
        if rows.numel() != sources[0].shape[1]:
            sources = [src[0, rows] for src in sources]
        mixer = core.output_res
        if len(sources) > 1:
            return cpu.mix_norm(sources, mixer.norm_weight, self._query[mixer], mixer.eps, core.norm.weight,
                                core.norm.eps, check=False)
        return cpu.mix_norm(sources, None, None, 0.0, core.norm.weight, core.norm.eps, check=False)

    # -- KDA

    def _kda(self, idx, attn, h, pool, b):
        if not attn.bounded:  # Kimi Linear's softplus gate: the torch path
            return super()._kda(idx, attn, h, pool, b)
        H, K = attn.num_heads, attn.head_dim
        HK = H * K
        page_col, position = self.layout.kda_position(self.kda_ordinal[idx])
        proj = F.linear(h, self._fused[idx][0])  # [T, q|k|v, f_a, beta, gate]
        _, f_rank, _, gate_width = self._splits[idx]
        g = F.linear(proj[:, 3 * HK : 3 * HK + f_rank], attn.f_b_proj.weight)
        beta_col, gate_col = 3 * HK + f_rank, 3 * HK + f_rank + H
        if not hasattr(attn, "g_proj"):  # Kimi Linear's low-rank output gate: lift it, then point the kernel at it
            lifted = attn.g_b_proj(proj[:, gate_col : gate_col + gate_width])
            proj = torch.cat([proj[:, :gate_col], lifted], dim=1)
        convs, states = pool.kda_conv(position), pool.kda_state(position)

        def recurrent(proj, g, slots, cu):
            return cpu.kda_recurrent(
                proj, beta_col, gate_col, g, conv_weight_t=self._derived[idx]["conv_t"], conv_pool=convs,
                state_pool=states, slots=slots, cu_seqlens=cu, num_heads=H, head_dim=K, A_log=attn.A_log,
                dt_bias=attn.dt_bias, lower_bound=attn.lower_bound, norm_weight=attn.o_norm.weight,
                norm_eps=attn.o_norm.eps, check=False,
            )

        slots, sp = self._step_slots(b, page_col), b.kda_split
        if sp is None:
            return F.linear(recurrent(proj, g, slots, self._step_cu(b)), attn.o_proj.weight)
        # a checkpoint inside a chunk (runner.KdaSplit): the kernel advances each slot in one pass, so the rows up to
        # the boundaries run first, each boundary's state and conv cache are copied into its checkpoint, then the
        # rows after the boundaries continue from the same slots
        before, after, split, cu, cu_after = self._split_rows(b)
        o = torch.empty(proj.shape[0], H * K)
        o[before] = recurrent(proj[before], g[before], slots, cu)
        own, ckpt = slots[split], sp.ckpt[:, page_col]
        states[ckpt], convs[ckpt] = states[own], convs[own]
        o[after] = recurrent(proj[after], g[after], own.contiguous(), cu_after)
        return F.linear(o, attn.o_proj.weight)

    @staticmethod
    def _split_rows(b) -> tuple[torch.Tensor, ...]:
        """For a step with checkpoints inside it (cached on the batch: every KDA layer uses them): the rows before
        the boundaries (the decode rows included) and after them, the split sequences' rows in ``slot_pages``, and
        the offsets of the rows before (per sequence) and after (per split sequence)."""
        rows = getattr(b, "_cpu_split", None)
        if rows is None:
            sp, nd = b.kda_split, b.num_decode
            before, after, first = list(range(nd)), [], nd
            for n0, n1 in zip(sp.lens_before, sp.lens_after):
                before += range(first, first + n0)
                after += range(first + n0, first + n0 + n1)
                first += n0 + n1
            split = [nd + i for i, n1 in enumerate(sp.lens_after) if n1]
            cu = [*range(nd + 1), *(nd + x for x in itertools.accumulate(sp.lens_before))]
            cu_after = [0, *itertools.accumulate(n1 for n1 in sp.lens_after if n1)]
            rows = b._cpu_split = tuple(torch.tensor(x) for x in (before, after, split, cu, cu_after))
        return rows

    @staticmethod
    def _step_cu(b) -> torch.Tensor:
        """Token offsets of the step's sequences: one token per decode row, then the multi-token ones (cached on
        the batch: every KDA layer uses them)."""
        cu = getattr(b, "_cpu_cu", None)
        if cu is None:
            if b.prefill_offsets is not None:
                tail = (b.prefill_offsets[1][1:] + b.num_decode).tolist()
            else:
                tail = [b.num_decode + n for n in itertools.accumulate(b.prefill_lens)]
            cu = b._cpu_cu = torch.tensor([*range(b.num_decode + 1), *tail], dtype=torch.int64)
        return cu

    @staticmethod
    def _step_slots(b, page_col: int) -> torch.Tensor:
        cols = getattr(b, "_cpu_slots", None)
        if cols is None:
            cols = b._cpu_slots = {}
        slots = cols.get(page_col)
        if slots is None:
            slots = cols[page_col] = b.slot_pages[:, page_col].contiguous()
        return slots

    # -- MLA

    def _mla(self, idx, attn, h, pool, b, attend):
        """A decode-only step runs the attention from the queries to ``o_proj``'s input in one call; any other step
        ``ModelRunner._mla`` (with the decode rows through ``_paged_decode``)."""
        if b.prefill_lens or attend != self.mla_attend or b.pad is not None:
            return super()._mla(idx, attn, h, pool, b, attend)
        L, R = attn.kv_lora_rank, attn.rope_dim
        y = F.linear(h, self._fused[idx][0])  # [q (or its low-rank half) | latent + rope | gate]
        q_width, kv_width = self._splits[idx][:2]
        q = y[:, :q_width]
        if not hasattr(attn, "q_proj"):
            norm = attn.q_a_layernorm
            q = F.linear(cpu.rms_norm(q, norm.weight, norm.eps, check=False), attn.q_b_proj.weight)
        kv = y[:, q_width : q_width + kv_width]
        norm = attn.kv_a_layernorm
        m = self.mla_ordinal[idx]
        latent_pages, rope_pages = pool.latent(m), pool.rope(m)
        latent_pages[b.write_pages, b.write_offsets] = cpu.rms_norm(kv[:, :L], norm.weight, norm.eps, check=False)
        rope_pages[b.write_pages, b.write_offsets] = kv[:, L:]
        o = cpu.mla_decode(
            q, attn.kv_b_proj.weight, num_heads=attn.num_heads, nope_dim=attn.nope_dim, rope_dim=R,
            v_dim=attn.v_dim, latent_pages=latent_pages, rope_pages=rope_pages, block_tables=b.block_tables,
            seq_lens=b.seq_lens, scale=attn.scale, gate=y[:, q_width + kv_width :] if attn.g_proj is not None else None,
            check=False,
        )
        return F.linear(o, attn.o_proj.weight)

    def _paged_decode(self, q_nope, q_rope, latent_pages, rope_pages, tables, seq_lens, w_uk, w_uv, scale):
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1).contiguous()  # [B, H, L]
        o_lat = cpu.mla_paged_decode(q_lat, q_rope.contiguous(), latent_pages, rope_pages, tables.contiguous(),
                                     seq_lens.contiguous(), scale)
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [B, H, v]

    # -- feed-forward

    def _feed_forward(self, layer, h):
        mlp, derived = layer.mlp, self._derived[self._index[layer]]
        x = h[0]
        cfg = self.config
        if isinstance(mlp, MLP):
            y = F.linear(x, derived["ffn_in"])
            width = mlp.down_proj.weight.shape[1]
            mid = cpu.glu(y, 0, width, width, mlp.act.hidden_act, mlp.act.beta, mlp.act.linear_beta, check=False)
            return F.linear(mid, mlp.down_proj.weight)[None]
        if not self._moe_ok(mlp) or mlp.router.record_scores:
            return super()._feed_forward(layer, h)
        shared = mlp.shared_experts
        y = F.linear(x, derived["ffn_in"])
        router, experts = mlp.router, mlp.experts
        mid = cpu.latent_moe(
            y, num_experts=router.num_experts, top_k=router.top_k, latent=mlp.latent_dim,
            intermediate=experts.down_proj.shape[2], shared=shared.down_proj.weight.shape[1] if shared else 0,
            bias=router.e_score_correction_bias, renormalize=router.renormalize, scaling=router.scaling,
            gate_up_t=derived["gate_up_t"], down_t=derived["down_t"], act=cfg.hidden_act, beta=cfg.situ_beta,
            linear_beta=cfg.situ_linear_beta, norm_weight=mlp.routed_norm.weight if mlp.routed_norm else None,
            norm_eps=mlp.routed_norm.eps if mlp.routed_norm else 0.0, check=False,
        )
        return F.linear(mid, derived["ffn_out"])[None]
