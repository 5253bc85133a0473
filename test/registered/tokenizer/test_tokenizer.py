"""Tokenizers: the byte-level id layout and round trip, HF tokenizer.json loading, streaming
detokenization that never splits a UTF-8 character, and the DSV4 chat encoding reproducing
the release's reference prompts."""

import json
import random

import pytest

from sglang.srt.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    IncrementalDetokenizer,
    apply_chat_template,
    encode_messages,
    get_tokenizer,
)

BOS, EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"
MIXED_TEXT = "héllo, 世界! 🎉 ok"  # 1-, 2-, 3- and 4-byte UTF-8 characters


# ---- byte tokenizer -----------------------------------------------------------------------


def test_byte_tokenizer_id_layout():
    tok = ByteTokenizer(512)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.vocab_size) == (0, 1, 2, 512)
    assert tok.encode("A") == [0x41 + 3]
    assert tok.encode("é") == [0xC3 + 3, 0xA9 + 3]
    assert tok.id_to_token(0) == BOS and tok.id_to_token(1) == EOS
    assert tok.id_to_token(3) == "<0x00>" and tok.id_to_token(258) == "<0xFF>"
    assert [tok.id_to_token(i) for i in range(259, 265)] == [
        "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜latest_reminder｜>", "<｜action｜>",
    ]
    assert tok.id_to_token(300) == "<｜reserved_300｜>"


def test_byte_tokenizer_round_trips_multibyte_text():
    tok = ByteTokenizer(512)
    ids = tok.encode(MIXED_TEXT)
    assert len(ids) == len(MIXED_TEXT.encode("utf-8")) == 23
    assert all(3 <= i < 259 for i in ids)
    assert tok.decode(ids) == MIXED_TEXT


def test_byte_tokenizer_specials_in_text_map_to_their_ids():
    tok = ByteTokenizer(512)
    text = f"{BOS}<｜User｜>hi<｜Assistant｜><think>x</think>{EOS}"
    ids = tok.encode(text)
    assert ids == [0, 259, 104 + 3, 105 + 3, 260, 261, 120 + 3, 262, 1]
    # The think markers are text (not special) in the release's vocabulary: kept when skipping.
    assert tok.decode(ids) == "hi<think>x</think>"
    assert tok.decode(ids, skip_special_tokens=False) == text
    assert tok.encode("hi", add_special_tokens=True) == [0, 107, 108]
    assert tok.encode(BOS + "hi", add_special_tokens=True) == [0, 107, 108]  # no second BOS


def test_byte_tokenizer_invalid_utf8_and_bad_ids():
    tok = ByteTokenizer(512)
    assert tok.decode([0xFF + 3, 0x41 + 3]) == "\ufffdA"
    assert tok.decode([0xE4 + 3, 0xB8 + 3]) == "\ufffd"  # a truncated 3-byte character
    assert tok.decode([300, 0x41 + 3, 511]) == "A"  # reserved ids decode like specials
    with pytest.raises(ValueError, match="outside the vocab"):
        tok.decode([512])
    with pytest.raises(ValueError, match="at least 265"):
        ByteTokenizer(264)


def test_get_tokenizer_for_a_preset_is_the_byte_tokenizer():
    tok = get_tokenizer("dsv4-tiny")
    assert isinstance(tok, ByteTokenizer) and tok.vocab_size == 512


# ---- incremental detokenization ----------------------------------------------------------


def _stream(tok, ids, **kwargs):
    detok = IncrementalDetokenizer(tok, **kwargs)
    chunks = [detok.add([i]) for i in ids]
    chunks.append(detok.finish())
    return detok, chunks


def test_stream_one_token_at_a_time_never_splits_a_character():
    tok = ByteTokenizer(512)
    _, chunks = _stream(tok, tok.encode(MIXED_TEXT))
    assert "".join(chunks) == MIXED_TEXT
    assert not any("\ufffd" in c for c in chunks)
    # The 4-byte emoji arrives as one chunk, after its last byte.
    assert "🎉" in chunks
    assert chunks[:3] == ["h", "", "é"]


def test_stream_of_random_ids_concatenates_to_the_full_decode():
    # Random ids: invalid byte runs, specials and reserved ids mixed in, as a random-weight
    # model produces.
    tok = ByteTokenizer(512)
    rng = random.Random(0)
    for _ in range(200):
        ids = [rng.randrange(512) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            _, chunks = _stream(tok, ids, skip_special_tokens=skip)
            assert "".join(chunks) == tok.decode(ids, skip_special_tokens=skip)


def test_stream_cuts_before_a_stop_string_and_never_emits_its_start():
    tok = ByteTokenizer(512)
    detok, chunks = _stream(tok, tok.encode("Hello world. Bye"), stop=["world", "zz"])
    assert "".join(chunks) == "Hello " == detok.text
    assert detok.matched_stop == "world"
    assert not any("w" in c for c in chunks)
    # A stop-string prefix that never completes is released at the end.
    detok, chunks = _stream(tok, tok.encode("a w b w"), stop=["wx"])
    assert "".join(chunks) == "a w b w" and detok.matched_stop is None


# ---- Hugging Face tokenizer.json ---------------------------------------------------------


def _write_byte_level_bpe(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        special_tokens=[BOS, EOS, "<｜User｜>", "<｜Assistant｜>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(["hello world, hello there"] * 20, trainer)
    tok.save(str(directory / "tokenizer.json"))
    added_eos = {"__type": "AddedToken", "content": EOS, "lstrip": False}
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": added_eos})
    )


def _write_byte_fallback_bpe(directory):
    # SentencePiece-style: "▁" for spaces, unknown characters fall back to <0xNN> tokens.
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<unk>": 0, BOS: 1, EOS: 2}
    vocab.update({f"<0x{b:02X}>": 3 + b for b in range(256)})
    for piece in ["▁", "h", "i", "▁h", "▁hi"]:
        vocab[piece] = len(vocab)
    merges = [("▁", "h"), ("▁h", "i")]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    tok.add_special_tokens([BOS, EOS])
    tok.save(str(directory / "tokenizer.json"))
    (directory / "config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": [2]}))


def test_hf_tokenizer_from_model_directory(tmp_path):
    _write_byte_level_bpe(tmp_path)
    tok = get_tokenizer(str(tmp_path))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)  # from tokenizer_config.json
    ids = tok.encode(f"<｜User｜>hello {MIXED_TEXT}")
    assert ids[0] == 2  # the added marker matched as one token
    assert tok.decode(ids) == f"hello {MIXED_TEXT}"
    _, chunks = _stream(tok, ids)
    assert "".join(chunks) == f"hello {MIXED_TEXT}"
    assert not any("\ufffd" in c for c in chunks)


def test_hf_byte_fallback_stream_and_tokenizer_path_override(tmp_path):
    _write_byte_fallback_bpe(tmp_path)
    # --tokenizer-path wins over the model path (a preset here).
    tok = get_tokenizer("dsv4-tiny", tokenizer_path=str(tmp_path / "tokenizer.json"))
    assert isinstance(tok, HFTokenizer)
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)  # from config.json
    text = "hi 世界 hi 🎉"
    ids = tok.encode(text)
    assert tok.id_to_token(ids[-1]) == "<0x89>"  # the emoji's last byte is a fallback token
    assert tok.decode(ids) == text
    _, chunks = _stream(tok, ids)
    assert "".join(chunks) == text
    assert not any("\ufffd" in c for c in chunks)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        get_tokenizer("dsv4-tiny", tokenizer_path=str(tmp_path / "missing"))


# ---- chat encoding ------------------------------------------------------------------------


def _load_case(reference_dir, n):
    data = json.loads((reference_dir / "chat-encoding" / f"messages_{n}.json").read_text("utf-8"))
    expected = (reference_dir / "chat-encoding" / f"prompt_{n}.txt").read_text("utf-8")
    if isinstance(data, dict):
        return data["messages"], data.get("tools"), expected
    return data, None, expected


def test_chat_encoding_reproduces_reference_case_2_exactly(dsv4_reference_dir):
    messages, tools, expected = _load_case(dsv4_reference_dir, 2)
    assert encode_messages(messages, tools) == expected


@pytest.mark.parametrize("case", [1, 3, 4])
def test_chat_encoding_reproduces_tool_and_extra_role_cases(dsv4_reference_dir, case):
    messages, tools, expected = _load_case(dsv4_reference_dir, case)
    assert encode_messages(messages, tools) == expected


def test_chat_prompt_through_the_byte_tokenizer_uses_marker_ids(dsv4_reference_dir):
    messages, _, expected = _load_case(dsv4_reference_dir, 2)
    tok = ByteTokenizer(512)
    ids = apply_chat_template(tok, messages)
    assert ids[0] == 0 and ids[-1] == 1
    assert (ids.count(259), ids.count(260), ids.count(261), ids.count(262)) == (2, 2, 1, 2)
    assert tok.decode(ids, skip_special_tokens=False) == expected


def test_generation_prompt_ends_with_the_assistant_marker():
    messages = [{"role": "user", "content": "Hi"}]
    assert encode_messages(messages) == f"{BOS}<｜User｜>Hi<｜Assistant｜></think>"
    assert encode_messages(messages, thinking=True) == f"{BOS}<｜User｜>Hi<｜Assistant｜><think>"
    with_parts = [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]
    assert encode_messages(with_parts) == encode_messages(messages)


def test_unsupported_chat_features_raise_not_implemented():
    tool_turn = {"role": "tool", "content": "1"}
    call = {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]}
    user = {"role": "user", "content": "q"}
    with pytest.raises(NotImplementedError, match="consecutive tool messages"):
        encode_messages([user, call, tool_turn, tool_turn])
    with pytest.raises(NotImplementedError, match="'narrator'"):
        encode_messages([{"role": "narrator", "content": "x"}])
    with pytest.raises(NotImplementedError, match="image_url"):
        encode_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}])
    with pytest.raises(ValueError, match="non-empty list"):
        encode_messages([])
