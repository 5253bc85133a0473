"""Soak a running server with abusive mixed traffic and watch whether anything leaks.

    python -m sglang.launch_server --model-path dsv4-tiny --device cpu &
    python -m sglang.bench_soak --url http://127.0.0.1:30000 --duration-s 3600 --out soak.json

Clients loop over a mix: native and OpenAI requests, streamed and not, stop strings, clients
that disconnect mid-stream, aborts by rid, oversized or malformed prompts (which must get a
4xx). Every `--sample-every-s` the server's own counters (KV pages and request slots in use,
queued and running requests, per DP rank) and the server's process tree (RSS, threads, open
files) are sampled. The report compares the first sample after `--warmup-s` with the last one
taken once traffic stopped and the server went idle: a server that leaks shows growth there.
Responses >= 500 and unexpected statuses are counted by kind.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import threading
import time
from pathlib import Path

import requests

from sglang.test.server_process import descendant_pids

CHAT = "/v1/chat/completions"


def process_tree_usage(root_pid: int) -> dict:
    """RSS (MiB), threads and open file descriptors summed over `root_pid` and its descendants."""
    rss_kib = threads = fds = 0
    for pid in [root_pid, *descendant_pids(root_pid)]:
        try:
            status = Path(f"/proc/{pid}/status").read_text()
            fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
            rss_kib += int(fields.get("VmRSS", "0 kB").split()[0])
            threads += int(fields["Threads"])
            fds += len(os.listdir(f"/proc/{pid}/fd"))
        except (OSError, KeyError, ValueError):
            continue
    return {"rss_mib": rss_kib / 1024, "threads": threads, "open_fds": fds}


def server_usage(url: str) -> dict:
    """KV pages and request slots requests hold, queued and running requests, summed over DP
    ranks; pages only the prefix cache holds (free on demand) count apart as kv_pages_cached."""
    info = requests.get(url + "/get_server_info", timeout=30).json()
    ranks = info.get("dp_rank_stats") or [info["scheduler_stats"]]
    total = collections.Counter()
    for r in ranks:
        cached = r.get("num_evictable_pages", 0)
        total["kv_pages_used"] += r["num_total_pages"] - r["num_free_pages"] - cached
        total["kv_pages_cached"] += cached
        total["req_slots_used"] += r["num_total_req_slots"] - r["num_free_req_slots"]
        total["running"] += r["num_running_reqs"]
        total["waiting"] += r["num_waiting_reqs"]
    return dict(total)


class Traffic:
    """The request mix; each call sends one request and returns its outcome's kind."""

    def __init__(self, url: str, context_length: int, max_new_tokens: int, rng: random.Random):
        self.url, self.context_length, self.max_new_tokens, self.rng = url, context_length, max_new_tokens, rng
        self.session = requests.Session()

    def one(self) -> str:
        kind = self.rng.choice(["generate", "generate_stream", "chat", "chat_stream", "stop", "disconnect",
                                "abort", "oversized", "malformed"])
        try:
            return kind + ":" + getattr(self, "_" + kind)()
        except requests.RequestException as e:
            return f"{kind}:client error {type(e).__name__}"

    def _params(self) -> dict:
        return {"max_new_tokens": self.rng.randint(1, self.max_new_tokens), "temperature": self.rng.choice([0, 0.8])}

    def _text(self) -> str:
        return " ".join(self.rng.choice(["soak", "the", "server", "ünï", "数据", "42"]) for _ in range(self.rng.randint(1, 40)))

    def _status(self, r) -> str:
        return str(r.status_code)

    def _generate(self) -> str:
        return self._status(self.session.post(self.url + "/generate", json={"text": self._text(), "sampling_params": self._params()}, timeout=300))

    def _generate_stream(self) -> str:
        with self.session.post(self.url + "/generate", json={"text": self._text(), "stream": True,
                                                            "sampling_params": self._params()}, stream=True, timeout=300) as r:
            lines = [line for line in r.iter_lines() if line]
            return self._status(r) + ("" if not lines or lines[-1] == b"data: [DONE]" else " unterminated")

    def _chat(self, stream: bool = False) -> str:
        body = {"messages": [{"role": "user", "content": self._text()}], "max_tokens": self._params()["max_new_tokens"],
                "stream": stream}
        with self.session.post(self.url + CHAT, json=body, stream=stream, timeout=300) as r:
            if stream:
                list(r.iter_lines())
            return self._status(r)

    def _chat_stream(self) -> str:
        return self._chat(stream=True)

    def _stop(self) -> str:
        params = dict(self._params(), stop=[self.rng.choice(["a", "e", " ", "\u00e9"])], max_new_tokens=self.max_new_tokens)
        return self._status(self.session.post(self.url + "/generate", json={"text": self._text(), "sampling_params": params}, timeout=300))

    def _disconnect(self) -> str:
        # A fresh connection, closed after the first event: the server must abort the request.
        with requests.post(self.url + "/generate", json={"text": self._text(), "stream": True,
                                                          "sampling_params": dict(self._params(), max_new_tokens=self.max_new_tokens, ignore_eos=True)},
                           stream=True, timeout=300) as r:
            next(r.iter_lines(), None)
            return self._status(r)

    def _abort(self) -> str:
        # The native API aborts by closing the stream; a rid reused while in flight must be refused.
        rid = f"soak-{self.rng.getrandbits(48):x}"
        body = {"text": self._text(), "rid": rid, "stream": True,
                "sampling_params": dict(self._params(), max_new_tokens=self.max_new_tokens, ignore_eos=True)}
        with requests.post(self.url + "/generate", json=body, stream=True, timeout=300) as r:
            next(r.iter_lines(), None)
            dup = self.session.post(self.url + "/generate", json=dict(body, stream=False), timeout=300)
            return f"{r.status_code}/dup {dup.status_code}"

    def _oversized(self) -> str:
        body = {"input_ids": [5] * (self.context_length + self.rng.randint(1, 64)), "sampling_params": {"max_new_tokens": 4}}
        return self._status(self.session.post(self.url + "/generate", json=body, timeout=300))

    def _malformed(self) -> str:
        data = self.rng.choice([b"{", b"[]", b'{"text": 5}', b'{"messages": "x"}', b'{"input_ids": [-1]}'])
        path = self.rng.choice(["/generate", CHAT])
        return self._status(self.session.post(self.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=300))


# What each kind may answer; anything else (and every 5xx) is a failure.
ALLOWED = {"generate": {"200"}, "generate_stream": {"200"}, "chat": {"200"}, "chat_stream": {"200"}, "stop": {"200"},
           "disconnect": {"200"}, "abort": {"200/dup 200", "200/dup 400"}, "oversized": {"400"}, "malformed": {"400"}}


def unexpected(outcome: str) -> bool:
    kind, result = outcome.split(":", 1)
    return result not in ALLOWED[kind]


def soak(url: str, server_pid: int | None, duration_s: float, concurrency: int, sample_every_s: float,
         warmup_s: float, max_new_tokens: int, seed: int = 0, idle_timeout_s: float = 120) -> dict:
    info = requests.get(url + "/get_server_info", timeout=30).json()
    context_length = info["context_length"]
    counts, stop = collections.Counter(), threading.Event()
    lock = threading.Lock()

    def client(i: int):
        traffic = Traffic(url, context_length, max_new_tokens, random.Random(seed * 1000 + i))
        while not stop.is_set():
            outcome = traffic.one()
            with lock:
                counts[outcome] += 1

    def sample(t0: float) -> dict:
        s = {"t_s": round(time.monotonic() - t0, 1), **server_usage(url)}
        if server_pid is not None:
            s.update(process_tree_usage(server_pid))
        return s

    t0 = time.monotonic()
    samples = [sample(t0)]
    threads = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(concurrency)]
    for t in threads:
        t.start()
    while time.monotonic() - t0 < duration_s:
        time.sleep(min(sample_every_s, max(0.0, duration_s - (time.monotonic() - t0))))
        samples.append(sample(t0))
    stop.set()
    for t in threads:
        t.join(timeout=600)
    deadline = time.monotonic() + idle_timeout_s  # let aborted / disconnected requests drain
    while time.monotonic() < deadline:
        idle = sample(t0)
        if idle["running"] == 0 and idle["waiting"] == 0 and idle["kv_pages_used"] == 0:
            break
        time.sleep(0.5)
    after_warmup = next((s for s in samples if s["t_s"] >= warmup_s), samples[-1])
    bad = {k: v for k, v in counts.items() if unexpected(k)}
    return {"url": url, "duration_s": duration_s, "concurrency": concurrency, "requests": sum(counts.values()),
            "outcomes": dict(sorted(counts.items())), "unexpected": bad,
            "server_errors": sum(v for k, v in counts.items() if k.split(":", 1)[1][:1] == "5"),
            "after_warmup": after_warmup, "idle_at_end": idle, "samples": samples}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:30000", help="the server to soak")
    p.add_argument("--server-pid", type=int, default=None,
                   help="the server's pid, to sample RSS / threads / open files of its process tree (Linux)")
    p.add_argument("--duration-s", type=float, default=3600.0, help="how long traffic runs")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent client loops")
    p.add_argument("--sample-every-s", type=float, default=10.0, help="seconds between samples")
    p.add_argument("--warmup-s", type=float, default=300.0, help="growth is measured from the first sample after this")
    p.add_argument("--max-new-tokens", type=int, default=64, help="largest max_new_tokens a request asks for")
    p.add_argument("--seed", type=int, default=0, help="traffic seed")
    p.add_argument("--out", default=None, help="write the JSON report here")
    args = p.parse_args(argv)
    report = soak(args.url, args.server_pid, args.duration_s, args.concurrency, args.sample_every_s, args.warmup_s,
                  args.max_new_tokens, args.seed)
    start, end = report["after_warmup"], report["idle_at_end"]
    print(f"{report['requests']} requests in {args.duration_s:.0f} s, {report['server_errors']} responses >= 500, "
          f"unexpected: {report['unexpected'] or 'none'}")
    for key in ("kv_pages_used", "kv_pages_cached", "req_slots_used", "running", "waiting", "rss_mib", "threads", "open_fds"):
        if key in start:
            print(f"  {key:15s} after warm-up {start[key]:10.1f}   idle at end {end.get(key, float('nan')):10.1f}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 1 if report["server_errors"] or report["unexpected"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
