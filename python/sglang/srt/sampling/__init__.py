"""Sampling parameters of a request (validated at the process boundary)."""

from sglang.srt.sampling.sampling_params import SamplingParams

__all__ = ["SamplingParams"]
