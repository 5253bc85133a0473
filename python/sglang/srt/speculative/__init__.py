"""Speculative decoding: drafts from the model's MTP layers, verified by one target step."""


def make_speculator(server_args, model_runner):
    """The speculator --speculative-algorithm asks for, or None."""
    if getattr(server_args, "speculative_algorithm", None) is None:
        return None
    from sglang.srt.speculative.mtp import MTPSpeculator

    return MTPSpeculator(model_runner, server_args.speculative_num_steps)
