"""Benchmarks of the megamoe kernels (python -m bench.gemm)."""
