"""The breakable-graph interface: capture a forward as segments split at break ops, replay
it as segment, break, segment, ... Subclasses provide the segments (real CUDA graphs, or
the CPU emulator's recorded op lists); this class owns the break ops and the capture state.
"""

from __future__ import annotations

import abc
import contextlib
import time
from typing import Callable, Iterator, NamedTuple, Optional, Tuple

import torch

from sglang.srt.model_executor.breakable_cuda_graph.break_op import _set_current_graph
from sglang.srt.model_executor.breakable_cuda_graph.debug import (
    TensorArgSnapshot,
    check_break_arguments,
    snapshot_break_arguments,
)
from sglang.srt.model_executor.breakable_cuda_graph.errors import GraphCaptureError


class BreakRecord(NamedTuple):
    """One break op as captured: replay calls it again with these very objects."""

    name: str
    args: tuple
    kwargs: dict


class BreakableGraph(abc.ABC):
    """A forward captured as `num_breaks + 1` segments with eager break ops in between.

    Warm-up is the caller's job: run the forward eagerly once (or a few times) before
    `capture()` so lazy initialisation, autotuning and allocator growth happen outside it.
    """

    def __init__(self, device: torch.device, *, debug: bool = False):
        self.device = torch.device(device)
        self.debug = debug
        # The records hold every break op's tensor arguments (inputs and outputs) strongly
        # for the life of the graph. If one were dropped, its block would go back to the
        # (shared) memory pool and a later capture could place another live tensor there;
        # replay would then have the break op and that tensor's owner overwrite each other
        # with no error. Only release() lets go of them.
        self._breaks: list[BreakRecord] = []
        self._break_fns: list[Callable] = []
        self._break_snapshots: list[list[TensorArgSnapshot]] = []
        self._captured = False
        self._capturing = False
        self._in_break_op = False
        self._segment_open = False

    # ---- subclass hooks -------------------------------------------------------------
    @abc.abstractmethod
    def _capture_context(self) -> contextlib.AbstractContextManager:
        """Entered around the whole capture (streams, dispatch modes)."""

    @abc.abstractmethod
    def _begin_segment(self) -> None: ...

    @abc.abstractmethod
    def _end_segment(self) -> None: ...

    @abc.abstractmethod
    def _abort_segment(self) -> None:
        """End an open segment after an error; must not raise."""

    @abc.abstractmethod
    def _replay_segment(self, index: int) -> None: ...

    @abc.abstractmethod
    def _release_segments(self) -> None: ...

    def _hold_arguments(self, name: str, fn: Callable, transient: frozenset, args: tuple,
                        kwargs: dict) -> tuple[tuple, dict]:
        """The arguments the record keeps. Default: the very objects, held strongly (the CUDA
        graph keeps transient ones as weak aliases: intermediates.py)."""
        return args, kwargs

    def _translate_capture_error(self, error: BaseException) -> BaseException:
        """Turn a backend error raised inside a segment into a clearer one (or keep it)."""
        return error

    # ---- public interface -----------------------------------------------------------
    @property
    def is_captured(self) -> bool:
        return self._captured

    @property
    def in_break_op(self) -> bool:
        """True while a break op runs eagerly during capture (nothing is recorded then)."""
        return self._in_break_op

    @property
    def num_breaks(self) -> int:
        return len(self._breaks)

    @property
    def num_segments(self) -> int:
        return len(self._breaks) + 1 if self._captured else 0

    @property
    def break_records(self) -> list[BreakRecord]:
        return list(self._breaks)

    @contextlib.contextmanager
    def capture(self) -> Iterator["BreakableGraph"]:
        """`with g.capture(): out = forward(static_inputs)`; tensors the body leaves behind
        (e.g. `out`) are refreshed in place by every `replay()`."""
        if self._captured or self._capturing:
            raise RuntimeError("this breakable graph was already captured; create a new one")
        _set_current_graph(self)
        self._capturing = True
        try:
            with self._capture_context():
                self._open_segment()
                try:
                    yield self
                    self._close_segment()
                except BaseException as error:
                    self._close_segment_after_error()
                    translated = self._translate_capture_error(error)
                    if translated is error:
                        raise
                    raise translated from error
            self._captured = True
        finally:
            self._capturing = False
            _set_current_graph(None)
            if not self._captured:
                self.release()

    def run_break_op(self, name: str, fn: Callable, args: tuple, kwargs: dict,
                     transient: frozenset = frozenset()) -> None:
        """Called by a break op under capture: end the segment, run `fn` eagerly, record it,
        begin the next segment. `transient`: the argument names the op declared intermediates."""
        self._close_segment()
        self._in_break_op = True
        try:
            result = fn(*args, **kwargs)
        finally:
            self._in_break_op = False
        if result is not None:
            raise GraphCaptureError(
                f"break op '{name}' returned a {type(result).__name__} during capture; break "
                "ops must return None and write results in place into tensor arguments, "
                "because replay calls them again with the same arguments and ignores results"
            )
        args, kwargs = self._hold_arguments(name, fn, transient, args, kwargs)
        self._breaks.append(BreakRecord(name, tuple(args), dict(kwargs)))
        self._break_fns.append(fn)
        if self.debug:
            self._break_snapshots.append(snapshot_break_arguments(fn, args, kwargs))
        self._open_segment()

    def replay(self, host_seconds: Optional[Tuple[list, list]] = None) -> None:
        """Replay segment 0, call break 0 on its recorded arguments, replay segment 1, ...
        host_seconds=(segments, breaks): also append the host seconds each segment launch and
        each break op took, without syncs (benchmark/bcg/profile_bcg_step.py)."""
        if not self._captured:
            raise RuntimeError("replay() before capture() finished (or after release())")
        clock = time.perf_counter
        timed = host_seconds is not None
        # Graph replay has no autograd, and tensors captured under inference mode may only
        # be written in place under inference mode, so break ops run under it too.
        with torch.inference_mode():
            for index, record in enumerate(self._breaks):
                t0 = clock() if timed else 0.0
                self._replay_segment(index)
                t1 = clock() if timed else 0.0
                if self.debug:
                    check_break_arguments(index, record.name, self._break_snapshots[index])
                self._break_fns[index](*record.args, **record.kwargs)
                if timed:
                    host_seconds[0].append(t1 - t0)
                    host_seconds[1].append(clock() - t1)
            t0 = clock() if timed else 0.0
            self._replay_segment(len(self._breaks))
            if timed:
                host_seconds[0].append(clock() - t0)

    def release(self) -> None:
        """Drop the segments and every reference the graph holds; safe to call twice."""
        self._release_segments()
        self._breaks = []
        self._break_fns = []
        self._break_snapshots = []
        self._captured = False

    # ---- helpers ----------------------------------------------------------------------
    def _open_segment(self) -> None:
        self._begin_segment()
        self._segment_open = True

    def _close_segment(self) -> None:
        self._segment_open = False
        self._end_segment()

    def _close_segment_after_error(self) -> None:
        if self._segment_open:
            self._segment_open = False
            self._abort_segment()
