"""Planning from the config alone, no device: how a GPU's memory divides (memory_planner) and
what one step must move and compute (step_cost), both from one meta-device build of the model."""
