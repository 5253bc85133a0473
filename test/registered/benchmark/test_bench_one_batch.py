"""bench_one_batch on CPU (dsv4-tiny, a world of one): --profile-kernels lists the largest
ops of one eager step under each row, in the table and in the result."""

from __future__ import annotations

from sglang.bench_one_batch import main

SMALL = ["--model-path", "dsv4-tiny", "--device", "cpu", "--num-tokens", "8", "--iters", "1", "--repeats", "1",
         "--warmup", "1", "--prefix", "64", "--max-chunk", "32", "--context-length", "512", "--skip-ideal"]


def test_profile_kernels_lists_the_largest_ops_of_each_row(capfd):
    # every op (not a top 4): which op ranks where is timing, and timing moves with machine load
    result = main([*SMALL, "--modes", "extend", "decode", "--profile-kernels", "100000"])
    out = capfd.readouterr().out
    assert [r["mode"] for r in result["rows"]] == ["extend", "decode"]
    for row in result["rows"]:
        prof = row["kernels"]
        assert prof["kind"] == "CPU ops" and len(prof["top"]) > 4
        ms = [k["ms"] for k in prof["top"]]
        assert ms == sorted(ms, reverse=True) and ms[-1] > 0
        assert prof["num_kernels"] >= sum(k["calls"] for k in prof["top"]) > 0
        assert abs(prof["top"][0]["share"] - ms[0] / prof["total_ms"]) < 1e-9
        # the attention core is one op per layer (4 layers), with its own time
        assert any(k["name"] == "sglang::deepseek_v4_attention_with_output" and k["calls"] == 4
                   for k in prof["top"]), prof
        assert f"{row['mode']} 8, one eager step: {prof['num_kernels']} CPU ops" in out
        # every op of the step in launch order, each with its own time (the result file's layer lists)
        assert len(prof["sequence_us"]) == prof["num_kernels"] and all(us > 0 for _, us in prof["sequence_us"])
    graph = result["rows"][1]["graph_kernels"]  # decode rows: one graph replay too (the emulator's on CPU)
    assert graph["num_kernels"] > 0 and "decode 8, one graph replay" in out
    assert "graph_kernels" not in result["rows"][0]


def test_without_the_flag_no_profile_is_taken(capfd):
    result = main([*SMALL, "--modes", "extend"])
    assert "kernels" not in result["rows"][0]
    assert "one eager step" not in capfd.readouterr().out
