"""ServerArgs is the one source of the model runner's settings and their defaults: the runner
takes resolved ServerArgs, reads nothing else, and no other settings class restates a
ServerArgs default (two sets of defaults drift apart: that is how a test and a server end up
running different configurations under the same names)."""

import ast
import dataclasses
import pathlib

import pytest

from sglang.srt.model_executor.model_runner import ModelRunner
from sglang.srt.server_args import ServerArgs
from sglang.test.runner_args import SMALL_RUNNER, cpu_server_args

SETTINGS = {f.name for f in dataclasses.fields(ServerArgs)}
PACKAGE = pathlib.Path(__file__).resolve().parents[3] / "python" / "sglang"
# Dataclasses allowed a field named like a setting, with a default, and why.
ALLOWED = {
    # where one scheduler process sits among the DP ranks; the default is "no DP", filled
    # from the resolved ServerArgs whenever there is DP
    ("RankSpec", "dp_size"), ("RankSpec", "node_rank"),
}


def _has_default(value: ast.expr) -> bool:
    """`x: int = 3` or `field(default=...)`; `field()` and `static_field()` declare none."""
    if isinstance(value, ast.Call):
        return any(k.arg in ("default", "default_factory") for k in value.keywords)
    return True


def _restated_defaults(package: pathlib.Path = PACKAGE):
    for path in sorted(package.rglob("*.py")):
        if path.name == "server_args.py":
            continue
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef) or not any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
                continue
            for stmt in cls.body:
                if (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and stmt.value is not None
                        and stmt.target.id in SETTINGS and _has_default(stmt.value)
                        and (cls.name, stmt.target.id) not in ALLOWED):
                    yield f"{path.relative_to(package)}: {cls.name}.{stmt.target.id}"


def test_no_settings_class_restates_a_server_args_default():
    assert PACKAGE.is_dir() and (PACKAGE / "srt" / "server_args.py").is_file()
    assert list(_restated_defaults()) == []


def test_the_scan_finds_a_restated_default(tmp_path):
    """The guard above would catch the old ModelRunnerConfig (own defaults for server flags)."""
    (tmp_path / "runner_config.py").write_text(
        "from dataclasses import dataclass\n\n@dataclass(frozen=True)\nclass ModelRunnerConfig:\n"
        "    dtype: str = 'float32'\n    max_num_reqs: int = 16\n    context_length: int = 1024\n")
    assert list(_restated_defaults(tmp_path)) == ["runner_config.py: ModelRunnerConfig.dtype",
                                          "runner_config.py: ModelRunnerConfig.context_length"]


class _Recorded(ServerArgs):
    """Resolved ServerArgs that remembers which attributes were read."""

    def __getattribute__(self, name):
        if not name.startswith("_"):
            object.__getattribute__(self, "__dict__").setdefault("_reads", set()).add(name)
        return object.__getattribute__(self, name)


def test_the_runner_reads_only_server_args_fields():
    args = cpu_server_args(num_layers=2, context_length=256, max_total_tokens=1024, max_running_requests=2)
    recorded = _Recorded(**{f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs)})
    recorded.__dict__["_reads"] = set()  # what the runner reads, not the constructor's checks
    runner = ModelRunner(recorded)
    reads = recorded.__dict__["_reads"]
    # derived from the fields: properties, and methods (run_config) whose reads are recorded too
    derived = {n for n, v in vars(ServerArgs).items() if isinstance(v, property) or callable(v)}
    assert reads <= SETTINGS | derived, reads - SETTINGS - derived
    assert "speculative_algorithm" in reads  # read through run_config
    # the sizes the pools are built from come from there
    assert {"context_length", "max_running_requests", "max_total_tokens", "page_size", "dtype"} <= reads
    assert runner.server_args is recorded
    assert runner.req_to_token_pool.max_num_reqs == 2 and runner.max_context_len == 256
    runner.shutdown()


def test_the_runner_refuses_unresolved_or_other_settings():
    with pytest.raises(ValueError, match="needs resolved ServerArgs"):
        ModelRunner(ServerArgs())
    with pytest.raises(TypeError, match="ModelRunner takes ServerArgs, got dict"):
        ModelRunner(dict(SMALL_RUNNER))


def test_small_runner_args_keep_the_sizes_the_tests_were_written_for():
    a = cpu_server_args()
    assert a.resolved and (a.device, a.dtype, a.model_path) == ("cpu", "float32", "dsv4-tiny")
    assert (a.context_length, a.max_running_requests, a.max_total_tokens) == (1024, 16, 16384)
    assert (a.chunked_prefill_size, a.breakable_cuda_graph_max_tokens, a.cuda_graph_max_bs) == (2048, 512, 16)
    assert (a.attention_backend, a.segment_kernels, a.quant_numerics) == ("torch", "off", "weight_only")
    assert not a.enable_breakable_cuda_graph and a.breakable_cuda_graph_tokens is None
    b = cpu_server_args(context_length=512, max_running_requests=4, breakable_cuda_graph_tokens=[8, 32])
    assert (b.context_length, b.max_running_requests, b.breakable_cuda_graph_tokens) == (512, 4, (8, 32))
    with pytest.raises(TypeError, match="max_num_reqs"):  # one name per setting
        cpu_server_args(max_num_reqs=4)
