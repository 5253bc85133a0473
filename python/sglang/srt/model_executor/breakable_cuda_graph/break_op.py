"""Break ops: functions that split a breakable graph and run eagerly between its segments.

Also owns the per-thread "which graph is capturing" state, because a break op has to find
the graph that is capturing it without being handed one (it is called from model code).
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

if TYPE_CHECKING:
    from sglang.srt.model_executor.breakable_cuda_graph.base import BreakableGraph

SPLIT_OP_NAMESPACE = "sglang"
SPLIT_OPERATOR_PREFIX = f"{SPLIT_OP_NAMESPACE}::"

# Thread-local: a scheduler thread replaying eagerly must not be split by a capture that
# another thread happens to be running.
_capture_state = threading.local()


def current_graph() -> Optional["BreakableGraph"]:
    """The breakable graph capturing on this thread, or None."""
    return getattr(_capture_state, "graph", None)


def is_capturing() -> bool:
    """True while a breakable graph captures on this thread (break ops included)."""
    return current_graph() is not None


def _set_current_graph(graph: Optional["BreakableGraph"]) -> None:
    if graph is not None and current_graph() is not None:
        raise RuntimeError("a breakable graph is already capturing on this thread")
    _capture_state.graph = graph


class break_ops_inline:
    """Inside this context break ops do not split: they are captured into the current
    segment like any other op. Full (unbroken) graphs use it, e.g. decode graphs, whose
    attention path has static shapes."""

    def __enter__(self):
        self._prev = getattr(_capture_state, "inline", False)
        _capture_state.inline = True
        return self

    def __exit__(self, *exc):
        _capture_state.inline = self._prev
        return False


def break_ops_are_inline() -> bool:
    return getattr(_capture_state, "inline", False)


def _split_or_run(name: str, fn: Callable, args: tuple, kwargs: dict) -> Any:
    graph = current_graph()
    if graph is None or graph.in_break_op or break_ops_are_inline():
        # Outside capture, and for break ops nested in a running break op: just run.
        return fn(*args, **kwargs)
    graph.run_break_op(name, fn, args, kwargs, _transient_args.get(name, frozenset()))
    return None


def _declare_transient(op_name: str, fn: Callable, transient) -> None:
    transient = frozenset(transient)
    unknown = transient - set(inspect.signature(fn).parameters)
    if unknown:
        raise ValueError(f"break op {op_name!r}: transient arguments {sorted(unknown)} are not parameters of "
                         f"{getattr(fn, '__name__', fn)!r}")
    if transient:
        _transient_args[op_name] = transient


def eager_on_graph(fn: Optional[Callable] = None, *, name: Optional[str] = None, transient=()):
    """Mark `fn` as a break op: under capture it ends the segment, runs eagerly, is recorded
    with its exact arguments and is called again with them at every replay.

    `fn` must return None and write results in place into its tensor arguments, because a
    replay ignores return values. Usable as `@eager_on_graph` or `@eager_on_graph(name=...)`.
    `transient` names the tensor arguments that are intermediates of the forward (written by
    the segment before the break or by the break itself): on a GPU the graph records them
    without keeping them allocated (intermediates.py).
    """

    def decorate(f: Callable) -> Callable:
        op_name = name or f.__name__
        _declare_transient(op_name, f, transient)

        @functools.wraps(f)
        def break_op(*args, **kwargs):
            return _split_or_run(op_name, f, args, kwargs)

        break_op.break_op_name = op_name
        return break_op

    return decorate(fn) if fn is not None else decorate


# break op name -> the names of its transient tensor arguments (intermediates.py)
_transient_args: dict[str, frozenset] = {}
# name -> the callable register_split_op returned; tooling lists them via get_split_ops().
_split_ops: dict[str, Callable] = {}
# name -> the Python function behind the op, for recorders that must see what it dispatches.
_split_op_impls: dict[str, Callable] = {}
# Kept alive for the process: dropping a CustomOpDef deregisters its op.
_custom_op_defs: dict[str, Any] = {}


def get_split_ops() -> dict[str, Callable]:
    """Registered split ops by name (a copy)."""
    return dict(_split_ops)


def is_split_op(func: Any) -> bool:
    """True when `func` is the dispatcher overload of a registered split op."""
    schema = getattr(func, "_schema", None)
    if schema is None or not schema.name.startswith(SPLIT_OPERATOR_PREFIX):
        return False
    return schema.name[len(SPLIT_OPERATOR_PREFIX) :] in _split_ops


def split_op_impl(func: Any) -> Callable:
    """The Python function registered behind the split op overload `func` (see is_split_op)."""
    return _split_op_impls[func._schema.name[len(SPLIT_OPERATOR_PREFIX) :]]


def _no_output_fake(*args, **kwargs) -> None:
    # Split ops return nothing and only mutate declared arguments, so tracing needs no shapes.
    return None


def _define_with_custom_op(name: str, impl: Callable, schema: str, mutates_args) -> None:
    op = torch.library.custom_op(
        f"{SPLIT_OPERATOR_PREFIX}{name}", impl, mutates_args=mutates_args, schema=schema
    )
    op.register_fake(_no_output_fake)
    _custom_op_defs[name] = op


def register_split_op(
    name: str,
    fn: Callable,
    mutates_args: tuple[str, ...],
    *,
    schema: Optional[str] = None,
    transient: tuple[str, ...] = (),
) -> Callable:
    """Register `fn` as the dispatcher op `torch.ops.sglang.<name>` and as a split op.

    Returns a callable that calls the dispatcher op. The op's kernel splits the capturing
    graph (like `eager_on_graph`), so the split also happens when compiled code calls the op
    directly. `schema` (e.g. "(Tensor q, Tensor(a!) output) -> ()") defaults to one inferred
    from `fn`'s type hints. `transient`: as for eager_on_graph.
    """
    if name in _split_ops:
        raise ValueError(f"split op {name!r} is already registered")
    _declare_transient(name, fn, transient)
    mutates_args = tuple(mutates_args)
    if schema is None:
        schema = torch.library.infer_schema(fn, mutates_args=mutates_args)

    @functools.wraps(fn)
    def kernel(*args, **kwargs):
        _split_or_run(name, fn, args, kwargs)

    _define_with_custom_op(name, kernel, schema, mutates_args)
    overload = getattr(getattr(torch.ops, SPLIT_OP_NAMESPACE), name).default

    @functools.wraps(fn)
    def split_op(*args, **kwargs) -> None:
        overload(*args, **kwargs)

    split_op.break_op_name = name
    split_op.op = overload
    _split_ops[name] = split_op
    _split_op_impls[name] = fn
    return split_op
