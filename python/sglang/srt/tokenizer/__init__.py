"""Tokenizers: a Hugging Face tokenizer.json when the checkpoint has one, else the byte-level
tokenizer (presets); plus incremental detokenization and the DSV4 chat encoding."""

from __future__ import annotations

import logging
import os

from sglang.srt.tokenizer.byte_tokenizer import ByteTokenizer
from sglang.srt.tokenizer.chat_template import apply_chat_template, encode_messages
from sglang.srt.tokenizer.detokenizer import IncrementalDetokenizer
from sglang.srt.tokenizer.hf_tokenizer import HFTokenizer

logger = logging.getLogger(__name__)

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "IncrementalDetokenizer",
    "apply_chat_template",
    "encode_messages",
    "get_tokenizer",
]


def _find_tokenizer_json(path: str) -> str | None:
    if os.path.isfile(path) and path.endswith(".json"):
        return path
    candidate = os.path.join(path, "tokenizer.json")
    return candidate if os.path.isfile(candidate) else None


def get_tokenizer(model_path: str, tokenizer_path: str | None = None):
    """`tokenizer_path` (a tokenizer.json or a directory holding one) wins; else the model
    directory's tokenizer.json; else the byte tokenizer sized to the model's vocab."""
    if tokenizer_path:
        found = _find_tokenizer_json(tokenizer_path)
        if found is None:
            raise ValueError(f"no tokenizer.json at tokenizer path {tokenizer_path!r}")
        return HFTokenizer(found)
    if os.path.isdir(model_path):
        found = _find_tokenizer_json(model_path)
        if found is not None:
            return HFTokenizer(found)
    from sglang.srt.configs.loader import load_model_config

    vocab_size = load_model_config(model_path).vocab_size
    if os.path.isdir(model_path):
        logger.warning("%s has no tokenizer.json: using the byte-level tokenizer", model_path)
    return ByteTokenizer(vocab_size)
