"""Benchmarks: ``asyncrl bench <name>``."""
