"""Field classes of attention metadata under breakable CUDA graphs (docs/design.md, contract 4).

Every dataclass field of a metadata object declares exactly one class next to it:
- copy:     read by kernels inside captured segments. Refresh copies the new contents into
            the captured tensor in place (`copy_`); its storage is never replaced. A nested
            metadata object declared `copy` is refreshed recursively and keeps its identity.
- assign:   read only by the eager break op. Refresh replaces it with the new object.
- static:   configuration that must be equal at capture and replay; a mismatch raises.
- produced: written inside a segment and read by the break (e.g. the indexer's selected
            indices). Refresh keeps the captured storage and never touches it.
`refresh_for_breakable_cuda_graph_replay_` is derived from these declarations, so a new field
cannot be forgotten: an unclassified field makes the refresh raise.

A full decode CUDA graph captures the break op too, so there every field is read inside the
graph: `refresh_for_decode_cuda_graph_replay_` (`full_graph=True`) copies assign tensors in
place like copy fields and holds assign host values (the static-width decode widths) equal
like static fields.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

COPY, ASSIGN, STATIC, PRODUCED = "copy", "assign", "static", "produced"
FIELD_CLASSES = (COPY, ASSIGN, STATIC, PRODUCED)
_KEY = "breakable_field_class"


class MetadataContractError(RuntimeError):
    pass


def copy_field(**kw):
    return dataclasses.field(metadata={_KEY: COPY}, **kw)


def assign_field(**kw):
    return dataclasses.field(metadata={_KEY: ASSIGN}, **kw)


def static_field(**kw):
    return dataclasses.field(metadata={_KEY: STATIC}, **kw)


def produced_field(**kw):
    return dataclasses.field(metadata={_KEY: PRODUCED}, **kw)


def field_class(f: dataclasses.Field) -> str | None:
    return f.metadata.get(_KEY)


def field_classes(obj_or_cls) -> dict[str, str | None]:
    return {f.name: field_class(f) for f in dataclasses.fields(obj_or_cls)}


def unclassified_fields(cls) -> list[str]:
    """Names of `cls`'s own fields with no class (nested metadata types are checked by
    calling this on each of them)."""
    out = []
    for f in dataclasses.fields(cls):
        if field_class(f) not in FIELD_CLASSES:
            out.append(f"{cls.__name__}.{f.name}")
    return out


_PLANS: dict = {}


def _plan(cls) -> tuple:
    """(field name, field class) of each field of `cls`, computed once per class: the refresh
    runs before every replay, on the host's critical path."""
    plan = _PLANS.get(cls)
    if plan is None:
        plan = _PLANS[cls] = tuple((f.name, field_class(f)) for f in dataclasses.fields(cls))
    return plan


def refresh_(captured: Any, fresh: Any, path: str = "", full_graph: bool = False) -> None:
    """Make `captured` (the object the graph captured) hold `fresh`'s values per the contract;
    `full_graph`: the graph reads every field (decode graphs), so nothing is replaced."""
    if type(captured) is not type(fresh):
        raise MetadataContractError(
            f"{path or type(captured).__name__}: captured {type(captured).__name__}, fresh {type(fresh).__name__}"
        )
    for fname, cls in _plan(type(captured)):
        old, new = getattr(captured, fname), getattr(fresh, fname)
        if cls == COPY or (cls == ASSIGN and full_graph and isinstance(old, torch.Tensor)):
            _copy_into(old, new, captured, fname, path, full_graph)
        elif cls == ASSIGN and not full_graph:
            setattr(captured, fname, new)
        elif cls in (STATIC, ASSIGN):
            if not _static_equal(old, new):
                what = "static field" if cls == STATIC else "host value read inside the full graph"
                raise MetadataContractError(
                    f"{_name(captured, fname, path)}: {what} differs (captured {old!r}, replay {new!r})")
        elif cls == PRODUCED:
            continue
        else:
            raise MetadataContractError(f"{_name(captured, fname, path)}: field has no breakable-cuda-graph class")


def _name(obj: Any, fname: str, path: str) -> str:
    """The field's path in error messages (built only when raising)."""
    return f"{path}{type(obj).__name__}.{fname}"


def _copy_into(old: Any, new: Any, owner: Any, fname: str, path: str, full_graph: bool = False) -> None:
    if old is None or new is None:
        if old is not new:
            raise MetadataContractError(f"{_name(owner, fname, path)}: present at capture xor replay")
        return
    if isinstance(old, torch.Tensor):
        if old.shape != new.shape:
            raise MetadataContractError(f"{_name(owner, fname, path)}: copy field shape {tuple(new.shape)} at "
                                        f"replay, {tuple(old.shape)} at capture")
        if old is not new:  # a builder may already have written into the captured storage
            old.copy_(new)
    elif dataclasses.is_dataclass(old):
        refresh_(old, new, path=f"{_name(owner, fname, path)} -> ", full_graph=full_graph)
    else:
        raise MetadataContractError(f"{_name(owner, fname, path)}: copy field must be a tensor or nested metadata")


def _static_equal(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b
