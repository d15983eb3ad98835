"""Training data: where tokens come from (corpus) and how batches are drawn (loader)."""
