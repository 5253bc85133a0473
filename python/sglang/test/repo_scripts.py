"""The repository's scripts (benchmark tools, not part of the package) imported as modules by
the tests that exercise them."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[3]


def load_script(relpath: str) -> ModuleType:
    """The script at REPO / relpath, executed once more as a fresh module named after its file."""
    path = REPO / relpath
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
