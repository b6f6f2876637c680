"""Context management: keep a conversation under a token threshold without splitting a tool call from its result.

The K3 write-up compacts past 300K tokens and also trains without compaction; both are policies here.

:class:`Compaction` sees the conversation as a pinned head (the system message and the first user message: the
task) and then *units*: an assistant message together with the tool results that follow it, or a lone user or
system message. A unit is only ever changed as a whole, so a call and its result are kept together, stubbed
together or dropped together. When the rendered conversation is over ``threshold_tokens`` it applies, oldest
first, the least of these steps that brings it under:

1. stub old units (all but the last ``keep_last_turns``): each tool output becomes a short note with its first
   ``stub_chars`` characters (0 drops it to the note alone), long call arguments and reasoning are cut;
2. drop old units whole, leaving one marker message saying how many messages were removed;
3. the same for the recent units except the very last one, then stub the last one, then drop it;
4. cut every message's text to a common length (system prompt last).

Steps 1-3 are one ordered list of actions, and the number of actions applied is found by binary search on the
exact token count, so compaction costs O(log n) renders of the conversation (and one count per unit, to keep a
stub only where it saves tokens). The count falls with each action except at the first drop, whose marker message
can cost more than the unit it removes; the search runs on each side of it. The result is under the threshold
whenever the threshold can hold the (cut) system prompt and tool list at all.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass

from harness.tools import truncate

Count = Callable[[list[dict]], int]
MARKER = "[Context compacted: {n} earlier messages were removed to stay within the context limit.]"


def _is_marker(m: dict) -> bool:
    return m.get("role") == "user" and str(m.get("content", "")).startswith("[Context compacted:")


def _marker_count(m: dict) -> int:
    digits = "".join(ch for ch in str(m.get("content", ""))[:40] if ch.isdigit())
    return int(digits) if digits else 1


def units_of(messages: list[dict]) -> tuple[list[dict], list[list[dict]]]:
    """Split into the pinned head and the units described in the module docstring."""
    i = 0
    head: list[dict] = []
    if i < len(messages) and messages[i].get("role") == "system":
        head.append(messages[i])
        i += 1
    if i < len(messages) and messages[i].get("role") == "user":
        head.append(messages[i])
        i += 1
    units: list[list[dict]] = []
    while i < len(messages):
        unit = [messages[i]]
        i += 1
        if unit[0].get("role") == "assistant":
            while i < len(messages) and messages[i].get("role") == "tool":
                unit.append(messages[i])
                i += 1
        units.append(unit)
    return head, units


def _text(m: dict) -> str:
    c = m.get("content")
    if isinstance(c, str):
        return c
    if isinstance(c, list):
        return "".join(p.get("text", "") for p in c if isinstance(p, dict))
    return ""


def stub_unit(unit: list[dict], stub_chars: int) -> list[dict]:
    out = []
    for m in unit:
        m = copy.deepcopy(m)
        if m.get("role") == "tool":
            text = _text(m)
            note = f"[output cleared by context compaction; it had {len(text)} characters"
            note += f". It began: {text[:stub_chars]}]" if stub_chars > 0 and text else "]"
            if len(note) < len(text):
                m["content"] = note
        elif m.get("role") == "assistant":
            m.pop("reasoning_content", None)
            m["content"] = truncate(_text(m), max(stub_chars, 64) * 4)
            for c in m.get("tool_calls") or []:
                f = c.get("function", c)
                if isinstance(f.get("arguments"), dict):
                    f["arguments"] = {
                        k: truncate(v, max(stub_chars, 64)) if isinstance(v, str) else v
                        for k, v in f["arguments"].items()
                    }
        else:
            m["content"] = truncate(_text(m), max(stub_chars, 64) * 4)
        out.append(m)
    return out


def cut_text(messages: list[dict], cap: int, include_system: bool) -> list[dict]:
    out = []
    for i, m in enumerate(messages):
        if m.get("role") == "system" and i == 0 and not include_system:
            out.append(m)
            continue
        m = copy.deepcopy(m)
        m["content"] = truncate(_text(m), cap)
        if "reasoning_content" in m:
            m["reasoning_content"] = truncate(str(m["reasoning_content"]), cap)
        for c in m.get("tool_calls") or []:
            f = c.get("function", c)
            if isinstance(f.get("arguments"), dict):
                f["arguments"] = {k: truncate(v, cap) if isinstance(v, str) else v for k, v in f["arguments"].items()}
        out.append(m)
    return out


@dataclass(frozen=True)
class NoCompaction:
    """Run without compaction: the conversation grows until the loop's own length limit stops it."""

    threshold_tokens: int | None = None

    def compact(self, messages: list[dict], count: Count, n_tokens: int | None = None) -> list[dict]:
        return messages


@dataclass(frozen=True)
class Compaction:
    threshold_tokens: int
    keep_last_turns: int = 4
    stub_chars: int = 200

    def __post_init__(self) -> None:
        if not isinstance(self.threshold_tokens, int) or self.threshold_tokens < 1:
            raise ValueError(f"threshold_tokens must be a positive int, got {self.threshold_tokens!r}")
        if not isinstance(self.keep_last_turns, int) or self.keep_last_turns < 1:
            raise ValueError(f"keep_last_turns must be an int >= 1, got {self.keep_last_turns!r}")
        if not isinstance(self.stub_chars, int) or self.stub_chars < 0:
            raise ValueError(f"stub_chars must be an int >= 0, got {self.stub_chars!r}")

    def compact(self, messages: list[dict], count: Count, n_tokens: int | None = None) -> list[dict]:
        """``messages`` if they fit (same object: nothing to re-render), else a compacted copy.

        ``count`` gives the exact token count of a message list as the model would see it; ``n_tokens``, when
        the caller already knows the current count, saves one render.
        """
        limit = self.threshold_tokens
        if (n_tokens if n_tokens is not None else count(messages)) <= limit:
            return messages
        head, units = units_of(messages)
        m = len(units)
        old = list(range(max(0, m - self.keep_last_turns)))
        recent = list(range(len(old), max(len(old), m - 1)))
        actions = [(i, 1) for i in old] + [(i, 2) for i in old] + [(i, 1) for i in recent] + [(i, 2) for i in recent]
        if m:  # the last unit goes last: stubbed, and dropped only when nothing else is left to remove
            actions += [(m - 1, 1), (m - 1, 2)]
        # a stub is shorter in characters but can take more tokens (a note replacing a short, repetitive output):
        # a unit whose stub does not count fewer tokens stays as it is, so that no stub adds tokens
        stubbed = [stub_unit(u, self.stub_chars) for u in units]
        stubbed = [s if count(s) < count(u) else u for s, u in zip(stubbed, units)]
        # how many original messages dropping a unit removes: an earlier compaction's marker stands for its count
        removed = [_marker_count(u[0]) if _is_marker(u[0]) else len(u) for u in units]

        def build(level: int) -> list[dict]:
            state = [0] * m
            for i, s in actions[:level]:
                state[i] = s
            out = list(head)
            dropped = sum(removed[i] for i in range(m) if state[i] == 2)
            if dropped:
                out.append({"role": "user", "content": MARKER.format(n=dropped)})
            for i in range(m):
                if state[i] == 0:
                    out.extend(units[i])
                elif state[i] == 1:
                    out.extend(stubbed[i])
            return out

        # The count falls with the level except where the first drop adds the marker message (it can cost more
        # than the unit it replaces): the levels before that drop and the levels from it on are each monotone, so
        # the smallest level that fits is searched for in the first run, then in the second.
        first_drop = next(n for n, (_, s) in enumerate(actions, 1) if s == 2) if actions else 1
        for lo, hi in ((1, first_drop - 1), (first_drop, len(actions))):
            if lo > hi or count(build(hi)) > limit:
                continue
            while lo < hi:  # smallest level that fits
                mid = (lo + hi) // 2
                if count(build(mid)) <= limit:
                    hi = mid
                else:
                    lo = mid + 1
            return build(lo)
        base = build(len(actions))
        for include_system in (False, True):
            longest = max((len(_text(x)) for x in base), default=0)
            if count(cut_text(base, 0, include_system)) <= limit:
                lo, hi = 0, longest
                while lo < hi:  # the largest cap that fits
                    mid = (lo + hi + 1) // 2
                    if count(cut_text(base, mid, include_system)) <= limit:
                        lo = mid
                    else:
                        hi = mid - 1
                return cut_text(base, lo, include_system)
        # not even an empty conversation fits: the threshold is below the tool list itself (a config error the
        # harness reports at construction); return the smallest form
        return cut_text(base, 0, True)
