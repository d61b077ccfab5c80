"""The dev tools' switches of the kernel's launch policy: forced_kv_path picks one of the K/V
load paths (choose.KV_PATHS: host, persistent, device, pointers) at any launch size,
forced_tile one tile (height, key block, warps, stages); each puts every setting back on exit,
so that tools timing several variants in one process leave the production policy behind.
(Tests force paths through pytest's monkeypatch instead: tests/kernel_cases.force_kv_path.)"""

from __future__ import annotations

import contextlib

from compiled_attn.ops import choose
from compiled_attn.ops import policy


@contextlib.contextmanager
def forced_kv_path(name: str):
    """Within the block, launches take K/V path ``name``; yields its TMA constexpr."""
    tma, settings = choose.KV_PATHS[name]
    with policy.override(**settings):
        yield tma


@contextlib.contextmanager
def forced_tile(block_m: int, block_n: int, num_warps: int, num_stages: int):
    """Within the block, launches (and block_m_for) take this tile, K/V descriptors allowed."""
    saved = choose.tile, choose.config
    choose.tile = lambda *_a, **_kw: block_m
    choose.config = lambda *_a: dict(BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages,
                                 TMA=True)
    try:
        yield
    finally:
        choose.tile, choose.config = saved
