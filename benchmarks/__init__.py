"""Side-by-side benchmarks against peers. Run: python -m benchmarks [NAME ...]."""
