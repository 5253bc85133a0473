"""Conformance with DeepSeek's own V4 reference code: the conformance-tiny checkpoint, loaded
through the normal model-path code, reproduces the logits the release's reference produced
(float32, CPU), with the prompt prefilled whole and in chunks.

The prompt of this case has exact ties in the indexer's top-k (every head relu'd to 0) that
cross the top-k boundary (17 prompt rows in some c4 layer), and every later row depends on
them through the KV cache, so no row is tie-free. DeepSeek's reference breaks those ties as
CPU `torch.topk` does over its row layout; the runtime breaks them by candidate position
(deterministic on every device and width, docs/architecture.md). The exactness tests
therefore run with the reference's tie order (`deepseek_tie_order`): everything but the tie
rule is checked exactly. With the runtime's own rule the argmax differs at rows 6 and 7
only, and chunked prefill agrees with full prefill (no width dependence left).
"""

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dsv4_harness import Session, prefill_in_chunks, run_step  # noqa: E402

from sglang.srt.model_executor.model_runner import ModelRunner  # noqa: E402
from sglang.test.runner_args import cpu_server_args  # noqa: E402

# Full prefill + decode match the reference to ~5e-6. Chunked prefill changes the width of the
# indexer's candidate rows, and with the reference's tie order (torch.topk) the exact ties
# then break differently: row 0 moves by up to ~1e-2.
ATOL_FULL = 1e-3
ATOL_CHUNKED = 2e-2
# Rows whose argmax differs from the reference under the runtime's deterministic tie rule.
TIE_ORDER_ARGMAX_ROWS = [6, 7]


@pytest.fixture
def deepseek_tie_order(monkeypatch):
    """The indexer's top-k with the reference's tie order: CPU torch.topk, same row layout."""
    import dsv4_kernels.reference as kernel_reference

    monkeypatch.setattr(kernel_reference, "topk_indices", lambda score, k: score.topk(k, dim=-1).indices)


@pytest.fixture(scope="module")
def conformance_dir(dsv4_reference_dir):
    return dsv4_reference_dir / "conformance-tiny"


@pytest.fixture(scope="module")
def expected(conformance_dir):
    return load_file(str(conformance_dir / "expected.safetensors"))


@pytest.fixture(scope="module")
def runner(conformance_dir):
    return ModelRunner(cpu_server_args(model_path=str(conformance_dir), context_length=512,
                                       max_total_tokens=2048, dtype="float32", device="cpu"))


def test_expected_file_layout(expected):
    n_prompt = int(expected["n_prompt"][0])
    assert expected["input_ids"].shape == (300,)
    assert expected["logits"].shape == (300 - n_prompt + 1, 512)


def _full_prefill_and_decode(runner, expected):
    ids = expected["input_ids"].tolist()
    n_prompt = int(expected["n_prompt"][0])
    s = Session(runner)
    rows = [run_step(runner, [s], [ids[:n_prompt]]).next_token_logits[0]]
    for k in range(1, expected["logits"].shape[0]):
        rows.append(run_step(runner, [s], [[ids[n_prompt + k - 1]]]).next_token_logits[0])
    s.release()
    return torch.stack(rows)


def test_full_prefill_and_decode_reproduce_every_reference_row(runner, expected, deepseek_tie_order):
    ref = expected["logits"]
    got = _full_prefill_and_decode(runner, expected)
    print(f"conformance-tiny full prefill + decode: max |diff| {(got - ref).abs().max().item():.3e}")
    assert torch.equal(got.argmax(-1), ref.argmax(-1))
    torch.testing.assert_close(got, ref, atol=ATOL_FULL, rtol=0)


@pytest.mark.parametrize("chunk_sizes", [[100], [37, 91]], ids=["chunks_of_100", "chunks_37_91_91_61"])
def test_chunked_prefill_reproduces_row_0(runner, expected, chunk_sizes, deepseek_tie_order):
    ids = expected["input_ids"].tolist()
    n_prompt = int(expected["n_prompt"][0])
    per_chunk = prefill_in_chunks(runner, ids[:n_prompt], chunk_sizes)
    assert len(per_chunk) > 1
    row0 = per_chunk[-1]
    ref = expected["logits"][0]
    print(f"conformance-tiny chunks {chunk_sizes}: max |diff| {(row0 - ref).abs().max().item():.3e}")
    assert row0.argmax() == ref.argmax()
    torch.testing.assert_close(row0, ref, atol=ATOL_CHUNKED, rtol=0)


def test_deterministic_ties_differ_from_the_reference_only_at_the_documented_rows(runner, expected):
    ref = expected["logits"]
    got = _full_prefill_and_decode(runner, expected)
    differs = (got.argmax(-1) != ref.argmax(-1)).nonzero().flatten().tolist()
    print(f"conformance-tiny, deterministic ties: argmax differs at rows {differs}, "
          f"max |diff| {(got - ref).abs().max().item():.3e}")
    assert differs == TIE_ORDER_ARGMAX_ROWS


def test_deterministic_ties_make_chunked_prefill_agree_with_full_prefill(runner, expected):
    """The tie rule no longer depends on the candidate-list width, so chunking only changes
    rounding (with torch.topk's order row 0 moved by ~1e-2)."""
    ids, n_prompt = expected["input_ids"].tolist(), int(expected["n_prompt"][0])
    full = prefill_in_chunks(runner, ids[:n_prompt], [n_prompt])[-1]
    chunked = prefill_in_chunks(runner, ids[:n_prompt], [37, 91])[-1]
    torch.testing.assert_close(chunked, full, atol=1e-4, rtol=0)
