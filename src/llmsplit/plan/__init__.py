"""The planner: a pure model of memory and time per device for every layout (no torch.distributed)."""
