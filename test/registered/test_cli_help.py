"""Every command-line entry point explains every option it offers in --help."""

import argparse
import importlib

import pytest

ENTRY_POINTS = [
    "sglang.srt.server_args_cli",  # python -m sglang.launch_server
    "sglang.bench_one_batch",
    "sglang.bench_offline_throughput",
    "sglang.bench_serving",
    "sglang.srt.configs.presets",
]


@pytest.mark.parametrize("module", ENTRY_POINTS)
def test_every_option_has_help(module):
    parser = importlib.import_module(module).make_parser()
    actions = [a for a in parser._actions if not isinstance(a, argparse._HelpAction)]
    assert len(actions) >= 3
    missing = [a.option_strings[0] if a.option_strings else a.dest for a in actions
               if not (a.help or "").strip()]
    assert missing == [], f"{module}: options without help: {missing}"


def test_launch_server_parser_is_the_server_args_cli():
    from sglang.srt.server_args import ServerArgs
    from sglang.srt.server_args_cli import make_parser

    flags = {a.option_strings[0] for a in make_parser()._actions if a.option_strings}
    want = {"--" + f.name.replace("_", "-") for f in ServerArgs.__dataclass_fields__.values() if f.name != "resolved"}
    assert flags - {"-h"} == want


def test_server_help_states_plain_defaults():
    from sglang.srt.server_args_cli import make_parser

    helps = {a.dest: a.help for a in make_parser()._actions}
    assert helps["port"].startswith("HTTP port (default 30000)")
    assert helps["mem_fraction_static"].endswith("(default 0.8)")
    assert helps["dp_idle_policy"].endswith("(default replay)")
    assert "(default" not in helps["enable_dp_attention"]  # a switch, off unless given
    # prefix caching is on unless turned off: both switches say so
    assert "on by default" in helps["enable_prefix_caching"] and "--disable-radix-cache" in helps["enable_prefix_caching"]
    assert helps["disable_radix_cache"].startswith("turn prefix caching off")
    assert "off by default" not in helps["enable_prefix_caching"]
