"""Launch-geometry integer math for host code.

`triton.cdiv` and `triton.next_power_of_2` are constexpr functions: every host call unwraps
its arguments and imports inside the call, several µs each. Breaks launch kernels on every
replay with a handful of these per launch, so host code uses these plain versions; kernels
keep `tl.cdiv`. `sm_count` is the wave size the split choices aim at.
"""

import functools

import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n; 0 for 0 (as triton.next_power_of_2)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


@functools.lru_cache(maxsize=None)
def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of `device`; 132 (an H200's) off CUDA, so that interpreter
    tests exercise the splits the GPU takes."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 132
