"""Incremental execution is exact: on dsv4-tiny (window 8, index top-4, ratios [0, 4, 128, 4]),
one full prefill, chunked prefill (uneven chunks, boundaries on and next to c4 / c128 block
ends) and token-by-token decode give the same logits, and a request's logits do not depend
on the other requests sharing its batch."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dsv4_harness import Session, prefill_in_chunks, run_step  # noqa: E402

from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402

SEQ_LEN = 300  # window 8 wraps ~37 times, c128 blocks 0 and 1 complete, up to 75 c4 candidates
ATOL = 1e-4


def _tokens(n: int, seed: int) -> list:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(2, 512, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def runner():
    return ModelRunner(cpu_server_args(model_path="dsv4-tiny", dtype="float32", device="cpu",
                                       context_length=512, max_total_tokens=4096, max_running_requests=8))


@pytest.fixture(scope="module")
def tokens():
    return _tokens(SEQ_LEN, seed=1234)


@pytest.fixture(scope="module")
def decode_logits(runner, tokens):
    """Logits after each token when the sequence is fed one token per forward: [SEQ_LEN, vocab]."""
    return torch.stack(prefill_in_chunks(runner, tokens, [1]))


@pytest.fixture(scope="module")
def full_prefill(runner, tokens):
    s = Session(runner)
    out = run_step(runner, [s], [tokens], return_all_logits=True)
    s.release()
    return out


def test_the_sequence_exercises_every_attention_path(runner, tokens):
    c = runner.config
    assert c.sliding_window < SEQ_LEN // 4
    assert SEQ_LEN // 128 >= 2
    assert c.index_topk < SEQ_LEN // 4  # c4 selection is truly sparse at the end
    assert [c.layer_compress_ratio(i) for i in range(c.num_hidden_layers)] == [0, 4, 128, 4]


def test_full_prefill_last_token_matches_token_by_token_decode(full_prefill, decode_logits):
    last = full_prefill.next_token_logits[0]
    assert last.shape == (512,)
    assert last.std() > 0.1  # not degenerate
    torch.testing.assert_close(last, decode_logits[-1], atol=ATOL, rtol=0)


def test_full_prefill_all_token_logits_match_decode_at_every_position(full_prefill, decode_logits):
    all_logits = full_prefill.all_logits
    assert all_logits.shape == (SEQ_LEN, 512)
    torch.testing.assert_close(all_logits[-1], full_prefill.next_token_logits[0], atol=0, rtol=0)
    # A few positions singled out (block ends and their neighbours), then every position.
    for p in (0, 3, 4, 7, 8, 126, 127, 128, 255, 256, SEQ_LEN - 1):
        torch.testing.assert_close(all_logits[p], decode_logits[p], atol=ATOL, rtol=0, msg=f"position {p}")
    torch.testing.assert_close(all_logits, decode_logits, atol=ATOL, rtol=0)


# Chunk sizes; the prefix length at each chunk boundary is listed on the right.
CHUNKINGS = {
    # 4, 7, 8 (c4 ends and neighbours), 127, 128, 129 (c128 block 0), 255, 256 (block 1)
    "c4_and_c128_block_ends": [4, 3, 1, 119, 1, 1, 126, 1, 44],
    # 37, 128, 129, 255, 300: a long chunk ending exactly on a c128 block end
    "uneven_long": [37, 91, 1, 126, 45],
    # 5, 16, 66, 129, 130, 256, 257: just past the block ends, c4 ends at 16
    "just_past_block_ends": [5, 11, 50, 63, 1, 126, 1, 43],
    # 1, 2, 3, 4, 5 then 127-token chunks: 132, 259, (chunk ends at 300)
    "tiny_then_big": [1, 1, 1, 1, 1, 127, 127, 41],
}


@pytest.mark.parametrize("name", sorted(CHUNKINGS))
def test_chunked_prefill_matches_decode_after_every_chunk(runner, tokens, decode_logits, name):
    sizes = CHUNKINGS[name]
    assert sum(sizes) == SEQ_LEN
    per_chunk = prefill_in_chunks(runner, tokens, sizes)
    ends = torch.tensor(sizes).cumsum(0) - 1
    assert len(per_chunk) == len(sizes)
    for end, logits in zip(ends.tolist(), per_chunk):
        torch.testing.assert_close(logits, decode_logits[end], atol=ATOL, rtol=0, msg=f"chunk ending at {end}")


def test_chunked_prefill_then_decode_matches_full_prefill_then_decode(runner, tokens, decode_logits):
    """The state a chunked prefill leaves behind (ring state, compressed entries) carries on."""
    s = Session(runner)
    got = []
    for lo, hi in ((0, 128), (128, 250)):
        got.append(run_step(runner, [s], [tokens[lo:hi]]).next_token_logits[0])
    for t in tokens[250:]:
        got.append(run_step(runner, [s], [[t]]).next_token_logits[0])
    s.release()
    expect = torch.cat([decode_logits[[127, 249]], decode_logits[250:]])
    torch.testing.assert_close(torch.stack(got), expect, atol=ATOL, rtol=0)


def _solo(runner, tokens, sizes):
    """Logits after each chunk with the request alone in its batches."""
    return prefill_in_chunks(runner, tokens, sizes)


def test_batch_independence_of_a_request_sharing_batches_with_others(runner, tokens, decode_logits):
    """Target T runs the same chunks alone and inside batches with other requests: some
    prefilling (shorter and longer than T), some decoding, one that leaves and one that
    reuses its freed slot mid-way. T's logits must not move."""
    t_sizes = [100, 100, 90] + [1] * 10
    solo = torch.stack(_solo(runner, tokens, t_sizes))

    other_a = _tokens(420, seed=7)  # longer than T: widens every candidate list of the batch
    other_b = _tokens(60, seed=8)  # prefilled first, then decodes next to T
    other_c = _tokens(40, seed=9)  # starts later, in the slot other_a leaves behind

    a_ref = torch.stack(_solo(runner, other_a, [150, 270]))
    b_ref = torch.stack(_solo(runner, other_b, [57] + [1] * 3))
    c_ref = torch.stack(_solo(runner, other_c[:10], [5, 1, 1, 1, 1, 1]))

    T, A, B = Session(runner), Session(runner), Session(runner)
    run_step(runner, [B], [other_b[:57]])
    got, got_a, got_b, got_c = [], [], [], []

    # step 1: three prefills of different lengths (EXTEND)
    out = run_step(runner, [T, A], [tokens[:100], other_a[:150]], mode=ForwardMode.EXTEND)
    got.append(out.next_token_logits[0]); got_a.append(out.next_token_logits[1])  # noqa: E702
    # step 2: T and A prefill, B decodes (MIXED)
    out = run_step(runner, [T, A, B], [tokens[100:200], other_a[150:420], [other_b[57]]], mode=ForwardMode.MIXED)
    got.append(out.next_token_logits[0]); got_a.append(out.next_token_logits[1])  # noqa: E702
    got_b.append(out.next_token_logits[2])
    A.release()
    C = Session(runner)  # reuses A's freed request slot and pages
    # step 3: T prefills its last chunk next to C's first chunk and B's decode
    out = run_step(runner, [T, C, B], [tokens[200:290], other_c[:5], [other_b[58]]], mode=ForwardMode.MIXED)
    got.append(out.next_token_logits[0]); got_c.append(out.next_token_logits[1])  # noqa: E702
    got_b.append(out.next_token_logits[2])
    # steps 4..: T decodes; B and C decode alongside for a while, then T is alone
    for i, t in enumerate(tokens[290:]):
        sess, chunks = [T], [[t]]
        if i < 5:
            sess.append(C); chunks.append([other_c[5 + i]])  # noqa: E702
        if i < 1:
            sess.append(B); chunks.append([other_b[59]])  # noqa: E702
        out = run_step(runner, sess, chunks, mode=ForwardMode.DECODE)
        got.append(out.next_token_logits[0])
        if i < 5:
            got_c.append(out.next_token_logits[1])
        if i < 1:
            got_b.append(out.next_token_logits[2])
    for s in (T, B, C):
        s.release()

    torch.testing.assert_close(torch.stack(got), solo, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.stack(got_a), a_ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.stack(got_b), b_ref[1:], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.stack(got_c), c_ref, atol=1e-5, rtol=0)
    # and the solo run itself is the token-by-token result at the same positions
    ends = (torch.tensor(t_sizes).cumsum(0) - 1).tolist()
    torch.testing.assert_close(solo, decode_logits[ends], atol=ATOL, rtol=0)
