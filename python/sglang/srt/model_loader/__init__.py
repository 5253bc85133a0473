"""Weights: seeded random initialisation, the safetensors loader for real DSV4 key names,
and a writer for synthetic checkpoints in that format."""
