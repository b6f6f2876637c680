"""The user docs against the code they describe, where the code's side can be collected without guessing: the
dataclasses behind docs/engine.md's tables, the config schema behind every `section.key` the docs name, and the
metrics an RL and a MOPD iteration actually write to metrics.jsonl against docs/rl.md's "Metrics" table."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from rlk3.config import DOMAINS, EFFORTS, FREE_FORM, Config, load_config

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "BENCHMARKS.md")]


def _section(text: str, heading: str) -> str:
    """The body of a markdown section, up to the next heading of the same or a higher level."""
    level = heading.split(" ")[0]
    start = text.index(heading + "\n") + len(heading) + 1
    end = re.search(rf"^#{{1,{len(level)}}} ", text[start:], re.M)
    return text[start:start + end.start()] if end else text[start:]


def _table(text: str) -> list[list[str]]:
    """The cells of the one markdown table in ``text``, header row left out."""
    rows = [line for line in text.splitlines() if line.startswith("|") and not line.startswith("|---")]
    return [[c.strip() for c in re.split(r"(?<!\\)\|", row)[1:-1]] for row in rows[1:]]


def _first_column(text: str) -> list[str]:
    return [row[0] for row in _table(text)]


def _names(cell: str) -> set[str]:
    """The names one table cell documents: each backticked span, with `a/x, y, z` meaning a/x, a/y, a/z and
    `a/{x, y}` meaning a/x, a/y; text in parentheses is left out."""
    out = set()
    for span in re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cell)):  # `pool` (`PoolStats`): pool
        brace = re.fullmatch(r"(.*)\{(.*)\}", span)
        if brace:
            out |= {brace[1] + s.strip() for s in brace[2].split(",")}
            continue
        items = [s.strip() for s in span.split(",")]
        prefix = items[0].rsplit("/", 1)[0] + "/" if "/" in items[0] else ""
        out |= {items[0], *(prefix + s for s in items[1:])}
    return out


# ----------------------------------------------------------------------------------------- docs/engine.md


def _engine_doc() -> str:
    return (ROOT / "docs/engine.md").read_text()


def test_engine_config_table_lists_every_engine_config_key():
    from rlk3.engine import EngineConfig

    doc = set().union(*map(_names, _first_column(_section(_engine_doc(), "## Configuration"))))
    code = {f.name for f in dataclasses.fields(EngineConfig)}
    assert doc == code, f"in docs/engine.md only: {sorted(doc - code)}; in EngineConfig only: {sorted(code - doc)}"


def test_engine_metrics_table_lists_every_stats_field():
    from rlk3.engine import EngineStats, PoolStats, PrefixCacheStats

    rows = {row[0]: row[1] for row in _table(_section(_engine_doc(), "## Metrics (`stats()` → `EngineStats`)"))}
    doc: set[str] = set()
    for cell in rows:
        for name in _names(cell):
            head, *rest = name.split("/")  # num_waiting/running/paused/finished
            doc |= {head, *(head.rsplit("_", 1)[0] + "_" + r for r in rest)}
    code = {f.name for f in dataclasses.fields(EngineStats)}
    assert doc == code, f"in docs/engine.md only: {sorted(doc - code)}; in EngineStats only: {sorted(code - doc)}"
    for field, cls in (("pool", PoolStats), ("prefix_cache", PrefixCacheStats)):
        cell = next(v for k, v in rows.items() if f"`{field}`" in k)
        listed = set(re.findall(r"`([^`]+)`", re.sub(r"\([^)]*\)", "", cell)))
        want = {f.name for f in dataclasses.fields(cls)}
        assert listed == want, f"{field}: in docs/engine.md only {sorted(listed - want)}, in {cls.__name__} only " \
                               f"{sorted(want - listed)}"


# ------------------------------------------------------------------------------- config keys in every doc

# backticked `section.key` spans that are not config keys: a weight name, files
NOT_CONFIG = {"model.embed_tokens.weight", "model.safetensors", "harness.py"}


def _config_key_error(schema, key: str) -> str | None:
    from rlk3.engine import EngineConfig

    parts = key.split(".")
    node = schema
    for i, part in enumerate(parts):
        where = ".".join(parts[:i])
        if where == "rollout.engine":
            return None if part in {f.name for f in dataclasses.fields(EngineConfig)} else "not an EngineConfig key"
        if where in FREE_FORM or part.startswith("<"):
            return None  # user-named entries
        if not OmegaConf.is_dict(node) or part not in node:
            return f"no {part!r} under {where or 'the top level'}"
        node = node[part]
    return None


def test_every_config_key_the_docs_name_exists_in_the_schema():
    schema = OmegaConf.structured(Config)
    schema.run.stage = "rl"  # MISSING in the schema, which `in` reads as absent
    sections = "|".join(f.name for f in dataclasses.fields(Config))
    # a whole backticked span that is `section.key`, optionally `=value` or `: value`
    span = re.compile(rf"`((?:{sections})(?:\.(?:[A-Za-z_]\w*|<\w+>))+)(?:\s*[=:][^`]*)?`")
    bad = []
    for doc in DOCS:
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)  # code blocks hold Python and shell, not keys
        for m in span.finditer(text):
            key = m[1]
            if key in NOT_CONFIG or _is_python(key):
                continue
            err = _config_key_error(schema, key)
            if err:
                bad.append(f"{doc.name}:{text[:m.start()].count(chr(10)) + 1}: `{key}`: {err}")
    assert not bad, "config keys the docs name that rlk3/config.py does not have:\n" + "\n".join(bad)


def _is_python(name: str) -> bool:
    """`harness.tokenizer.load_tokenizer`, `rewards.effort`: a module path, not a config key."""
    parts = name.split(".")
    for k in range(len(parts), 1, -1):
        try:
            if importlib.util.find_spec(".".join(parts[:k])):
                return True
        except ModuleNotFoundError:
            continue
    return False


def test_the_config_key_check_sees_a_key_that_does_not_exist():
    schema = OmegaConf.structured(Config)
    assert _config_key_error(schema, "sft.habit_stage.demos")  # renamed to domain_demos: the docs kept it
    assert _config_key_error(schema, "rollout.engine.memory_fractoin")
    assert _config_key_error(schema, "sft.habit_stage.domain_demos.general") is None
    assert _config_key_error(schema, "rollout.engine.memory_fraction") is None


# ------------------------------------------------------------------------------- metrics: docs/rl.md


class _Method:  # an actor method in place: ``.remote(...)`` calls it
    def __init__(self, fn):
        self.remote = fn


class _Actor:
    def __init__(self, obj):
        self._obj = obj

    def __getattr__(self, name):
        return _Method(lambda: None) if name == "__ray_ready__" else _Method(getattr(self._obj, name))


class _ActorClass:
    def __init__(self, cls):
        self.cls = cls

    def options(self, **_):
        return self

    def remote(self, *args, **kwargs):
        return _Actor(self.cls(*args, **kwargs))


def _run_in_process(monkeypatch, cfg) -> list[dict]:
    """``run_rl`` with every Ray actor a plain object in this process (the workers are plain classes): the real
    driver, rollout worker, trainer and teacher pool, so the rows are what a Ray run writes."""
    from rlk3.cluster import driver

    fake = SimpleNamespace(remote=_ActorClass, get=lambda x: x, put=lambda x: x,
                           util=SimpleNamespace(remove_placement_group=lambda pg: None))
    monkeypatch.setattr(driver, "ray", fake)
    monkeypatch.setattr(driver, "connect", lambda cfg: None)
    monkeypatch.setattr(driver, "placement_group", lambda bundles, strategy: SimpleNamespace(ready=lambda: None))
    monkeypatch.setattr(driver, "PlacementGroupSchedulingStrategy", lambda *a, **k: None)
    threads = torch.get_num_threads()
    try:
        driver.run_rl(cfg, log=lambda *_: None)
    finally:
        torch.set_num_threads(threads)  # the workers set their own
    return [json.loads(line) for line in (Path(cfg.run.output_dir) / "metrics.jsonl").read_text().splitlines()]


def _pattern(key: str) -> str:
    return "/".join("<domain>" if p in DOMAINS else "<effort>" if p in EFFORTS else p for p in key.split("/"))


def _documented_metrics() -> set[str]:
    table = _section((ROOT / "docs/rl.md").read_text(), "## Metrics")
    return set().union(*map(_names, _first_column(table)))


@pytest.fixture(scope="module")
def logged_metrics(tmp_path_factory):
    """The keys of the rows an RL iteration (with a KL anchor and an evaluation) and a MOPD iteration write."""
    from harness.tokenizer import default_tokenizer
    from rlk3.model import K3Config, K3ForCausalLM

    mp = pytest.MonkeyPatch()
    tmp = tmp_path_factory.mktemp("metrics")
    tok = default_tokenizer()
    torch.manual_seed(0)
    K3ForCausalLM(K3Config.preset("k3-tiny", num_hidden_layers=2, vocab_size=len(tok))).save_pretrained(tmp / "init")
    tok.save_pretrained(tmp / "init")
    small = [f"model.init_from={tmp / 'init'}", "run.iterations=1", "run.eval_every=1", "run.checkpoint_every=1",
             "run.log_tensorboard=false", "rollout.groups_per_iteration=2", "rollout.group_size=2",
             "rollout.max_new_tokens=8", "tasks.heldout_size=1", "cluster.cpu_threads=1"]
    try:
        rl = _run_in_process(mp, load_config(ROOT / "configs/quickstart.yaml",
                                             [*small, f"run.output_dir={tmp / 'rl'}", "train.kl_coef=0.1"]))
        teachers = json.dumps({f"general/{e}": str(tmp / "init") for e in EFFORTS})
        mopd = _run_in_process(mp, load_config(ROOT / "configs/mopd.yaml",
                                               [*small, f"run.output_dir={tmp / 'mopd'}", "tasks.domains=[general]",
                                                f"mopd.teachers={teachers}", "run.stage=mopd"]))
    finally:
        mp.undo()
    return {_pattern(k) for row in rl + mopd for k in row}


def test_every_logged_metric_is_documented_and_every_documented_one_logged(logged_metrics):
    documented = _documented_metrics()
    assert logged_metrics == documented, (
        f"logged but not in docs/rl.md's Metrics table: {sorted(logged_metrics - documented)}; "
        f"documented but not logged: {sorted(documented - logged_metrics)}")


def test_the_metrics_table_reader_expands_the_short_forms():
    assert _names("`train/loss, tokens`, `eval/<domain>/<effort>/{pass_rate, n}`, `version`") == {
        "train/loss", "train/tokens", "eval/<domain>/<effort>/pass_rate", "eval/<domain>/<effort>/n", "version"}
    assert _pattern("kl/general/high") == "kl/<domain>/<effort>"
