"""Test utilities shipped with the package (importable from spawned worker processes)."""
