"""Config composition and validation: unknown keys and bad values fail before anything is allocated."""

import json
import re

import pytest

from envs.tasks.loaders import EXAMPLES
from rlk3.config import CONFIG_DIR, ConfigError, load_config


def write(tmp_path, text):
    p = tmp_path / "run.yaml"
    p.write_text(text)
    return p


def test_composes_defaults_file_and_overrides(tmp_path):
    p = write(tmp_path, "defaults: [base, model/k3-tiny, domain/agentic, effort/medium, stage/rl]\n"
                        "rollout:\n  lam: 0.7\n")
    cfg = load_config(p, ["train.lr=5e-5", "run.name=x"])
    assert cfg.run.stage == "rl" and cfg.tasks.domains == ["agentic"]
    assert cfg.effort.level == "medium" and cfg.effort.budget_start == 384
    assert cfg.rollout.lam == 0.7 and cfg.train.lr == 5e-5
    assert cfg.run.output_dir == "runs/x"  # interpolation resolved after overrides
    with pytest.raises(Exception, match="read-only"):
        cfg.train.lr = 1.0


@pytest.mark.parametrize(
    ("text", "overrides", "match"),
    [
        ("defaults: [stage/rl]\nrollout:\n  lamda: 0.5\n", [], r"unknown key 'rollout.lamda'; valid keys.*'lam'"),
        ("defaults: [stage/rl]\n", ["train.lrr=1"], r"unknown key 'train.lrr'"),
        ("defaults: [stage/rl]\n", ["rollout.lam=1.5"], r"rollout.lam must be in \(0, 1\], got 1.5"),
        ("defaults: [stage/rl]\n", ["rollout.lam=0"], r"rollout.lam must be in \(0, 1\], got 0"),
        ("defaults: [stage/rl]\n", ["train.share_prompts=true", "cluster.train_workers=2"],
         r"train.share_prompts=true .* needs cluster.train_workers=1 \(got 2\)"),
        ("defaults: [stage/rl]\n", ["rollout.top_up=prompts"],
         r"rollout.top_up must be one of \['groups', 'trajectories'\], got 'prompts'"),
        ("defaults: [stage/rl]\n", ["rollout.sampler=gumbel"],
         r"rollout.sampler must be one of \['generator', 'counter', None\], got 'gumbel'"),
        ("defaults: [stage/rl]\n", ["train.estimator=ppo"], r"train.estimator must be one of \['grpo', 'rloo'"),
        ("defaults: [stage/rl]\n", ["tasks.domains=[math]"], r"tasks.domains\[0\] must be one of \['general'"),
        ("defaults: [stage/rl]\n", ["model.preset=k3-huge"], r"model.preset must be one of \['k3-full', 'k3-small'"),
        ("defaults: [stage/rl]\n", ["rollout.group_size=abc"], r"rollout.group_size"),
        ("defaults: [stage/rl, effort/low]\n", ["effort.budget_start=50"], r"must be 0 or >= effort.budget \(128\)"),
        ("defaults: [stage/rl]\n", ["model.init_from=/nonexistent"], r"checkpoint directory '/nonexistent' does not"),
        ("defaults: [stage/rl]\n", ["cluster.weight_sync=broadcast", "cluster.num_gpus=1"],
         r"cluster.weight_sync=broadcast .* cluster.colocate=true puts on one GPU .* use cuda_ipc \(or object_store\) "
         r"colocated, or set cluster.colocate=false"),
        ("defaults: [stage/mopd]\n", [], r"mopd.teachers is empty"),
        ("defaults: [stage/rl]\n", ["rollout.engine.memory_fraction=1.5"],
         r"rollout.engine: EngineConfig.memory_fraction must be a number in \(0, 1\], got 1.5"),
        ("defaults: [stage/rl]\n", ["rollout.engine.memory_bytes=1", "rollout.engine.memory_fraction=0.5"],
         r"rollout.engine: EngineConfig: set at most one of memory_bytes and memory_fraction"),
        ("defaults: [stage/rl]\n", ["rollout.engine.gpu_memory_utilization=0.9"],
         r"rollout.engine: unknown key 'gpu_memory_utilization'; EngineConfig's keys .*'memory_fraction'"),
        ("defaults: [stage/rl]\n", ["rollout.engine.max_model_len=4096"],
         r"rollout.engine.max_model_len is set from rollout.max_total_tokens: set that instead"),
        ("defaults: [stage/mopd]\n", ["mopd.teachers={math/high: x}"], r"mopd.teachers key 'math/high'"),
        ("defaults: [stage/mopd]\n", ["mopd.teachers={general/low: x, general/high: x}", "tasks.domains=[general]"],
         r"mopd.teachers has no teacher for \['general/medium'\], which the prompt mix draws \(tasks.domains="
         r"\['general'\] x rollout.efforts=\['low', 'medium', 'high'\]\)"),
        ("defaults: [stage/nope]\n", [], r"no config fragment 'stage/nope'.*available: .*stage/rl"),
        ("rollout:\n  lam: 0.5\n", [], r"missing required keys \['run.stage'\]"),
        ("defaults: [stage/rl]\n", ["rollout.lam"], r"must look like key=value"),
        ("defaults: [stage/sft]\n", ["sft.domain_demos={math: 10}"], r"sft.domain_demos key must be one of \["),
        ("defaults: [stage/sft]\n", ["sft.domain_demos={general: 0}"], r"sft.domain_demos.general must be in \[1,"),
        ("defaults: [stage/sft]\n", ["sft.effort_weights={max: 1}"], r"sft.effort_weights key must be one of \['low'"),
        ("defaults: [stage/sft]\n", ["sft.effort_weights={low: 0}"], r"sft.effort_weights must have a positive sum"),
        ("defaults: [stage/rl]\n", ["train.ppo_epochs=0"], r"train.ppo_epochs must be in \[1, inf\], got 0"),
        ("defaults: [stage/rl]\n", ["train.minibatches=64"], r"train.minibatches=64 is more than the 32 samples"),
        ("defaults: [stage/rl]\n", ["train.adam_beta2=1.0"], r"train.adam_beta2 must be in \(0, 1\), got 1.0"),
        ("defaults: [stage/rl]\n", ["train.warmup_steps=-1"], r"train.warmup_steps must be in \[0, inf\], got -1"),
        ("defaults: [stage/teachers]\n", ["teachers.overrides.general.rollout.temprature=0.6"],
         r"teachers.overrides.general: .*unknown key 'rollout.temprature'; valid keys here: .*'temperature'"),
        ("defaults: [stage/teachers]\n", ["teachers.overrides.agentic/low.train.lr=-1"],
         r"teachers.overrides.agentic/low: train.lr must be in \(0, inf\], got -1"),
        ("defaults: [stage/demo]\n", ["teachers.overrides.math.train.lr=1"],
         r"teachers.overrides key 'math' must be a domain \['general', 'agentic', 'coding'\] or 'domain/effort'"),
        ("defaults: [stage/demo]\n", ["teachers.overrides.general/max.train.lr=1"], r"key 'general/max' must be"),
        ("defaults: [stage/teachers]\n", ["teachers.overrides.coding.tasks.domains=[general]"],
         r"teachers.overrides.coding: tasks.domains is set by the teachers stage itself"),
        ("defaults: [stage/teachers]\n", ["teachers.overrides.coding=3"],
         r"teachers.overrides.coding must be a mapping of config keys"),
        ("defaults: [stage/demo]\n", ["mopd.overrides.run.iterations=3"],
         r"mopd.overrides: run.iterations is set by the demo stage itself"),
        ("defaults: [stage/demo]\n", ["mopd.overrides.mopd.clip=1"], r"mopd.overrides: mopd.clip is set by the demo"),
        ("defaults: [stage/demo]\n", ["mopd.overrides.train.lrr=1"],
         r"mopd.overrides: .*unknown key 'train.lrr'; valid keys here: .*'lr'"),
        ("defaults: [stage/demo]\n", ["mopd.overrides.rollout.temperature=-1"],
         r"mopd.overrides: rollout.temperature must be in"),
        ("defaults: [stage/sft]\n", ["sft.habit_stage.domain_demos={agentic: 10}", "tasks.domains=[general]"],
         r"sft.habit_stage.domain_demos.agentic=10 needs 'agentic' in tasks.domains"),
        # a mapping where a list belongs (or the reverse), a section set to a value: omegaconf's TypeError and
        # AttributeError leaked
        ("defaults: [stage/rl]\n", ["tasks.domains={}"], r"override 'tasks.domains=\{\}': .*a list key needs"),
        ("defaults: [stage/rl]\n", ["rollout.engine=[]"], r"override 'rollout.engine=\[\]': .*a mapping key"),
        ("defaults: [stage/teachers]\n", ["teachers.overrides.general.train=3"],
         r"teachers.overrides.general: derived config \(train\): .*a section takes a mapping of its keys"),
        ("defaults: [stage/rl]\n", ["train.lr=nan"], r"train.lr must be in \(0, inf\], got nan"),
        ("defaults: [stage/rl]\n", ["rollout.temperature=nan"], r"rollout.temperature must be in \(0, inf\], got nan"),
        ("defaults: [stage/sft]\n", ["sft.effort_weights={low: nan}"], r"sft.effort_weights.low must be in \[0, inf\]"),
        ("defaults: [stage/demo]\n", ["mopd.overrides.train.lr=nan"], r"mopd.overrides: train.lr must be in"),
        # keys no rule covered: each failed (or silently misbehaved) once the run had started
        ("defaults: [stage/rl]\n", ["effort.anneal_steps=-1"], r"effort.anneal_steps must be in \[0, inf\], got -1"),
        ("defaults: [stage/sft]\n", ["sft.epochs=0"], r"sft.epochs must be in \(0, inf\], got 0"),
        ("defaults: [stage/sft]\n", ["sft.warmup_ratio=-0.1"], r"sft.warmup_ratio must be in \[0, 1\), got -0.1"),
        ("defaults: [stage/rl]\n", ["cluster.cpu_threads=-1"], r"cluster.cpu_threads must be in \[0, inf\], got -1"),
        ("defaults: [stage/rl]\n", ["cluster.num_gpus=-1"], r"cluster.num_gpus must be in \[0, inf\], got -1"),
        ("defaults: [stage/rl]\n", ["train.weight_decay=-1"], r"train.weight_decay must be in \[0, inf\], got -1"),
        ("defaults: [stage/rl]\n", ["train.grad_clip=-1"], r"train.grad_clip must be in \(0, inf\], got -1"),
        ("defaults: [stage/rl]\n", ["train.micro_batch_tokens=0"], r"train.micro_batch_tokens must be in \[1, inf\]"),
        ("defaults: [stage/rl]\n", ["train.qb_bins=0"], r"train.qb_bins must be in \[1, inf\], got 0"),
        ("defaults: [stage/rl]\n", ["train.clip_high=-0.1"], r"train.clip_high must be in \[0, inf\], got -0.1"),
        ("defaults: [stage/demo]\n", ["mopd.max_resident=0"], r"mopd.max_resident must be in \[1, inf\], got 0"),
        ("defaults: [stage/demo]\n", ["mopd.iterations=-1"], r"mopd.iterations must be in \[0, inf\], got -1"),
        ("defaults: [stage/mopd]\n", ["rollout.efforts=[]", "mopd.teachers={general/low: x}"],
         r"rollout.efforts must name at least one of \['low', 'medium', 'high'\]"),
        ("defaults: [stage/teachers]\n", ["rollout.efforts=[max]"], r"rollout.efforts\[0\] must be one of \['low'"),
        ("defaults: [stage/rl]\n", ["rollout.max_total_tokens=0"],
         r"rollout.max_total_tokens \(0\) must be >= max_new_tokens \(256\)"),
        # model.overrides reached K3Config only inside the rollout actor (after Ray started) or after SFT's
        # demonstrations; an unknown key was stored and ignored (PretrainedConfig takes any keyword)
        ("defaults: [stage/rl]\n", ["model.overrides.hiden_size=64"],
         r"model.overrides: unknown key 'hiden_size'; did you mean \['hidden_size'.*\? K3Config's keys .*'v_head_dim'"),
        ("defaults: [stage/sft]\n", ["model.overrides.pad_token_id=0"], r"model.overrides: unknown key 'pad_token_id'"),
        ("defaults: [stage/rl]\n", ["model.overrides.hidden_size=-5"],
         r"model.overrides.hidden_size must be an int >= 1, got -5"),
        ("defaults: [stage/rl]\n", ["model.overrides.num_hidden_layers=abc"],
         r"model.overrides.num_hidden_layers must be an int >= 1, got 'abc'"),
        ("defaults: [stage/rl]\n", ["model.overrides.kda_gate=relu"],
         r"model.overrides.kda_gate must be one of \['bounded', 'softplus'\], got 'relu'"),
        ("defaults: [stage/rl]\n", ["model.overrides.num_experts=4"],
         r"model.overrides \{'num_experts': 4\} on model.preset='k3-tiny': K3Config.num_experts_per_token must be "
         r"< num_experts=4"),
        ("defaults: [stage/rl, model/k3-small]\n", ["model.overrides.num_hidden_layers=8"],
         r"model.overrides \{'num_hidden_layers': 8\} on model.preset='k3-small': K3Config.full_attn_layers: layer 12 "
         r"is out of range"),
        ("defaults: [stage/sft]\n", ["model.overrides.vocab_size=300"],
         r"model.overrides.vocab_size is set from the tokenizer's size \(sft.vocab_size"),
        # keys a stage silently replaced: the checkpoint's config.json decides the architecture, and the demo stage
        # builds its own models and teachers
        ("defaults: [stage/demo]\n", ["model.overrides.num_hidden_layers=2"],
         r"model.preset='k3-tiny' / model.overrides=\{'num_hidden_layers': 2\}: the demo stage does not read them"),
        ("defaults: [stage/demo, model/k3-small]\n", [], r"model.preset='k3-small' .*: the demo stage does not read"),
        ("defaults: [stage/demo]\n", ["mopd.teachers={general/low: /x}"],
         r"mopd.teachers \['general/low'\]: the demo stage trains its own nine teachers .* run the mopd stage"),
        ("defaults: [stage/teachers]\n", ["teachers.overrides.coding.model.overrides.hidden_size=0"],
         r"teachers.overrides.coding: model.overrides.hidden_size must be an int >= 1, got 0"),
        # tasks.files: a domain the run trains, a format of that domain, an existing .jsonl/.json/.parquet file
        ("defaults: [stage/rl]\n", [f"tasks.files={{coding: {{path: {EXAMPLES}/mbpp.jsonl, format: mbpp}}}}"],
         r"tasks.files key 'coding' must be a domain of tasks.domains=\['general'\] .*domains: \['general', "),
        ("defaults: [stage/rl]\n", [f"tasks.files={{math: {EXAMPLES}/gsm8k.jsonl}}"],
         r"tasks.files key 'math' must be a domain of tasks.domains=\['general'\]"),
        ("defaults: [stage/rl]\n", [f"tasks.files={{general: {{path: {EXAMPLES}/mbpp.jsonl, format: mbpp}}}}"],
         r"tasks.files.general: format 'mbpp' makes coding tasks, not general ones; a general file is one of "
         r"\['gsm8k', 'verl'\]"),
        ("defaults: [stage/rl]\n", [f"tasks.files={{general: {{path: {EXAMPLES}/gsm8k.jsonl, format: gsm}}}}"],
         r"tasks.files.general.format must be one of \['gsm8k', 'mbpp', 'humaneval', 'swe', 'verl'\], got 'gsm'"),
        ("defaults: [stage/rl]\n", ["tasks.domains=[coding]", f"tasks.files={{coding: {EXAMPLES}/mbpp.jsonl}}"],
         r"tasks.files.coding='.*mbpp.jsonl': a coding file is one of \['mbpp', 'humaneval'\]; name it: "
         r"tasks.files.coding=\{path: .*mbpp.jsonl, format: mbpp\}"),
        ("defaults: [stage/rl]\n", ["tasks.files={general: /data/gsm8k.jsonl}"],
         r"tasks.files.general='/data/gsm8k.jsonl': no such file"),
        ("defaults: [stage/rl]\n", [f"tasks.files={{general: {EXAMPLES.parent}/loaders.py}}"],
         r"tasks.files.general='.*loaders.py': a task file is .jsonl, .json, .parquet, got '.py'"),
        ("defaults: [stage/rl]\n", ["tasks.files={general: [a.jsonl]}"],
         r"tasks.files.general must be a path or \{path: ..., format: ...\}, with heldout: .*, got \['a.jsonl'\]"),
        ("defaults: [stage/sft]\n", [f"tasks.files={{general: {EXAMPLES}/gsm8k.jsonl}}"],
         r"tasks.files=.*: the sft stage demonstrates the synthetic suites .* reads no task file"),
        # a dataset's own held-out file: it must exist, be a task file and not be the train file itself
        ("defaults: [stage/rl]\n", [f"tasks.files={{general: {{path: {EXAMPLES}/gsm8k.jsonl, format: gsm8k, "
                                     f"heldout: /data/test.parquet}}}}"],
         r"tasks.files.general.heldout='/data/test.parquet': no such file"),
        ("defaults: [stage/rl]\n", [f"tasks.files={{general: {{path: {EXAMPLES}/gsm8k.jsonl, format: gsm8k, "
                                     f"heldout: {EXAMPLES}/gsm8k.jsonl}}}}"],
         r"tasks.files.general.heldout names the train file itself .* drop heldout to split"),
        ("defaults: [stage/rl]\n", [f"tasks.files={{general: {{path: {EXAMPLES}/gsm8k.jsonl, format: gsm8k, "
                                     f"test: {EXAMPLES}/verl.jsonl}}}}"],
         r"tasks.files.general must be a path or \{path: ..., format: ...\}, with heldout: <path> where the "
         r"dataset ships its own held-out file"),
    ],
)
def test_bad_configs_name_the_key_and_valid_values(tmp_path, text, overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config(write(tmp_path, text), overrides)


def test_task_files_take_a_path_or_a_path_and_format_and_their_records_are_read_before_the_stage(tmp_path):
    """A path alone takes its domain's one format (general: gsm8k, agentic: swe); coding names mbpp or humaneval.
    The stage's entry (``check_paths``, before Ray) reads every record: a bad one is an error naming it, and so is a
    file whose records all hash to one side of the train/held-out split."""
    from rlk3.config import check_paths, derive, task_files

    cfg = load_config(write(tmp_path, "defaults: [stage/teachers]\n"), [
        "tasks.domains=[general, coding, agentic]", f"tasks.files.general={EXAMPLES}/gsm8k.jsonl",
        f"tasks.files.coding={{path: {EXAMPLES}/mbpp.jsonl, format: mbpp}}",
        f"tasks.files.agentic={EXAMPLES}/swe.jsonl"])
    assert task_files(cfg) == {"general": (f"{EXAMPLES}/gsm8k.jsonl", "gsm8k"),
                               "coding": (f"{EXAMPLES}/mbpp.jsonl", "mbpp"),
                               "agentic": (f"{EXAMPLES}/swe.jsonl", "swe")}
    # a teacher trains one domain: its config keeps that domain's file only (the others would not be its domains)
    teacher = derive(cfg, {"run.stage": "rl", "tasks.domains": ["coding"],
                           "tasks.files": {"coding": {"path": f"{EXAMPLES}/mbpp.jsonl", "format": "mbpp"}}})
    assert task_files(teacher) == {"coding": (f"{EXAMPLES}/mbpp.jsonl", "mbpp")}

    bad = tmp_path / "bad.jsonl"
    rows = [{"question": f"What is {a} + 1?", "answer": f"#### {a + 1}"} for a in range(12)]
    bad.write_text("".join(json.dumps(r) + "\n" for r in [*rows, {"question": "2+2?", "answer": "4"}]))
    run = load_config(write(tmp_path, "defaults: [stage/rl]\n"), [f"tasks.files={{general: {bad}}}"])
    with pytest.raises(ConfigError, match=r"tasks.files.general: gsm8k record 12: answer must end with '#### "):
        check_paths(run)
    # one question hash in five is held out: the example's two records are one train, one held out; a file of one
    # held-out record has nothing to train on
    one = tmp_path / "one.jsonl"
    one.write_text((EXAMPLES / "gsm8k.jsonl").read_text().splitlines()[0] + "\n")
    run = load_config(write(tmp_path, "defaults: [stage/rl]\n"), [f"tasks.files={{general: {one}}}"])
    with pytest.raises(ConfigError, match=r"tasks.files.general='.*one.jsonl': none of its 1 records is in the "
                                          r"train split"):
        check_paths(run)
    check_paths(load_config(write(tmp_path, "defaults: [stage/rl]\n"),
                            [f"tasks.files={{general: {EXAMPLES}/gsm8k.jsonl}}"]))
    # verl's preprocessed records, named (a path alone is gsm8k, and its error says which format the file is)
    verl = load_config(write(tmp_path, "defaults: [stage/rl]\n"),
                       [f"tasks.files={{general: {{path: {EXAMPLES}/verl.jsonl, format: verl}}}}"])
    assert task_files(verl) == {"general": (f"{EXAMPLES}/verl.jsonl", "verl")}
    check_paths(verl)
    with pytest.raises(ConfigError, match=r"gsm8k record 0: has prompt and reward_model, not question .* format: verl"):
        check_paths(load_config(write(tmp_path, "defaults: [stage/rl]\n"),
                                [f"tasks.files={{general: {EXAMPLES}/verl.jsonl}}"]))
    # a dataset's own split (verl's train.parquet and test.parquet): each file is one side whole, and the teachers
    # stage hands the held-out file on to each teacher with the train file
    test = tmp_path / "test.jsonl"
    first = (EXAMPLES / "gsm8k.jsonl").read_text().splitlines()[0]
    test.write_text(first + "\n")  # a question the train file holds: nothing would be held out
    with pytest.raises(ConfigError, match=r"tasks.files.general.heldout='.*test.jsonl': all 1 of its records have a "
                                          r"prompt the train file .*gsm8k.jsonl' also holds.*heldout_sizes.general=0"):
        check_paths(load_config(write(tmp_path, "defaults: [stage/rl]\n"), [
            f"tasks.files={{general: {{path: {EXAMPLES}/gsm8k.jsonl, format: gsm8k, heldout: {test}}}}}"]))
    rec = json.loads(first)
    test.write_text(json.dumps({**rec, "question": rec["question"] + " (again)"}) + "\n")
    own = load_config(write(tmp_path, "defaults: [stage/rl]\n"), [
        f"tasks.files={{general: {{path: {EXAMPLES}/gsm8k.jsonl, format: gsm8k, heldout: {test}}}}}"])
    assert task_files(own) == {"general": (f"{EXAMPLES}/gsm8k.jsonl", "gsm8k", str(test))}
    check_paths(own)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"tasks.files.general.heldout='.*empty.jsonl' holds no records"):
        check_paths(load_config(write(tmp_path, "defaults: [stage/rl]\n"), [
            f"tasks.files={{general: {{path: {EXAMPLES}/gsm8k.jsonl, format: gsm8k, heldout: {empty}}}}}"]))
    check_paths(load_config(write(tmp_path, "defaults: [stage/rl]\n"), [  # not evaluated: no held-out file needed
        f"tasks.files={{general: {{path: {EXAMPLES}/gsm8k.jsonl, format: gsm8k, heldout: {empty}}}}}",
        "tasks.heldout_sizes.general=0"]))
    # the swe example's two records are both train: the domain could not be evaluated
    run = load_config(write(tmp_path, "defaults: [stage/rl]\n"),
                      ["tasks.domains=[agentic]", f"tasks.files={{agentic: {EXAMPLES}/swe.jsonl}}"])
    with pytest.raises(ConfigError, match=r"none of its 2 records is in the held-out split .* set "
                                          r"tasks.heldout_sizes.agentic=0"):
        check_paths(run)


def test_rollout_engine_settings_reach_the_rollout_workers_engine(tmp_path):
    """``rollout.engine`` is how a run sizes its engine (the pool was a fixed 256 MiB, on a GPU too) and sets its
    other EngineConfig keys; the run's own keys stay where they are documented."""
    from rlk3.cluster.workers import engine_config

    default = engine_config(load_config(write(tmp_path, "defaults: [stage/rl]\n")))
    assert (default.memory_bytes, default.memory_fraction) == (256 << 20, None)
    cfg = load_config(write(tmp_path, "defaults: [stage/rl]\n"), [
        "rollout.engine.memory_fraction=0.5", "rollout.engine.recompute_on_weight_update=true",
        "rollout.engine.cuda_graph_batch_sizes=[1, 8]", "rollout.max_total_tokens=3000", "rollout.sampler=counter"])
    e = engine_config(cfg)
    assert (e.memory_bytes, e.memory_fraction, e.recompute_on_weight_update) == (None, 0.5, True)
    assert (list(e.cuda_graph_batch_sizes), e.max_model_len, e.sampler) == ([1, 8], 3000, "counter")


def test_mopd_needs_a_teacher_only_for_the_slices_it_draws(tmp_path):
    """A missing teacher used to surface as TeacherRoutingError after the first iteration's rollouts; validation now
    names it. A domain of weight 0 is never drawn and needs none."""
    text = "defaults: [stage/mopd]\n"
    cfg = load_config(write(tmp_path, text), ["tasks.domains=[general, coding]", "tasks.weights=[1, 0]",
                                              "rollout.efforts=[low]", "mopd.teachers={general/low: x}"])
    assert dict(cfg.mopd.teachers) == {"general/low": "x"}
    with pytest.raises(ConfigError, match=r"no teacher for \['coding/low'\]"):
        load_config(write(tmp_path, text), ["tasks.domains=[general, coding]", "rollout.efforts=[low]",
                                            "mopd.teachers={general/low: x}"])


def test_a_run_config_builds_on_another(tmp_path):
    cfg = load_config(CONFIG_DIR / "sft-demo.yaml")
    tiny = load_config(CONFIG_DIR / "sft-tiny.yaml")
    assert cfg.run.name == "sft-demo" and cfg.sft.epochs == tiny.sft.epochs
    assert cfg.model.overrides == tiny.model.overrides
    assert set(cfg.sft.habit_stage.domain_demos) == {"general", "agentic", "coding"}
    assert dict(tiny.sft.habit_stage.domain_demos) == {"general": 1200}  # make test's checkpoint: general only
    (CONFIG_DIR / "_cycle_test.yaml").write_text("defaults: [_cycle_test]\n")
    try:
        with pytest.raises(ConfigError, match=r"_cycle_test -> _cycle_test is a cycle"):
            load_config(write(tmp_path, "defaults: [_cycle_test]\n"))
    finally:
        (CONFIG_DIR / "_cycle_test.yaml").unlink()


def test_every_fragment_loads(tmp_path):
    for frag in ("model/k3-tiny", "model/k3-small", "domain/general", "domain/agentic", "domain/coding",
                 "effort/low", "effort/medium", "effort/high", "stage/sft", "stage/rl", "stage/eval"):
        cfg = load_config(write(tmp_path, f"defaults: [base, stage/rl, {frag}]\n"))
        assert cfg.run.stage in ("sft", "rl", "eval")


def test_teacher_overrides_apply_domain_then_teacher(tmp_path):
    from rlk3.config import teacher_changes

    cfg = load_config(write(tmp_path, "defaults: [base, stage/teachers]\nteachers:\n  overrides:\n"
                                      "    general: {rollout: {temperature: 0.6, group_size: 8}}\n"
                                      "    general/low: {rollout: {temperature: 0.9}, run: {iterations: 3}}\n"))
    assert teacher_changes(cfg, "general", "high") == {"rollout.temperature": 0.6, "rollout.group_size": 8}
    assert teacher_changes(cfg, "general", "low") == {"rollout.temperature": 0.9, "rollout.group_size": 8,
                                                      "run.iterations": 3}
    assert teacher_changes(cfg, "coding", "low") == {}


@pytest.mark.parametrize("sampler", ["generator", "counter", None])
def test_rollout_sampler_reaches_the_rollout_engine(tmp_path, sampler):
    from rlk3.cluster.workers import engine_config

    cfg = load_config(write(tmp_path, "defaults: [stage/rl]\n"), [f"rollout.sampler={sampler or 'null'}"])
    engine = engine_config(cfg)
    assert engine.sampler == sampler and engine.max_model_len == cfg.rollout.max_total_tokens


def test_eval_without_a_manifest_names_the_stage_that_writes_one(tmp_path, capsys):
    # the teachers stage writes teachers.json, not a manifest: the message sent users to a file that never appears
    from rlk3.cli import main

    assert main(["eval", str(tmp_path / "manifest.json")]) == 2
    err = capsys.readouterr().err
    assert "no manifest at" in err and "the demo stage writes one" in err and "teachers" not in err


def test_model_overrides_that_k3config_accepts_load(tmp_path):
    cfg = load_config(write(tmp_path, "defaults: [stage/rl]\n"),
                      ["model.overrides.num_hidden_layers=2", "model.overrides.full_attn_layers=[2]"])
    assert cfg.model.overrides == {"num_hidden_layers": 2, "full_attn_layers": [2]}


# ---------------------------------------------------------------------------------------------- paths a stage reads

CHECKPOINT = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


def fake_checkpoint(path, files=CHECKPOINT):
    path.mkdir(parents=True, exist_ok=True)
    for name in files:
        (path / name).write_text("{}")
    return path


@pytest.fixture
def no_ray(monkeypatch):
    """Starting Ray is the first allocation of the rl, mopd and teachers stages: a check after it comes too late."""
    import rlk3.cluster.driver as driver

    def connect(cfg):
        raise AssertionError("Ray was started before the stage's checkpoints were checked")

    monkeypatch.setattr(driver, "connect", connect)


def mopd_overrides(tmp_path, teacher):
    return [f"run.output_dir={tmp_path / 'out'}", f"model.init_from={fake_checkpoint(tmp_path / 'sft')}",
            "tasks.domains=[general]", "rollout.efforts=[low]", f"mopd.teachers={{general/low: {teacher}}}"]


@pytest.mark.parametrize(
    ("files", "match"),
    [
        # TeacherPool found a teacher without weights only when the first rollouts were scored (one iteration in)
        (CHECKPOINT[:1] + CHECKPOINT[2:],
         r"mopd.teachers\['general/low'\]='.*/teacher': no readable model.safetensors or "
         r"model.safetensors.index.json there; a checkpoint directory holds .*config.json, model.safetensors"),
        (CHECKPOINT[1:], r"mopd.teachers\['general/low'\]='.*/teacher': no readable config.json there"),
        (None, r"mopd.teachers\['general/low'\]='.*/teacher': no such checkpoint directory"),
    ],
)
def test_run_stage_checks_teacher_checkpoints_before_ray(tmp_path, no_ray, files, match):
    """A config naming placeholder teachers loads (validate() leaves paths alone); running its stage checks them."""
    from rlk3.pipeline import run_stage

    teacher = tmp_path / "teacher"
    if files is not None:
        fake_checkpoint(teacher, files)
    cfg = load_config(write(tmp_path, "defaults: [stage/mopd]\n"), mopd_overrides(tmp_path, teacher))
    with pytest.raises(ConfigError, match=match):
        run_stage(cfg)


@pytest.mark.parametrize(
    ("stage", "missing"),
    [("rl", "tokenizer.json"), ("teachers", "config.json"), ("mopd", "tokenizer_config.json"),
     ("rl", "model.safetensors")],
)
def test_run_stage_checks_the_init_from_checkpoint_before_ray(tmp_path, no_ray, stage, missing):
    """validate() only asks that model.init_from is a directory: the rollout actor found it was not a checkpoint."""
    from rlk3.pipeline import run_stage

    init = fake_checkpoint(tmp_path / "sft", [f for f in CHECKPOINT if f != missing])
    overrides = [f"run.output_dir={tmp_path / 'out'}", f"model.init_from={init}"]
    if stage == "mopd":
        overrides += [f"mopd.teachers={{general/low: {fake_checkpoint(tmp_path / 'teacher')}}}",
                      "tasks.domains=[general]", "rollout.efforts=[low]"]
    cfg = load_config(write(tmp_path, f"defaults: [stage/{stage}]\n"), overrides)
    with pytest.raises(ConfigError, match=rf"model.init_from='.*/sft': no readable {missing}"):
        run_stage(cfg)


def test_model_overrides_beside_init_from_must_match_the_checkpoint(tmp_path):
    """With model.init_from the checkpoint's config.json decides the architecture: an override that differs from it
    was silently ignored. One that matches (configs/sft-tiny.yaml's on its own checkpoint) is fine."""
    from rlk3.config import CONFIG_DIR, check_paths
    from rlk3.model import K3Config

    init = fake_checkpoint(tmp_path / "sft", [f for f in CHECKPOINT if f != "config.json"])
    K3Config.preset("k3-tiny", num_hidden_layers=2).save_pretrained(init)
    base = [f"model.init_from={init}", f"run.output_dir={tmp_path / 'out'}"]
    check_paths(load_config(CONFIG_DIR / "sft-tiny.yaml", base))  # overrides {num_hidden_layers: 2}: matches
    with pytest.raises(ConfigError, match=r"model.overrides.num_hidden_layers=4, but the checkpoint model.init_from="
                                          r"'.*/sft' has num_hidden_layers=2: its config.json decides"):
        check_paths(load_config(CONFIG_DIR / "sft-tiny.yaml", [*base, "model.overrides.num_hidden_layers=4"]))


def test_check_paths_reads_relative_paths_from_the_current_directory(tmp_path, monkeypatch):
    from rlk3.config import check_paths

    monkeypatch.chdir(tmp_path)
    fake_checkpoint(tmp_path / "runs/sft", CHECKPOINT[:1])
    cfg = load_config(write(tmp_path, "defaults: [stage/rl]\n"), ["model.init_from=runs/sft"])
    with pytest.raises(ConfigError, match=rf"model.init_from='runs/sft' \({re.escape(str(tmp_path))}/runs/sft: "
                                          r"relative to the current directory\): no readable model.safetensors"):
        check_paths(cfg)
    # SFT from a checkpoint reads its tokenizer too (the checkpoint's embeddings are indexed by its ids)
    fake_checkpoint(tmp_path / "runs/sft", CHECKPOINT[:2])
    with pytest.raises(ConfigError, match=r"no readable tokenizer.json"):
        check_paths(load_config(write(tmp_path, "defaults: [stage/sft]\n"), ["model.init_from=runs/sft"]))


def test_a_checkpoint_rlk3_writes_passes_and_placeholders_load(tmp_path):
    """What save_pretrained writes is a checkpoint to check_paths; a config naming placeholders still loads (it is
    the stage that needs the files), and the demo stage, which makes its own, is not checked."""
    from harness.tokenizer import default_tokenizer
    from rlk3.config import check_paths
    from rlk3.model import K3Config, K3ForCausalLM

    tok = default_tokenizer()
    K3ForCausalLM(K3Config.preset("k3-tiny", num_hidden_layers=2, vocab_size=len(tok))).save_pretrained(tmp_path / "c")
    tok.save_pretrained(tmp_path / "c")
    real = [*mopd_overrides(tmp_path, tmp_path / "c"), f"model.init_from={tmp_path / 'c'}"]
    check_paths(load_config(write(tmp_path, "defaults: [stage/mopd]\n"), real))
    placeholders = load_config(write(tmp_path, "defaults: [stage/mopd]\n"), mopd_overrides(tmp_path, "x"))
    with pytest.raises(ConfigError, match=r"mopd.teachers\['general/low'\]='x'"):
        check_paths(placeholders)
    check_paths(load_config(write(tmp_path, "defaults: [stage/demo]\n"), [f"model.init_from={tmp_path}"]))


def test_cli_reports_a_missing_checkpoint_as_a_config_error(tmp_path, no_ray, capsys):
    from rlk3.cli import main

    config = write(tmp_path, "defaults: [stage/mopd]\n")
    args = ["mopd", str(config), *mopd_overrides(tmp_path, tmp_path / "nowhere")]
    assert main(args) == 2
    assert "config error: mopd.teachers['general/low']=" in capsys.readouterr().err
    assert main([*args, "--print-config"]) == 0  # shows the config as composed: placeholders are fine there


@pytest.mark.parametrize("override", ["harness.presets={hermes: 1.0}", "harness.compact_at_tokens=4096"])
def test_harness_keys_that_nothing_read_are_unknown(tmp_path, override):
    # both were in the schema, validated and never read: a preset mix or compaction set there changed nothing
    with pytest.raises(ConfigError, match="harness"):
        load_config(write(tmp_path, "defaults: [stage/rl]\n"), [override])


@pytest.mark.parametrize("args", [["n=abc"], ["n=0"], ["tasks.heldout_size=5"], ["--print-config"], ["device=tpu"],
                                  ["device="]])
def test_eval_refuses_what_it_would_ignore(tmp_path, capsys, args):
    # eval took n= and ignored every other override (and --print-config) without a word; a bad n was a traceback
    from rlk3.cli import main

    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    assert main(["eval", str(manifest), *args]) == 2
    assert "eval" in capsys.readouterr().err


def test_eval_on_cuda_without_a_gpu_says_what_it_sees(tmp_path, capsys, monkeypatch):
    import torch

    from rlk3.cli import main
    from rlk3.pipeline import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on CI's machine, wherever this runs

    manifest = tmp_path / "manifest.json"
    manifest.write_text("{}")
    assert main(["eval", str(manifest), "device=cuda"]) == 2
    err = capsys.readouterr().err
    assert "sees no GPU" in err and "device=cpu" in err
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(ValueError, match="valid are auto, cpu, cuda"):
        resolve_device("gpu")


def test_eval_checks_the_manifest_before_loading_a_model(tmp_path, capsys):
    # a moved or cleaned-up run directory failed inside an evaluation process, as a loader's traceback
    from rlk3.cli import main

    manifest = tmp_path / "manifest.json"
    base = tmp_path / "sft"
    base.mkdir()
    (base / "config.json").write_text("{}")
    cases = [
        ("{", r"is not JSON"),
        ("{}", r"names no 'sft' checkpoint"),
        (json.dumps({"sft": str(base), "teachers": {"general/high": str(tmp_path / "gone")}}),
         r"teacher-general-high's checkpoint '.*gone' is not a saved model \(no config.json there\)"),
        (json.dumps({"sft": str(base), "files": {"general": [str(tmp_path / "train.jsonl"), "gsm8k"]}}),
         r"the general task file '.*train.jsonl' \(gsm8k\) is gone"),
    ]
    for text, match in cases:
        manifest.write_text(text)
        assert main(["eval", str(manifest), "device=cpu"]) == 2
        assert re.search(match, capsys.readouterr().err), text
