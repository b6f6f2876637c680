"""Presets: every registered preset loads, builds and renders; bad YAML is refused naming key, value and valid
options; one loader for names, paths and dotted paths; seeded weighted mixes."""

from __future__ import annotations

import copy
from collections import Counter

import pytest
import yaml

from harness import Harness, Preset, PresetMix, load_preset, registered_presets
from harness.presets import PRESET_DIR, load_object
from harness.tools import KINDS

ISSUE_PRESETS = {"kimi_code", "claude_code", "codex", "openclaw", "hermes"}


def test_the_issue_presets_are_registered():
    assert set(registered_presets()) >= ISSUE_PRESETS


@pytest.mark.parametrize("name", registered_presets())
def test_every_registered_preset_loads_builds_and_renders(name, tok, tmp_path):
    p = load_preset(name)
    assert isinstance(p, Preset) and p.name == name
    h = Harness(name, tok, memory_dir=tmp_path)
    msgs = h.start("Say hi.", effort="high", budget=100, group="g")
    text = h.render_text(msgs)
    for tool in h.tool_schemas():
        f = tool["function"]
        if p.tool_list == "compact":  # one line per tool: NAME(params): description
            assert f'{f["name"]}({", ".join(f["parameters"]["properties"])}): {f["description"]}' in text
        else:
            assert f'"name": "{f["name"]}"' in text
    assert "Reasoning effort: high" in text and "Token budget: 100 tokens" in text
    assert h.count_tokens(msgs) < 4000


def test_presets_use_the_scaffolds_tool_names_and_syntaxes():
    names = {n: [e.name for e in load_preset(n).tools] for n in ISSUE_PRESETS}
    assert {"Read", "Edit", "Write", "Bash", "Glob", "Grep", "Task"} <= set(names["claude_code"])
    assert {"shell", "apply_patch"} <= set(names["codex"])
    assert {"Shell", "ReadFile", "WriteFile", "StrReplaceFile", "Glob", "Grep", "Task"} <= set(names["kimi_code"])
    assert {"exec", "read", "write", "edit", "sessions_spawn"} <= set(names["openclaw"])
    assert {"terminal", "read_file", "write_file", "delegate_task"} <= set(names["hermes"])
    syntaxes = {n: load_preset(n).syntax for n in ISSUE_PRESETS}
    assert syntaxes == {
        "kimi_code": "kimi",
        "claude_code": "claude",
        "codex": "codex",
        "openclaw": "kimi",
        "hermes": "hermes",
    }
    # Claude Code's argument shapes
    edit = next(t for t in load_preset("claude_code").build_tools() if t.name == "Edit").parameters()
    assert list(edit["properties"]) == ["file_path", "old_string", "new_string", "replace_all"]
    assert edit["required"] == ["file_path", "old_string", "new_string"]
    shell = next(t for t in load_preset("codex").build_tools() if t.name == "shell").parameters()
    assert shell["properties"]["command"]["type"] == "array"


def base() -> dict:
    return yaml.safe_load((PRESET_DIR / "claude_code.yaml").read_text())


def edited(path: str, value) -> dict:
    d = copy.deepcopy(base())
    keys = path.split(".")
    cur = d
    for k in keys[:-1]:
        cur = cur[int(k)] if isinstance(cur, list) else cur[k]
    if value is KeyError:
        del cur[keys[-1]]
    elif isinstance(cur, list):
        cur[int(keys[-1])] = value
    else:
        cur[keys[-1]] = value
    return d


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (edited("colour", "blue"), r"preset: unknown key\(s\) 'colour'; valid keys: name, description, syntax"),
        (edited("syntax", "xml"), r"preset.syntax: 'xml' is not valid; valid: kimi, hermes, claude, codex"),
        (edited("name", KeyError), r"preset: missing required key 'name'"),
        (edited("context.policy", "magic"), r"preset.context.policy: 'magic' is not valid; valid: none, compact"),
        (edited("context.threshold_tokens", "big"), r"preset.context.threshold_tokens: expected int, got str 'big'"),
        (edited("context.keep_last_turns", 0), r"preset.context: keep_last_turns must be an int >= 1, got 0"),
        (edited("limits.max_output_chars", True), r"preset.limits.max_output_chars: expected int, got bool True"),
        (edited("limits.exec_timeout_s", 900), r"need 0 < exec_timeout_s <= max_timeout_s, got 900.0 and 600.0"),
        (edited("tools.0", {"kind": "teleport"}), r"preset.tools\[0\]: unknown tool kind 'teleport'; valid: shell,"),
        (
            edited("tools.0", {"kind": "shell", "params": {"cmd": "command"}}),
            r"preset.tools\[0\]: tool shell: kind 'shell' has no parameter\(s\) \['cmd'\]; valid: command, timeout_s",
        ),
        (
            edited("tools.1", {"kind": "read", "name": "Read", "params": {"offset": "offset"}}),
            r"preset.tools\[1\]: tool Read: required parameter\(s\) \['path'\] of kind 'read' must be exposed",
        ),
        (
            edited("tools.1", {"kind": "read", "name": "Bash"}),
            r"preset.tools: tool name\(s\) \['Bash'\] used twice",
        ),
        (
            edited("tools.0.extra", 1),
            r"preset.tools\[0\]: unknown key\(s\) 'extra'; valid keys: kind, name, description",
        ),
        (edited("tools", "Bash"), r"preset.tools: expected a list, got str 'Bash'"),
        (edited("skills", ["juggling"]), r"unknown skill\(s\) \['juggling'\]; available: apply-patch, debugging"),
        (edited("skills", []), r"a tool of kind 'skill' and skills go together: set skills or remove the tool"),
        (
            edited("subagents.enabled", False),
            r"a tool of kind 'subagent' and subagents.enabled go together: set subagents.enabled or remove the tool",
        ),
        (
            edited("memory", {"enabled": True}),
            r"a tool of kind 'memory' and memory.enabled go together: add the tool or turn it off",
        ),
        (edited("workdir", "home"), r"preset.workdir: must be an absolute path, got 'home'"),
        (edited("subagents.preset", "nobody"), r"preset.subagents.preset: 'nobody' is not a registered preset"),
    ],
)
def test_bad_presets_are_refused_with_the_key_the_value_and_the_valid_options(data, match):
    with pytest.raises(ValueError, match=match):
        Preset.from_dict(data)


def test_every_kind_appears_in_some_registered_preset():
    used = {e.kind for n in registered_presets() for e in load_preset(n).tools}
    assert used == set(KINDS)


def test_one_loader_for_names_yaml_paths_dotted_paths_and_dicts(tmp_path, monkeypatch):
    by_name = load_preset("hermes")
    assert load_preset(str(PRESET_DIR / "hermes.yaml")) == by_name
    assert load_preset(base()).name == "claude_code"
    assert load_preset(by_name) is by_name
    # a dotted path to an attribute holding a dict, and to a callable returning a Preset
    mod = tmp_path / "my_agents.py"
    mod.write_text(
        "import yaml, harness.presets as P\n"
        "DATA = yaml.safe_load((P.PRESET_DIR / 'codex.yaml').read_text())\n"
        "DATA['name'] = 'my_codex'\n"
        "def make():\n    return P.Preset.from_dict(DATA)\n"
        "NOT_A_PRESET = 3\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_preset("my_agents.DATA").name == "my_codex"
    assert load_preset("my_agents:make").name == "my_codex"
    with pytest.raises(ValueError, match=r"'my_agents\.NOT_A_PRESET' gave a int; expected a Preset, a dict"):
        load_preset("my_agents.NOT_A_PRESET")
    with pytest.raises(ValueError, match="module 'my_agents' has no attribute 'missing'"):
        load_object("my_agents.missing")
    with pytest.raises(ValueError, match="cannot import module 'no_such_mod'"):
        load_object("no_such_mod.X")
    with pytest.raises(ValueError, match=r"unknown preset 'gemini': registered presets are chat, claude_code, codex,"):
        load_preset("gemini")
    with pytest.raises(ValueError, match=r"preset file nowhere/x\.yaml does not exist"):
        load_preset("nowhere/x.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(ValueError, match=r"bad\.yaml: invalid YAML"):
        load_preset(str(bad))


def test_a_mix_draws_by_weight_and_the_same_key_always_gets_the_same_preset():
    mix = PresetMix.parse({"claude_code": 3, "hermes": 1, "codex": 0}, seed=7)
    draws = [mix.draw(f"traj-{i}") for i in range(8000)]
    c = Counter(draws)
    assert c["codex"] == 0 and abs(c["claude_code"] / 8000 - 0.75) < 0.03
    assert [mix.draw(f"traj-{i}") for i in range(8000)] == draws  # a pure function of (seed, key)
    # the order the mapping was written in does not matter; the seed does
    assert PresetMix.parse({"codex": 0, "hermes": 1, "claude_code": 3}, seed=7).draw("k") == mix.draw("k")
    other = PresetMix.parse({"claude_code": 3, "hermes": 1}, seed=8)
    assert [other.draw(f"traj-{i}") for i in range(200)] != draws[:200]
    assert PresetMix.parse("openclaw").draw("anything") == "openclaw"
    assert set(PresetMix.parse(["kimi_code", "codex"]).draw(i) for i in range(100)) == {"kimi_code", "codex"}


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({}, "a preset mix needs at least one preset"),
        ({"hermes": -1}, "weight of 'hermes' must be a number >= 0, got -1"),
        ({"hermes": "lots"}, "weight of 'hermes' must be a number >= 0, got 'lots'"),
        ({"hermes": 0}, "the weights must not all be 0"),
        ({"hermes": 1, "gemini": 1}, "unknown preset 'gemini'"),
        (42, "a preset mix is a name, a list of names or a {name: weight} mapping, got 42"),
    ],
)
def test_bad_mixes_are_refused(spec, match):
    with pytest.raises(ValueError, match=match.replace("{", r"\{").replace("}", r"\}")):
        PresetMix.parse(spec)
