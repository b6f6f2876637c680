"""Harness presets: YAML files that configure every module of the harness, validated on load.

    preset = load_preset("claude_code")            # a registered name (harness/presets/<name>.yaml)
    preset = load_preset("configs/my_agent.yaml")  # a YAML file
    preset = load_preset("mypkg.agents:PRESET")    # a dotted path to a Preset, a dict, or a callable returning one
    mix = PresetMix.parse({"claude_code": 2, "hermes": 1}, seed=0)
    mix.draw(trajectory_uid)                        # the preset for one episode, a pure function of (seed, key)

Every error names the key, the bad value and what would be valid.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import types
import typing
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml

from harness.context import Compaction
from harness.skills import SkillLibrary
from harness.syntax import SYNTAXES
from harness.tools import KINDS, Tool

PRESET_DIR = Path(__file__).with_name("presets")
Syntax = Literal["kimi", "hermes", "claude", "codex"]


@dataclass(frozen=True)
class ToolEntry:
    kind: str  # a canonical kind: shell, shell_argv, read, write, edit, apply_patch, glob, grep, python, ...
    name: str | None = None  # the name the model sees (default: the kind)
    description: str | None = None  # default: the kind's description
    params: dict[str, str] | None = None  # canonical name -> public name; parameters left out are hidden


@dataclass(frozen=True)
class ContextConfig:
    policy: Literal["none", "compact"] = "none"
    threshold_tokens: int = 300_000  # the K3 write-up's compaction point
    keep_last_turns: int = 4
    stub_chars: int = 200


@dataclass(frozen=True)
class MemoryConfig:
    enabled: bool = False
    max_chars: int = 4000
    max_note_chars: int = 1000
    inject_chars: int = 2000  # how much of the notes the system prompt shows


@dataclass(frozen=True)
class SubagentConfig:
    enabled: bool = False
    max_depth: int = 1  # subagents of depth max_depth get no subagent tool
    max_turns: int = 16  # for the agent loop: the sub-episode's turn limit
    preset: str | None = None  # the preset subagents run (default: this one)


@dataclass(frozen=True)
class Limits:
    max_output_chars: int = 16000  # per tool result
    exec_timeout_s: float = 60.0  # default command timeout
    max_timeout_s: float = 600.0  # the most a model may ask for
    read_max_lines: int = 2000
    max_calls_per_turn: int = 16
    max_parse_chars: int = 2_000_000  # completions longer than this are refused, not parsed


@dataclass(frozen=True)
class Preset:
    name: str
    description: str
    syntax: Syntax
    system_prompt: str  # "{workdir}" is replaced by the working directory
    tools: tuple[ToolEntry, ...]
    workdir: str = "/home/user"
    context: ContextConfig = field(default_factory=ContextConfig)
    skills: tuple[str, ...] = ()
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    subagents: SubagentConfig = field(default_factory=SubagentConfig)
    limits: Limits = field(default_factory=Limits)
    tool_list: Literal["json", "compact"] = "json"  # compact: one line per tool (small models, CPU runs)

    @classmethod
    def from_dict(cls, data: Any, where: str = "preset") -> Preset:
        p = _build(cls, data, where)
        p.validate(where)
        return p

    def build_tools(self, where: str = "preset") -> list[Tool]:
        out = []
        for i, e in enumerate(self.tools):
            try:
                out.append(Tool.make(e.kind, e.name, e.description, e.params))
            except ValueError as err:
                raise ValueError(f"{where}.tools[{i}]: {err}") from None
        return out

    def kinds(self) -> set[str]:
        return {e.kind for e in self.tools}

    def validate(self, where: str = "preset") -> None:
        if not self.system_prompt.strip():
            raise ValueError(f"{where}.system_prompt: must not be empty")
        if not self.workdir.startswith("/"):
            raise ValueError(f"{where}.workdir: must be an absolute path, got {self.workdir!r}")
        tools = self.build_tools(where)
        names = [t.name for t in tools]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"{where}.tools: tool name(s) {dup} used twice")
        kinds = self.kinds()
        for kind, on, key in (
            ("subagent", self.subagents.enabled, "subagents.enabled"),
            ("memory", self.memory.enabled, "memory.enabled"),
            ("skill", bool(self.skills), "skills"),
        ):
            if (kind in kinds) != on:
                raise ValueError(
                    f"{where}: a tool of kind {kind!r} and {key} go together: "
                    f"{'add the tool' if on else f'set {key}'} or {'turn it off' if on else 'remove the tool'}"
                )
        SkillLibrary.load().subset(list(self.skills))  # unknown skills -> error listing the available ones
        if self.context.policy == "compact":
            try:
                Compaction(self.context.threshold_tokens, self.context.keep_last_turns, self.context.stub_chars)
            except ValueError as err:
                raise ValueError(f"{where}.context: {err}") from None
        lim = self.limits
        for k in ("max_output_chars", "read_max_lines", "max_calls_per_turn", "max_parse_chars"):
            if getattr(lim, k) < 1:
                raise ValueError(f"{where}.limits.{k}: must be >= 1, got {getattr(lim, k)}")
        if not 0 < lim.exec_timeout_s <= lim.max_timeout_s:
            raise ValueError(
                f"{where}.limits: need 0 < exec_timeout_s <= max_timeout_s, got {lim.exec_timeout_s} and "
                f"{lim.max_timeout_s}"
            )
        if self.subagents.max_depth < 1 or self.subagents.max_turns < 1:
            raise ValueError(f"{where}.subagents: max_depth and max_turns must be >= 1")
        sub = self.subagents.preset
        # only checked for existence here: loading it could recurse through presets that name each other
        if sub is not None and sub not in registered_presets() and not Path(sub).is_file() and "." not in sub:
            raise ValueError(
                f"{where}.subagents.preset: {sub!r} is not a registered preset ({', '.join(registered_presets())}), "
                "a YAML file or a dotted path"
            )


# ------------------------------------------------------------------------------------- generic validation


def _type_name(t: Any) -> str:
    return getattr(t, "__name__", str(t))


def _build(cls: Any, data: Any, where: str) -> Any:
    """Build dataclass ``cls`` from plain data, checking keys and types (no coercion except int -> float)."""
    if not isinstance(data, dict):
        raise ValueError(
            f"{where}: expected a mapping with keys {', '.join(f.name for f in dataclasses.fields(cls))}, "
            f"got {type(data).__name__}"
        )
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = [k for k in data if k not in fields]
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; valid keys: {', '.join(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{where}: missing required key {name!r}")
            continue
        kwargs[name] = _convert(hints[name], data[name], f"{where}.{name}")
    return cls(**kwargs)


def _convert(t: Any, v: Any, where: str) -> Any:
    origin, args = typing.get_origin(t), typing.get_args(t)
    if origin in (typing.Union, types.UnionType):
        if v is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _convert(inner[0], v, where)
    if origin is Literal:
        if v not in args:
            raise ValueError(f"{where}: {v!r} is not valid; valid: {', '.join(map(str, args))}")
        return v
    if dataclasses.is_dataclass(t):
        return _build(t, v, where)
    if origin is tuple:
        if not isinstance(v, list | tuple):
            raise ValueError(f"{where}: expected a list, got {type(v).__name__} {v!r}")
        return tuple(_convert(args[0], x, f"{where}[{i}]") for i, x in enumerate(v))
    if origin is dict:
        if not isinstance(v, dict):
            raise ValueError(f"{where}: expected a mapping, got {type(v).__name__} {v!r}")
        return {_convert(args[0], k, f"{where} key"): _convert(args[1], x, f"{where}.{k}") for k, x in v.items()}
    if t is float and isinstance(v, int) and not isinstance(v, bool):
        return float(v)
    if (t in (int, float) and isinstance(v, bool)) or not isinstance(v, t):
        raise ValueError(f"{where}: expected {_type_name(t)}, got {type(v).__name__} {v!r}")
    return v


# ------------------------------------------------------------------------------------------ registry/loader


def registered_presets() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def load_object(path: str) -> Any:
    """Import ``module.attr`` or ``module:attr``; the one dotted-path loader of the harness."""
    mod, _, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not mod or not attr:
        raise ValueError(f"{path!r} is not a dotted path: write module.attr or module:attr")
    try:
        obj = importlib.import_module(mod)
    except ImportError as e:
        raise ValueError(f"cannot import module {mod!r} of {path!r}: {e}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"{path!r}: module {mod!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _load_yaml(p: Path) -> Preset:
    try:
        data = yaml.safe_load(p.read_text())
    except yaml.YAMLError as e:
        raise ValueError(f"{p}: invalid YAML: {e}") from None
    return Preset.from_dict(data, where=str(p))


@lru_cache(maxsize=64)
def _load_named(name: str) -> Preset:
    return _load_yaml(PRESET_DIR / f"{name}.yaml")


def load_preset(ref: Any) -> Preset:
    """A :class:`Preset` from a registered name, a YAML path, a dotted path, a dict, or a Preset."""
    if isinstance(ref, Preset):
        return ref
    if isinstance(ref, dict):
        return Preset.from_dict(ref)
    if not isinstance(ref, str) or not ref:
        raise ValueError(f"a preset reference must be a name, a path or a dotted path, got {ref!r}")
    if ref in registered_presets():
        return _load_named(ref)
    if ref.endswith((".yaml", ".yml")) or "/" in ref:
        p = Path(ref)
        if not p.is_file():
            raise ValueError(f"preset file {ref} does not exist")
        return _load_yaml(p)
    if "." in ref or ":" in ref:
        obj = load_object(ref)
        obj = obj() if callable(obj) and not isinstance(obj, Preset) else obj
        if isinstance(obj, Preset | dict):
            return load_preset(obj)
        raise ValueError(f"{ref!r} gave a {type(obj).__name__}; expected a Preset, a dict, or a callable returning one")
    raise ValueError(
        f"unknown preset {ref!r}: registered presets are {', '.join(registered_presets())}; "
        "or give a YAML path or a dotted path (module.attr)"
    )


@dataclass(frozen=True)
class PresetMix:
    """A task group's weighted choice of presets; each episode draws one from (seed, its key)."""

    weights: dict[str, float]
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.weights:
            raise ValueError("a preset mix needs at least one preset")
        for name, w in self.weights.items():
            if isinstance(w, bool) or not isinstance(w, int | float) or w < 0:
                raise ValueError(f"preset mix: weight of {name!r} must be a number >= 0, got {w!r}")
            load_preset(name)  # fail now, naming the bad preset, not mid-run
        if sum(self.weights.values()) <= 0:
            raise ValueError(f"preset mix: the weights must not all be 0 (got {self.weights})")

    @classmethod
    def parse(cls, spec: Any, seed: int = 0) -> PresetMix:
        """``"hermes"``, ``["hermes", "codex"]`` (equal weights) or ``{"hermes": 3, "codex": 1}``."""
        if isinstance(spec, str):
            return cls({spec: 1.0}, seed)
        if isinstance(spec, list | tuple):
            return cls({s: 1.0 for s in spec}, seed)
        if isinstance(spec, dict):
            return cls(dict(spec), seed)
        raise ValueError(f"a preset mix is a name, a list of names or a {{name: weight}} mapping, got {spec!r}")

    def draw(self, key: str | int) -> str:
        """The preset for the episode ``key``: the same (seed, key) always gives the same preset."""
        h = hashlib.sha256(f"{self.seed}:{key}".encode()).digest()
        u = int.from_bytes(h[:8], "big") / 2**64
        names = sorted(self.weights)  # independent of the order the mapping was written in
        total = sum(self.weights[n] for n in names)
        acc = 0.0
        for n in names:
            acc += self.weights[n] / total
            if u < acc:
                return n
        return next(n for n in reversed(names) if self.weights[n] > 0)


__all__ = [
    "KINDS",
    "SYNTAXES",
    "ContextConfig",
    "Limits",
    "MemoryConfig",
    "Preset",
    "PresetMix",
    "SubagentConfig",
    "ToolEntry",
    "load_object",
    "load_preset",
    "registered_presets",
]
