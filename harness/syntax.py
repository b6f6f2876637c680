"""Tool-call syntaxes: how a model writes tool calls in text, and a total parser for each.

Rendering is the chat template's job (``harness/chat_template.jinja``, selected by ``tool_syntax``); this module
is the inverse. Four syntaxes, after the scaffolds the policy should meet:

  kimi    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{JSON}
          <|tool_call_end|><|tool_calls_section_end|>                    (Kimi K2's special tokens)
  hermes  <tool_call>\\n{"name": NAME, "arguments": {JSON}}\\n</tool_call>   (Hermes / Qwen JSON-in-tags)
  claude  <function_calls><invoke name="NAME"><parameter name="P">VALUE</parameter></invoke></function_calls>
          (XML; string values raw, others JSON; the tool's schema decides which)
  codex   <|channel|>commentary to=functions.NAME<|message|>{JSON}<|call|>  (harmony-style; the payload of a
          freeform tool such as apply_patch is raw text, stored as arguments["input"])

Parsing is total: every input gives either calls or an error message written for the model, never an exception.
It is linear in the input: each parser makes one left-to-right pass with ``str.find`` and ``json`` raw decoding
from increasing positions, and stops at the first error or after ``max_calls`` calls, so no span is scanned more
than ``max_calls + 1`` times.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from harness.schema import types_of
from harness.tokenizer import TOOL_CALL_ARGS, TOOL_CALL_BEGIN, TOOL_CALL_END, TOOL_CALLS_BEGIN, TOOL_CALLS_END

_DECODER = json.JSONDecoder()
_WS = re.compile(r"\s*")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.\-]{0,63}\Z")
MAX_CALLS = 32  # per assistant turn; also the bound on parse work (see the module docstring)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    id: str = ""

    def to_message(self) -> dict:
        """The OpenAI-style ``tool_calls`` entry (arguments as a dict, which the chat template accepts)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class SyntaxParse:
    content: str  # text outside the calls, stripped
    calls: list[ToolCall] = field(default_factory=list)
    error: str | None = None  # the first problem found; when set, ``calls`` is empty


class ParseError(Exception):
    """Internal: carries the message for the model out of a parser's single pass."""


def _ws(text: str, pos: int) -> int:
    return _WS.match(text, pos).end()


def _snippet(text: str, pos: int, n: int = 40) -> str:
    s = text[pos : pos + n]
    return repr(s + ("..." if len(text) > pos + n else ""))


def _json_at(text: str, pos: int, what: str) -> tuple[Any, int]:
    """Decode one JSON value starting at ``pos``; return it and the end index."""
    try:
        return _DECODER.raw_decode(text, pos)
    except json.JSONDecodeError as e:
        if e.pos >= len(text):
            raise ParseError(f"{what}: the output ends inside the JSON (was it cut off?)") from None
        raise ParseError(f"{what}: invalid JSON at {_snippet(text, e.pos, 20)}: {e.msg}") from None
    except (ValueError, RecursionError) as e:  # nesting too deep, or a number too large to convert
        raise ParseError(f"{what}: invalid JSON: {type(e).__name__}") from None


def _args_dict(value: Any, what: str) -> dict:
    # arguments written as a JSON string holding an object (the OpenAI wire form) are accepted too
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise ParseError(f"{what}: arguments must be a JSON object, got a string that is not JSON") from None
    if not isinstance(value, dict):
        raise ParseError(f"{what}: arguments must be a JSON object, got {type(value).__name__}")
    return value


def _check_name(name: str, what: str) -> str:
    if not _NAME.match(name):
        raise ParseError(f"{what}: {name[:80]!r} is not a valid tool name")
    return name


class Syntax:
    """A tool-call syntax. ``parse`` is the only method the harness needs."""

    name: str = ""
    example: str = ""  # one call, shown to the model after a parse error

    def __init__(self, freeform: tuple[str, ...] = ("apply_patch",), max_calls: int = MAX_CALLS) -> None:
        self.freeform = tuple(freeform)
        self.max_calls = max_calls

    def parse(self, text: str, tools: dict[str, dict] | None = None) -> SyntaxParse:
        """``tools`` maps tool name -> JSON schema of its parameters (the claude syntax types its values by it)."""
        calls: list[ToolCall] = []
        try:
            content = self._parse(text, tools or {}, calls)
        except ParseError as e:
            return SyntaxParse(content=text.strip(), error=str(e))
        return SyntaxParse(content=content.strip(), calls=calls)

    def _parse(self, text: str, tools: dict[str, dict], calls: list[ToolCall]) -> str:
        raise NotImplementedError

    def _add(self, calls: list[ToolCall], call: ToolCall) -> None:
        if len(calls) >= self.max_calls:
            raise ParseError(f"too many tool calls in one turn (the limit is {self.max_calls})")
        calls.append(call)


class HermesSyntax(Syntax):
    name = "hermes"
    example = '<tool_call>\n{"name": "TOOL", "arguments": {"PARAM": "VALUE"}}\n</tool_call>'
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def _parse(self, text, tools, calls):
        content, pos = [], 0
        while True:
            i = text.find(self.OPEN, pos)
            if i < 0:
                content.append(text[pos:])
                return "".join(content)
            content.append(text[pos:i])
            what = f"tool call {len(calls) + 1}"
            j = _ws(text, i + len(self.OPEN))
            if j == len(text):
                raise ParseError(f"{what}: the output ends right after {self.OPEN} (was it cut off?)")
            obj, end = _json_at(text, j, what)
            if not isinstance(obj, dict):
                raise ParseError(f'{what}: expected a JSON object {{"name": ..., "arguments": {{...}}}}')
            end = _ws(text, end)
            if not text.startswith(self.CLOSE, end):
                raise ParseError(f"{what}: expected {self.CLOSE} after the JSON object, found {_snippet(text, end)}")
            name = obj.get("name")
            if not isinstance(name, str):
                raise ParseError(f'{what}: the object needs a "name" string (keys given: {", ".join(obj)[:200]})')
            extra = [k for k in obj if k not in ("name", "arguments")]
            if extra:
                raise ParseError(f"{what}: unexpected key(s) {', '.join(extra)[:200]}; valid: name, arguments")
            args = _args_dict(obj.get("arguments", {}), what)
            self._add(calls, ToolCall(_check_name(name, what), args, f"call_{len(calls)}"))
            pos = end + len(self.CLOSE)


class KimiSyntax(Syntax):
    name = "kimi"
    example = (
        f"{TOOL_CALLS_BEGIN}{TOOL_CALL_BEGIN}functions.TOOL:0{TOOL_CALL_ARGS}"
        f'{{"PARAM": "VALUE"}}{TOOL_CALL_END}{TOOL_CALLS_END}'
    )

    @staticmethod
    def _name_of(call_id: str, what: str) -> str:
        # functions.NAME:INDEX is the documented form; NAME:INDEX and NAME are accepted too
        s = call_id.strip()
        if s.startswith("functions."):
            s = s[len("functions.") :]
        head, sep, idx = s.rpartition(":")
        if sep and idx.isdigit():
            s = head
        return _check_name(s, what)

    def _parse(self, text, tools, calls):
        content, pos = [], 0
        while True:
            i = text.find(TOOL_CALLS_BEGIN, pos)
            if i < 0:
                content.append(text[pos:])
                return "".join(content)
            content.append(text[pos:i])
            pos = i + len(TOOL_CALLS_BEGIN)
            while True:
                what = f"tool call {len(calls) + 1}"
                pos = _ws(text, pos)
                if text.startswith(TOOL_CALLS_END, pos):
                    pos += len(TOOL_CALLS_END)
                    break
                if not text.startswith(TOOL_CALL_BEGIN, pos):
                    found = "the end of the output" if pos >= len(text) else _snippet(text, pos)
                    raise ParseError(f"{what}: expected {TOOL_CALL_BEGIN} or {TOOL_CALLS_END}, found {found}")
                # the call id is short: look for the argument marker no further than 200 characters on
                a = text.find(TOOL_CALL_ARGS, pos, pos + len(TOOL_CALL_BEGIN) + 200 + len(TOOL_CALL_ARGS))
                if a < 0:
                    raise ParseError(f"{what}: expected functions.NAME:INDEX then {TOOL_CALL_ARGS}")
                call_id = text[pos + len(TOOL_CALL_BEGIN) : a]
                name = self._name_of(call_id, what)
                j = _ws(text, a + len(TOOL_CALL_ARGS))
                obj, end = _json_at(text, j, what)
                end = _ws(text, end)
                if not text.startswith(TOOL_CALL_END, end):
                    raise ParseError(
                        f"{what}: expected {TOOL_CALL_END} after the arguments, found {_snippet(text, end)}"
                    )
                self._add(calls, ToolCall(name, _args_dict(obj, what), f"functions.{name}:{len(calls)}"))
                pos = end + len(TOOL_CALL_END)


class ClaudeSyntax(Syntax):
    name = "claude"
    example = (
        '<function_calls>\n<invoke name="TOOL">\n<parameter name="PARAM">VALUE</parameter>\n</invoke>\n'
        "</function_calls>"
    )
    OPEN, CLOSE = "<function_calls>", "</function_calls>"
    INVOKE, INVOKE_END = '<invoke name="', "</invoke>"
    PARAM, PARAM_END = '<parameter name="', "</parameter>"

    def _attr(self, text: str, pos: int, what: str) -> tuple[str, int]:
        q = text.find('">', pos, pos + 202)  # names are short: look no further than that
        if q < 0:
            raise ParseError(f'{what}: expected NAME"> after {text[max(0, pos - 16) : pos]!r}')
        return text[pos:q], q + 2

    @staticmethod
    def _value(raw: str, schema: dict | None, what: str) -> Any:
        types = types_of(schema or {})
        if not types or "string" in types:
            return raw
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):
            raise ParseError(f"{what} must be {' or '.join(types)} written as JSON, got {raw[:60]!r}") from None

    def _parse(self, text, tools, calls):
        content, pos = [], 0
        while True:
            i = text.find(self.OPEN, pos)
            if i < 0:
                content.append(text[pos:])
                return "".join(content)
            content.append(text[pos:i])
            pos = i + len(self.OPEN)
            while True:
                what = f"tool call {len(calls) + 1}"
                pos = _ws(text, pos)
                if text.startswith(self.CLOSE, pos):
                    pos += len(self.CLOSE)
                    break
                if not text.startswith(self.INVOKE, pos):
                    found = "the end of the output" if pos >= len(text) else _snippet(text, pos)
                    raise ParseError(f'{what}: expected <invoke name="..."> or {self.CLOSE}, found {found}')
                name, pos = self._attr(text, pos + len(self.INVOKE), what)
                name = _check_name(name, what)
                props = (tools.get(name) or {}).get("properties", {}) or {}
                args: dict = {}
                while True:
                    pos = _ws(text, pos)
                    if text.startswith(self.INVOKE_END, pos):
                        pos += len(self.INVOKE_END)
                        break
                    if not text.startswith(self.PARAM, pos):
                        found = "the end of the output" if pos >= len(text) else _snippet(text, pos)
                        raise ParseError(f'{what}: expected <parameter name="..."> or {self.INVOKE_END}, found {found}')
                    pname, pos = self._attr(text, pos + len(self.PARAM), what)
                    end = text.find(self.PARAM_END, pos)
                    if end < 0:
                        raise ParseError(f"{what}: parameter {pname[:60]!r} has no closing {self.PARAM_END}")
                    if pname in args:
                        raise ParseError(f"{what}: parameter {pname[:60]!r} is given twice")
                    args[pname] = self._value(text[pos:end], props.get(pname), f"{what}: parameter {pname[:60]!r}")
                    pos = end + len(self.PARAM_END)
                self._add(calls, ToolCall(name, args, f"call_{len(calls)}"))


class CodexSyntax(Syntax):
    name = "codex"
    example = '<|channel|>commentary to=functions.TOOL<|message|>{"PARAM": "VALUE"}<|call|>'
    OPEN, MESSAGE, CALL = "<|channel|>commentary to=functions.", "<|message|>", "<|call|>"

    def _parse(self, text, tools, calls):
        content, pos = [], 0
        while True:
            i = text.find(self.OPEN, pos)
            if i < 0:
                content.append(text[pos:])
                return "".join(content)
            content.append(text[pos:i])
            what = f"tool call {len(calls) + 1}"
            start = i + len(self.OPEN)
            m = text.find(self.MESSAGE, start, start + 200)
            if m < 0:
                raise ParseError(f"{what}: expected to=functions.NAME{self.MESSAGE}")
            # harmony writes an optional content-type hint between the name and <|message|>
            name = text[start:m].split(" <|constrain|>", 1)[0].strip()
            name = _check_name(name, what)
            end = text.find(self.CALL, m)
            if end < 0:
                raise ParseError(f"{what}: no closing {self.CALL} (was the output cut off?)")
            body = text[m + len(self.MESSAGE) : end]
            if name in self.freeform:
                args = {"input": body}
            else:
                j = _ws(body, 0)
                obj, k = _json_at(body, j, what)
                if _ws(body, k) != len(body):
                    raise ParseError(f"{what}: unexpected text after the JSON arguments: {_snippet(body, k)}")
                args = _args_dict(obj, what)
            self._add(calls, ToolCall(name, args, f"call_{len(calls)}"))
            pos = end + len(self.CALL)


SYNTAXES: dict[str, type[Syntax]] = {s.name: s for s in (KimiSyntax, HermesSyntax, ClaudeSyntax, CodexSyntax)}


def get_syntax(name: str, **kwargs) -> Syntax:
    if name not in SYNTAXES:
        raise ValueError(f"unknown tool syntax {name!r}; valid: {', '.join(SYNTAXES)}")
    return SYNTAXES[name](**kwargs)
