"""A chat completion's generated text in OpenAI's shapes: reasoning (`reasoning_content`),
content and `tool_calls`, whole or as stream deltas. The same parser serves both, so a stream's
deltas always add up to the non-streamed message."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sglang.srt.parsers import ReasoningParser, ToolCall, ToolCallParser


@dataclass(frozen=True)
class ChatOutputSpec:
    """How one request's output is read. `thinking`: the prompt ended with `<think>`.
    `forced_prefix`: text appended to the prompt to start a tool call (tool_choice required
    or a named function)."""

    thinking: bool = False
    parse_reasoning: bool = False
    parse_tools: bool = False
    forced_prefix: str = ""


class ChatOutputParser:
    def __init__(self, spec: ChatOutputSpec):
        self.spec = spec
        self._reasoning = ReasoningParser(spec.thinking) if spec.parse_reasoning else None
        self._tools = ToolCallParser(spec.forced_prefix) if spec.parse_tools else None
        self.calls: list[tuple[str, ToolCall]] = []  # (id, call)

    def feed(self, text: str) -> list[dict]:
        """Stream deltas (`delta` objects) for newly generated text."""
        reasoning, content = self._reasoning.feed(text) if self._reasoning else ("", text)
        return self._deltas(reasoning, content, final=False)

    def finish(self) -> list[dict]:
        reasoning, content = self._reasoning.finish() if self._reasoning else ("", "")
        return self._deltas(reasoning, content, final=True)

    def message(self, text: str) -> dict:
        """The non-streamed assistant message of the whole generated text."""
        deltas = self.feed(text) + self.finish()
        reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
        content = "".join(d.get("content", "") for d in deltas)
        msg: dict = {"role": "assistant", "content": content}
        if self.spec.parse_reasoning:
            msg["reasoning_content"] = reasoning if self.spec.thinking else None
        if self.calls:
            msg["tool_calls"] = [{"id": cid, "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments_json()}}
                                 for cid, c in self.calls]
        if not content and (self.calls or reasoning):
            msg["content"] = None
        return msg

    def finish_reason(self, reason: str | None) -> str | None:
        """A generation that stopped after complete tool calls finished to call them."""
        return "tool_calls" if reason == "stop" and self.calls else reason

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict]:
        deltas = []
        if reasoning:
            deltas.append({"reasoning_content": reasoning})
        calls: list[ToolCall] = []
        if self._tools is not None:
            content, calls = self._tools.feed(content)
            if final:
                content += self._tools.finish()
        if content:
            deltas.append({"content": content})
        for call in calls:
            index, cid = len(self.calls), f"call_{uuid.uuid4().hex[:24]}"
            self.calls.append((cid, call))
            deltas.append({"tool_calls": [{"index": index, "id": cid, "type": "function",
                                           "function": {"name": call.name, "arguments": ""}}]})
            deltas.extend({"tool_calls": [{"index": index, "function": {"arguments": frag}}]}
                          for frag in call.argument_fragments())
        return deltas
