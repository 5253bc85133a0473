"""DeepSeek-V4 tool calls: the model answers a request with `tools` by writing a DSML block
after its (possibly empty) text, the shape the chat template teaches it:

    <｜DSML｜tool_calls>
    <｜DSML｜invoke name="get_weather">
    <｜DSML｜parameter name="location" string="true">Beijing</｜DSML｜parameter>
    <｜DSML｜parameter name="days" string="false">3</｜DSML｜parameter>
    </｜DSML｜invoke>
    </｜DSML｜tool_calls>

`string="true"` values are raw text; `string="false"` values are JSON (a value that does not
parse stays a string rather than losing the call). `ToolCallParser` splits a stream of text
deltas into content and complete calls. A block is held until it closes and is only then
parsed, so text that merely looks like a block, or a block cut off by max_tokens, comes back
unchanged as content: no token is ever lost and no call is ever half-formed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from sglang.srt.parsers.reasoning import held_prefix
from sglang.srt.tokenizer.chat_template import DSML

BLOCK_START = f"<{DSML}tool_calls>"
BLOCK_END = f"</{DSML}tool_calls>"
INVOKE_START = f"<{DSML}invoke"

_INVOKE_RE = re.compile(rf'\s*<{DSML}invoke name="([^"]+)">(.*?)</{DSML}invoke>\s*', re.S)
_PARAM_RE = re.compile(rf'\s*<{DSML}parameter name="([^"]+)" string="(true|false)">(.*?)</{DSML}parameter>\s*', re.S)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict

    def arguments_json(self) -> str:
        return json.dumps(self.arguments, ensure_ascii=False)

    def argument_fragments(self) -> list[str]:
        """`arguments_json()` cut after each parameter, as a stream sends it: the pieces
        concatenate to exactly the non-streamed string."""
        if not self.arguments:
            return ["{}"]
        pieces = [json.dumps({k: v}, ensure_ascii=False)[1:-1] for k, v in self.arguments.items()]
        return ["{" + pieces[0]] + [", " + p for p in pieces[1:]] + ["}"]


def _value(raw: str, is_string: str) -> object:
    if is_string == "true":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _full_matches(pattern: re.Pattern, text: str) -> list[re.Match] | None:
    """Consecutive matches covering all of `text`, or None if anything else is in it."""
    matches, pos = [], 0
    while pos < len(text):
        m = pattern.match(text, pos)
        if m is None or m.end() == pos:
            return None if text[pos:].strip() else matches
        matches.append(m)
        pos = m.end()
    return matches


def parse_block(body: str) -> list[ToolCall] | None:
    """The calls of one block's body (the text between its start and end markers), or None
    when the body is not a well-formed list of at least one invoke."""
    invokes = _full_matches(_INVOKE_RE, body)
    if not invokes:
        return None
    calls = []
    for inv in invokes:
        params = _full_matches(_PARAM_RE, inv.group(2))
        if params is None:
            return None
        calls.append(ToolCall(inv.group(1), {p.group(1): _value(p.group(3), p.group(2)) for p in params}))
    return calls


class ToolCallParser:
    """One request's content/tool-call split over text deltas. `prefix`: text the server
    appended to the prompt to start a call (tool_choice required or a named function); it is
    parsed as if generated and, should the block never close, returned as content with it.

    Whitespace before a block (the template's blank line) and after the last block is not
    content; anywhere else it is kept."""

    def __init__(self, prefix: str = ""):
        self.calls: list[ToolCall] = []
        self._buf = ""
        self._in_block = False
        self._ws = ""  # trailing whitespace of content, held until we know a block does not follow
        self._ws_before_block = ""
        if prefix:
            content, _ = self.feed(prefix)
            if content:
                raise ValueError(f"a forced tool-call prefix must start a block, got {prefix!r}")

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """(content, calls completed by this delta)."""
        self._buf += delta
        out, new = [], []
        while True:
            if not self._in_block:
                i = self._buf.find(BLOCK_START)
                if i < 0:
                    hold = held_prefix(self._buf, BLOCK_START)
                    out.append(self._content(self._buf[: len(self._buf) - hold]))
                    self._buf = self._buf[len(self._buf) - hold:]
                    break
                out.append(self._content(self._buf[:i]))
                self._ws_before_block, self._ws = self._ws, ""
                self._buf = self._buf[i + len(BLOCK_START):]
                self._in_block = True
            j = self._buf.find(BLOCK_END)
            if j < 0:
                break
            body = self._buf[:j]
            self._buf = self._buf[j + len(BLOCK_END):]
            self._in_block = False
            calls = parse_block(body)
            if calls is None:
                out.append(self._ws_before_block + BLOCK_START + body + BLOCK_END)
            else:
                new.extend(calls)
        self.calls.extend(new)
        return "".join(out), new

    def finish(self) -> str:
        """Content still held: a block that never closed, verbatim, or held whitespace."""
        if self._in_block:
            text = self._ws_before_block + BLOCK_START + self._buf
        else:
            text = self._ws + self._buf
            if self.calls and not text.strip():
                text = ""
        self._buf, self._ws, self._in_block = "", "", False
        return text

    def _content(self, text: str) -> str:
        text = self._ws + text
        kept = text.rstrip()
        self._ws = text[len(kept):]
        return kept
