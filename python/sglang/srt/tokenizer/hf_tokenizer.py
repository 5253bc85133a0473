"""A Hugging Face `tokenizer.json` (real checkpoints) behind the same small interface as the
byte tokenizer; `tokenizers` is imported only when a checkpoint ships one."""

from __future__ import annotations

import json
import os


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _token_content(entry) -> str | None:
    # tokenizer_config.json spells special tokens either as strings or as AddedToken dicts.
    if isinstance(entry, dict):
        return entry.get("content")
    return entry if isinstance(entry, str) else None


def _first_id(value) -> int | None:
    if isinstance(value, list):
        return value[0] if value else None
    return value if isinstance(value, int) else None


class HFTokenizer:
    """Wraps `tokenizers.Tokenizer`; bos/eos come from tokenizer_config.json, else from
    config.json / generation_config.json next to it."""

    def __init__(self, tokenizer_json: str):
        from tokenizers import Tokenizer

        self.path = tokenizer_json
        self._tok = Tokenizer.from_file(tokenizer_json)
        directory = os.path.dirname(os.path.abspath(tokenizer_json))
        tok_cfg = _read_json(os.path.join(directory, "tokenizer_config.json"))
        model_cfg = _read_json(os.path.join(directory, "config.json"))
        gen_cfg = _read_json(os.path.join(directory, "generation_config.json"))
        self.bos_token_id = self._resolve("bos", tok_cfg, model_cfg, gen_cfg)
        self.eos_token_id = self._resolve("eos", tok_cfg, model_cfg, gen_cfg)
        self.pad_token_id = self._resolve("pad", tok_cfg, model_cfg, gen_cfg)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self._special_ids = {
            i for i, t in self._tok.get_added_tokens_decoder().items() if t.special
        }

    def _resolve(self, kind: str, tok_cfg: dict, model_cfg: dict, gen_cfg: dict) -> int | None:
        content = _token_content(tok_cfg.get(f"{kind}_token"))
        if content is not None:
            token_id = self._tok.token_to_id(content)
            if token_id is not None:
                return token_id
        for cfg in (model_cfg, gen_cfg):
            token_id = _first_id(cfg.get(f"{kind}_token_id"))
            if token_id is not None:
                return token_id
        return None

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_ids

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        # Added tokens (the chat markers) written literally are matched by `tokenizers` itself.
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)
