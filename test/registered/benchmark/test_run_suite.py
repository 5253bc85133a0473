"""benchmark/run_suite.py and benchmark/suites.toml: the suites parse and name files that exist;
the driver runs a suite's items in order with a log each and a summary, kills an item's whole
process group on timeout, skips items needing more GPUs than it sees, and lists / prints."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sglang.test.repo_scripts import REPO, load_script

run_suite = load_script("benchmark/run_suite.py")

PY = shlex.quote(sys.executable)
REPO_PATH = re.compile(r"^(benchmark|sgl-kernel|test|python)/[^\s$]*$")


def _repo_paths(command: str) -> list[str]:
    """The repository paths a command names (pytest node ids cut at '::')."""
    return [tok.split("::")[0] for tok in shlex.split(command) if REPO_PATH.match(tok.split("::")[0])]


def test_every_suite_parses_and_names_files_that_exist():
    suites = run_suite.load_suites()
    for name in ("one-batch-bcg", "flash-one-gpu", "flash-dp2", "serving", "overlap", "release-format",
                 "gpu-tests", "moe-backends", "moe-tiles", "kernels"):
        assert suites[name]["items"], name
    checked = 0
    for name, suite in suites.items():
        assert suite["about"], name
        for item in suite["items"]:
            assert item["timeout"] > 0, (name, item["name"])
            paths = _repo_paths(item["command"])
            missing = [p for p in paths if not (REPO / p).exists()]
            assert not missing, (name, item["name"], missing)
            checked += len(paths)
    assert checked > 50  # the path pattern does match the commands' files


def test_a_misspelt_item_key_is_an_error(tmp_path):
    path = tmp_path / "suites.toml"
    path.write_text('[s]\nabout = "x"\n[s.a]\ncommand = "true"\ntimeout = 5\noutput = ["typo"]\n')
    with pytest.raises(ValueError, match="unknown: \\['output'\\]"):
        run_suite.load_suites(path)


def _write_suite(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "suites.toml"
    path.write_text(body)
    return path


def test_a_tiny_suite_runs_in_order_with_logs_and_summary(tmp_path):
    write = "import os; open(os.path.join(os.environ['OUT'], 'made.txt'), 'w').write(os.environ['GREETING'])"
    suites = _write_suite(tmp_path, f'''
[tiny]
about = "a suite for the test"
env = {{ GREETING = "hello" }}

[tiny.first]
command = "{PY} -c \\"{write}; print('first ran')\\""
timeout = 60
outputs = ["made.txt", "never.txt"]

[tiny.second]
command = "echo second ran; echo on stderr >&2; exit 3"
timeout = 60

[tiny.too_many_gpus]
command = "echo must not run"
timeout = 60
gpus = 99
''')
    results = tmp_path / "results"
    rc = run_suite.main(["tiny", "--suites-file", str(suites), "--results-dir", str(results)])
    assert rc == 1  # an item failed
    summary = json.loads((results / "tiny" / "summary.json").read_text())
    rows = {r["item"]: r for r in summary["items"]}
    assert [r["item"] for r in summary["items"]] == ["first", "second", "too_many_gpus"]
    assert rows["first"]["rc"] == 0 and rows["first"]["outputs"] == {"made.txt": True, "never.txt": False}
    assert rows["second"]["rc"] == 3 and not rows["second"]["timed_out"]
    assert rows["too_many_gpus"]["rc"] is None and "needs 99 GPUs" in rows["too_many_gpus"]["skipped"]
    assert (results / "tiny" / "first" / "made.txt").read_text() == "hello"
    assert "first ran" in (results / "tiny" / "first.log").read_text()
    second_log = (results / "tiny" / "second.log").read_text()
    assert "second ran" in second_log and "on stderr" in second_log
    assert not (results / "tiny" / "too_many_gpus.log").exists()


def _gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether pid exits (or is only a zombie waiting for its reaper) within the time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except FileNotFoundError:
            return True
        if re.search(r"^State:\s+Z", status, re.M):
            return True
        time.sleep(0.1)
    return False


@pytest.mark.parametrize("leaves_it", [False, True], ids=["timeout", "left-behind"])
def test_the_items_process_group_is_killed(tmp_path, leaves_it):
    # The item starts a grandchild that sleeps for a minute: on timeout (the item waits for it)
    # or when the item exits leaving it behind (a server it forgot), the driver kills it.
    spawn = ("import os, subprocess, sys; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "open(os.path.join(os.environ['OUT'], 'pid'), 'w').write(str(p.pid))")
    tail = "" if leaves_it else "; p.wait()"
    suites = _write_suite(tmp_path, f'''
[hang]
about = "a grandchild that outlives its budget"

[hang.sleeper]
command = "{PY} -c \\"{spawn}{tail}\\""
timeout = {30 if leaves_it else 3}
''')
    results = tmp_path / "results"
    start = time.monotonic()
    run_suite.main(["hang", "--suites-file", str(suites), "--results-dir", str(results)])
    assert time.monotonic() - start < 25
    row = json.loads((results / "hang" / "summary.json").read_text())["items"][0]
    assert row["timed_out"] is (not leaves_it)
    assert row["rc"] == (0 if leaves_it else -15)
    pid = int((results / "hang" / "sleeper" / "pid").read_text())
    assert _gone(pid), f"grandchild {pid} survived its item"


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "term"])
def test_an_interrupted_driver_kills_the_running_item(tmp_path, sig):
    spawn = ("import os, subprocess, sys; "
             "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
             "open(os.path.join(os.environ['OUT'], 'pid'), 'w').write(str(p.pid)); p.wait()")
    suites = _write_suite(tmp_path, f'''
[hang]
about = "an item interrupted while it runs"

[hang.sleeper]
command = "{PY} -c \\"{spawn}\\""
timeout = 60

[hang.never]
command = "echo never > $OUT/ran"
timeout = 60
''')
    results = tmp_path / "results"
    driver = subprocess.Popen([sys.executable, str(REPO / "benchmark" / "run_suite.py"), "hang", "--suites-file",
                               str(suites), "--results-dir", str(results)], stdout=subprocess.PIPE, text=True)
    pid_file = results / "hang" / "sleeper" / "pid"
    deadline = time.monotonic() + 30
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.1)
    pid = int(pid_file.read_text())
    driver.send_signal(sig)
    out, _ = driver.communicate(timeout=30)
    assert driver.returncode == 130, out
    assert _gone(pid), f"grandchild {pid} survived the interrupted driver"
    rows = json.loads((results / "hang" / "summary.json").read_text())["items"]
    assert rows == [{"item": "sleeper", "rc": None, "interrupted": True}]
    assert not (results / "hang" / "never").exists()


def test_list_and_dry_run_print_the_suites(tmp_path, capsys):
    suites = _write_suite(tmp_path, '''
[alpha]
about = "measures alpha"
[alpha.one]
command = "echo 1 > $OUT/one.txt"
timeout = 7
[alpha.two]
command = "echo 2"
timeout = 8
gpus = 2
env = { MODE = "bcg" }

[beta]
about = "measures beta"
[beta.only]
command = "echo b"
timeout = 9
''')
    assert run_suite.main(["--list", "--suites-file", str(suites)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "alpha: measures alpha", "  one (7 s)", "  two (8 s, 2 GPUs)", "beta: measures beta", "  only (9 s)"]
    results = tmp_path / "results"
    assert run_suite.main(["alpha", "--dry-run", "--only", "two", "--suites-file", str(suites),
                           "--results-dir", str(results)]) == 0
    assert capsys.readouterr().out.splitlines() == ["# alpha/two (timeout 8 s)", "MODE=bcg echo 2"]
    assert not results.exists()  # a dry run runs nothing


def test_the_results_folder_is_named_by_date_gpu_and_commit():
    assert run_suite.gpu_label([]) == "cpu"
    assert run_suite.gpu_label(["NVIDIA H200"]) == "h200"
    assert run_suite.gpu_label(["NVIDIA H200", "NVIDIA H200"]) == "2xh200"
    name = run_suite.default_results_dir(["NVIDIA H200"]).name
    assert re.fullmatch(r"\d{4}-\d\d-\d\d_h200_([0-9a-f]{7,}|nogit)", name), name


def test_the_driver_sets_the_repository_paths_and_out(tmp_path):
    env = run_suite.item_env({"env": {"A": 1}}, {"env": {"B": "x"}}, tmp_path)
    assert env["PYTHONPATH"].split(os.pathsep)[:2] == [str(REPO / "python"), str(REPO / "sgl-kernel" / "python")]
    assert (env["OUT"], env["A"], env["B"], env["NCCL_NVLS_ENABLE"]) == (str(tmp_path), "1", "x", "0")
