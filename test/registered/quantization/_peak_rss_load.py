"""Run as a subprocess by test_release_format_loader.py: loads a checkpoint into a model built
from its config and prints (as JSON) the peak growth of anonymous resident memory during the
load, sampled as each tensor is read (while it is alive) and by a 1 ms sampling thread."""

import json
import sys
import threading
import time

import torch


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no RssAnon in /proc/self/status")


def main(ckpt: str) -> None:
    import dsv4_kernels.quant_reference  # noqa: F401  (imported before the baseline)
    from sglang.srt.configs.loader import load_model_config
    from sglang.srt.model_loader.safetensors_io import load_checkpoint
    from sglang.srt.models.deepseek_v4 import DeepseekV4ForCausalLM

    torch.set_num_threads(1)
    model = DeepseekV4ForCausalLM(load_model_config(ckpt), torch.float32, max_positions=64)
    with torch.no_grad():  # touch every parameter page now, so the baseline already holds them
        for p in list(model.parameters()) + list(model.buffers()):
            p.view(torch.uint8).zero_() if p.element_size() == 1 else p.zero_()
    largest, n_keys = [0], [0]
    base = rss_anon()
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_anon())
            time.sleep(0.001)

    def on_tensor(key, t):
        largest[0] = max(largest[0], t.numel() * t.element_size())
        n_keys[0] += 1
        peak[0] = max(peak[0], rss_anon())

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    load_checkpoint(model, ckpt, on_tensor=on_tensor)
    stop.set()
    thread.join()
    print(json.dumps({"peak_growth": peak[0] - base, "largest_tensor": largest[0], "n_keys": n_keys[0]}))


if __name__ == "__main__":
    main(sys.argv[1])
