"""`bench_one_batch --dp-size 2` end to end on CPU (2 gloo rank processes, dsv4-tiny): every
row timed on every rank through the real DP step, BCG rows replayed on every rank, the
step's collectives measured (inside the eager step, and alone); a world of one still gives the plain table; failing ranks and
impossible flags are clear errors. The multi_gpu twin runs the same on 2 GPUs (NCCL)."""

from __future__ import annotations

import pytest
import torch

from sglang.bench_one_batch import main

TOKENS = (8, 32)
MODES = ("extend", "mixed")
SMALL = ["--model-path", "dsv4-tiny", "--num-tokens", *map(str, TOKENS), "--modes", *MODES, "--iters", "1",
         "--repeats", "1", "--warmup", "1", "--prefix", "64", "--max-chunk", "32", "--decode-rows", "4",
         "--context-length", "512"]
STEPS_PER_MODE = 1 + 1 * 1  # warmup + repeats * iters


def _table_lines(text: str) -> dict:
    """(mode, tokens) -> the printed row's fields."""
    rows = {}
    for line in text.splitlines():
        f = line.split()
        if len(f) > 2 and f[0] in MODES and f[1].isdigit():
            rows[f[0], int(f[1])] = f
    return rows


def test_dp2_gloo_every_row_on_every_rank_with_comm_share(tmp_path, capfd):
    result_file = tmp_path / "dp.json"
    result = main([*SMALL, "--device", "cpu", "--dp-size", "2", "--result-file", str(result_file)])
    out = capfd.readouterr().out
    assert result["rank_exitcodes"] == [0, 0]
    assert result["dp_size"] == 2
    assert '"dp_size": 2' in result_file.read_text()
    assert [(r["mode"], r["tokens"]) for r in result["rows"]] == [(m, n) for m in MODES for n in TOKENS]
    header = next(line for line in out.splitlines() if line.split()[:2] == ["mode", "tokens"])
    assert header.split()[-8:] == ["comm", "ms", "comm", "%", "xfer", "ms", "xfer", "%"]
    printed = _table_lines(out)
    assert set(printed) == {(m, n) for m in MODES for n in TOKENS}
    for row in result["rows"]:
        # every BCG step of the row replayed the bucket's breakable graph on both ranks
        assert row["graph_replays_by_rank"] == [STEPS_PER_MODE, STEPS_PER_MODE], row
        assert row["breaks"] > 0
        assert row["comm_ms"] > 0 and all(c > 0 for c in row["comm_ms_by_rank"]), row
        assert row["comm_share"] == pytest.approx(row["comm_ms"] / row["eager_ms"])
        assert row["ideal_ms"] > 0 and row["eager_ms"] > 0 and row["bcg_ms"] > 0
        # the same collectives alone, timed on every rank
        assert row["comm_transfer_ms"] > 0 and all(c > 0 for c in row["comm_transfer_ms_by_rank"]), row
        assert row["comm_transfer_share"] == pytest.approx(row["comm_transfer_ms"] / row["eager_ms"])
        fields = printed[row["mode"], row["tokens"]]
        assert float(fields[-4]) == pytest.approx(row["comm_ms"], abs=0.006)
        assert fields[-3] == f"{row['comm_share']:.0%}"
        assert float(fields[-2]) == pytest.approx(row["comm_transfer_ms"], abs=0.006)
        assert fields[-1] == f"{row['comm_transfer_share']:.0%}"


def test_world_of_one_keeps_the_plain_table(capfd):
    result = main([*SMALL, "--device", "cpu", "--num-tokens", "8", "--modes", "extend", "--skip-ideal"])
    out = capfd.readouterr().out
    assert "comm" not in out
    (row,) = result["rows"]
    assert result["dp_size"] == 1 and row["graph_replays_by_rank"] == [STEPS_PER_MODE]
    assert row["ideal_ms"] is None and "comm_ms" not in row
    fields = _table_lines(out)["extend", 8]
    assert fields[4] == "-" and fields[6] == "-" and fields[-1] == "-"  # ideal, bcg/ideal, % limit


def test_a_failing_rank_is_a_clear_error():
    with pytest.raises(RuntimeError, match=r"--dp-size 2 failed \(rank 0: exit 1, rank 1: exit 1\)"):
        main([*SMALL, "--device", "cpu", "--dp-size", "2", "--model-path", "no-such-model"])


def test_more_ranks_than_gpus_is_refused():
    want = max(2, torch.cuda.device_count() + 1)
    with pytest.raises(ValueError, match=f"--dp-size {want} needs {want} GPUs"):
        main([*SMALL, "--device", "cuda", "--dp-size", str(want)])
    with pytest.raises(ValueError, match="pass --device cuda or --device cpu, not 'cuda:1'"):
        main([*SMALL, "--device", "cuda:1", "--dp-size", "2"])


@pytest.mark.multi_gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_dp2_nccl_comm_is_the_nccl_kernels(capfd):
    result = main([*SMALL, "--device", "cuda", "--dp-size", "2", "--num-tokens", "16", "64"])
    out = capfd.readouterr().out
    print(out)
    assert result["rank_exitcodes"] == [0, 0]
    for row in result["rows"]:
        assert row["graph_replays_by_rank"] == [STEPS_PER_MODE, STEPS_PER_MODE], row
        assert row["comm_ms"] > 0 and all(c > 0 for c in row["comm_ms_by_rank"]), row
        assert row["comm_transfer_ms"] > 0, row
        assert row["ideal_ms"] > 0, "the ideal graph (NCCL inside one CUDA graph) did not run"
