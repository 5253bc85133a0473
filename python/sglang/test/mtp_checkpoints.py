"""A checkpoint with two chained MTP modules for tests: DeepSeek's conformance checkpoint (one
module, `mtp.0`) plus `mtp.1`, built from its ratio-4 decoder layer 1 and `mtp.0`'s own
projections, norms and hc head, so the second module has compressor and indexer rings."""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file

# what an MTP module has besides a decoder layer's weights
_MTP_OWN = ("e_proj.", "enorm.", "h_proj.", "hnorm.", "norm.", "hc_head_")


def write_two_module_checkpoint(source: Path, out: Path, layer: int = 1) -> Path:
    """`source`'s config and tensors with a second MTP module made from decoder layer `layer`
    (compress ratio appended to compress_ratios), written to the directory `out`."""
    source, out = Path(source), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((source / "config.json").read_text())
    if config.get("num_nextn_predict_layers") != 1:
        raise ValueError(f"{source}: expected a checkpoint with one MTP module")
    config["num_nextn_predict_layers"] = 2
    config["compress_ratios"] = config["compress_ratios"] + [config["compress_ratios"][layer]]
    (out / "config.json").write_text(json.dumps(config))
    with safe_open(str(source / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    prefix = f"layers.{layer}."
    for key in list(tensors):
        if key.startswith(prefix):
            tensors["mtp.1." + key.removeprefix(prefix)] = tensors[key].clone()
        elif key.startswith("mtp.0.") and key.removeprefix("mtp.0.").startswith(_MTP_OWN):
            tensors["mtp.1." + key.removeprefix("mtp.0.")] = tensors[key].clone()
    save_file(tensors, str(out / "model.safetensors"))
    return out
