"""Incremental detokenization for streaming: each call returns only text that can no longer
change, so a stream never carries half of a multi-byte UTF-8 character, and never carries the
start of a stop string that is trimmed from the final text."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Decodes a growing list of token ids.

    Text is decoded over a short window of recent ids (`prefix_offset`..end) and compared
    with the window's previously decoded text, so tokenizers whose pieces depend on their
    neighbours (SentencePiece leading spaces, byte fallback) still produce the right delta.
    A delta ending in U+FFFD is held back: the bytes of the last character may be incomplete
    (byte-level and HF byte-fallback tokenizers both decode an incomplete tail to U+FFFD).
    `finish()` flushes whatever is held; the concatenation of everything returned equals
    `tokenizer.decode(all_ids)` cut before the first stop string.
    """

    def __init__(
        self,
        tokenizer,
        skip_special_tokens: bool = True,
        stop: Sequence[str] | str | None = None,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        if isinstance(stop, str):
            stop = [stop]
        self.stop = [s for s in (stop or []) if s]
        self.ids: list[int] = []
        self.prefix_offset = 0  # window start: ids before it are already emitted
        self.read_offset = 0  # ids before it are decoded into `_pending` or emitted text
        self._pending = ""  # decoded text held back because it may begin a stop string
        self.text = ""  # everything returned so far
        self.matched_stop: str | None = None

    @property
    def stopped(self) -> bool:
        return self.matched_stop is not None

    def add(self, new_ids: Iterable[int]) -> str:
        """Append token ids; return the newly completed text (possibly "")."""
        self.ids.extend(int(i) for i in new_ids)
        if self.stopped:
            return ""
        return self._emit(self._decode_delta(final=False), final=False)

    def finish(self) -> str:
        """The request ended: flush held-back text (an incomplete tail decodes to U+FFFD)."""
        if self.stopped:
            return ""
        return self._emit(self._decode_delta(final=True), final=True)

    def _decode_delta(self, final: bool) -> str:
        if self.read_offset == len(self.ids):
            return ""
        decode = self.tokenizer.decode
        prefix_text = decode(
            self.ids[self.prefix_offset : self.read_offset],
            skip_special_tokens=self.skip_special_tokens,
        )
        new_text = decode(self.ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if not final and (len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR)):
            return ""  # nothing complete yet: keep the window and wait for more bytes
        # The window ends on a complete character here, so it is a safe place to restart.
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return new_text[len(prefix_text) :]

    def _emit(self, delta: str, final: bool) -> str:
        pending = self._pending + delta
        if not self.stop:
            self._pending = ""
            self.text += pending
            return pending
        cut = min((i for i in (pending.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.matched_stop = min(
                (s for s in self.stop if pending.find(s) == cut), key=len
            )
            out, self._pending = pending[:cut], ""
        elif final:
            out, self._pending = pending, ""
        else:
            hold = _longest_stop_prefix_suffix(pending, self.stop)
            out, self._pending = pending[: len(pending) - hold], pending[len(pending) - hold :]
        self.text += out
        return out


def _longest_stop_prefix_suffix(text: str, stops: Sequence[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some stop string:
    that much must be held back, since the next token may complete the stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best
