"""benchmark/accuracy/greedy_agreement.py: collect against a real server (its top-2 logprobs per step),
and compare's first divergences with their near-tie call."""

import json
import subprocess
import sys

import pytest

from sglang.test.repo_scripts import REPO, load_script


TOOL = REPO / "benchmark" / "accuracy" / "greedy_agreement.py"
greedy_agreement = load_script("benchmark/accuracy/greedy_agreement.py")


def _write(path, outputs, top2=None):
    data = {"seed": 1, "input_len": 4, "outputs": outputs}
    if top2 is not None:
        data["top2"] = top2
    path.write_text(json.dumps(data))
    return str(path)


def test_compare_finds_first_divergences_and_calls_near_ties(tmp_path):
    a = [[5, 6, 7], [1, 2, 3], [9, 9, 9]]
    b = [[5, 6, 7], [1, 2, 4], [8, 9, 9]]
    top2_a = [[[[-0.1, 5], [-3.0, 1]]] * 3,
              [[[-0.5, 1], [-2.0, 0]], [[-0.5, 2], [-2.0, 0]], [[-0.70, 3], [-0.71, 4]]],  # gap 0.01 at step 2
              [[[-0.2, 9], [-1.4, 8]]] * 3]  # gap 1.2 at step 0
    top2_b = [[[[-0.1, 5], [-3.0, 1]]] * 3,
              [[[-0.5, 1], [-2.0, 0]], [[-0.5, 2], [-2.0, 0]], [[-0.69, 4], [-0.70, 3]]],
              [[[-0.3, 8], [-1.2, 9]]] * 3]
    got = greedy_agreement.compare(_write(tmp_path / "a.json", a, top2_a), _write(tmp_path / "b.json", b, top2_b))
    assert got["identical"] == 1 and got["first_divergence_steps"] == [0, 2]
    first, second = got["divergences"]
    assert first["step"] == 0 and first["near_tie"] is False and first["gap_a"] == pytest.approx(1.2)
    assert second["step"] == 2 and second["near_tie"] is True and second["gap_a"] == pytest.approx(0.01)
    assert (got["near_ties"], got["not_near_ties"]) == (1, 1)


def test_compare_of_files_without_logprobs_leaves_the_call_open(tmp_path):
    got = greedy_agreement.compare(_write(tmp_path / "a.json", [[1, 2]]), _write(tmp_path / "b.json", [[1, 3]]))
    assert got["first_divergence_steps"] == [1] and got["divergences"][0]["near_tie"] is None


def test_collect_against_a_server_records_ids_and_top2(tmp_path, tiny_server):
    out = tmp_path / "run.json"
    for path in (out, tmp_path / "again.json"):
        subprocess.run([sys.executable, str(TOOL), "collect", "--port",
                        str(tiny_server.port), "--num", "3", "--input-len", "8", "--output-len", "4",
                        "--out", str(path)], check=True, timeout=120)
    data = json.loads(out.read_text())
    assert len(data["outputs"]) == 3 and all(len(o) == 4 for o in data["outputs"])
    for ids, top2 in zip(data["outputs"], data["top2"]):
        assert [step[0][1] for step in top2] == ids  # greedy: the top-1 token is the output
        assert all(step[0][0] >= step[1][0] for step in top2)
    same = greedy_agreement.compare(str(out), str(tmp_path / "again.json"))
    assert same["identical"] == 3
