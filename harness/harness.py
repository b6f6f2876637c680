"""The Harness: one preset made usable by the agent loop (see docs/harness.md for the whole API).

    h = Harness("claude_code", tokenizer, memory_dir=run_dir / "memory")
    messages = h.start(task.prompt, effort="high", budget=task.budget, group=task.group)
    ids = h.render(messages)                                # prompt token ids, ending with the generation prompt
    ...engine generates `completion` (text, decoded with special tokens kept)...
    parsed = h.parse(completion)                            # calls, or an error for the model; never raises
    messages.append(parsed.message())
    if parsed.finished: ...                                 # no call: the model answered in text
    ctx = h.context(sandbox_client, sandbox_id, group=task.group, subagent=run_subagent)
    result = await h.execute(parsed, ctx)                   # tool-result messages (+ the submitted answer)
    messages += result.messages
    ids += h.continuation(messages, n_before)               # tokens to append after the model's own tokens
    messages = h.compact(messages, n_tokens=len(ids))       # same object when nothing changed

Messages are plain OpenAI-style dicts (JSON-serialisable, what ``Trajectory.messages`` stores):
  {"role": "system", "content": str, "effort": "low"|"medium"|"high"}
  {"role": "user", "content": str}
  {"role": "assistant", "content": str, "reasoning_content": str?, "tool_calls": [{"id", "type": "function",
   "function": {"name": str, "arguments": dict}}]?}
  {"role": "tool", "tool_call_id": str?, "name": str, "content": str}
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from harness.context import Compaction, NoCompaction
from harness.memory import MemoryStore
from harness.presets import Preset, load_preset
from harness.schema import check_object
from harness.skills import SkillLibrary
from harness.syntax import ToolCall, get_syntax
from harness.tokenizer import (
    EFFORTS,
    EOT,
    IM_END,
    SPECIAL_TOKENS,
    THINK,
    THINK_END,
    assistant_mask,
    default_tokenizer,
    stop_token_ids,
)
from harness.tools import SandboxAPI, SubagentFn, Tool, ToolContext

# A special token inside a tool result or other text the harness writes would be encoded as the real control
# token (a file could then fake a turn boundary); a zero-width space after its first character keeps it text.
_SPECIAL_RX = re.compile("|".join(re.escape(t) for t in SPECIAL_TOKENS))
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(t) for t in SPECIAL_TOKENS) + ")")
_SPECIAL_SET = frozenset(SPECIAL_TOKENS)
ZWSP = "\u200b"


def defuse_special_tokens(text: str) -> str:
    return _SPECIAL_RX.sub(lambda m: m.group(0)[0] + ZWSP + m.group(0)[1:], text)


@dataclass
class Parsed:
    """One assistant completion, parsed. Either ``calls`` (possibly none) or ``error`` — never both."""

    text: str  # the completion as parsed (end-of-turn token removed)
    content: str  # visible text outside reasoning and calls (the raw text when there was an error)
    reasoning: str | None
    calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None  # the message returned to the model as the tool result

    @property
    def finished(self) -> bool:
        """The model wrote no tool call and no broken one: it is answering in text."""
        return not self.calls and self.error is None

    def message(self) -> dict:
        msg: dict = {"role": "assistant", "content": self.content}
        if self.reasoning:
            msg["reasoning_content"] = self.reasoning
        if self.calls:
            msg["tool_calls"] = [c.to_message() for c in self.calls]
        return msg


@dataclass
class Execution:
    messages: list[dict]  # one tool message per call (or one carrying the parse error)
    submitted: str | None = None  # the answer given to the submit tool, if it was called
    n_errors: int = 0  # tool results that were errors (for metrics)


class Harness:
    """A preset bound to a tokenizer: renders, parses, executes and compacts. Stateless across episodes."""

    def __init__(
        self,
        preset: Preset | str | dict,
        tokenizer: PreTrainedTokenizerFast | None = None,
        *,
        memory_dir: str | os.PathLike | None = None,
        skills_dirs: tuple[str | Path, ...] = (),
        depth: int = 0,
    ) -> None:
        self.preset = load_preset(preset)
        self.tokenizer = tokenizer if tokenizer is not None else default_tokenizer()
        self.depth = depth
        p = self.preset
        tools = p.build_tools()
        if depth > 0:  # a subagent reports back with its final message and may spawn only within the depth limit
            drop = {"submit"} | ({"subagent"} if depth >= p.subagents.max_depth else set())
            tools = [t for t in tools if t.kind.name not in drop]
        self.tools: list[Tool] = tools
        self._by_name = {t.name: t for t in tools}
        self._params = {t.name: t.parameters() for t in tools}
        self._schemas = [t.schema() for t in tools]
        freeform = [t.name for t in tools if t.kind.name == "apply_patch"]
        self.syntax = get_syntax(p.syntax, freeform=tuple(freeform), max_calls=p.limits.max_calls_per_turn)
        self.template_kwargs = {"tool_syntax": p.syntax, "freeform_tools": freeform, "tool_list": p.tool_list}
        self.skills = SkillLibrary.load(*skills_dirs).subset(list(p.skills))
        if p.memory.enabled and memory_dir is None:
            raise ValueError(
                f"preset {p.name!r} keeps memories across episodes (memory.enabled): pass memory_dir= "
                "(a directory that lives as long as the run), or use a preset with memory disabled"
            )
        self.memory = MemoryStore(memory_dir, p.memory.max_chars, p.memory.max_note_chars) if p.memory.enabled else None
        self._memory_dir = memory_dir
        self._skills_dirs = skills_dirs
        c = p.context
        self.context_policy = (
            Compaction(c.threshold_tokens, c.keep_last_turns, c.stub_chars) if c.policy == "compact" else NoCompaction()
        )
        self.stop_token_ids = stop_token_ids(self.tokenizer)
        self._seg_counts: dict[str, int] = {}
        self._seg_chars = 0
        if c.policy == "compact":
            floor = self.count_tokens(self.start("x", effort="high", budget=10**9, group=None))
            if floor * 2 > c.threshold_tokens:
                raise ValueError(
                    f"preset {p.name!r}: context.threshold_tokens={c.threshold_tokens} leaves no room: the system "
                    f"prompt and tool list alone take {floor} tokens (use at least {floor * 2})"
                )

    # ------------------------------------------------------------------------------------------ prompts

    def tool_schemas(self) -> list[dict]:
        """The tools as OpenAI-style schemas (what the chat template lists in the system turn)."""
        return [dict(s) for s in self._schemas]

    def tool_names(self) -> list[str]:
        return list(self._by_name)

    def _tool_of_kind(self, kind: str) -> str | None:
        return next((t.name for t in self.tools if t.kind.name == kind), None)

    def system_prompt(self, effort: str, budget: int | None = None, group: str | None = None) -> str:
        if effort not in EFFORTS:
            raise ValueError(f"effort must be one of {', '.join(EFFORTS)}, got {effort!r}")
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"budget must be a positive int (tokens) or None, got {budget!r}")
        p = self.preset
        parts = [p.system_prompt.replace("{workdir}", p.workdir).strip()]
        if self.depth > 0:
            parts.append(
                "You are a subagent: another agent gave you the task below. Do it, then end with a final message "
                "that reports what you found or did; that message is returned to the agent that started you."
            )
        parts.append(f"Reasoning effort: {effort}")
        if budget is not None:
            parts.append(
                f"Token budget: {budget} tokens for this problem, reasoning and answer included. "
                "A response that goes over the budget scores as a failure."
            )
        skill_tool = self._tool_of_kind("skill")
        if self.skills.skills and skill_tool:
            parts.append(f"## Skills\nLoad a skill's instructions with the {skill_tool} tool.\n{self.skills.index()}")
        if self.memory is not None and group is not None:
            notes = self.memory.notes(group).excerpt(p.memory.inject_chars).strip()
            parts.append(
                f"## Memory\nNotes from earlier episodes of this task ({self._tool_of_kind('memory')} tool to view "
                f"or update them):\n{defuse_special_tokens(notes) or '(no notes yet)'}"
            )
        return "\n\n".join(parts)

    def start(self, task: str, *, effort: str, budget: int | None = None, group: str | None = None) -> list[dict]:
        """The first two messages of an episode: the system prompt (with the effort) and the task."""
        return [
            {"role": "system", "content": self.system_prompt(effort, budget, group), "effort": effort},
            {"role": "user", "content": task},
        ]

    # ---------------------------------------------------------------------------------------- rendering

    def render_text(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            messages,
            tools=self._schemas or None,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **self.template_kwargs,
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the conversation as the model sees it (the tools listed in the system turn)."""
        return self.tokenizer.encode(self.render_text(messages, add_generation_prompt), add_special_tokens=False)

    def count_tokens(self, messages: list[dict]) -> int:
        """``len(self.render(messages))``, computed segment by segment with a cache.

        Byte-level BPE never merges across a special token, so the count is the number of special tokens plus
        the counts of the text between them. Compaction counts many variants of one conversation that share
        most of their segments; caching per segment makes each further count cost only the changed text.
        """
        n = 0
        for part in _SPECIAL_SPLIT.split(self.render_text(messages)):
            if part in _SPECIAL_SET:
                n += 1
            elif part:
                c = self._seg_counts.get(part)
                if c is None:
                    c = len(self.tokenizer.encode(part, add_special_tokens=False))
                    if self._seg_chars > 20_000_000:  # bound the cache's memory: start over
                        self._seg_counts.clear()
                        self._seg_chars = 0
                    self._seg_counts[part] = c
                    self._seg_chars += len(part)
                n += c
        return n

    def continuation(self, messages: list[dict], start: int) -> list[int]:
        """Ids to append after ``messages[:start]`` (ending with a finished assistant turn) for the rest.

        The loop keeps the model's own sampled ids for its turns (re-tokenizing decoded text need not give the
        same ids), and appends these: the new tool/user turns and the generation prompt.
        """
        prefix = self.render_text(messages[:start], add_generation_prompt=False)
        full = self.render_text(messages, add_generation_prompt=True)
        if not full.startswith(prefix):  # the template guarantees this; a failure here is a template bug
            raise RuntimeError("chat template is not prefix-stable: the continuation cannot be rendered")
        return self.tokenizer.encode(full[len(prefix) :], add_special_tokens=False)

    def assistant_text(self, message: dict) -> str:
        """The text a model would generate for assistant ``message`` in this preset's syntax, ``<|im_end|>``
        included: what SFT demonstrations teach and what :meth:`parse` reads back."""
        head = [{"role": "user", "content": ""}]
        prefix = self.render_text(head, add_generation_prompt=True)
        full = self.render_text([*head, message], add_generation_prompt=False)
        return full[len(prefix) :]

    def assistant_mask(self, messages: list[dict]) -> tuple[list[int], list[int]]:
        """Ids and a 0/1 mask on the assistant tokens (SFT), rendered in this preset's syntax and tools."""
        return assistant_mask(self.tokenizer, messages, tools=self._schemas or None, **self.template_kwargs)

    # ------------------------------------------------------------------------------------------ parsing

    def parse(self, completion: str | bytes) -> Parsed:
        """Parse a completion into calls or an error for the model. Total: never raises, linear time."""
        try:
            return self._parse(completion)
        except Exception as e:  # the parsers are total by construction; this keeps the loop alive regardless
            text = completion if isinstance(completion, str) else repr(completion)[:1000]
            return Parsed(
                text, text.strip(), None, error=self._error_text(f"internal parser error ({type(e).__name__})")
            )

    def _error_text(self, detail: str) -> str:
        names = ", ".join(self._by_name) or "none"
        return (
            f"Error: your tool call could not be used: {detail}\n"
            f"Write tool calls like this:\n{self.syntax.example}\nAvailable tools: {names}."
        )

    def _parse(self, completion: str | bytes) -> Parsed:
        if isinstance(completion, bytes | bytearray):
            text = bytes(completion).decode("utf-8", "replace")
        elif isinstance(completion, str):
            # lone surrogates (a broken decode upstream) could not be tokenized later: replace them
            text = completion.encode("utf-8", "replace").decode("utf-8")
        else:
            text = str(completion)
        for end in (IM_END, EOT):
            if text.endswith(end):
                text = text[: -len(end)]
        limit = self.preset.limits.max_parse_chars
        if len(text) > limit:
            detail = f"the output has {len(text)} characters; outputs longer than {limit} are not parsed"
            return Parsed(text, text.strip(), None, error=self._error_text(detail))
        reasoning, rest = None, text
        s = text.lstrip()
        if s.startswith(THINK):
            body = s[len(THINK) :]
            k = body.find(THINK_END)
            reasoning, rest = (body, "") if k < 0 else (body[:k], body[k + len(THINK_END) :])
        else:
            k = text.find(THINK_END)
            if k >= 0:  # a prompt that opened <think> itself: what precedes </think> is the reasoning
                reasoning, rest = text[:k], text[k + len(THINK_END) :]
        sp = self.syntax.parse(rest, self._params)
        if sp.error is not None:
            return Parsed(text, sp.content, reasoning, error=self._error_text(sp.error))
        for i, call in enumerate(sp.calls, 1):
            if call.name not in self._by_name:
                detail = f"tool call {i}: there is no tool named {call.name!r}"
                return Parsed(text, rest.strip(), reasoning, error=self._error_text(detail))
            err = check_object(self._params[call.name], call.arguments, f"tool call {i} ({call.name}) arguments")
            if err:
                return Parsed(text, rest.strip(), reasoning, error=self._error_text(err))
        return Parsed(text, sp.content, reasoning, calls=sp.calls)

    # ---------------------------------------------------------------------------------------- execution

    def context(
        self, sandbox: SandboxAPI, sid: str, *, group: str | None = None, subagent: SubagentFn | None = None
    ) -> ToolContext:
        """The tools' view of one episode: its sandbox, its task group's notes, the loop's subagent callback."""
        if self.memory is not None and group is None:
            raise ValueError(f"preset {self.preset.name!r} keeps memories per task group: pass group=")
        lim = self.preset.limits
        return ToolContext(
            sandbox=sandbox,
            sid=sid,
            workdir=self.preset.workdir,
            max_output_chars=lim.max_output_chars,
            exec_timeout_s=lim.exec_timeout_s,
            max_timeout_s=lim.max_timeout_s,
            read_max_lines=lim.read_max_lines,
            skills=self.skills,
            memory=self.memory.notes(group) if self.memory is not None else None,
            subagent=subagent if self._tool_of_kind("subagent") else None,
        )

    async def execute(self, parsed: Parsed, ctx: ToolContext) -> Execution:
        """Run the parsed calls in order; one tool message each. Never raises (except on cancellation)."""
        if parsed.error is not None:
            msg = {"role": "tool", "name": "error", "content": defuse_special_tokens(parsed.error)}
            return Execution([msg], None, 1)
        out, submitted, n_err = [], None, 0
        for call in parsed.calls:
            tool = self._by_name.get(call.name)
            if tool is None:  # parse() rejects these; a hand-built Parsed might not
                text, is_error, sub = f"Error: there is no tool named {call.name!r}", True, None
            else:
                r = await tool(call.arguments, ctx)
                text, is_error, sub = r.text, r.is_error, r.submitted
            if sub is not None and submitted is None:
                submitted = sub
            n_err += int(is_error)
            out.append(
                {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": defuse_special_tokens(text)}
            )
        return Execution(out, submitted, n_err)

    # ---------------------------------------------------------------------------------------- context

    def compact(self, messages: list[dict], n_tokens: int | None = None) -> list[dict]:
        """``messages`` itself when under the threshold (or no compaction), else a compacted copy.

        A new list means the prompt changed: the loop must re-render it (``render``) and prefill again.
        """
        return self.context_policy.compact(messages, self.count_tokens, n_tokens)

    # ---------------------------------------------------------------------------------------- subagents

    def for_subagent(self) -> Harness:
        """The harness a subagent runs under: the configured preset, one level deeper."""
        sub = self.preset.subagents
        preset = load_preset(sub.preset) if sub.preset else self.preset
        return Harness(
            preset, self.tokenizer, memory_dir=self._memory_dir, skills_dirs=self._skills_dirs, depth=self.depth + 1
        )
