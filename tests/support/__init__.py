"""Builders and drivers used only by the tests (and the benchmarks run from a checkout)."""
