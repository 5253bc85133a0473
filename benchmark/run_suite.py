"""Runs the benchmark suites of benchmark/suites.toml, one item after another.

    python benchmark/run_suite.py --list                    # suites and their items
    python benchmark/run_suite.py one-batch-bcg serving     # run suites
    python benchmark/run_suite.py flash-dp2 --only one_batch one_batch_decode
    python benchmark/run_suite.py release-format --dry-run  # print the commands only

An item is a shell command with a timeout in seconds. It runs from the repository root in a
process group of its own, so that on timeout or Ctrl-C the whole group (the item and every
process it started: servers, ranks, compilers) is killed. Its stdout and stderr go to
`<results>/<suite>/<item>.log`; the files it writes go under `$OUT`, which the driver sets to
`<results>/<suite>/<item>/`. `<results>` is `benchmark/results/<date>_<gpu>_<commit>` (e.g.
`2026-12-02_h200_abc1234`, `2xh200` for two GPUs, `cpu` without one) unless --results-dir says
otherwise. After each item `<results>/<suite>/summary.json` is rewritten with every item run so
far: rc (null when skipped), seconds, whether it timed out, and the declared outputs found.

Item keys: command (required), timeout (seconds, required), outputs (paths under $OUT), env
(extra environment), gpus (the least number of visible GPUs; fewer and the item is skipped).
A suite may carry `env` and `about` too. The environment always has PYTHONPATH with python/
and sgl-kernel/python in front, PYTHONUNBUFFERED=1 and NCCL_NVLS_ENABLE=0.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SUITES = REPO / "benchmark" / "suites.toml"
ITEM_KEYS = {"command", "timeout", "outputs", "env", "gpus"}
SUITE_KEYS = {"about", "env"}
KILL_GRACE_S = 5.0


def load_suites(path: Path = SUITES) -> dict[str, dict]:
    """The suites of a TOML file, each {"about", "env", "items": [{"name", "command", ...}]},
    in file order. Raises ValueError on an item without a command or a timeout, or with keys
    the driver does not know (a typo would otherwise be silently ignored)."""
    data = tomllib.loads(Path(path).read_text())
    suites = {}
    for name, suite in data.items():
        items = []
        for item_name, item in suite.items():
            if item_name in SUITE_KEYS:
                continue
            if not isinstance(item, dict):
                raise ValueError(f"{path}: {name}.{item_name} is neither an item table nor one of "
                                 f"{sorted(SUITE_KEYS)}")
            unknown = set(item) - ITEM_KEYS
            if unknown or "command" not in item or "timeout" not in item:
                raise ValueError(f"{path}: item {name}.{item_name} needs command and timeout "
                                 f"and knows only {sorted(ITEM_KEYS)} (unknown: {sorted(unknown)})")
            items.append(dict(item, name=item_name))
        suites[name] = {"about": suite.get("about", ""), "env": suite.get("env", {}), "items": items}
    return suites


def gpu_names() -> list[str]:
    """The visible GPUs' names from nvidia-smi ([] without one); honours CUDA_VISIBLE_DEVICES."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index,name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    rows = [line.split(",", 1) for line in out.stdout.splitlines() if "," in line]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        keep = {v.strip() for v in visible.split(",") if v.strip()}
        rows = [r for r in rows if r[0].strip() in keep]
    return [r[1].strip() for r in rows]


def gpu_label(names: list[str]) -> str:
    """'h200' for one NVIDIA H200, '2xh200' for two, 'cpu' for none."""
    if not names:
        return "cpu"
    short = re.sub(r"[^a-z0-9]+", "-", names[0].lower().replace("nvidia", "")).strip("-") or "gpu"
    return short if len(names) == 1 else f"{len(names)}x{short}"


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "nogit"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "nogit"


def default_results_dir(names: list[str]) -> Path:
    today = datetime.date.today().isoformat()
    return REPO / "benchmark" / "results" / f"{today}_{gpu_label(names)}_{git_commit()}"


def item_env(suite: dict, item: dict, out_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(REPO / "python"), str(REPO / "sgl-kernel" / "python")]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env.update(PYTHONPATH=os.pathsep.join(paths), PYTHONUNBUFFERED="1", NCCL_NVLS_ENABLE="0")
    env.update({k: str(v) for k, v in suite["env"].items()})
    env.update({k: str(v) for k, v in item.get("env", {}).items()})
    env["OUT"] = str(out_dir)
    return env


def _kill_group(proc: subprocess.Popen) -> None:
    """TERM the item's process group (the item and every process it started, by the group's
    id, which is the item's pid), then KILL whatever is left after a grace period."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + KILL_GRACE_S
    while time.monotonic() < deadline:
        proc.poll()  # reap the leader, or it stays in the group as a zombie
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.05)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def run_item(suite: dict, item: dict, suite_dir: Path) -> dict:
    """Runs one item; returns its summary row. Ctrl-C kills the item's group and re-raises."""
    out_dir = suite_dir / item["name"]
    out_dir.mkdir(parents=True, exist_ok=True)
    log_path = suite_dir / f"{item['name']}.log"
    start = time.monotonic()
    timed_out = False
    with open(log_path, "w") as log:
        log.write(f"$ {item['command']}\n")
        log.flush()
        proc = subprocess.Popen(["bash", "-c", item["command"]], cwd=REPO, env=item_env(suite, item, out_dir),
                                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=item["timeout"])
            # an item's leftover background processes (a server it forgot) die with it
            _kill_group(proc)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            rc = proc.returncode
        except KeyboardInterrupt:
            _kill_group(proc)
            raise
    outputs = {o: (out_dir / o).exists() for o in item.get("outputs", [])}
    return {"item": item["name"], "rc": rc, "seconds": round(time.monotonic() - start, 2),
            "timed_out": timed_out, "log": str(log_path), "outputs": outputs}


def run_suite(name: str, suite: dict, results_dir: Path, only: list[str] | None, num_gpus: int) -> dict:
    suite_dir = results_dir / name
    suite_dir.mkdir(parents=True, exist_ok=True)
    summary = {"suite": name, "results_dir": str(results_dir), "started": datetime.datetime.now().isoformat(
        timespec="seconds"), "items": []}

    def write():
        (suite_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")

    for item in suite["items"]:
        if only and item["name"] not in only:
            continue
        need = int(item.get("gpus", 0))
        if need > num_gpus:
            row = {"item": item["name"], "rc": None, "seconds": 0.0, "timed_out": False,
                   "skipped": f"needs {need} GPUs, {num_gpus} visible", "outputs": {}}
            print(f"== {name}/{item['name']}: skipped ({row['skipped']})", flush=True)
        else:
            print(f"== {name}/{item['name']} (at most {item['timeout']} s)", flush=True)
            try:
                row = run_item(suite, item, suite_dir)
            except KeyboardInterrupt:
                summary["items"].append({"item": item["name"], "rc": None, "interrupted": True})
                write()
                raise
            missing = [o for o, found in row["outputs"].items() if not found]
            print(f"   rc {row['rc']}{' (timed out)' if row['timed_out'] else ''} in {row['seconds']} s"
                  f"{'; missing outputs ' + ', '.join(missing) if missing else ''}; log {row['log']}", flush=True)
        summary["items"].append(row)
        write()
    write()
    return summary


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def print_list(suites: dict[str, dict]) -> None:
    for name, suite in suites.items():
        print(f"{name}: {suite['about']}")
        for item in suite["items"]:
            gpus = f", {item['gpus']} GPUs" if item.get("gpus") else ""
            print(f"  {item['name']} ({item['timeout']} s{gpus})")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("suites", nargs="*", help="suites to run, in this order")
    ap.add_argument("--list", action="store_true", help="print every suite and its items")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--only", nargs="+", default=None, help="run only these items of the suites")
    ap.add_argument("--suites-file", type=Path, default=SUITES)
    ap.add_argument("--results-dir", type=Path, default=None,
                    help="default: benchmark/results/<date>_<gpu>_<commit>")
    args = ap.parse_args(argv)
    suites = load_suites(args.suites_file)
    if args.list:
        print_list(suites)
        return 0
    if not args.suites:
        ap.error("name a suite (--list shows them)")
    unknown = [s for s in args.suites if s not in suites]
    if unknown:
        ap.error(f"unknown suites {unknown}; known: {list(suites)}")
    if args.only:
        known = {i["name"] for s in args.suites for i in suites[s]["items"]}
        if set(args.only) - known:
            ap.error(f"unknown items {sorted(set(args.only) - known)}")
    if args.dry_run:
        for name in args.suites:
            for item in suites[name]["items"]:
                if not args.only or item["name"] in args.only:
                    env = {**suites[name]["env"], **item.get("env", {})}
                    prefix = " ".join(f"{k}={v}" for k, v in env.items())
                    print(f"# {name}/{item['name']} (timeout {item['timeout']} s)")
                    print(f"{prefix + ' ' if prefix else ''}{item['command']}")
        return 0
    names = gpu_names()
    results_dir = args.results_dir or default_results_dir(names)
    failed = []
    # A killed or interrupted driver takes its item along. SIGINT is installed explicitly: a driver
    # started in the background of a non-interactive shell inherits SIGINT as ignored.
    previous = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for name in args.suites:
            summary = run_suite(name, suites[name], results_dir, args.only, len(names))
            failed += [f"{name}/{r['item']}" for r in summary["items"] if r.get("rc") not in (0, None)]
    except KeyboardInterrupt:
        print(f"interrupted; results so far under {results_dir}")
        return 130
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(f"results under {results_dir}" + (f"; failed: {' '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
