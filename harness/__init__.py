"""Agent scaffolds: tools, prompts, context management, skills, memories, subagents (docs/harness.md).

The agent loop needs :class:`Harness` (render / parse / execute / compact) and a tokenizer from
:mod:`harness.tokenizer`; presets are chosen by name, YAML path or dotted path through :func:`load_preset`.
"""

from harness.harness import Execution, Harness, Parsed, defuse_special_tokens
from harness.presets import Preset, PresetMix, load_preset, registered_presets
from harness.syntax import ToolCall
from harness.tokenizer import assistant_mask, default_tokenizer, load_tokenizer, train_tokenizer
from harness.tools import SandboxAPI, ToolContext

__all__ = [
    "Execution",
    "Harness",
    "Parsed",
    "Preset",
    "PresetMix",
    "SandboxAPI",
    "ToolCall",
    "ToolContext",
    "assistant_mask",
    "default_tokenizer",
    "defuse_special_tokens",
    "load_preset",
    "load_tokenizer",
    "registered_presets",
    "train_tokenizer",
]
