"""Expert parallelism behind the MoEDispatcher interface: at dp=2 and dp=4 (gloo, CPU) each
rank holds 1/dp of the routed experts, and every rank's MoE output equals one process
holding all experts, on hash-routed and top-k layers, torch and grouped-kernel paths, with
uneven and idle ranks. Only dispatchers that exist are offered."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from sglang.srt.layers.moe.ep_dispatch import GatherScatterDispatcher, create_moe_dispatcher
from sglang.test.ep_harness import EP_LAYERS, ep_inputs, ep_moe_forward, ep_moe_layers, ep_rank_main
from sglang.test.server_process import free_port

SEED = 3


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory):
    """Four rank processes: the dp=4 run on all of them, the dp=2 run on ranks 0 and 1."""
    out_dir = tmp_path_factory.mktemp("ep")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=ep_rank_main, args=(r, 4, port, SEED, str(out_dir))) for r in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
    assert all(not p.is_alive() for p in procs), "an EP rank hung"
    results = {}
    for rank in range(4):
        err = out_dir / f"ep{rank}.err"
        assert not err.exists(), err.read_text()
        results[rank] = torch.load(out_dir / f"ep{rank}.pt", weights_only=False)
    return results


@pytest.mark.parametrize("dp", [2, 4])
def test_expert_shards_equal_one_process(ep_run, dp):
    config, layers = ep_moe_layers(SEED)  # one process, every expert
    per = config.n_routed_experts // dp
    for rank in range(dp):
        got = ep_run[rank]
        assert got[dp, "held"] == (rank * per, (rank + 1) * per, per)  # 1/dp of the experts
        x, ids = ep_inputs(SEED, rank, dp, config.hidden_size, config.vocab_size)
        with torch.inference_mode():
            for layer_id in EP_LAYERS:
                for kernels in (False, True):
                    want = ep_moe_forward(layers[layer_id], x, ids, kernels)
                    out = got[dp, layer_id, kernels]
                    assert out.shape == want.shape == (x.shape[0], config.hidden_size)
                    assert x.shape[0] == 0 or want.abs().max() > 0.1  # the experts did contribute
                    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)


def test_the_dp_context_carries_the_dispatcher_it_is_given():
    from sglang.srt.layers.dp_attention import DPMoEContext

    gather = create_moe_dispatcher("gather")
    assert isinstance(gather, GatherScatterDispatcher)
    assert DPMoEContext(None, 0, 2, 4, gather).dispatcher is gather
    with pytest.raises(TypeError, match="dispatcher"):
        DPMoEContext(None, 0, 2, 4)  # no silent default: --moe-dispatcher chooses it
    for name in ("nccl", "deepep"):  # deepep: no all-to-all dispatcher exists, so none is offered
        with pytest.raises(ValueError, match=f"--moe-dispatcher must be one of gather, got '{name}'"):
            create_moe_dispatcher(name)


def test_moe_dispatcher_server_arg():
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.server_args_cli import prepare_server_args

    assert ServerArgs().moe_dispatcher == "gather"
    assert prepare_server_args(["--moe-dispatcher", "gather"]).moe_dispatcher == "gather"
    with pytest.raises(ValueError, match="--moe-dispatcher must be one of gather, got 'deepep'"):
        ServerArgs(moe_dispatcher="deepep")
    with pytest.raises(SystemExit):  # argparse: invalid choice
        prepare_server_args(["--moe-dispatcher", "deepep"])
