"""rlk3's configuration: omegaconf structured configs, composed and validated before anything is allocated.

A run config is a YAML file whose ``defaults`` list names fragments under ``configs/`` (``base``, ``model/…``,
``domain/…``, ``effort/…``, ``stage/…``, or another run config: ``configs/sft-demo.yaml`` is ``defaults: [sft-tiny]``
plus its own keys), merged in order, each fragment's own ``defaults`` first, then the file's own keys, then
``key=value`` overrides from the command line. The schema below is the whole vocabulary: an unknown key anywhere is an
error naming it and the valid keys at that level; every value is range-checked with a message naming the key,
the bad value and what would be valid. The checkpoints a stage reads (``model.init_from``, ``mopd.teachers``) are
checked when it starts (``check_paths``), so that a config naming placeholders still loads; so are the records of
``tasks.files`` (their keys, formats, suffixes and existence are checked at load).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, ValidationError

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"
STAGES = ("sft", "rl", "teachers", "mopd", "eval", "demo")
DOMAINS = ("general", "agentic", "coding")
EFFORTS = ("low", "medium", "high")


class ConfigError(ValueError):
    """An invalid configuration; the message names the key, the value and what is valid."""


@dataclass
class ModelConfig:
    preset: str = "k3-tiny"  # a K3Config preset
    overrides: dict[str, Any] = field(default_factory=dict)  # K3Config keys on top of the preset
    init_from: str | None = None  # a checkpoint directory (HF format) to start from
    dtype: str = "float32"  # float32 | bfloat16: SFT's mixed precision and the RL rollout engine's weights and caches


@dataclass
class TasksConfig:
    domains: list[str] = field(default_factory=lambda: ["general"])
    weights: list[float] = field(default_factory=list)  # sampling weight per domain (empty: equal)
    train_size: int = 4096  # distinct training tasks per domain (synthetic suites are unbounded)
    heldout_size: int = 64  # held-out tasks per domain for evaluation
    heldout_sizes: dict[str, int] = field(default_factory=dict)  # per-domain exceptions, e.g. {general: 400}
    # domain -> a local .jsonl/.json/.parquet task file that replaces the domain's synthetic suite in training and
    # held-out evaluation: a path (general: gsm8k, agentic: swe) or {path: ..., format: ...} (coding: mbpp | humaneval),
    # split by question hash; {path, format, heldout: <path>} where the dataset ships its own held-out file (verl's
    # test.parquet)
    files: dict[str, Any] = field(default_factory=dict)


@dataclass
class EffortConfig:
    level: str = "high"  # stated in the system prompt
    budget: int = 256  # generated-token budget once annealed; over it the reward is -1
    budget_start: int = 0  # 0: no annealing (start at `budget`); else anneal from here down to `budget`
    anneal_steps: int = 0
    schedule: str = "linear"  # linear | step | constant


@dataclass
class HarnessConfig:
    # each domain's harness preset is fixed (rlk3.rollout.demos.DOMAIN_PRESETS: the SFT demonstrations' format); no
    # preset mix and no context compaction in rollouts: a compacted context is not the one token stream the trainer
    # scores, so neither has a key here
    max_turns: int = 6


@dataclass
class HabitStageConfig:
    """A closing SFT stage on a careless demonstrator's solutions, most of which carry its domain's habit
    (``rlk3.rollout.demos.HABITS``): the systematic flaw imitation leaves in a policy and RL corrects (docs/sft.md,
    "The closing stage")."""

    domain_demos: dict[str, int] = field(default_factory=dict)  # domain -> demonstrations; all 0: no closing stage
    effort_weights: dict[str, float] = field(default_factory=dict)  # effort -> weight (empty: `efforts`, equally)
    efforts: list[str] = field(default_factory=lambda: ["high"])  # the efforts whose demonstrations have the habit
    rate: float = 0.65  # share of those written with the habit
    habits: dict[str, str] = field(default_factory=dict)  # domain -> which of its HABITS (empty: each domain's first)
    lr: float = 3e-4  # constant, a fresh AdamW


@dataclass
class SFTConfig:
    demos_per_domain: int = 2000
    domain_demos: dict[str, int] = field(default_factory=dict)  # domain -> count, replacing demos_per_domain there
    effort_weights: dict[str, float] = field(default_factory=dict)  # effort -> weight of demos at it (empty: equal)
    epochs: float = 1.0
    lr: float = 3e-3
    batch_size: int = 16
    max_length: int = 384
    warmup_ratio: float = 0.05
    demo_error_rate: float = 0.15  # demonstrations are imperfect on purpose: RL needs headroom
    # agentic thoughts reason each step through (what the last output said, what follows) instead of naming the move:
    # high effort's agentic demonstrations then take ~2.7x low's tokens, not ~1.4x (docs/sft.md, "Worked thoughts")
    worked_thoughts: bool = False
    habit_stage: HabitStageConfig = field(default_factory=lambda: HabitStageConfig())
    vocab_size: int = 4096  # the tokenizer trained on the demonstrations (k3-tiny's vocab)


@dataclass
class RolloutConfig:
    groups_per_iteration: int = 8  # prompts per iteration
    group_size: int = 4  # samples per prompt
    lam: float = 1.0  # fraction of trajectories that must finish before the rest are paused (λ)
    max_staleness: int = 4  # the most versions a trained token may lag the trainer (carried ones run to the end first)
    top_up: str = "groups"  # groups | trajectories: what each iteration tops up to (rlk3/rollout/partial.py)
    temperature: float = 1.0
    top_p: float = 1.0
    max_new_tokens: int = 256  # per assistant turn
    max_total_tokens: int = 2048
    snapshot_turns: bool = True  # snapshot each sandbox after every turn (environment recovery)
    # generator | counter | null: the rollout engine's sampler (rlk3/engine/sampling.py); null = counter on CUDA,
    # generator on CPU (set it to keep one sampler when a run moves between devices)
    sampler: str | None = None
    efforts: list[str] = field(default_factory=lambda: ["low", "medium", "high"])  # MOPD's prompt mix
    # the rollout engine's own settings, EngineConfig keys (docs/engine.md), e.g. {memory_fraction: 0.5} on a GPU
    # (vLLM's gpu_memory_utilization) or {recompute_on_weight_update: true}. Unset: a 256 MiB pool (k3-tiny on a
    # CPU). max_model_len and sampler come from rollout.max_total_tokens and rollout.sampler (``engine_settings``)
    engine: dict[str, Any] = field(default_factory=dict)


@dataclass
class TrainConfig:
    lr: float = 1e-4
    warmup_steps: int = 0  # optimizer steps of linear learning-rate warm-up (verl: lr_warmup_steps)
    adam_beta2: float = 0.999  # AdamW's second-moment decay (torch's and verl's default)
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    estimator: str = "grpo"  # grpo | rloo | reinforce
    scale_advantages: bool = True
    negative_scale: float = 1.0  # weight on below-baseline advantages (0: positive sample reinforcement only)
    clip_low: float = 0.2
    clip_high: float = 0.28
    is_mode: str = "truncate"  # truncate | mask | icepop | none
    is_cap: float = 2.0
    is_low: float = 0.5
    is_high: float = 2.0
    kl_coef: float = 0.0
    aggregation: str = "token-mean"
    micro_batch_tokens: int = 4096
    minibatches: int = 1  # optimizer steps per iteration, each on 1/minibatches of the batch (verl: ppo_mini_batch)
    ppo_epochs: int = 1  # passes over the batch per iteration; >1 update against one π_old (the PPO clip's job)
    qb_update: bool = True  # Quantile Balancing bias update after each step
    share_prompts: bool = False  # a group's prompt runs once in training, its samples from its states (trainer.py)
    qb_bins: int = 1000
    dead_signal_patience: int = 5  # warn, then stop after this many steps without a learning signal


@dataclass
class MOPDConfig:
    teachers: dict[str, str] = field(default_factory=dict)  # "domain/effort" -> checkpoint dir
    clip: float = 5.0
    alpha: float = 0.0  # weight of the outcome reward next to the distillation reward
    iterations: int = 20  # the demo stage's MOPD iterations (run.iterations for a plain mopd run)
    max_resident: int = 9  # teachers kept loaded at once, on the GPU when there is one (fewer: loaded on demand)
    # the demo stage's student run: nested keys of this schema on top of the stage's config, as teachers.overrides
    # are for a teacher (e.g. {"train": {"lr": 1e-4}, "rollout": {"group_size": 8}})
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass
class TeachersConfig:
    # per-teacher changes on top of the stage's config (the teachers and demo stages): under a domain ("general")
    # for its three teachers, or under "domain/effort" for one (applied after its domain's), as nested keys of
    # this schema, e.g. {"general": {"rollout": {"temperature": 0.6}}, "agentic/low": {"run": {"iterations": 10}}}
    overrides: dict[str, Any] = field(default_factory=dict)
    # teachers trained at once (a medium or low starts when its domain's high is done): 0 = as many as the Ray
    # cluster's CPUs (and GPUs, with cluster.num_gpus) hold runs of this config's bundles; 1 = one after another
    parallel: int = 0


TOP_UP_MODES = ("groups", "trajectories")  # rlk3/rollout/partial.py
SAMPLERS = ("generator", "counter")  # rlk3/engine/sampling.py
WEIGHT_SYNC_MODES = ("object_store", "broadcast", "cuda_ipc")  # rlk3/cluster/weight_sync.py


@dataclass
class ClusterConfig:
    ray_address: str | None = None  # None: a local head (ray.init())
    colocate: bool = True  # rollout and training share the bundle, alternating phases
    num_gpus: int = 0
    sandbox_url: str | None = None  # None: start the local sandbox server; else an E2B-compatible URL
    sandbox_api_key: str | None = None  # the X-API-KEY of cluster.sandbox_url's server; None: $E2B_API_KEY
    cpu_threads: int = 0  # torch intra-op threads per process on CPU (0: torch's default)
    train_workers: int = 1  # data-parallel training ranks, one actor and bundle each (FSDP2; gloo on CPU, NCCL on GPUs)
    # trainer -> engine: object_store (Ray shared memory) | broadcast (gloo/NCCL group of two) | cuda_ipc (one GPU)
    weight_sync: str = "object_store"
    # disaggregated only: iteration i + 1's rollout runs while iteration i trains (one policy version of lag,
    # corrected per token like a resumed partial rollout); off at checkpoint boundaries
    overlap: bool = False


@dataclass
class RunConfig:
    stage: str = MISSING  # sft | rl | mopd | eval
    name: str = "run"
    output_dir: str = "runs/${run.name}"
    seed: int = 0
    iterations: int = 40
    eval_every: int = 10
    checkpoint_every: int = 10
    resume: bool = True  # continue from the latest checkpoint in output_dir when there is one
    log_tensorboard: bool = True


@dataclass
class Config:
    run: RunConfig = field(default_factory=RunConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    tasks: TasksConfig = field(default_factory=TasksConfig)
    effort: EffortConfig = field(default_factory=EffortConfig)
    harness: HarnessConfig = field(default_factory=HarnessConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    mopd: MOPDConfig = field(default_factory=MOPDConfig)
    teachers: TeachersConfig = field(default_factory=TeachersConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


# ---------------------------------------------------------------------------------------------- loading


FREE_FORM = (
    "model.overrides", "tasks.files", "tasks.heldout_sizes", "mopd.teachers", "sft.domain_demos",
    "sft.effort_weights", "sft.habit_stage.effort_weights", "sft.habit_stage.domain_demos",
    "sft.habit_stage.habits", "teachers.overrides",
    "mopd.overrides", "rollout.engine",
)


def _fragment(name: str) -> DictConfig:
    path = CONFIG_DIR / f"{name}.yaml"
    if not path.is_file():
        options = sorted(str(p.relative_to(CONFIG_DIR).with_suffix("")) for p in CONFIG_DIR.rglob("*.yaml"))
        raise ConfigError(f"defaults: no config fragment {name!r} (looked for {path}); available: {options}")
    return OmegaConf.load(path)


def _compose(cfg, name: str, seen: tuple[str, ...] = ()):
    """``cfg`` with the fragment ``name`` merged on, its own ``defaults`` first: a run config can build on another
    (``defaults: [sft-tiny]``)."""
    if name in seen:
        raise ConfigError(f"defaults: {' -> '.join((*seen, name))} is a cycle")
    frag = _fragment(name)
    for inner in list(frag.pop("defaults", []) or []):
        cfg = _compose(cfg, str(inner), (*seen, name))
    return _merge(cfg, frag, f"configs/{name}.yaml")


def _merge(base: DictConfig, extra: DictConfig | dict, where: str) -> DictConfig:
    try:
        return OmegaConf.merge(base, extra)
    except (ConfigKeyError, ConfigAttributeError) as e:
        key = e.full_key or getattr(e, "key", "?")
        parent = ".".join(str(key).split(".")[:-1])
        node = OmegaConf.select(base, parent) if parent else base
        valid = sorted(node.keys()) if isinstance(node, DictConfig) else []
        raise ConfigError(f"{where}: unknown key {key!r}; valid keys here: {valid}") from None
    except ValidationError as e:
        # a section set to a plain value ({train: 3}) raises with neither a message nor a key
        msg = e.msg.splitlines()[0] if e.msg else "a value of the wrong type (a section takes a mapping of its keys)"
        raise ConfigError(f"{where}: {e.full_key}: {msg}" if e.full_key else f"{where}: {msg}") from None
    except TypeError as e:  # omegaconf merging a mapping onto a list or the reverse ("tasks.domains={}")
        raise ConfigError(f"{where}: {e} (a list key needs [a, b], a mapping key {{k: v}})") from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Compose ``path`` (its ``defaults`` first) and ``key=value`` overrides onto the schema, then validate.
    Returns a typed ``Config`` (a read-only omegaconf view with attribute access)."""
    cfg = OmegaConf.structured(Config)
    OmegaConf.set_struct(cfg, True)
    for key in FREE_FORM:  # user-named entries (teachers, preset weights, ...): any key is fine there
        OmegaConf.set_struct(OmegaConf.select(cfg, key), False)
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        user = OmegaConf.load(path)
        defaults = list(user.pop("defaults", []) or [])
        for name in defaults:
            cfg = _compose(cfg, str(name))
        cfg = _merge(cfg, user, str(path))
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key=value (e.g. rollout.lam=0.7)")
        cfg = _merge(cfg, OmegaConf.from_dotlist([item]), f"override {item!r}")
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"missing required keys {missing} (set them in the config file or as key=value)")
    OmegaConf.resolve(cfg)
    validate(cfg)
    OmegaConf.set_readonly(cfg, True)
    return cfg  # type: ignore[return-value]


def derive(cfg: Config, changes: dict[str, Any]) -> Config:
    """A validated copy of ``cfg`` with dotted-key ``changes`` (how the teachers and demo stages make each run's
    config from the one the user gave)."""
    new = OmegaConf.create(OmegaConf.to_container(cfg))
    base = OmegaConf.structured(Config)
    OmegaConf.set_struct(base, True)
    for key in FREE_FORM:
        OmegaConf.set_struct(OmegaConf.select(base, key), False)
    new = _merge(base, new, "derived config")
    for key, value in changes.items():
        if isinstance(value, dict) and key in FREE_FORM:  # the mapping given is the key's value, not merged onto it
            OmegaConf.update(new, key, value, merge=False)
            OmegaConf.set_struct(OmegaConf.select(new, key), False)
            continue
        new = _merge(new, OmegaConf.from_dotlist([f"{key}={value}"]) if not isinstance(value, (list, dict))
                     else OmegaConf.create(_nest(key, value)), f"derived config ({key})")
    validate(new)
    OmegaConf.set_readonly(new, True)
    return new  # type: ignore[return-value]


# a path alone in tasks.files takes its domain's one format; coding has two (mbpp, humaneval), so it names its own
FILE_FORMAT_OF = {"general": "gsm8k", "agentic": "swe"}


def task_files(cfg: Config) -> dict[str, tuple[str, ...]]:
    """``tasks.files`` as domain -> (path, format), or (path, format, held-out path) where the entry names its
    dataset's own held-out file (checked by ``validate``)."""
    out = {}
    for d, v in cfg.tasks.files.items():
        if isinstance(v, str):
            out[str(d)] = (str(v), FILE_FORMAT_OF[d])
        else:
            out[str(d)] = (str(v["path"]), str(v["format"])) + ((str(v["heldout"]),) if v.get("heldout") else ())
    return out


def heldout_notes(cfg: Config) -> list[str]:
    """A line for each ``tasks.files`` entry whose held-out file shares prompts with its train file: those records
    are left out of evaluation (``envs.tasks.heldout_overlap``), and a run says how many at its start."""
    from envs.tasks import heldout_overlap

    files, out = task_files(cfg), []
    for d, (path, _fmt, *own) in files.items():
        dropped, records = heldout_overlap(files, d)  # (0, 0) without a held-out file
        if dropped:
            out.append(f"tasks.files.{d}: {dropped} of the {records} records of {own[0]} have a prompt the train "
                       f"file {path} also holds; they are not evaluated")
    return out


def heldout_sizes(cfg: Config) -> dict[str, int]:
    """Held-out tasks per domain for evaluation: ``tasks.heldout_sizes`` where given, else ``tasks.heldout_size``."""
    return {d: int(cfg.tasks.heldout_sizes.get(d, cfg.tasks.heldout_size)) for d in DOMAINS}


# what the teachers stage itself sets for each teacher (rlk3/pipeline.py): an override may not move these
TEACHER_FIXED = ("run.stage", "run.name", "run.output_dir", "tasks.domains", "model.init_from", "effort.level")


def _flat(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix: tree}
    out: dict[str, Any] = {}
    for k, v in tree.items():
        out |= _flat(v, f"{prefix}.{k}" if prefix else str(k))
    return out


# the engine keys the run sets from its own: one place for each number (the agent loop's context limit is the
# engine's max_model_len; rollout.sampler is documented with the run's other sampling keys)
ENGINE_FROM_RUN = {"max_model_len": "rollout.max_total_tokens", "sampler": "rollout.sampler"}
ENGINE_DEFAULT_MEMORY = 256 << 20  # the pool when rollout.engine names no memory key: ample for k3-tiny on a CPU


def engine_settings(cfg: Config) -> dict[str, Any]:
    """The rollout engine's EngineConfig keyword arguments: ``rollout.engine`` on top of the run's own."""
    engine = cfg.rollout.engine
    own = dict(OmegaConf.to_container(engine) if OmegaConf.is_config(engine) else engine)
    base: dict[str, Any] = {"max_model_len": cfg.rollout.max_total_tokens, "sampler": cfg.rollout.sampler}
    if "memory_bytes" not in own and "memory_fraction" not in own:
        base["memory_bytes"] = ENGINE_DEFAULT_MEMORY
    return base | own


def _check_engine(cfg: Config) -> None:
    """``rollout.engine``: known EngineConfig keys, not the ones the run sets, values EngineConfig accepts. Checked
    here, with the rest of the config: the engine is built inside the rollout actor, after Ray has started."""
    from rlk3.engine.config import EngineConfig, EngineConfigError

    keys = {f.name for f in fields(EngineConfig)}
    for key in cfg.rollout.engine:
        if key in ENGINE_FROM_RUN:
            raise ConfigError(f"rollout.engine.{key} is set from {ENGINE_FROM_RUN[key]}: set that instead")
        if key not in keys:
            raise ConfigError(f"rollout.engine: unknown key {key!r}; EngineConfig's keys (docs/engine.md): "
                              f"{sorted(keys - set(ENGINE_FROM_RUN))}")
    try:
        EngineConfig(**engine_settings(cfg))
    except EngineConfigError as e:
        raise ConfigError(f"rollout.engine: {e}") from None


# the K3Config keys the stages set themselves (rlk3/train/sft.py, rlk3/cluster/workers.py): an override would be dropped
MODEL_FROM_RUN = {"vocab_size": "the tokenizer's size (sft.vocab_size bounds it at the sft stage; an RL run without "
                                "model.init_from uses the built-in tokenizer)"}


def _check_model_overrides(cfg: Config) -> None:
    """``model.overrides``: K3Config keys, none the run sets, values K3Config accepts on top of ``model.preset``.
    Checked by building the K3Config (cheap; the model is not built): the stages build it inside a Ray actor or
    after SFT's demonstrations, where a bad value used to surface."""
    import difflib
    import inspect

    from rlk3.model.configuration_k3 import K3Config, K3ConfigError

    overrides = _overrides(cfg, cfg.model.overrides)
    keys = [k for k in inspect.signature(K3Config.__init__).parameters if k not in ("self", "kwargs")]
    for key in overrides:
        if key in MODEL_FROM_RUN:
            raise ConfigError(f"model.overrides.{key} is set from {MODEL_FROM_RUN[key]}: leave it out")
        if key not in keys:
            # K3Config takes any keyword (PretrainedConfig stores it), so a misspelt key would be silently ignored
            close = difflib.get_close_matches(str(key), keys, n=3)
            hint = f"did you mean {close}? " if close else ""
            raise ConfigError(f"model.overrides: unknown key {key!r}; {hint}K3Config's keys (docs/model.md): "
                              f"{sorted(set(keys) - set(MODEL_FROM_RUN))}")
    try:
        K3Config.preset(cfg.model.preset, **overrides)
    except K3ConfigError as e:
        msg = str(e)
        named = msg.split()[0].removeprefix("K3Config.").rstrip(":")
        if named in overrides:  # the message names the overridden key: say where it was set
            raise ConfigError(f"model.overrides.{msg.removeprefix('K3Config.')}") from None
        raise ConfigError(f"model.overrides {overrides} on model.preset={cfg.model.preset!r}: {msg}") from None


def _check_teacher_overrides(cfg: Config) -> None:
    """Each ``teachers.overrides`` entry: a domain or 'domain/effort' key, a mapping of this schema's keys, none of
    them one the stage sets itself, and values the schema accepts (checked by deriving a throwaway copy)."""
    for key, tree in _overrides(cfg).items():
        d, _, e = key.partition("/")
        if d not in DOMAINS or (e and e not in EFFORTS):
            raise ConfigError(f"teachers.overrides key {key!r} must be a domain {list(DOMAINS)} or 'domain/effort' "
                              f"with effort in {list(EFFORTS)}")
        if not isinstance(tree, dict):
            raise ConfigError(f"teachers.overrides.{key} must be a mapping of config keys (e.g. "
                              f"{{rollout: {{temperature: 0.6}}}}), got {tree!r}")
        for k in _flat(tree):
            if k in TEACHER_FIXED or k.startswith("teachers."):
                raise ConfigError(f"teachers.overrides.{key}: {k} is set by the teachers stage itself; "
                                  f"an override may change anything but {list(TEACHER_FIXED)}")
        try:
            derive(cfg, {"run.stage": "rl", **_flat(tree)})
        except ConfigError as e:
            raise ConfigError(f"teachers.overrides.{key}: {e}") from None


def _overrides(cfg: Config, o=None) -> dict[str, Any]:
    o = cfg.teachers.overrides if o is None else o
    return OmegaConf.to_container(o) if isinstance(o, DictConfig) else dict(o)


# what the demo stage sets for its student run (rlk3/pipeline.py): mopd.overrides may not move these
STUDENT_FIXED = ("run.stage", "run.name", "run.output_dir", "tasks.domains", "model.init_from", "run.iterations",
                 "effort.budget_start")


def _check_student_overrides(cfg: Config) -> None:
    """``mopd.overrides``: a mapping of this schema's keys, none the demo stage sets itself (``run.iterations`` is
    ``mopd.iterations``), values the schema accepts."""
    tree = _overrides(cfg, cfg.mopd.overrides)
    for k in _flat(tree) if tree else ():
        if k in STUDENT_FIXED or k.startswith(("mopd.", "teachers.")):
            raise ConfigError(f"mopd.overrides: {k} is set by the demo stage itself; an override may change "
                              f"anything but {list(STUDENT_FIXED)} and the mopd/teachers sections")
    try:
        derive(cfg, {"run.stage": "rl", **_flat(tree)})
    except ConfigError as e:
        raise ConfigError(f"mopd.overrides: {e}") from None


def student_changes(cfg: Config) -> dict[str, Any]:
    """The dotted-key changes ``mopd.overrides`` makes for the demo's student run (checked at validation)."""
    return _flat(_overrides(cfg, cfg.mopd.overrides))


def teacher_changes(cfg: Config, domain: str, effort: str) -> dict[str, Any]:
    """The dotted-key changes ``teachers.overrides`` makes for the (domain, effort) teacher: its domain's entry,
    then its own (the entries were checked when the config was validated)."""
    overrides = _overrides(cfg)
    return _flat(overrides.get(domain, {})) | _flat(overrides.get(f"{domain}/{effort}", {}))


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(cfg)


# ---------------------------------------------------------------------------------------------- validation


def _in(key: str, value, valid) -> None:
    if value not in valid:
        raise ConfigError(f"{key} must be one of {list(valid)}, got {value!r}")


def _range(key: str, value, lo=None, hi=None, lo_open=False) -> None:
    # NaN compares false with everything, so it passed every bound: a nan learning rate or temperature ran
    bad = value != value or (lo is not None and (value <= lo if lo_open else value < lo)) or (
        hi is not None and value > hi)
    if bad:
        lo_s = "-inf" if lo is None else f"{lo}"
        hi_s = "inf" if hi is None else f"{hi}"
        raise ConfigError(f"{key} must be in {'(' if lo_open else '['}{lo_s}, {hi_s}], got {value!r}")


def _check_task_files(cfg: Config) -> None:
    """``tasks.files``: each key a domain the run trains, each value a path or {path, format[, heldout]} with a
    format of that domain, naming existing .jsonl/.json/.parquet files. The records themselves are read when the
    stage starts (``check_paths``)."""
    from envs.tasks.loaders import DOMAIN_OF, FORMATS, SUFFIXES

    files = cfg.tasks.files
    if files and cfg.run.stage == "sft":
        raise ConfigError(f"tasks.files={_overrides(cfg, files)}: the sft stage demonstrates the synthetic suites "
                          "(rlk3/rollout/demos.py) and reads no task file; tasks.files is for the rl, mopd, teachers "
                          "and demo stages (training prompts and held-out evaluation)")
    for d, v in files.items():
        key = f"tasks.files.{d}"
        if d not in cfg.tasks.domains:
            raise ConfigError(f"tasks.files key {d!r} must be a domain of tasks.domains={list(cfg.tasks.domains)} "
                              f"(a file replaces a trained domain's tasks; domains: {list(DOMAINS)})")
        formats = [f for f in FORMATS if DOMAIN_OF[f] == d]
        if isinstance(v, str):
            if d not in FILE_FORMAT_OF:
                raise ConfigError(f"{key}={v!r}: a {d} file is one of {formats}; name it: "
                                  f"{key}={{path: {v}, format: {formats[0]}}}")
            path, fmt = v, FILE_FORMAT_OF[d]
        elif isinstance(v, DictConfig | dict) and {"path", "format"} <= set(v.keys()) <= {"path", "format",
                                                                                      "heldout"}:
            path, fmt = v["path"], v["format"]
        else:
            plain = OmegaConf.to_container(v) if OmegaConf.is_config(v) else v
            raise ConfigError(f"{key} must be a path or {{path: ..., format: ...}}, with heldout: <path> where the "
                              f"dataset ships its own held-out file (verl's test.parquet), got {plain!r}")
        if fmt not in FORMATS:
            raise ConfigError(f"{key}.format must be one of {list(FORMATS)}, got {fmt!r}")
        if DOMAIN_OF[fmt] != d:
            raise ConfigError(f"{key}: format {fmt!r} makes {DOMAIN_OF[fmt]} tasks, not {d} ones; a {d} file is "
                              f"one of {formats}")
        named = [(key, path)]
        if not isinstance(v, str) and v.get("heldout") is not None:
            if not isinstance(v["heldout"], str) or not v["heldout"]:
                raise ConfigError(f"{key}.heldout must be a path (the dataset's held-out file), got {v['heldout']!r}")
            if Path(v["heldout"]).resolve() == Path(str(path)).resolve():
                raise ConfigError(f"{key}.heldout names the train file itself ({path!r}): the held-out tasks would "
                                  f"be trained on; drop heldout to split {path!r} by question hash instead")
            named.append((f"{key}.heldout", v["heldout"]))
        for where, path in named:
            p = Path(str(path))
            where = f"{where}={str(path)!r}" + ("" if p.is_absolute() else f" ({p.resolve()})")
            if p.suffix not in SUFFIXES:
                raise ConfigError(f"{where}: a task file is {', '.join(SUFFIXES)}, got {p.suffix or 'no suffix'!r}")
            if not p.is_file():
                raise ConfigError(f"{where}: no such file")


def validate(cfg: Config) -> None:
    """Every cross-field and range rule, before anything is allocated."""
    from rlk3.algo.advantages import ESTIMATORS
    from rlk3.algo.effort import KINDS
    from rlk3.algo.loss import AGGREGATIONS, IS_MODES
    from rlk3.model.configuration_k3 import PRESETS
    from rlk3.rollout.demos import HABITS

    _in("run.stage", cfg.run.stage, STAGES)
    _range("run.iterations", cfg.run.iterations, 0)
    _range("run.eval_every", cfg.run.eval_every, 1)
    _range("run.checkpoint_every", cfg.run.checkpoint_every, 1)
    _in("model.preset", cfg.model.preset, sorted(PRESETS))
    _in("model.dtype", cfg.model.dtype, ("float32", "bfloat16"))
    _check_model_overrides(cfg)
    if cfg.model.init_from is not None and not Path(cfg.model.init_from).is_dir():
        raise ConfigError(f"model.init_from: checkpoint directory {cfg.model.init_from!r} does not exist")
    if not cfg.tasks.domains:
        raise ConfigError(f"tasks.domains must name at least one of {list(DOMAINS)}")
    for i, d in enumerate(cfg.tasks.domains):
        _in(f"tasks.domains[{i}]", d, DOMAINS)
    if cfg.tasks.weights and len(cfg.tasks.weights) != len(cfg.tasks.domains):
        raise ConfigError(
            f"tasks.weights has {len(cfg.tasks.weights)} entries for {len(cfg.tasks.domains)} domains; give one each"
        )
    if any(w < 0 for w in cfg.tasks.weights) or (cfg.tasks.weights and sum(cfg.tasks.weights) <= 0):
        raise ConfigError(f"tasks.weights must be >= 0 with a positive sum, got {list(cfg.tasks.weights)}")
    _range("tasks.train_size", cfg.tasks.train_size, 1)
    _range("tasks.heldout_size", cfg.tasks.heldout_size, 0)
    for d, n in cfg.tasks.heldout_sizes.items():
        _in("tasks.heldout_sizes key", d, DOMAINS)
        _range(f"tasks.heldout_sizes.{d}", n, 0)
    _check_task_files(cfg)
    _in("effort.level", cfg.effort.level, EFFORTS)
    _range("effort.budget", cfg.effort.budget, 1)
    if cfg.effort.budget_start and cfg.effort.budget_start < cfg.effort.budget:
        raise ConfigError(
            f"effort.budget_start ({cfg.effort.budget_start}) must be 0 or >= effort.budget ({cfg.effort.budget}): "
            "the budget anneals downward"
        )
    _in("effort.schedule", cfg.effort.schedule, KINDS)
    _range("effort.anneal_steps", cfg.effort.anneal_steps, 0)  # BudgetSchedule raised in the rollout worker
    _range("harness.max_turns", cfg.harness.max_turns, 1)
    _range("sft.lr", cfg.sft.lr, 0, lo_open=True)
    _range("sft.epochs", cfg.sft.epochs, 0, lo_open=True)
    if not 0 <= cfg.sft.warmup_ratio < 1:  # HF's warmup_steps: a float in [0, 1) is a ratio of the total steps
        raise ConfigError(f"sft.warmup_ratio must be in [0, 1), got {cfg.sft.warmup_ratio!r}")
    _range("sft.batch_size", cfg.sft.batch_size, 1)
    _range("sft.demos_per_domain", cfg.sft.demos_per_domain, 1)
    for d, n in cfg.sft.domain_demos.items():
        _in("sft.domain_demos key", d, DOMAINS)
        _range(f"sft.domain_demos.{d}", n, 1)
    for e, w in cfg.sft.effort_weights.items():
        _in("sft.effort_weights key", e, EFFORTS)
        _range(f"sft.effort_weights.{e}", w, 0)
    if cfg.sft.effort_weights and sum(cfg.sft.effort_weights.values()) <= 0:
        raise ConfigError(f"sft.effort_weights must have a positive sum, got {dict(cfg.sft.effort_weights)}")
    _range("sft.demo_error_rate", cfg.sft.demo_error_rate, 0, 1)
    hs = cfg.sft.habit_stage
    for d, n in hs.domain_demos.items():
        _range(f"sft.habit_stage.domain_demos.{d}", n, 0)
        if n and d not in cfg.tasks.domains:
            raise ConfigError(f"sft.habit_stage.domain_demos.{d}={n} needs {d!r} in tasks.domains (the closing stage "
                              f"demonstrates the stage's own domains); got tasks.domains={list(cfg.tasks.domains)}; "
                              f"set sft.habit_stage.domain_demos.{d}=0 to leave it out")
    _range("sft.habit_stage.rate", hs.rate, 0, 1)
    for d, name in hs.habits.items():
        _in("sft.habit_stage.habits key", d, DOMAINS)
        _in(f"sft.habit_stage.habits.{d}", name, tuple(HABITS[d]))
    _range("sft.habit_stage.lr", hs.lr, 0, lo_open=True)
    for e in hs.efforts:
        _in("sft.habit_stage.efforts entry", e, EFFORTS)
    for e, w in hs.effort_weights.items():
        _in("sft.habit_stage.effort_weights key", e, EFFORTS)
        _range(f"sft.habit_stage.effort_weights.{e}", w, 0)
    if hs.effort_weights and sum(hs.effort_weights.values()) <= 0:
        raise ConfigError(f"sft.habit_stage.effort_weights must have a positive sum, got {dict(hs.effort_weights)}")
    _range("sft.vocab_size", cfg.sft.vocab_size, 300)
    _range("sft.max_length", cfg.sft.max_length, 16)
    r = cfg.rollout
    _range("rollout.lam", r.lam, 0, 1, lo_open=True)
    _range("rollout.group_size", r.group_size, 1)
    _range("rollout.groups_per_iteration", r.groups_per_iteration, 1)
    _range("rollout.max_staleness", r.max_staleness, 0)
    # a trajectory paused at the cutoff resumes at least one version later (two under overlap, whose rollouts train
    # one version after they sample): at or under that bound nothing may be paused, and λ would do nothing
    floor = 1 + bool(cfg.cluster.overlap)
    if r.lam < 1 and r.max_staleness < floor:
        raise ConfigError(f"rollout.lam={r.lam} pauses trajectories, and a paused one resumes under the next "
                          f"version: its first tokens train {floor} version(s) stale"
                          f"{' under cluster.overlap' if floor == 2 else ''}; rollout.max_staleness={r.max_staleness} "
                          f"forbids that, so nothing could be paused: set "
                          f"rollout.lam=1 (on-policy), or rollout.max_staleness>={floor}")
    _in("rollout.top_up", r.top_up, TOP_UP_MODES)
    _in("rollout.sampler", r.sampler, (*SAMPLERS, None))
    _range("rollout.temperature", r.temperature, 0, lo_open=True)
    _range("rollout.top_p", r.top_p, 0, 1, lo_open=True)
    _range("rollout.max_new_tokens", r.max_new_tokens, 1)
    if r.max_total_tokens < r.max_new_tokens:
        raise ConfigError(
            f"rollout.max_total_tokens ({r.max_total_tokens}) must be >= max_new_tokens ({r.max_new_tokens})"
        )
    # every stage but rl draws its prompts' efforts from here (rollout/partial.py: rng.choice of an empty list)
    if not r.efforts:
        raise ConfigError(f"rollout.efforts must name at least one of {list(EFFORTS)}")
    for i, e in enumerate(r.efforts):
        _in(f"rollout.efforts[{i}]", e, EFFORTS)
    _check_engine(cfg)  # after max_total_tokens: its errors name that key, not the engine's max_model_len
    t = cfg.train
    _range("cluster.train_workers", cfg.cluster.train_workers, 1)
    _range("cluster.num_gpus", cfg.cluster.num_gpus, 0)
    _range("cluster.cpu_threads", cfg.cluster.cpu_threads, 0)  # torch.set_num_threads(-1) raised in each worker
    _range("teachers.parallel", cfg.teachers.parallel, 0)
    _in("cluster.weight_sync", cfg.cluster.weight_sync, WEIGHT_SYNC_MODES)
    if cfg.train.share_prompts and cfg.cluster.train_workers > 1:
        raise ConfigError(
            "train.share_prompts=true runs a micro-batch as two forward passes (the prompts, then the samples), "
            "which data-parallel ranks would not keep in step with each other's placeholder passes: it needs "
            f"cluster.train_workers=1 (got {cfg.cluster.train_workers})"
        )
    if cfg.cluster.overlap and cfg.cluster.colocate:
        raise ConfigError(
            "cluster.overlap=true runs the next rollout while training, which needs rollout and training on "
            "separate resources: set cluster.colocate=false (colocated workers alternate on one bundle)"
        )
    if cfg.cluster.weight_sync == "broadcast" and cfg.cluster.num_gpus and cfg.cluster.colocate:
        # colocated, train rank 0 and the rollout worker share bundle 0's one GPU, and NCCL refuses two ranks of a
        # group on one device: the run would stop at its first sync, after a whole iteration of rollouts and training
        raise ConfigError(
            "cluster.weight_sync=broadcast forms an NCCL group of train rank 0 and the rollout worker, which "
            "cluster.colocate=true puts on one GPU (NCCL refuses two ranks on one device): use cuda_ipc (or "
            "object_store) colocated, or set cluster.colocate=false for broadcast"
        )
    if cfg.cluster.weight_sync == "cuda_ipc" and not (cfg.cluster.num_gpus and cfg.cluster.colocate):
        raise ConfigError(
            "cluster.weight_sync=cuda_ipc hands the engine handles to the trainer's GPU memory, so it needs "
            f"cluster.num_gpus > 0 and cluster.colocate=true (got num_gpus={cfg.cluster.num_gpus}, "
            f"colocate={cfg.cluster.colocate}); use broadcast (NCCL/gloo) or object_store otherwise"
        )
    _range("train.lr", t.lr, 0, lo_open=True)
    _range("train.warmup_steps", t.warmup_steps, 0)
    _range("train.weight_decay", t.weight_decay, 0)
    _range("train.grad_clip", t.grad_clip, 0, lo_open=True)  # clip_grad_norm_ with max_norm <= 0 zeroes/flips grads
    _range("train.micro_batch_tokens", t.micro_batch_tokens, 1)
    _range("train.qb_bins", t.qb_bins, 1)
    if not 0 < t.adam_beta2 < 1:
        raise ConfigError(f"train.adam_beta2 must be in (0, 1), got {t.adam_beta2!r} (0.999 is AdamW's default)")
    _in("train.estimator", t.estimator, ESTIMATORS)
    _in("train.is_mode", t.is_mode, IS_MODES)
    _in("train.aggregation", t.aggregation, AGGREGATIONS)
    _range("train.clip_low", t.clip_low, 0, 1)
    _range("train.clip_high", t.clip_high, 0)  # LossConfig raised it in the trainer, after allocation
    _range("train.is_cap", t.is_cap, 1)
    if not 0 < t.is_low <= 1 <= t.is_high:
        raise ConfigError(f"train.is_low/is_high must satisfy 0 < is_low <= 1 <= is_high, got {t.is_low}, {t.is_high}")
    _range("train.kl_coef", t.kl_coef, 0)
    _range("train.dead_signal_patience", t.dead_signal_patience, 1)
    _range("train.negative_scale", t.negative_scale, 0, 1)
    _range("train.minibatches", t.minibatches, 1)
    _range("train.ppo_epochs", t.ppo_epochs, 1)
    per_iteration = cfg.rollout.groups_per_iteration * cfg.rollout.group_size
    if t.minibatches > per_iteration:
        raise ConfigError(f"train.minibatches={t.minibatches} is more than the {per_iteration} samples an iteration "
                          f"trains on (rollout.groups_per_iteration x rollout.group_size); use at most {per_iteration}")
    _range("mopd.max_resident", cfg.mopd.max_resident, 1)
    _range("mopd.iterations", cfg.mopd.iterations, 0)
    if cfg.run.stage == "mopd":
        if not cfg.mopd.teachers:
            raise ConfigError("mopd.teachers is empty: map each 'domain/effort' the student trains on to a checkpoint")
        for key in cfg.mopd.teachers:
            domain, _, effort = key.partition("/")
            if domain not in DOMAINS or effort not in EFFORTS:
                raise ConfigError(f"mopd.teachers key {key!r} must be 'domain/effort' with domain in {list(DOMAINS)} "
                                  f"and effort in {list(EFFORTS)}")
        # every (domain, effort) the prompt mix can draw needs its teacher: found missing only when the first
        # rollout of that slice is scored, the run would stop after an iteration's sampling (TeacherRoutingError)
        weights = list(cfg.tasks.weights) or [1.0] * len(cfg.tasks.domains)
        drawn = [(d, e) for d, w in zip(cfg.tasks.domains, weights, strict=True) if w > 0 for e in cfg.rollout.efforts]
        missing = [f"{d}/{e}" for d, e in dict.fromkeys(drawn) if f"{d}/{e}" not in cfg.mopd.teachers]
        if missing:
            raise ConfigError(f"mopd.teachers has no teacher for {missing}, which the prompt mix draws (tasks.domains="
                              f"{list(cfg.tasks.domains)} x rollout.efforts={list(cfg.rollout.efforts)}); teachers "
                              f"given: {sorted(cfg.mopd.teachers)}; add them, or drop those domains/efforts")
        _range("mopd.clip", cfg.mopd.clip, 0, lo_open=True)
    if cfg.run.stage in ("teachers", "demo"):
        _check_teacher_overrides(cfg)
    if cfg.run.stage == "demo":
        _check_student_overrides(cfg)
        _check_demo_model(cfg)


def _check_demo_model(cfg: Config) -> None:
    """The demo stage builds its models itself (rlk3/pipeline.py, run_demo): SFT from configs/sft-demo.yaml, or the
    checkpoint ``model.init_from`` names, then its own nine teachers; model keys and teachers given here would be
    silently replaced."""
    if cfg.model.overrides or cfg.model.preset != ModelConfig.preset:
        raise ConfigError(f"model.preset={cfg.model.preset!r} / model.overrides={_overrides(cfg, cfg.model.overrides)}"
                          f": the demo stage does not read them (its SFT model is configs/sft-demo.yaml's, or the "
                          f"checkpoint model.init_from names); change the model there, or run the stages one by one")
    if cfg.mopd.teachers:
        raise ConfigError(f"mopd.teachers {sorted(cfg.mopd.teachers)}: the demo stage trains its own nine teachers "
                          f"and distils them; to distil existing teachers, run the mopd stage (python -m rlk3 mopd "
                          f"configs/mopd.yaml ...)")


# ---------------------------------------------------------------------------------------------- paths a stage reads


# what save_pretrained of a model and its tokenizer writes and the stages read back (from_pretrained,
# harness.tokenizer.load_tokenizer): one name of each group must be a readable file (without tokenizer_config.json
# the tokenizer still loads, but with no pad or eos token)
CHECKPOINT_FILES = (("config.json",), ("model.safetensors", "model.safetensors.index.json"), ("tokenizer.json",),
                    ("tokenizer_config.json",))


def _check_checkpoint(key: str, path: str) -> None:
    p = Path(path)
    where = f"{key}={path!r}" + ("" if p.is_absolute() else f" ({p.resolve()}: relative to the current directory)")
    if not p.is_dir():
        raise ConfigError(f"{where}: no such checkpoint directory")
    for names in CHECKPOINT_FILES:
        if not any((p / n).is_file() and os.access(p / n, os.R_OK) for n in names):
            raise ConfigError(f"{where}: no readable {' or '.join(names)} there; a checkpoint directory holds what "
                              f"save_pretrained writes for the model and its tokenizer "
                              f"({', '.join(n[0] for n in CHECKPOINT_FILES)}), e.g. an SFT run's output_dir or an "
                              f"RL run's output_dir/final")


def check_paths(cfg: Config) -> None:
    """The checkpoints ``cfg``'s stage will read and the records of its task files, checked before it starts anything
    (``rlk3.pipeline.run_stage``).
    Not part of ``validate``: configs that are loaded but not run (tests, ``--print-config``) may name placeholders.
    Relative paths are read from the current directory, as the driver and the Ray workers it starts read them
    (under ``ray job submit``, the job's copy of its working_dir: give absolute paths there)."""
    stage = cfg.run.stage
    # the demo stage runs SFT itself when model.init_from is not a checkpoint (docs/demo.md)
    if cfg.model.init_from and stage in ("sft", "rl", "mopd", "teachers"):
        # SFT too reads the tokenizer: a checkpoint's embeddings are indexed by its own tokenizer's ids
        _check_checkpoint("model.init_from", cfg.model.init_from)
        _check_overrides_match(cfg)
    if stage == "mopd":
        for key, path in cfg.mopd.teachers.items():
            _check_checkpoint(f"mopd.teachers[{key!r}]", path)
    _check_task_records(cfg)


def _check_overrides_match(cfg: Config) -> None:
    """With ``model.init_from`` the checkpoint's config.json decides the architecture: a ``model.overrides`` value
    that differs from it would be silently ignored (one that matches, as configs/sft-tiny.yaml's on its own
    checkpoint, is harmless)."""
    from rlk3.model.configuration_k3 import K3Config

    if not cfg.model.overrides:  # nothing to compare: the checkpoint's config is not read
        return
    ckpt = K3Config.from_pretrained(cfg.model.init_from)
    for key, value in _overrides(cfg, cfg.model.overrides).items():
        have = getattr(ckpt, key, None)
        if (list(have) if isinstance(have, tuple) else have) != value:
            raise ConfigError(f"model.overrides.{key}={value!r}, but the checkpoint model.init_from="
                              f"{cfg.model.init_from!r} has {key}={have!r}: its config.json decides the architecture, "
                              f"so the override would be ignored; drop it, or leave init_from unset to build a fresh "
                              f"model from model.preset + overrides")


def _check_task_records(cfg: Config) -> None:
    """Every record of every ``tasks.files`` file converts to a task (the error names the record), and each file
    has train tasks to draw, and held-out ones where the domain is evaluated."""
    from envs.tasks import TaskError, file_tasks, heldout_overlap

    files = task_files(cfg)
    sizes = heldout_sizes(cfg)
    for d, (path, _fmt, *own) in files.items():
        try:
            train, heldout = file_tasks(files, d, "train"), file_tasks(files, d, "heldout")
        except TaskError as e:
            raise ConfigError(f"tasks.files.{d}: {e}") from None
        if own:  # the dataset's own split: each file is one side whole
            dropped, records = heldout_overlap(files, d)
            if records and dropped == records and sizes[d]:
                raise ConfigError(f"tasks.files.{d}.heldout={own[0]!r}: all {records} of its records have a "
                                  f"prompt the train file {path!r} also holds, so nothing held out is left to "
                                  f"evaluate {d} on; name the dataset's test file, or set tasks.heldout_sizes.{d}=0")
            for name, side, tasks in ((path, "path", train), (own[0], "heldout", heldout)):
                if not tasks and (side == "path" or sizes[d]):
                    raise ConfigError(f"tasks.files.{d}.{side}={name!r} holds no records")
            continue
        # a record's split is its question's hash (envs/tasks/loaders.py): a tiny file may put all of them on one side
        if not train:
            raise ConfigError(f"tasks.files.{d}={path!r}: none of its {len(heldout)} records is in the train split "
                              "(one question hash in five is held out); give it more records")
        if not heldout and sizes[d]:
            raise ConfigError(f"tasks.files.{d}={path!r}: none of its {len(train)} records is in the held-out split "
                              f"(one question hash in five), so {d} cannot be evaluated; give it more records or set "
                              f"tasks.heldout_sizes.{d}=0")
