"""Byte-level tokenizer for the built-in presets: random weights need no learned vocabulary,
and every UTF-8 text round-trips through it exactly.

Id layout (the first 265 ids; any model vocab of at least 265 fits, dsv4-tiny has 512):

    id        token                          role
    0         <｜begin▁of▁sentence｜>        BOS (as in the DeepSeek-V4 release)
    1         <｜end▁of▁sentence｜>          EOS (as in the DeepSeek-V4 release)
    2         <｜▁pad▁｜>                    PAD
    3..258    the bytes 0x00..0xFF           id = byte + 3
    259       <｜User｜>                     chat-template markers (chat_template.py)
    260       <｜Assistant｜>
    261       <think>
    262       </think>
    263       <｜latest_reminder｜>
    264       <｜action｜>
    265..V-1   <｜reserved_{id}｜>            unused by text; a random-weight model may still
                                             sample them, so they decode like special tokens

Special tokens written literally in the input text encode to their ids; everything else is
encoded as its UTF-8 bytes. `<think>` and `</think>` are single ids but text, not special, as
DeepSeek's released vocabularies mark them: decoding keeps them even when it skips special
tokens, so a reasoning parser sees where the reasoning ends.
"""

from __future__ import annotations

import re

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
PAD_TOKEN = "<｜▁pad▁｜>"
BYTE_OFFSET = 3
NUM_BYTES = 256
CHAT_SPECIAL_TOKENS = (
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜latest_reminder｜>",
    "<｜action｜>",
)
TEXT_MARKERS = ("<think>", "</think>")
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)
FIRST_CHAT_SPECIAL_ID = BYTE_OFFSET + NUM_BYTES  # 259
MIN_VOCAB_SIZE = FIRST_CHAT_SPECIAL_ID + len(CHAT_SPECIAL_TOKENS)  # 265


class ByteTokenizer:
    """Tokenizer with the fixed id layout in the module docstring."""

    bos_token_id = 0
    eos_token_id = 1
    pad_token_id = 2

    def __init__(self, vocab_size: int = 512):
        if vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"the byte tokenizer needs a vocab of at least {MIN_VOCAB_SIZE} ids, "
                f"the model has {vocab_size}"
            )
        self.vocab_size = vocab_size
        named = list(SPECIAL_TOKENS) + [None] * NUM_BYTES + list(CHAT_SPECIAL_TOKENS)
        self._special_to_id = {tok: i for i, tok in enumerate(named) if tok is not None}
        # Longest first, so a marker that is a prefix of another never wins the match.
        alternatives = sorted(self._special_to_id, key=len, reverse=True)
        self._special_re = re.compile("|".join(re.escape(t) for t in alternatives))
        self._text_marker_ids = frozenset(self._special_to_id[t] for t in TEXT_MARKERS)

    # ---- ids <-> tokens -----------------------------------------------------------------

    def is_special(self, token_id: int) -> bool:
        return not (BYTE_OFFSET <= token_id < BYTE_OFFSET + NUM_BYTES)

    def id_to_token(self, token_id: int) -> str:
        self._check_id(token_id)
        if token_id < BYTE_OFFSET:
            return SPECIAL_TOKENS[token_id]
        if token_id < FIRST_CHAT_SPECIAL_ID:
            return f"<0x{token_id - BYTE_OFFSET:02X}>"  # byte-fallback spelling, as in HF vocabs
        if token_id < MIN_VOCAB_SIZE:
            return CHAT_SPECIAL_TOKENS[token_id - FIRST_CHAT_SPECIAL_ID]
        return f"<｜reserved_{token_id}｜>"

    def token_to_id(self, token: str) -> int | None:
        return self._special_to_id.get(token)

    # ---- text <-> ids -------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes as ids; literal special tokens as their ids. `add_special_tokens`
        prepends BOS unless the text already starts with it (as HF post-processors do)."""
        ids: list[int] = []
        pos = 0
        for m in self._special_re.finditer(text):
            ids.extend(b + BYTE_OFFSET for b in text[pos : m.start()].encode("utf-8"))
            ids.append(self._special_to_id[m.group()])
            pos = m.end()
        ids.extend(b + BYTE_OFFSET for b in text[pos:].encode("utf-8"))
        if add_special_tokens and (not ids or ids[0] != self.bos_token_id):
            ids.insert(0, self.bos_token_id)
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        """Bytes are joined and decoded as UTF-8 (invalid sequences become U+FFFD); special
        ids are dropped, or spelled out when `skip_special_tokens` is False (the text markers
        always are)."""
        parts: list[str] = []
        buf = bytearray()
        for token_id in ids:
            token_id = int(token_id)
            self._check_id(token_id)
            if not self.is_special(token_id):
                buf.append(token_id - BYTE_OFFSET)
                continue
            if skip_special_tokens and token_id not in self._text_marker_ids:
                continue
            # A special token ends the byte run: bytes never merge across it.
            parts.append(buf.decode("utf-8", errors="replace"))
            buf.clear()
            parts.append(self.id_to_token(token_id))
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise ValueError(f"token id {token_id} is outside the vocab [0, {self.vocab_size})")
