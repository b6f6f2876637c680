"""Kernel tasks the grader knows: reference (ground truth, run in float64 by the judge), expert
implementation (the speed bar), input generator with several value distributions, forbidden ops.

Pristine: this file is mounted read-only into the judging fork; the policy only ever sees `reference.py`
(a copy of the reference, for reading) in its workspace.
"""

import torch


def _softmax_ref(x, scale):
    z = x.double() * scale
    return torch.softmax(z, dim=-1)


def _softmax_expert(x, scale):
    return torch.softmax(x * scale, dim=-1)


def _softmax_inputs(gen, dist, shape, device):
    rows, cols = shape
    if dist == "normal":
        x = torch.randn(rows, cols, generator=gen)
    elif dist == "uniform_wide":
        x = (torch.rand(rows, cols, generator=gen) - 0.5) * 60.0
    elif dist == "large_offset":  # overflows exp() unless the row max is subtracted
        # at every scale drawn below: 0.5 x (250 - 8 sd) = 109 > 88.7, where float32 exp overflows (an offset of
        # 120 left scales under ~0.65 in range, and an unstable kernel passed ~1 grading in 10)
        x = torch.randn(rows, cols, generator=gen) * 4 + 250.0
    elif dist == "sparse_peaks":  # mostly -20 with a few large peaks per row
        x = torch.full((rows, cols), -20.0)
        idx = torch.randint(0, cols, (rows, 4), generator=gen)
        x.scatter_(1, idx, torch.rand(rows, 4, generator=gen) * 30)
    else:
        raise ValueError(dist)
    scale = 0.5 + float(torch.rand(1, generator=gen)) * 1.5
    return [x.to(device)], {"scale": scale}


TASKS = {
    "scaled_softmax": {
        "doc": "y = softmax(x * scale, dim=-1) for x: float32 [rows, cols], scale: python float",
        "reference": _softmax_ref,
        "expert": _softmax_expert,
        "inputs": _softmax_inputs,
        "shape": (512, 2048),
        "distributions": ["normal", "uniform_wide", "large_offset", "sparse_peaks"],
        "out_dtype": torch.float32,
        # tolerance against the float64 reference: float32 rounding of a softmax is ~1e-7 absolute
        "atol": 2e-6,
        "rtol": 1e-4,
        # the library op the task forbids (static name check and profiler op check)
        "forbidden_names": ["softmax", "log_softmax", "_softmax", "Softmax", "_log_softmax"],
        "forbidden_aten": ["aten::softmax", "aten::_softmax", "aten::log_softmax", "aten::_log_softmax"],
        "entry": "kernel",
    },
}


def bytes_moved(task, inputs, out_numel):
    """Lower bound on memory traffic: read every input once, write the output once."""
    b = sum(t.numel() * t.element_size() for t in inputs)
    return b + out_numel * torch.empty((), dtype=task["out_dtype"]).element_size()


def tolerance_ok(err_abs, ref_abs, task):
    return err_abs <= task["atol"] + task["rtol"] * ref_abs
