"""The tile-height bounds of both launchers: choose.tile sizes a plan's tiles by
them, and the Gluon launcher (prefill_gluon.gather_short) picks its short-request tile by the same
GLUON_SHORT_KV; and the page size both launchers give a one-page POD prefill cache. A leaf
module, so neither launcher imports the other for them.
"""

from __future__ import annotations

import triton

# Tile choice (block_m_for): 64-row tiles for short key ranges (POLICY.tma_min_kv; up to SHORT_KV
# causal keys where K/V go through descriptors, GLUON_SHORT_KV on the Gluon kernel's ping-pong
# tiles, half either without a mask), 128-row tiles beyond; the Triton kernel's small pages
# (SMALL_PAGE_MAX keys or fewer) at 64 < D <= 128 take 256-row tiles of 64 keys when the requests
# fill them (padded rows at most SMALL_PAGE_PAD times 128-row tiles'); pages the Gluon kernel
# gathers take its 128-row tiles from GATHER_MIN_KV causal keys on. Measured in
# benchmarks/NOTES.md (2026-11-22: tile sweeps, small-page tiles; 2026-11-23: ping-pong tiles;
# 2026-11-24: gathered pages). The interpreter has no per-program setup to amortise: it reads
# K/V through descriptors at any length (POLICY.tma_min_kv is 0 there), so CI runs that path.
# Decode rows (every request at most DECODE_ROWS packed rows: qo_len x group) on pages the Gluon
# kernel reads by TMA boxes take 64-row tiles at any key length: two programs a SM stream K/V
# where one 128-row ping-pong program computed a half-empty tile (benchmarks/NOTES.md,
# 2026-11-28, decode rows against the copy ceiling).
DECODE_ROWS = 64
SHORT_KV = 4096
GLUON_SHORT_KV = 1024
GATHER_MIN_KV = 512
SMALL_PAGE_BLOCK_M = 256
SMALL_PAGE_MAX = 8
SMALL_PAGE_PAD = 1.05


# The page-size constexpr of a one-page POD prefill cache (choose.one_page_cache) up to this
# many keys; longer ones take the next power of two. No key leaves page 0 either way, and the
# kernels are not compiled again for every new prefill length.
ONE_PAGE_SIZE = 1 << 20


def one_page_size(rows: int) -> int:
    """The page-size constexpr of a one-page cache of ``rows`` keys: at least ONE_PAGE_SIZE."""
    return max(ONE_PAGE_SIZE, triton.next_power_of_2(int(rows)))
