"""Data-parallel training with FSDP2: sharding the model, and the few collectives the trainer needs.

The trainer stays one class; what changes with more than one rank (``torch.distributed`` initialised with
``world_size > 1``: NCCL on GPUs, gloo on CPU) is:

    parameters   sharded with ``fully_shard`` — every attention block and every MLP/MoE is its own unit, the
                 small rest (embeddings, norms, residual mixers, LM head) is the root's. Units are modules the
                 forward *calls*: a decoder layer is not one (its attention and MLP are called separately), so a
                 hook on it would never fire.
    batch        every rank receives the whole batch, computes the advantages on all of it (groups need all their
                 samples) and trains its share of each minibatch
    aggregation  token-mean over the *global* token count (an all-reduce), and FSDP's gradient average undone,
                 so that the update equals the single-process update on the whole batch
    micro-steps  every rank runs the same number of forward/backward passes (a rank with less data runs an empty
                 one): each pass all-gathers parameters, and collectives must match across ranks
    QB           routing scores become per-expert histograms, summed across ranks (the exact quantile would
                 gather every score)
    state        full (unsharded) state dicts, gathered to every rank: the engine and the checkpoint see the
                 same tensors as in one process

The reference model of the KL term, when there is one, is replicated (it has no optimizer state).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist


def world() -> tuple[int, int]:
    """(rank, world size); (0, 1) without an initialised process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def shard_model(model: torch.nn.Module) -> torch.nn.Module:
    """FSDP2-shard a K3 model in place: one unit per attention block and per MLP/MoE, then the root."""
    from torch.distributed.fsdp import fully_shard

    # FSDP2 warns when a unit returns a view, because an in-place op on it would skip the all-gather hook; the
    # residual streams only ever add out of place (rlk3/model/layers/attn_res.py), so the warning is noise here
    warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module .* returned a view tensor")
    for layer in model.model.layers:
        fully_shard(layer.self_attn)
        fully_shard(layer.mlp)
    fully_shard(model)
    return model


def all_reduce(t: torch.Tensor, op=None) -> torch.Tensor:
    """Sum (or ``op``) across ranks in place; a no-op in one process."""
    if world()[1] > 1:
        dist.all_reduce(t, op=op or dist.ReduceOp.SUM)
    return t


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict on every rank (parameters and persistent buffers, as ``model.state_dict()``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))


def load_full_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """The optimizer's full state keyed by parameter name (the distributed-checkpoint layout)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))


def load_optimizer_state(model: torch.nn.Module, opt: torch.optim.Optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, opt, state, options=StateDictOptions(full_state_dict=True))


def to_float(x) -> float:
    """A scalar tensor (a DTensor under FSDP2) as a Python float."""
    return float(x.full_tensor() if hasattr(x, "full_tensor") else x)
