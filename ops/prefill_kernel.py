"""The Triton prefill kernel family (in progress)."""

from __future__ import annotations


def block_m_for(head_dim_qk: int, head_dim_vo: int, group_size: int) -> int:
    """Tile height in packed rows for these head dims (plan() and the launch agree on it)."""
    return 64 if max(head_dim_qk, head_dim_vo) <= 128 else 64
