"""SFT → nine teachers → MOPD → eval, as stages over one config tree. Each stage reads as the steps it takes.

    python -m rlk3 sft      configs/sft-tiny.yaml          the base checkpoint (rlk3/train/sft.py)
    python -m rlk3 rl       configs/quickstart.yaml        one RL run (rlk3/cluster/driver.py)
    python -m rlk3 teachers configs/teachers.yaml          nine RL runs: per domain high, then medium and low from it
    python -m rlk3 mopd     configs/mopd.yaml              distil the teachers into one student
    python -m rlk3 eval     runs/demo/manifest.json        every model on every (domain, effort) slice + report
    python -m rlk3 demo     configs/demo.yaml              all of the above, on the embedded default
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import multiprocessing
import os
import time
from pathlib import Path

import torch

from rlk3.config import (
    CONFIG_DIR,
    DOMAINS,
    EFFORTS,
    check_paths,
    derive,
    heldout_sizes,
    load_config,
    student_changes,
    task_files,
    teacher_changes,
)
from rlk3.rollout.demos import DEFAULT_BUDGETS

# the effort levels' budgets (configs/effort/*.yaml): high trains at the maximum; medium and low anneal down from it
EFFORT_SETTINGS = {
    "high": {"effort.level": "high", "effort.budget": DEFAULT_BUDGETS["high"], "effort.budget_start": 0},
    "medium": {"effort.level": "medium", "effort.budget": DEFAULT_BUDGETS["medium"],
               "effort.budget_start": DEFAULT_BUDGETS["high"]},
    "low": {"effort.level": "low", "effort.budget": DEFAULT_BUDGETS["low"],
            "effort.budget_start": DEFAULT_BUDGETS["high"]},
}


def _setup(cfg) -> None:
    torch.manual_seed(cfg.run.seed)
    if cfg.cluster.cpu_threads:
        torch.set_num_threads(cfg.cluster.cpu_threads)


def run_stage(cfg) -> int:
    check_paths(cfg)  # before Ray starts: a teacher without weights surfaced only when the first rollouts were scored
    _setup(cfg)
    stage = cfg.run.stage
    if stage == "sft":
        from rlk3.train.sft import run_sft

        run_sft(cfg)
    elif stage in ("rl", "mopd"):
        from rlk3.cluster.driver import run_rl

        run_rl(cfg)
    elif stage == "teachers":
        run_teachers(cfg)
    elif stage == "demo":
        run_demo(cfg)
    else:
        raise ValueError(f"stage {stage!r}: the eval stage takes a manifest (python -m rlk3 eval <manifest.json>)")
    return 0


def run_teachers(cfg, sft: str | None = None, log=print) -> dict[str, str]:
    """Nine RL runs. Per domain: high from the SFT checkpoint at the maximum budget; medium and low continue from
    the high teacher while their budgets anneal down (the write-up's recipe). ``teachers.parallel`` runs train at
    once, each in its own placement group: a domain's medium and low start when its high is done. Returns
    "domain/effort" → checkpoint."""
    from rlk3.cluster.driver import run_rl, runs_that_fit

    sft = sft or cfg.model.init_from
    root = Path(cfg.run.output_dir)
    # every teacher's config is derived (and so validated) before any of them trains, medium's and low's from the
    # SFT checkpoint until their high teacher is done
    subs = {}
    for domain in cfg.tasks.domains:
        for effort in ("high", "medium", "low"):
            name = f"teacher-{domain}-{effort}"
            subs[domain, effort] = derive(cfg, {
                "run.stage": "rl", "run.name": name, "run.output_dir": str(root / name), "tasks.domains": [domain],
                "tasks.files": {d: {"path": path, "format": fmt, **({"heldout": own[0]} if own else {})}
                                for d, (path, fmt, *own) in task_files(cfg).items() if d == domain},
                "model.init_from": sft, "effort.anneal_steps": cfg.effort.anneal_steps, **EFFORT_SETTINGS[effort],
                **teacher_changes(cfg, domain, effort)})
    parallel = cfg.teachers.parallel or min(runs_that_fit(subs[cfg.tasks.domains[0], "high"]), len(subs))
    log(f"teachers: {len(subs)} runs, {parallel} at a time")

    def train(sub) -> str:
        name, t0 = sub.run.name, time.time()
        log(f"teachers: {name} from {sub.model.init_from}")
        # side by side, each run's lines carry its name
        final = run_rl(sub, log=log if parallel == 1 else (lambda line: log(f"{name} {line}")))
        log(f"teachers: {name} done in {time.time() - t0:.0f}s -> {final}")
        return str(final)

    out: dict[str, str] = {}
    failed: list[BaseException] = []
    ready = [(d, "high") for d in cfg.tasks.domains]
    running: dict[concurrent.futures.Future, tuple[str, str]] = {}
    with concurrent.futures.ThreadPoolExecutor(parallel, thread_name_prefix="teacher") as pool:
        while ready or running:
            # a run is handed to the pool only when it can start, so that after a failure none starts
            while ready and len(running) < parallel:
                domain, effort = ready.pop(0)
                sub = subs[domain, effort]
                if effort != "high":
                    sub = derive(sub, {"model.init_from": out[f"{domain}/high"]})
                running[pool.submit(train, sub)] = (domain, effort)
            finished, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in finished:
                domain, effort = running.pop(future)
                if future.exception() is not None:
                    # the teachers already training finish and keep their checkpoints; none starts after a failure
                    failed.append(future.exception())
                    ready.clear()
                    log(f"teachers: teacher-{domain}-{effort} failed ({future.exception()!r}); "
                        f"{len(running)} still training will finish, none will start")
                    continue
                out[f"{domain}/{effort}"] = future.result()
                if effort == "high" and not failed:
                    ready += [(domain, "medium"), (domain, "low")]
    if failed:
        raise failed[0]
    out = {f"{d}/{e}": out[f"{d}/{e}"] for d, e in subs}  # the grid's order, whatever order they finished in
    (root / "teachers.json").write_text(json.dumps(out, indent=2))
    return out


def _evaluate_model(job) -> tuple[dict, int, float]:
    """One model of ``run_eval``: its eval.json entry, how many graders raised, and the seconds it took."""
    from rlk3.rollout.evaluate import evaluate_policy, load_policy

    name, kind, d, e, path, mine, n, loop, files, device = job
    t0 = time.time()
    policy, tok = load_policy(path, device=device)
    res, _ = evaluate_policy(policy, tok, mine, n, loop_config=loop, files=files)
    entry = {"name": name, "kind": kind, "slices": [r.to_dict() for r in res]}
    if d is not None:
        entry |= {"domain": d, "effort": e}
    return entry, sum(r.grader_errors for r in res), time.time() - t0


def run_demo(cfg, log=print) -> Path:
    """SFT → nine teachers → MOPD → eval + report on the embedded default."""
    from rlk3.cluster.driver import run_rl
    from rlk3.train.sft import run_sft

    root = Path(cfg.run.output_dir)
    t0 = time.time()
    sft = Path(cfg.model.init_from) if cfg.model.init_from else None
    if sft is None or not (sft / "config.json").exists():
        # configs/sft-demo.yaml: the recipe of configs/sft-tiny.yaml on both cores, then a closing stage with a habit
        # for each domain's teachers to correct
        sft_cfg = load_config(CONFIG_DIR / "sft-demo.yaml", [f"run.output_dir={root / 'sft'}", "run.stage=sft"])
        threads = torch.get_num_threads()
        _setup(sft_cfg)
        sft = run_sft(sft_cfg, log=log)
        torch.set_num_threads(threads)  # the stages after it run at the demo's own setting
    log(f"demo: SFT ready ({time.time() - t0:.0f}s)")
    teachers = run_teachers(derive(cfg, {"run.stage": "teachers", "run.output_dir": str(root)}), str(sft), log=log)
    log(f"demo: nine teachers ready ({time.time() - t0:.0f}s)")
    manifest = {"sft": str(sft), "teachers": teachers, "heldout": heldout_sizes(cfg), "loop": eval_loop(cfg),
                "files": manifest_files(cfg)}
    # the base and the teachers are evaluated while the student trains (Evaluation); results do not depend on it
    with Evaluation.of_manifest(manifest, log=log) as evaluation:
        for model in manifest_models(manifest):
            evaluation.add(*model)
        log(f"demo: evaluating the SFT base and {len(teachers)} teachers while the student trains")
        student = run_rl(derive(cfg, {**student_changes(cfg),
                                      "run.stage": "mopd", "run.name": "student",
                                      "run.output_dir": str(root / "student"),
                                      "tasks.domains": list(DOMAINS), "model.init_from": str(sft),
                                      "mopd.teachers": teachers, "effort.budget_start": 0,
                                      "run.iterations": cfg.mopd.iterations}), log=log)
        log(f"demo: student ready ({time.time() - t0:.0f}s)")
        manifest |= {"student": str(student),
                     "runs": [str(Path(p).parent) for p in [*teachers.values(), student]]}
        (root / "manifest.json").write_text(json.dumps(manifest, indent=2))
        report = run_eval(root / "manifest.json", log=log, started=evaluation)
    log(f"demo: done in {time.time() - t0:.0f}s; report: {report}")
    return report


def manifest_files(cfg) -> dict[str, list[str]]:
    """``tasks.files`` for a run manifest: domain -> [absolute path, format] (and the absolute held-out file's path
    where the entry names one), so that ``rlk3 eval`` of the manifest, from any directory, evaluates those domains
    on their files' held-out tasks."""
    return {d: [str(Path(path).resolve()), fmt, *(str(Path(h).resolve()) for h in own)]
            for d, (path, fmt, *own) in task_files(cfg).items()}


def eval_loop(cfg) -> dict:
    """The agent loop's limits the runs trained under, which the evaluation keeps (greedy): a model evaluated with
    more turns than it was trained with retries past its budget where training would have stopped it."""
    return {"max_turns": cfg.harness.max_turns, "max_turn_tokens": cfg.rollout.max_new_tokens,
            "max_context_tokens": cfg.rollout.max_total_tokens}


class Evaluation:
    """Models evaluated side by side on the held-out slices: greedy pass@1 in the agent loop, each model in its own
    process with one torch thread (``workers``: models at once; None: one per core, at most 4; 1: each in this process,
    at its thread count, as it is added). A model can be added while others run: the demo adds the SFT base and the
    teachers as soon as they exist, so they are evaluated while the student trains (its rollouts are one process and
    leave the other core idle), and the student when it is done. A teacher is evaluated on its own domain's slices
    (all efforts: the ordering of tokens by effort is read there); the base and the student on all nine.

    ``device``: "cpu", "cuda" or "auto" (the default: the GPU where there is one). On a GPU the models run one after
    another in one process beside this one (None ``workers``), each with its engine on the card."""

    KINDS = ("sft", "teacher", "student")
    DEVICES = ("auto", "cpu", "cuda")

    def __init__(self, tasks_per_slice: dict[str, int], loop, workers: int | None = None, log=print,
                 files: dict[str, tuple[str, ...]] | None = None, device: str = "auto") -> None:
        self.device = resolve_device(device)
        self.n, self.loop, self.log = tasks_per_slice, loop, log
        # domain -> (path, format[, held-out path]): its held-out tasks
        self.files = {d: tuple(f) for d, f in (files or {}).items()}
        # on the CPU k3-tiny's small ops use one core poorly (and two threads beside a busy process spin), so models
        # run side by side at one thread each; on a GPU one process beside this one owns the card's evaluation (each
        # model's engine takes its share of the free memory)
        cuda = self.device == "cuda"
        n = workers or (1 if cuda else min(os.cpu_count() or 1, 4))
        threads = {} if cuda else {"initializer": torch.set_num_threads, "initargs": (1,)}
        self.pool = None if workers == 1 or (n == 1 and not cuda) else concurrent.futures.ProcessPoolExecutor(
            n, mp_context=multiprocessing.get_context("spawn"), **threads)
        self.kinds: dict[str, str] = {}
        self.entries: dict[str, dict] = {}
        self.running: dict[concurrent.futures.Future, str] = {}

    @classmethod
    def of_manifest(cls, m: dict, n: int | None = None, workers: int | None = None, log=print,
                    device: str = "auto") -> Evaluation:
        """For a run manifest's models: its held-out counts (``n`` for every domain instead), the agent loop's
        limits the runs trained under, greedy, and its task files (older manifests: one count for every domain, the
        loop's defaults, no files)."""
        from rlk3.rollout.agent_loop import LoopConfig

        loop = LoopConfig(temperature=0.0, **m["loop"]) if m.get("loop") else None
        return cls(tasks_per_slice(m.get("heldout", 40), n), loop, workers, log, files=m.get("files"),
                   device=device)

    def __contains__(self, name: str) -> bool:
        return name in self.kinds

    def add(self, name: str, kind: str, domain: str | None, effort: str | None, path: str) -> None:
        if kind not in self.KINDS or name in self.kinds:
            raise ValueError(f"model {name!r} ({kind!r}): kinds are {self.KINDS}, each name added once")
        self.kinds[name] = kind
        slices = [(d, e, DEFAULT_BUDGETS[e]) for d in DOMAINS for e in EFFORTS if domain is None or d == domain]
        job = (name, kind, domain, effort, path, slices, self.n, self.loop, self.files, self.device)
        if self.pool is None:
            self._done(*_evaluate_model(job))
        else:
            self.running[self.pool.submit(_evaluate_model, job)] = name

    def _done(self, entry: dict, bad: int, seconds: float) -> None:
        name = entry["name"]
        self.entries[name] = entry
        if bad:
            self.log(f"eval: WARNING {name}: {bad} episodes' graders raised (scored as fails; the grader or its "
                     "sandboxes are broken, so these pass rates understate the model)")
        self.log(f"eval: {name} on {len(entry['slices'])} slices x "
                 f"{sorted({self.n[s['domain']] for s in entry['slices']})} tasks in {seconds:.0f}s ({self.device})")

    def results(self) -> dict:
        """Waits for every model added; eval.json's content: the base, the teachers by name, then the student."""
        for future in concurrent.futures.as_completed(self.running):
            self._done(*future.result())
        self.running.clear()
        order = sorted(self.kinds, key=lambda name: (self.KINDS.index(self.kinds[name]), name))
        return {"models": [self.entries[name] for name in order]}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(cancel_futures=True)

    def __enter__(self) -> Evaluation:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class DeviceError(ValueError):
    """An evaluation device that is not valid here."""


def resolve_device(device: str) -> str:
    """"auto" → "cuda" where PyTorch sees a GPU, else "cpu"; "cuda" without one is refused with what is seen."""
    if device not in Evaluation.DEVICES:
        raise DeviceError(f"eval device {device!r}: valid are {', '.join(Evaluation.DEVICES)} (auto: the GPU where "
                          "there is one)")
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise DeviceError("eval device 'cuda': PyTorch sees no GPU here (torch.cuda.is_available() is False; this "
                          f"torch is {torch.__version__}); use device=cpu, or run where a GPU is visible")
    return device


def manifest_models(m: dict) -> list[tuple[str, str, str | None, str | None, str]]:
    """(name, kind, domain, effort, checkpoint) of every model a run manifest names, the longest to evaluate (all
    nine slices) first, so that no long one runs alone at the end."""
    models = [("sft", "sft", None, None, m["sft"])]
    if m.get("student"):
        models.append(("student", "student", None, None, m["student"]))
    for key, path in sorted(m.get("teachers", {}).items()):
        d, e = key.split("/")
        models.append((f"teacher-{d}-{e}", "teacher", d, e, path))
    return models


class ManifestError(ValueError):
    """A run manifest ``rlk3 eval`` cannot evaluate (the CLI prints it, where other errors keep their traceback)."""


def read_manifest(path: Path) -> dict:
    """The manifest at ``path``, checked before any model is loaded: every checkpoint it names is a saved model
    directory, and every task file it records is still there (a run directory moved or cleaned up failed inside an
    evaluation process, as a traceback from the loader)."""
    where = str(path)
    try:
        m = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ManifestError(f"{where} is not JSON ({e}); a manifest is what the demo stage writes") from None
    if not isinstance(m, dict) or "sft" not in m:
        raise ManifestError(f"{where} names no 'sft' checkpoint: a run manifest is what the demo stage writes "
                            "(<run.output_dir>/manifest.json), with sft, teachers and student checkpoints")
    for name, _kind, _d, _e, path in manifest_models(m):
        if not (Path(path) / "config.json").is_file():
            raise ManifestError(f"{where}: {name}'s checkpoint {path!r} is not a saved model (no config.json there)")
    for d, (path, fmt, *own) in (m.get("files") or {}).items():
        for p in (path, *own):
            if not Path(p).is_file():
                raise ManifestError(f"{where}: the {d} task file {p!r} ({fmt}) is gone; its held-out tasks are what "
                                    f"{d} is evaluated on")
    return m


def tasks_per_slice(heldout, n: int | None = None) -> dict[str, int]:
    """Held-out tasks per slice for each domain: ``n`` for all, else a manifest's ``heldout`` (per domain, or one count
    for every domain in older manifests)."""
    return {d: n or (int(heldout[d]) if isinstance(heldout, dict) else int(heldout)) for d in DOMAINS}


def run_eval(manifest_path: str | Path, n: int | None = None, log=print, workers: int | None = None,
             started: Evaluation | None = None, device: str = "auto") -> Path:
    """Evaluate the SFT base, every teacher and the student on every (domain, effort) slice of the held-out split;
    write eval.json and the report (report.md + plots) beside the manifest; print the slice and acceptance tables.
    ``n`` (tasks per slice) overrides the manifest's per-domain counts; ``workers`` and ``device`` as
    :class:`Evaluation`'s. ``started``: an evaluation already running some of the manifest's models (the demo's);
    the rest are added."""
    from rlk3.report import acceptance_summary, slice_table, write_report

    manifest_path = Path(manifest_path)
    m = read_manifest(manifest_path)
    with contextlib.nullcontext(started) if started else Evaluation.of_manifest(m, n, workers, log, device) as ev:
        for model in manifest_models(m):  # the caller's evaluation is the caller's to close
            if model[0] not in ev:
                ev.add(*model)
        out = ev.results()
    eval_path = manifest_path.parent / "eval.json"
    eval_path.write_text(json.dumps(out, indent=2))
    log(slice_table(out))
    runs = [Path(r) for r in m.get("runs", [])]
    report = write_report(eval_path, runs, manifest_path.parent / "report")
    log(acceptance_summary(eval_path, runs))
    return report
