"""Benchmarks: compiled_attn's ops against the peers installed beside them, one process, same inputs.

``python -m benchmarks.run --suite fa3|flashinfer|paged|gqa|varlen|all`` times, ``python -m
benchmarks.plot`` draws one PNG per suite, ``python -m benchmarks.report`` prints the ratios the
performance targets ask for. docs/benchmarks.md says how to run them on the GPU machine.
"""
