"""Server runtime: configs, model, attention backends, memory, executor and scheduler."""
