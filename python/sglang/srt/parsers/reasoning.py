"""DeepSeek-V4 reasoning: in thinking mode the generation prompt ends with `<think>`, so the
model writes its reasoning first and closes it with `</think>`; everything after is the answer.
`ReasoningParser` splits a stream of text deltas into (reasoning, content) deltas."""

from __future__ import annotations

from sglang.srt.tokenizer.chat_template import THINK_END, THINK_START


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: that much
    must wait for the next delta, which may complete the marker."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class ReasoningParser:
    """One request's reasoning split. `thinking`: the prompt ended with `<think>`. Outside
    thinking mode every delta is content. A reasoning cut off before `</think>` (max_tokens)
    stays reasoning; a `<think>` the model repeats at the very start is dropped."""

    def __init__(self, thinking: bool):
        self.in_reasoning = thinking
        self._at_start = thinking
        self._held = ""

    def feed(self, delta: str) -> tuple[str, str]:
        if not self.in_reasoning:
            return "", delta
        text = self._held + delta
        self._held = ""
        if self._at_start:
            if len(text) < len(THINK_START) and THINK_START.startswith(text):
                self._held = text
                return "", ""
            self._at_start = False
            if text.startswith(THINK_START):
                text = text[len(THINK_START):]
        end = text.find(THINK_END)
        if end >= 0:
            self.in_reasoning = False
            return text[:end], text[end + len(THINK_END):]
        hold = held_prefix(text, THINK_END)
        self._held = text[len(text) - hold:]
        return text[: len(text) - hold], ""

    def finish(self) -> tuple[str, str]:
        """The request ended: text held back was never a marker."""
        held, self._held = self._held, ""
        return (held, "") if self.in_reasoning else ("", held)
