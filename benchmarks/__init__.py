"""Measurements of the whole system: benchmarks, evaluations, the soak and the GPU harness.

Each module runs as `python -m benchmarks.NAME`; none is imported by the daemons.
"""
