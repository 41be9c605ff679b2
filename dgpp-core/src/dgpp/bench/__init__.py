"""Benchmarks (``tests/perf/bench_decode.py``): random-weight real geometries, roofline, HF baseline."""
