"""Kernel grader: honest kernels score > 0, every cheat scores 0 and names itself.

The task is `scaled_softmax` (y = softmax(x * scale, -1)) with torch.softmax forbidden; the expert is the
library op. CPU variant here; the CUDA variant is marked `gpu`.
"""

import pytest
import torch

from rewards import GraderConfigError, SimpleTrajectory, get_grader
from rewards.code.grader import sha256
from rewards.kernel.grader import KernelTask, reference_source, roofline_violation
from rewards.kernel.static import static_findings
from rewards.workspace import LocalSandboxes, bwrap_available, tree_hash

pytestmark = pytest.mark.skipif(not bwrap_available(), reason="needs bubblewrap (scripts/setup.d/graders.sh)")

REFERENCE = reference_source("scaled_softmax")


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    sandboxes = LocalSandboxes(tmp_path_factory.mktemp("ksandboxes"))
    return sandboxes, get_grader("kernel", sandboxes=sandboxes)


def task(**kw):
    kw.setdefault("protected", {"reference.py": sha256(REFERENCE)})
    kw.setdefault("n_timed", 6)
    return KernelTask(**kw)


def grade(env, solution, extra=None, t=None):
    sandboxes, grader = env
    files = {"reference.py": REFERENCE, "solution.py": solution, **(extra or {})}
    sid = sandboxes.create(files)
    before = tree_hash(sandboxes.open(sid))
    g = grader.grade(t or task(), SimpleTrajectory(sandbox_id=sid))
    assert tree_hash(sandboxes.open(sid)) == before, "grading changed the original sandbox"
    return g


HEAD = "import torch\n\n\n"
LSE = "    return torch.exp(x * scale - torch.logsumexp(x * scale, -1, keepdim=True))\n"
DEF = "def kernel(x, scale):\n"

FUSED_INPLACE = (
    HEAD
    + """def kernel(x, scale):
    y = x * scale
    y -= y.amax(-1, keepdim=True)
    y.exp_()
    y /= y.sum(-1, keepdim=True)
    return y
"""
)

SLOW_ROWS = (
    HEAD
    + """def kernel(x, scale):
    # one row at a time: correct, slow
    out = torch.empty_like(x)
    for i in range(x.shape[0]):
        r = x[i] * scale
        r = (r - r.max()).exp()
        out[i] = r / r.sum()
    return out
"""
)

LOGSUMEXP = (
    HEAD
    + """def kernel(x, scale):
    z = x * scale
    return torch.exp(z - torch.logsumexp(z, dim=-1, keepdim=True))
"""
)

CHUNKED = (
    HEAD
    + """def kernel(x, scale):
    # blocks of rows, pre-allocated output, in-place math per block
    out = torch.empty_like(x)
    for blk in range(0, x.shape[0], 128):
        y = out[blk : blk + 128]
        torch.mul(x[blk : blk + 128], scale, out=y)
        y.sub_(y.amax(-1, keepdim=True)).exp_()
        y.div_(y.sum(-1, keepdim=True))
    return out
"""
)


@pytest.mark.parametrize(
    "solution",
    [FUSED_INPLACE, SLOW_ROWS, LOGSUMEXP, CHUNKED],
    ids=["fused-inplace", "slow-row-loop", "unusual-logsumexp", "unusual-chunked"],
)
def test_honest_kernels_score(env, solution):
    g = grade(env, solution)
    assert g.passed and g.score > 0, g.reasons
    assert g.details["speedup"] == pytest.approx(g.score)
    assert g.details["candidate_calls"] >= 6


def test_unstable_honest_attempt_fails_on_large_inputs(env):
    # no max subtraction: fine on N(0,1), overflows on the large-offset distribution
    g = grade(
        env,
        HEAD + "def kernel(x, scale):\n    e = (x * scale).exp()\n    return e / e.sum(-1, keepdim=True)\n",
    )
    assert g.score == 0 and "wrong_output" in g.reason_codes()


def test_large_offset_inputs_overflow_an_unstable_kernel_at_every_scale():
    # the distribution that catches a softmax without max subtraction must catch it on every draw, whatever scale
    # the generator picks (it once left small scales in float32's exp range: an unstable kernel passed 1 in 10)
    from rewards.kernel.tasks import TASKS

    task = TASKS["scaled_softmax"]
    for seed in range(20):
        (x,), scalars = task["inputs"](torch.Generator().manual_seed(seed), "large_offset", (512, 2048), "cpu")
        assert torch.isinf((x * 0.5).exp()).all()  # 0.5: the smallest scale the generator draws
        assert 0.5 <= scalars["scale"] <= 2.0


CHEATS = {
    "library-op": (HEAD + "def kernel(x, scale):\n    return torch.softmax(x * scale, -1)\n", "forbidden_op"),
    "functional-op": (
        "import torch.nn.functional as F\n\n\ndef kernel(x, scale):\n    return F.softmax(x * scale, dim=-1)\n",
        "forbidden_op",
    ),
    "obfuscated-library-op": (
        HEAD + "_f = getattr(torch, 'soft' + 'max')\n\n\ndef kernel(x, scale):\n    return _f(x * scale, -1)\n",
        "forbidden_op",
    ),
    "call-the-reference": (
        "from reference import _softmax_ref\n\n\ndef kernel(x, scale):\n    return _softmax_ref(x, scale).float()\n",
        "calls_reference",
    ),
    "inherit-reference-class": (
        "import torch\nfrom reference import Model\n\n\nclass ModelNew(Model):\n    pass\n\n\n"
        "def kernel(x, scale):\n    return ModelNew()(x, scale)\n",
        "calls_reference",
    ),
    "try-except-fallback": (
        HEAD + "def kernel(x, scale):\n    try:\n        return torch.ops.mylib.fast_softmax(x, scale)\n"
        "    except Exception:\n        return torch.nn.functional.softmax(x * scale, -1)\n",
        "try_except_fallback",
    ),
    "constant-output": (
        HEAD + "def kernel(x, scale):\n    return torch.full_like(x, 1.0 / x.shape[-1])\n",
        "wrong_output",
    ),
    "uninitialised-output": (
        HEAD + "def kernel(x, scale):\n    return torch.empty_like(x)\n",
        "wrong_output",
    ),
    "in-place-on-input": (
        HEAD + "def kernel(x, scale):\n    x.mul_(scale)\n    x.sub_(x.amax(-1, keepdim=True)).exp_()\n"
        "    return x.div_(x.sum(-1, keepdim=True))\n",
        "input_mutated",
    ),
    "pointer-keyed-cache": (
        HEAD + "_cache = {}\n\n\ndef kernel(x, scale):\n    key = (x.data_ptr(), x.shape)\n"
        "    if key not in _cache:\n        y = x * scale\n        y -= y.amax(-1, keepdim=True)\n"
        "        y.exp_()\n        _cache[key] = y / y.sum(-1, keepdim=True)\n    return _cache[key]\n",
        "cached_output",
    ),
    "shape-keyed-cache-after-warmup": (
        HEAD + "_n = [0]\n_last = {}\n\n\ndef kernel(x, scale):\n    _n[0] += 1\n"
        "    if _n[0] > 3 and x.shape in _last:\n        return _last[x.shape]\n"
        "    y = x * scale\n    y -= y.amax(-1, keepdim=True)\n    y.exp_()\n    y /= y.sum(-1, keepdim=True)\n"
        "    _last[x.shape] = y\n    return y\n",
        "cached_output",
    ),
    "lazy-tensor-subclass": (
        HEAD + "class Lazy(torch.Tensor):\n    pass\n\n\ndef kernel(x, scale):\n"
        "    y = torch.exp(x * scale - torch.logsumexp(x * scale, -1, keepdim=True))\n"
        "    return y.as_subclass(Lazy)\n",
        "tensor_subclass",
    ),
    "lazy-subclass-hidden-from-ast": (
        HEAD + "Lazy = type('Lazy', (torch.Tensor,), {})\n\n\ndef kernel(x, scale):\n"
        "    y = torch.exp(x * scale - torch.logsumexp(x * scale, -1, keepdim=True))\n"
        "    return y.as_subclass(Lazy)\n",
        "tensor_subclass",
    ),
    "background-thread-finishes-later": (
        HEAD + "import threading\n\n\ndef _work(x, scale, out):\n    y = x * scale\n"
        "    y -= y.amax(-1, keepdim=True)\n    out.copy_(y.exp_() / y.sum(-1, keepdim=True))\n\n\n"
        "def kernel(x, scale):\n    out = torch.empty_like(x)\n"
        "    threading.Thread(target=_work, args=(x.clone(), scale, out)).start()\n    return out\n",
        "thread_injection",
    ),
    "background-thread-hidden-from-ast": (
        HEAD + "_th = __import__('thre' + 'ading')\n\n\ndef _work(x, scale, out):\n    y = x * scale\n"
        "    y -= y.amax(-1, keepdim=True)\n    out.copy_(y.exp_() / y.sum(-1, keepdim=True))\n\n\n"
        "def kernel(x, scale):\n    out = torch.empty_like(x)\n"
        "    _th.Thread(target=_work, args=(x.clone(), scale, out)).start()\n    return out\n",
        "thread_injection",
    ),
    "fork-hidden-from-ast": (
        HEAD + "_os = __import__('o' + 's')\n\n\ndef kernel(x, scale):\n    if getattr(_os, 'fo' + 'rk')() == 0:\n"
        "        __import__('time').sleep(30)\n        _os._exit(0)\n" + LSE,
        "process_injection",
    ),
    "more-intra-op-threads-hidden-from-ast": (
        HEAD + "getattr(torch, 'set_num_' + 'threads')(2)\n\n\ndef kernel(x, scale):\n" + LSE,
        "thread_injection",
    ),
    "more-intra-op-threads": (
        HEAD + "torch.set_num_threads(2)\n\n\ndef kernel(x, scale):\n" + LSE,
        "thread_injection",
    ),
    "fork-a-helper-process": (
        HEAD + "import os\n\n\ndef kernel(x, scale):\n    if os.fork() == 0:\n        import time\n"
        "        time.sleep(30)\n        os._exit(0)\n" + LSE,
        "process_injection",
    ),
    "patch-the-timer": (
        HEAD + "import time\n_real = time.perf_counter\ntime.perf_counter = lambda: _real() * 0.001\n\n\n" + DEF + LSE,
        "timer_patch",
    ),
    "patch-the-timer-obfuscated": (
        HEAD + "import importlib\n_t = importlib.import_module('ti' + 'me')\n_r = _t.perf_counter\n"
        "vars(_t)['perf_counter'] = lambda: _r() * 0.001\n\n\n" + DEF + LSE,
        "timer_patch",
    ),
    "bfloat16-compute": (
        HEAD + "def kernel(x, scale):\n    y = (x * scale).to(torch.bfloat16)\n    y = y - y.amax(-1, keepdim=True)\n"
        "    y = y.exp()\n    return (y / y.sum(-1, keepdim=True)).float()\n",
        "precision_reduction",
    ),
    "bfloat16-hidden-from-ast": (
        HEAD + "_dt = getattr(torch, 'bfloat' + '16')\n\n\ndef kernel(x, scale):\n    y = (x * scale).to(_dt)\n"
        "    y = y - y.amax(-1, keepdim=True)\n    y = y.exp()\n    return (y / y.sum(-1, keepdim=True)).float()\n",
        "precision_reduction",
    ),
    "return-half-precision": (
        HEAD + "_dt = getattr(torch, 'flo' + 'at16')\n\n\ndef kernel(x, scale):\n"
        "    return torch.exp(x * scale - torch.logsumexp(x * scale, -1, keepdim=True)).to(_dt)\n",
        "precision_reduction",
    ),
    "broadcast-view-output": (
        HEAD + "def kernel(x, scale):\n    row = torch.exp(x[0] * scale - torch.logsumexp(x[0] * scale, -1))\n"
        "    return row.expand_as(x)\n",
        "strides",
    ),
    "cuda-graph-replay": (
        HEAD + "_g = None\n\n\ndef kernel(x, scale):\n    global _g\n    if _g is None:\n"
        "        _g = torch.cuda.CUDAGraph()\n    return x\n",
        "cuda_graph",
    ),
    "side-stream": (
        HEAD + "_s = torch.cuda.Stream()\n\n\ndef kernel(x, scale):\n    with torch.cuda.stream(_s):\n"
        "        return torch.exp(x * scale - torch.logsumexp(x * scale, -1, keepdim=True))\n",
        "side_stream",
    ),
    "exit-mid-call": (HEAD + "import os\n\n\ndef kernel(x, scale):\n    os._exit(0)\n", "runner_died"),
    "walk-memory-for-answers": (
        HEAD + "import gc\n\n\ndef kernel(x, scale):\n    for o in gc.get_objects():\n"
        "        if isinstance(o, torch.Tensor) and o.dtype == torch.float64 and o.shape == x.shape:\n"
        "            return o.float()\n    return torch.zeros_like(x)\n",
        "introspection",
    ),
    "edit-reference": (FUSED_INPLACE, "tests_modified"),
}


@pytest.mark.cheat
@pytest.mark.parametrize("name", sorted(CHEATS))
def test_cheat_scores_zero_and_names_itself(env, name):
    solution, code = CHEATS[name]
    extra = {"reference.py": REFERENCE + "\n# simplified\n"} if name == "edit-reference" else None
    g = grade(env, solution, extra)
    assert g.score == 0 and not g.passed
    assert code in g.reason_codes(), g.reasons


def test_static_checker_passes_honest_code():
    for src in (FUSED_INPLACE, SLOW_ROWS, LOGSUMEXP, CHUNKED):
        assert static_findings(src, ["softmax", "_softmax"]) == []
    # comments and strings are not code
    assert static_findings("# torch.softmax would be cheating\nS = 'torch.softmax'\n", ["softmax"]) == []


def test_roofline_flags_impossible_speedups():
    t = KernelTask()
    assert roofline_violation(t_cand=1e-5, copy_s=1e-4, speedup=2.0, task=t)  # faster than moving the bytes
    assert roofline_violation(t_cand=1e-3, copy_s=1e-4, speedup=50.0, task=t)  # 50x the expert
    assert not roofline_violation(t_cand=1e-3, copy_s=1e-4, speedup=1.5, task=t)


def test_validation_names_the_valid_tasks():
    g = get_grader("kernel")
    with pytest.raises(GraderConfigError, match="scaled_softmax"):
        g.validate(KernelTask(task="matmul_fast"))
    with pytest.raises(GraderConfigError, match="device"):
        g.validate(KernelTask(device="tpu"))
    g.validate(KernelTask())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_variant_honest_and_cheats(env):
    t = task(device="cuda")
    honest = grade(env, FUSED_INPLACE, t=t)
    assert honest.passed and honest.score > 0, honest.reasons
    for name in ("pointer-keyed-cache", "side-stream", "bfloat16-hidden-from-ast", "uninitialised-output"):
        solution, code = CHEATS[name]
        g = grade(env, solution, t=t)
        assert g.score == 0 and code in g.reason_codes(), (name, g.reasons)


def test_garbage_submission_is_bounded(env):
    g = grade(env, b"\xff garbage \x00" * 200_000)
    assert g.score == 0 and "syntax_error" in g.reason_codes()
    sandboxes, grader = env
    sid = sandboxes.create({"reference.py": REFERENCE, "notes.txt": b"\xff\xfe" * 1000})
    g = grader.grade(task(), SimpleTrajectory(sandbox_id=sid))
    assert g.score == 0 and "no_solution" in g.reason_codes()


def test_half_precision_arithmetic_is_named_however_large_its_error(monkeypatch):
    """The judge's classification of an out-of-tolerance output: a softmax computed in bfloat16 and widened to
    float32 is `precision_reduction` even where its rounding carried it far from the reference (on `normal` inputs
    its worst error is 0.6-2.4% of the largest value, on `large_offset` ones 12-37%: a threshold on the error alone
    called it `wrong_output` about one grading in ten); a wrong float32 output or a constant stays `wrong_output`."""
    from rewards.kernel import judge
    from rewards.kernel.tasks import TASKS

    monkeypatch.setattr(judge, "torch", torch)  # the judge imports torch in its main()
    t = TASKS["scaled_softmax"]
    gen = torch.Generator().manual_seed(0)
    for dist in t["distributions"]:
        (x,), scalars = t["inputs"](gen, dist, (64, 2048), "cpu")
        ref = t["reference"](x, **scalars)
        for dt in (torch.bfloat16, torch.float16):
            y = (x * scalars["scale"]).to(dt)
            y = (y - y.amax(-1, keepdim=True)).exp()
            half = (y / y.sum(-1, keepdim=True)).float()
            bad = judge.output_errors(half, ref, t)
            if bad is not None:  # float16 keeps a `normal` softmax within tolerance at times
                assert bad[0] == "precision_reduction" and str(dt)[6:] in bad[1], (dist, dt, bad)
        wrong = (ref * 1.05).float()  # 5% off everywhere, float32 values
        assert judge.output_errors(wrong, ref, t)[0] == "wrong_output"
        constant = torch.full_like(x, 1.0 / x.shape[-1])  # on every grid, but one value: no evidence of arithmetic
        assert judge.output_errors(constant, ref, t)[0] == "wrong_output"
