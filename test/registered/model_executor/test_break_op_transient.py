"""Transient break arguments (breakable_cuda_graph/intermediates.py) on the CPU: declaration,
the weak alias, and which arguments the record keeps weakly. The GPU file checks the pool."""

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from sglang.srt.model_executor.breakable_cuda_graph import GraphCaptureError, register_split_op
from sglang.srt.model_executor.breakable_cuda_graph import intermediates


def _op(q: torch.Tensor, weights: torch.Tensor, output: torch.Tensor, index_q: torch.Tensor = None) -> None:
    output.copy_(q * weights)


def test_transient_names_must_be_parameters():
    with pytest.raises(ValueError, match=r"transient arguments \['outptu'\] are not parameters"):
        register_split_op("test_transient_typo", _op, mutates_args=("output",), transient=("q", "outptu"))


def test_weak_alias_reads_the_same_memory_without_owning_it():
    t = torch.arange(24.0).view(4, 6)[1:3, 2:5]  # a strided view at an offset
    alias = intermediates.weak_alias(t)
    assert (alias.data_ptr(), alias.shape, alias.stride(), alias.dtype) == (t.data_ptr(), t.shape, t.stride(), t.dtype)
    assert alias.tolist() == t.tolist()
    alias.mul_(-1)  # writes land in t's memory
    assert t.tolist() == [[-8.0, -9.0, -10.0], [-14.0, -15.0, -16.0]]
    ref = StorageWeakRef(t.untyped_storage())
    del t
    assert ref.expired()  # the alias did not keep the storage alive


def test_only_declared_transient_tensors_are_held_weakly(monkeypatch):
    monkeypatch.setattr(intermediates, "allocated_in_pool", lambda t, pool: True)
    q, w, out = torch.ones(3), torch.full((3,), 2.0), torch.zeros(3)
    args, kwargs = intermediates.hold_break_arguments(
        "op", _op, frozenset({"q", "output", "index_q"}), (q, w), {"output": out, "index_q": None}, pool=(0, 1))
    held_q, held_w = args[:2]
    held_out = args[2] if len(args) > 2 else kwargs["output"]
    assert held_w is w  # not declared: the very object
    assert held_q is not q and held_q.data_ptr() == q.data_ptr()
    assert held_out is not out and held_out.data_ptr() == out.data_ptr()
    ref = StorageWeakRef(q.untyped_storage())
    del q
    assert ref.expired()


def test_a_transient_argument_outside_the_graph_pool_is_refused(monkeypatch):
    monkeypatch.setattr(intermediates, "allocated_in_pool", lambda t, pool: False)
    with pytest.raises(GraphCaptureError, match="break op 'op': argument 'q' is declared transient"):
        intermediates.hold_break_arguments("op", _op, frozenset({"q"}), (torch.ones(3), torch.ones(3), torch.zeros(3)),
                                           {}, pool=(0, 1))
