"""The dev tools' switch between the kernel's K/V load paths (prefill_kernel.KV_PATHS: host,
persistent, device, pointers): one context manager that forces a path at any launch size and
puts every path setting back on exit, so that tools timing several paths in one process leave
the production policy behind. (Tests force paths through pytest's monkeypatch instead:
tests/kernel_cases.force_kv_path.)"""

from __future__ import annotations

import contextlib

from compiled_attn.ops import prefill_kernel as K


@contextlib.contextmanager
def forced_kv_path(name: str):
    """Within the block, launches take K/V path ``name``; yields its TMA constexpr."""
    tma, settings = K.KV_PATHS[name]
    saved = {n: getattr(K, n) for _, st in K.KV_PATHS.values() for n in st}
    for n, val in settings.items():
        setattr(K, n, val)
    try:
        yield tma
    finally:
        for n, val in saved.items():
            setattr(K, n, val)
