"""The FP4 routed experts on humming-kernels' indexed GEMMs (W4A8 on FP8 tensor cores under
release numerics, W4A16 under weight-only numerics), Hopper and newer.

Load: the release's tensors go to humming once (prepare): w1 and w3 stacked along N into one
gate/up weight [E, 2I, d/2] (gate rows first), w2 as it is, each with its e8m0 scales, through
humming's mxfp4 schema and layout transform; the packed originals are freed. Nothing is ever
inflated to bf16.

Step (forward), for T tokens, top-k, M = T * top-k assignments:
1. moe_align (sgl-kernel, one kernel at small M): assignment ids grouped by local expert, each
   group padded to the block size of the kernel configuration chosen for this M; the count of
   used rows stays on the device (no host sync).
2. release numerics: x rounded to e4m3 per 128 with power-of-two scales (moe_act.quantize_rows:
   the release's own rounding), handed to humming already quantized, fp32 scales per row. At
   small M steps 1 and 2 are one launch (moe_act.align_and_quantize).
3. gate/up GEMM -> [M, 2I] in the model dtype, rows by assignment.
4. moe_act.swiglu_weight_quant: clamped SwiGLU x routing weight, rounded to the model dtype
   and (release numerics) to e4m3 per 128: one launch.
5. down GEMM -> [M, d] in the model dtype; sum_topk adds each token's k rows in fp32, in
   top-k order, skipping ids outside this rank's experts. When the caller asks (defer_sum: a
   shared expert that sums them itself, inside its down GEMV at a decode row) the rows are
   returned before that sum (dsv4_kernels.moe.RoutedRows).
Numerics against quant_reference.fp4_moe_ref: the same products (e2m1 x e8m0 weights times
e4m3 x 2^k activations, or bf16 ones), fp32 accumulation; the gate/up outputs and each
expert's down output are rounded to the model dtype (the reference keeps fp32 there), the one
difference, within the release-numerics bound of the conformance tests.

Not bit-reproducible: where a configuration uses stream-K (humming's own heuristics do for
the MoE, some tuned rows too), the slices of a tile are added with bf16 atomics in whatever
order they finish, so two calls on the same inputs can differ (after the FP8 rounding between
the GEMMs, by up to 0.16 at Flash's dims on an H100); `--moe-backend triton` repeats exactly.

Kernel configurations come per (GEMM, M range) from a data file for this GPU when one exists
(configs/humming_<gpu>.json, written by sgl-kernel/benchmark/tune_humming_moe.py), else from
humming's own heuristics; every configuration in the list is compiled in `prepare`, so no step
compiles anything.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from sglang.srt.layers.moe.backends.base import Fp4MoEBackend

logger = logging.getLogger(__name__)

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
COMPUTE_CONFIG = json.dumps({"gemm_type": "indexed"})
LOCK_WORDS = 2048  # humming's stream-K lock words per layer (layers may run on other streams)


def device_key(device) -> str:
    """File-name form of the GPU's name: 'NVIDIA H200' -> 'nvidia_h200'."""
    return re.sub(r"[^a-z0-9]+", "_", torch.cuda.get_device_name(device).lower()).strip("_")


def gemm_key(gemm: str, n: int, k: int, n_local: int, n_total: int, fp8: bool) -> str:
    """A tuned list's key in the data file: the GEMM and the shape it was measured at (local of
    total experts: a shard's experts each see more rows per token)."""
    return f"{gemm},n={n},k={k},experts={n_local}/{n_total},act={'fp8' if fp8 else 'bf16'}"


def load_tuned(device) -> dict:
    """This GPU's tuned lists ({gemm_key: [[min_m, max_m, config], ...]}), {} without a file."""
    path = CONFIG_DIR / f"humming_{device_key(device)}.json"
    if not path.is_file():
        return {}
    return json.loads(path.read_text())["configs"]


@dataclass
class _Gemm:
    """One of a layer's two GEMMs as humming runs it: its layer config and tuned list."""
    config: object  # humming LayerConfig
    tuning: list  # [[min_m, max_m, kernel config], ...]
    tuning_str: str

    def block_m(self, m: int) -> int:
        for lo, hi, cfg in self.tuning:
            if lo < m <= hi:
                return int(cfg["block_shape"][0])
        raise ValueError(f"humming MoE: no kernel configuration covers {m} rows "
                         f"(ranges {[(lo, hi) for lo, hi, _ in self.tuning]})")


class HummingFp4MoE(Fp4MoEBackend):
    name = "humming"

    def __init__(self):
        self._tuned: dict | None = None

    def _tuning_for(self, config, key: str, device) -> list:
        from humming.tune import get_heuristics_config

        if self._tuned is None:
            self._tuned = load_tuned(device)
        tuned = self._tuned.get(key)
        if tuned is not None:
            return tuned
        return [list(entry) for entry in get_heuristics_config(config, gemm_type="indexed", device=device)]

    def prepare(self, experts) -> None:
        from humming import dtypes
        from humming.schema import HummingInputSchema
        from humming.schema.mxfp4 import Mxfp4WeightSchema
        from humming.transform import prepare_fp16_e8m0_scale, prepare_layer_config, transform_humming_tensors

        dtype = experts.model_dtype
        device = experts.w1.device
        fp8 = experts.act_quant
        n_local, inter, half_d = experts.w1.shape
        d = half_d * 2
        weight_schema = Mxfp4WeightSchema().to_humming_schema(dtype)
        input_schema = HummingInputSchema(a_dtype=dtypes.float8e4m3, input_scale_group_size=128) if fp8 else None
        gemms = {}
        stacks = {
            "w13": (torch.cat([experts.w1, experts.w3], dim=1), torch.cat([experts.w1_scale, experts.w3_scale], dim=1)),
            "w2": (experts.w2, experts.w2_scale),
        }
        for name in ("w1", "w3", "w1_scale", "w3_scale"):
            delattr(experts, name)  # the stacked copy holds them: one layer's gate/up is never held three times
        for name in ("w13", "w2"):
            w, s = stacks.pop(name)  # nothing keeps the gate/up copy once its layout exists
            n, k = w.shape[1], w.shape[2] * 2
            tensors = {"weight": w.contiguous().view(torch.int32),
                       "weight_scale": s.contiguous().view(torch.float8_e8m0fnu)}
            config = prepare_layer_config(shape_n=n, shape_k=k, weight_schema=weight_schema, input_schema=input_schema,
                                          num_experts=n_local, torch_dtype=dtype, device=device, tensors=tensors)
            config, tensors = prepare_fp16_e8m0_scale(config, tensors)
            tensors = transform_humming_tensors(config, tensors)
            for key, t in tensors.items():
                experts.register_buffer(f"hm_{name}_{key}", t)
            tuning = self._tuning_for(config, gemm_key(name, n, k, n_local, experts.n_total, fp8), device)
            gemms[name] = _Gemm(config, tuning, json.dumps(tuning))
            del w, s, tensors
        for name in ("w2", "w2_scale"):
            delattr(experts, name)  # the packed originals: humming's layout replaces them
        experts.register_buffer("hm_locks", torch.zeros(LOCK_WORDS, dtype=torch.int32, device=device))
        experts.humming = gemms
        experts.dims = (n_local, inter, d)
        self._compile(experts)

    def _compile(self, experts) -> None:
        """Every configuration of both tuned lists compiled now (humming caches them by config,
        so layers of one shape share them): no step ever waits for the JIT."""
        from humming.kernel.humming import HummingKernel

        device = experts.hm_locks.device
        for g in experts.humming.values():
            HummingKernel.prepare_kernels(g.config.to_str(), COMPUTE_CONFIG, g.tuning_str, device)

    def _gemm(self, experts, name: str, inputs, scale, out, align, top_k: int, m: int):
        from humming.forward import humming_forward

        g = experts.humming[name]
        sorted_ids, block_expert, padded = align
        return humming_forward(
            g.config, inputs=inputs, weight=getattr(experts, f"hm_{name}_weight"),
            weight_scale=getattr(experts, f"hm_{name}_weight_scale", None),
            weight_scale_2=getattr(experts, f"hm_{name}_weight_scale_2", None), outputs=out,
            input_scale=scale, sorted_ids=sorted_ids, expert_ids=block_expert, num_tokens_padded=padded,
            locks=experts.hm_locks, top_k=top_k, valid_shape_m=m, compute_config=COMPUTE_CONFIG,
            tuning_config=g.tuning_str)

    def forward(self, experts, x, weights, local_ids, defer_sum: bool = False):
        from dsv4_kernels.moe import RoutedRows, moe_align
        from dsv4_kernels.moe_act import align_and_quantize, swiglu_weight_quant

        n_local, inter, d = experts.dims
        T, topk = local_ids.shape
        if T == 0:
            return torch.empty(T, d, dtype=torch.float32, device=x.device)
        M = T * topk
        # rows this rank's experts see on average: the kernel configuration's M (a shard's
        # experts share the same routed rows as the whole set)
        m = max(1, -(-M * n_local // experts.n_total))
        fp8 = experts.act_quant
        block13, block2 = (experts.humming[name].block_m(m) for name in ("w13", "w2"))
        if fp8:  # the gate/up sort and the activation rounding share a launch at decode sizes
            align13, (xq, xs) = align_and_quantize(local_ids, n_local, block13, x)
        else:
            align13, xq, xs = moe_align(local_ids, n_local, block13, return_used=True), x, None
        align2 = align13 if block2 == block13 else moe_align(local_ids, n_local, block2, return_used=True)
        gate_up = torch.empty(M, 2 * inter, dtype=x.dtype, device=x.device)
        self._gemm(experts, "w13", xq, xs, gate_up, align13, topk, m)
        h, hs = swiglu_weight_quant(gate_up, weights.reshape(-1).float(), experts.limit, x.dtype, fp8)
        down = torch.empty(M, d, dtype=x.dtype, device=x.device)
        self._gemm(experts, "w2", h, hs, down, align2, 1, m)
        rows = RoutedRows(down, local_ids, n_local)
        return rows if defer_sum else rows.sum()
