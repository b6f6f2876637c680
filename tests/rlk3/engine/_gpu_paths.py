"""Helpers of the engine's GPU tests (test_gpu.py): the models, prompts and runs they compare, teacher forcing,
and the child process of the fp32 kernel-vs-torch test (``python -m tests.rlk3.engine._gpu_paths``)."""

import contextlib
import json
import os

import torch

import rlk3.engine.engine as engine_module
from rlk3.engine import EngineConfig, RolloutEngine, SamplingParams
from rlk3.model import K3Config, K3ForCausalLM

# prompt lengths of the kernel-vs-torch comparisons: short and long prefills, several prefill chunks, mixed steps
PATH_PROMPTS = [5, 77, 300, 1000, 33, 512, 2048, 9]


def make_model(preset, dtype):
    torch.manual_seed(0)
    return K3ForCausalLM(K3Config.preset(preset)).to("cuda", dtype).eval()


def make_prompts(vocab, lengths):
    g = torch.Generator().manual_seed(0)
    return [torch.randint(1, vocab, (n,), generator=g).tolist() for n in lengths]


def run(model, backend, graphs, prompts, max_tokens=24, sampling=None, compile=False):
    """Compilation is off unless asked for: the kernel-vs-torch comparisons pin MoE routing by patching the router
    (``pinned_routing``), which a compiled block would not see, and are about the kernels."""
    # prefill graphs off: these comparisons are about the decode graphs and the kernels; a padded bf16 prefill rounds
    # like a batch of its padded size, not of the eager one (test_prefill_graphs_replay_... covers the prefill graphs)
    cfg = EngineConfig(memory_bytes=2 * 2**30, backend=backend, cuda_graphs=graphs, max_tokens_per_step=1024,
                       prefill_chunk=256, compile=compile, prefill_graphs=False)
    engine = RolloutEngine(model, cfg)
    return engine.generate(prompts, sampling or SamplingParams(max_tokens=max_tokens, temperature=0))


@contextlib.contextmanager
def forced_tokens(streams):
    """Teacher forcing: while active, the engine's sampler emits each request's given tokens in turn instead of
    drawing one, with their log-probs under the engine's logits. Request ``i`` must carry ``seed=i`` (the sampler
    sees only the requests' SamplingParams)."""
    fed = [0] * len(streams)

    def sample(logits, params, generators, keys=None, cpu_kernels=False):  # engine.sample's signature
        tokens = []
        for p in params:
            tokens.append(streams[p.seed][fed[p.seed]])
            fed[p.seed] += 1
        logp = torch.log_softmax(logits.float(), dim=-1)
        return tokens, logp.gather(1, torch.tensor(tokens, device=logp.device)[:, None])[:, 0].tolist()

    original = engine_module.sample
    engine_module.sample = sample
    try:
        yield
    finally:
        engine_module.sample = original


def teacher_forced(model, backend, prompts, streams, graphs=False):
    """Per prompt, the engine's log-prob of each token of ``streams[i]`` when it is fed that stream: the steps of
    generation (prefill, then one decode step per token), with the sampler replaced (``forced_tokens``)."""
    sampling = [SamplingParams(max_tokens=len(s), temperature=0, seed=i) for i, s in enumerate(streams)]
    with forced_tokens(streams):
        results = run(model, backend, graphs, prompts, sampling=sampling)
    assert [r.token_ids for r in results] == [list(s) for s in streams]
    return [r.logprobs for r in results]


def true_fp32():
    """Every fp32 matrix product in fp32, not TF32. Triton runs a ``tl.dot`` of fp32 operands in TF32 unless the
    call names an input precision, and FLA's KDA kernels name none, except the triangular solve of its chunked
    prefill, which asks for TF32 outright (``SOLVE_TRIL_DOT_PRECISION``). Both settings are read when a kernel is
    compiled, and Triton keeps compiled kernels in memory by source, so this must run in a fresh process before
    any FLA kernel compiles, with its own ``TRITON_CACHE_DIR``. torch's own fp32 matmuls are already full fp32
    (``allow_tf32`` is off by default); set here so that the child does not depend on the default."""
    os.environ["TRITON_F32_DEFAULT"] = "ieee"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    import triton.language as tl
    from fla.ops.kda import chunk_intra

    assert hasattr(chunk_intra, "SOLVE_TRIL_DOT_PRECISION"), "FLA changed: find where its KDA kernels pick TF32"
    chunk_intra.SOLVE_TRIL_DOT_PRECISION = tl.constexpr("ieee")


def kernel_and_torch_paths(preset, dtype):
    """Greedy generations of the kernel path (``auto``) and the torch path: ``{backend: [[tokens, logprobs]]}``."""
    model = make_model(preset, dtype)
    prompts = make_prompts(model.config.vocab_size, PATH_PROMPTS)
    return {b: [[r.token_ids, r.logprobs] for r in run(model, b, False, prompts)] for b in ("torch", "auto")}


if __name__ == "__main__":  # the fp32 test's child: k3-tiny in true fp32 on both paths, the results as JSON
    true_fp32()
    print(json.dumps(kernel_and_torch_paths("k3-tiny", torch.float32)))
