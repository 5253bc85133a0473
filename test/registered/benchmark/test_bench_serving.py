"""sglang.bench_serving against a real (tiny, CPU) server: every request completes, the
percentiles are ordered, and --output-file / --tag record the run."""

import json
import subprocess
import sys


def test_bench_serving_records_a_tagged_run_of_completed_requests(tmp_path, tiny_server):
    out = tmp_path / "serving.jsonl"
    for tag in ("first", "second"):
        run = subprocess.run([sys.executable, "-m", "sglang.bench_serving", "--port", str(tiny_server.port),
                              "--num-prompts", "4", "--max-concurrency", "2", "--random-input-len", "8",
                              "--random-output-len", "5", "--tag", tag, "--output-file", str(out)],
                             capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stdout + run.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["args"]["tag"] for line in lines] == ["first", "second"]
    for m in lines:
        assert (m["completed"], m["failed"], m["total_output_tokens"]) == (4, 0, 20)
        assert m["args"]["max_concurrency"] == 2 and m["request_throughput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_latency_ms"):
            s = m[key]
            assert 0 < s["p50"] <= s["p90"] <= s["p99"], (key, s)
        assert m["e2e_latency_ms"]["p50"] >= m["ttft_ms"]["p50"]
