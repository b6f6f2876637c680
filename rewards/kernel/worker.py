"""Kernel worker: hosts ONE implementation (the expert's or the candidate's) for the judge.

Untrusted code runs in this process, so nothing it reports is believed: the judge times calls with its
own clock, freezes this process when a call returns and reads the output from this process's memory
itself. What this file adds are cheap in-process observations (exact tensor type, function identities),
which only ever add reasons, never remove them.

argv: cmd_fd res_fd shm_path mode task solution_dir device
"""

import importlib
import json
import os
import sys
import time


def main():
    cmd_fd, res_fd = int(sys.argv[1]), int(sys.argv[2])
    shm_path, mode, task_name, sol_dir, device = sys.argv[3:8]
    write, dumps = os.write, json.dumps
    cmd = os.fdopen(cmd_fd, "rb", buffering=0)

    def send(obj):
        write(res_fd, dumps(obj).encode() + b"\n")

    import torch

    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    sys.path.insert(0, "/grader")
    import tasks

    task = tasks.TASKS[task_name]
    Tensor = torch.Tensor
    exact_type = type
    on_cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if on_cuda else (lambda: None)  # captured before any candidate import
    watch = {
        "time.perf_counter": (time, "perf_counter"),
        "time.perf_counter_ns": (time, "perf_counter_ns"),
        "time.time": (time, "time"),
        "time.monotonic": (time, "monotonic"),
        "torch.cuda.synchronize": (torch.cuda, "synchronize"),
        "torch.cuda.Event": (torch.cuda, "Event"),
        "torch.cuda.Event.record": (torch.cuda.Event, "record"),
        "torch.cuda.Event.elapsed_time": (torch.cuda.Event, "elapsed_time"),
        "torch.Tensor.copy_": (torch.Tensor, "copy_"),
        # what the worker itself calls while staging a call's inputs, before the judge's clock starts
        "torch.Tensor.to": (torch.Tensor, "to"),
        "torch.Tensor.view": (torch.Tensor, "view"),
        "torch.empty": (torch, "empty"),
        "torch.full": (torch, "full"),
    }
    before = {k: getattr(m, a) for k, (m, a) in watch.items()}
    # warm-up: torch's own threads (and on CUDA the context, cuBLAS and their threads) exist before the
    # judge takes its thread baseline
    (torch.ones(64, 64) @ torch.ones(64, 64)).sum()
    if device.startswith("cuda"):
        w = torch.randn(256, 256, device=device)
        (w @ w).softmax(-1).sum().item()
        torch.cuda.synchronize()
    from torch.utils._python_dispatch import TorchDispatchMode

    class OpTrace(TorchDispatchMode):
        """Records every aten op a call reaches (a profiler without Kineto's one-second start-up)."""

        def __init__(self):
            super().__init__()
            self.ops = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.add(str(func.overloadpacket).replace(".", "::", 1))
            return func(*args, **(kwargs or {}))

    shm = None
    send({"ready": os.getpid()})
    impl = None
    last = None  # the latest result stays alive: the judge reads its memory
    buf = b""

    def receive():
        nonlocal buf
        while b"\n" not in buf:
            chunk = cmd.read(65536)
            if not chunk:
                os._exit(0)
            buf += chunk
        line, buf = buf.split(b"\n", 1)
        return json.loads(line)

    while True:
        msg = receive()
        op = msg["op"]
        try:
            if op == "load":
                shm = torch.from_file(shm_path, shared=True, size=msg["shm_bytes"], dtype=torch.uint8)
                shm.sum()  # map every page of the shared inputs now, not during a timed call
                if mode == "expert":
                    impl = task["expert"]
                else:
                    sys.path.insert(0, sol_dir)
                    impl = getattr(importlib.import_module("solution"), task["entry"])
                send({"loaded": True})
            elif op in ("call", "profile"):
                ins = []
                for spec in msg["inputs"]:
                    dt = getattr(torch, spec["dtype"])
                    n = spec["nbytes"]
                    t = shm[spec["offset"] : spec["offset"] + n].view(dt).view(spec["shape"])
                    if on_cuda:  # fresh device allocation at a random distance from the last one
                        pad = torch.empty(spec["pad"], dtype=torch.uint8, device=device)
                        t = t.to(device)
                        del pad
                    ins.append(t)
                scalars = msg["scalars"]
                if op == "profile":
                    with OpTrace() as trace:
                        impl(*ins, **scalars)
                    send({"ops": sorted(trace.ops)})
                    continue
                if on_cuda:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                last = None
                if on_cuda:  # poison the caching allocator: an output never written holds NaN, not a result
                    n = sum(t.numel() for t in ins) + (1 << 20)
                    poison = torch.full((n,), float("nan"), device=device)
                    del poison
                    sync()
                # inputs are staged: the judge starts its clock on "go", so the host-to-device copies above stay
                # out of the window it checks the CUDA events against (functions used above are in `watch`)
                send({"staged": True})
                if receive().get("op") != "go":
                    raise RuntimeError("protocol: expected 'go' after 'staged'")
                if on_cuda:
                    start.record()
                out = impl(*ins, **scalars)
                if on_cuda:
                    sync()  # whole device: work left on side streams is inside the timed call
                    end.record()
                    sync()
                last = out
                is_t = exact_type(out) is Tensor
                tname = f"{exact_type(out).__module__}.{exact_type(out).__qualname__}"
                meta = {"exact_type": is_t, "type": tname}
                if isinstance(out, Tensor):
                    meta.update(
                        dtype=str(out.dtype).removeprefix("torch."),
                        shape=list(out.shape),
                        strides=list(out.stride()),
                        ptr=out.data_ptr(),
                        nbytes=out.numel() * out.element_size(),
                        device=str(out.device),
                        contiguous=out.is_contiguous(),
                    )
                if on_cuda:
                    meta["event_ms"] = start.elapsed_time(end)
                meta["torch_threads"] = torch.get_num_threads()
                meta["tampered"] = sorted(k for k, (m, a) in watch.items() if getattr(m, a, None) is not before[k])
                send({"done": True, "meta": meta})
            elif op == "copy_out":  # CUDA: the judge cannot read device memory, so copy to the shm slot
                dst = shm[msg["offset"] : msg["offset"] + msg["nbytes"]]
                dst.copy_(last.detach().reshape(-1).view(torch.uint8).cpu())
                send({"copied": True})
            elif op == "exit":
                os._exit(0)
        except BaseException as e:
            send({"error": f"{type(e).__name__}: {str(e)[:300]}"})
            if isinstance(e, SystemExit | KeyboardInterrupt):
                os._exit(1)


if __name__ == "__main__":
    main()
