"""The runner's room: one process's piece of the model (runner.py), its paged KV storage and
attention kernels, placement and offload, CPU experts, and the split workers of --tp/--pp
(split.py). It computes what the engine's `Step` says; it knows nothing of requests."""
