"""Benchmarks: `make bench` runs them all (bench.run_all); each one is also `python -m bench.<name>`."""
