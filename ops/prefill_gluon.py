"""Hopper prefill kernel written in Gluon (Triton's explicit-layout dialect), for the hot path.

The Triton kernel (prefill_kernel.py) cannot keep a Q K^T wgmma in flight while the softmax of
the previous scores runs: Triton's Hopper pipeliner waits on every wgmma whose result the same
iteration reads (docs/design.md, "Not built"). Gluon exposes the wgmma's issue and wait
(``warpgroup_mma(..., is_async=True)``, ``warpgroup_mma_wait``), TMA copies and mbarriers, so
this kernel writes FA3's intra-warpgroup schedule by hand: each iteration issues S_t = Q K_t^T
and O += P_{t-1} V_{t-1} back to back, waits for S_t only, runs the softmax of S_t while
P_{t-1} V_{t-1} is still on the tensor cores (where P goes through shared memory: see TILES),
then waits for it and rescales O. K and V stream through STAGES-deep shared-memory rings filled
by TMA (host-built descriptors), each slot refilled as soon as the wgmma reading it has
completed: by the compute warps themselves, or (WS) by a one-warp load partition that the
compute warps release each slot to (gl.warp_specialize), which also issues a box per page for
pages smaller than a key tile; pages too small for a box are gathered key by key with cp.async
by a producer warp group in its place (PAGED_GATHER). 128-row tiles run FA3's inter-warpgroup
schedule too (PINGPONG): two compute groups of 64 rows share the slots and take turns issuing
their wgmmas, so one group's softmax runs under the other's matmuls. Persistent warp-specialized
programs (persistent_default) stay resident and take work items from a global counter through
the load warp, which decodes each item for the compute groups, brings its Q by TMA (one query
head per KV head) and starts its K / V under the previous item's last tiles.

Scope (ops.choose._gluon_scope; everything else takes the Triton kernel): dense,
ragged or paged K/V seen as 2D [rows, Hkv * D] (kv_2d; pages holding whole key tiles, or of 8+
keys dividing one: page_fits; pages of 1-7 keys: page_gathered), bf16 / fp16, head dim 64, 128
or 256 (TILES) for Q/K and V alike, causal or no mask, none of the logit transforms,
positional encodings, sinks or fp8 K/V, no split-KV.
Invariants as in prefill_kernel.py: packed row r of a request is token r // GROUP of query head
hkv * GROUP + r % GROUP; positions are bottom-right aligned; logits are base 2 (log2(e) folded
into qk_scale) and the LSE written is base 2; a row that sees no key writes 0 and LSE -inf;
element offsets are int64.
"""

from __future__ import annotations

import functools
from collections import namedtuple
from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                             warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

from . import launch as _launch
from .modes import LOG2E
from .tiles import GLUON_SHORT_KV, one_page_size

# The CTA-wide barrier is gl.thread_barrier in triton 3.6 and gl.barrier from 3.7 on.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# The TMA load is tma.async_copy_global_to_shared in triton 3.6 and tma.async_load from 3.7 on.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# cp.async of a pointer tensor into shared memory: async_copy_global_to_shared in triton 3.6,
# async_load from 3.7 on (3.9 keeps the old name as a function that raises)
_async_load = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared

# PAGED: contiguous K/V (0), pages read by TMA boxes (PAGED_BOXES: pages holding whole key
# tiles, one box per tile, or of 8+ keys dividing one, a box per page), or gathered key by key
# with cp.async by a producer warp group (PAGED_GATHER: pages too small for a box).
PAGED_BOXES = gl.constexpr(1)
PAGED_GATHER = gl.constexpr(2)
# The gathering warp group: GATHER_WARPS warps, each copy instruction over GATHER_TPW rows of a
# warp (4 rows x 128 bytes: the lines an instruction touches, not the sectors, set the copies'
# rate; benchmarks/NOTES.md, 2026-11-24, pages of 1-7 keys).
GATHER_WARPS = gl.constexpr(4)
GATHER_TPW = gl.constexpr(4)


# ---- the kernel's named bundles -----------------------------------------------------------------
# _gluon_fwd gathers its runtime values into one Ctx of these named tuples, which the partitions
# take (Gluon passes a tuple's fields like separate arguments; a tuple assigned to a name holds
# runtime values, so constexprs stay separate arguments). Ctx's fields flatten in the order the
# warp-specialized partitions receive them.
Io = namedtuple("Io", "q_ptr o_ptr lse_ptr q_rows_ptr")
Io.__doc__ = """\
    Q, O and LSE, and Q's row map (Schedule.Q_ROWS / PodConfig.Q_ROWS_D; never read without)."""


Ring = namedtuple("Ring", "q_ring k_ring v_ring k_bar v_bar k_empty v_empty p_ring turn")
Ring.__doc__ = """\
    The shared-memory rings and their barriers: Q slots, K / V slots filled on k_bar /
    v_bar and released on k_empty / v_empty (WS), P's slots (P_SMEM), the groups' turns
    (PINGPONG)."""


Keys = namedtuple("Keys", "k_desc v_desc qk_scale page_idx_ptr k_page_rows v_page_rows")
Keys.__doc__ = """\
    K / V through TMA: the descriptors over their 2D views, the base-2 logit scale, the page
    table and each cache's rows from one page to the next."""


RowStrides = namedtuple("RowStrides", "qb qt qh ob ot oh lb lt lh")
RowStrides.__doc__ = """\
    Element strides of q, o (batch, token, head) and lse (batch, token, head)."""


Work = namedtuple("Work", "work_ptr qo_indptr_ptr kv_indptr_ptr last_page_len_ptr "
                  "n_items n_req n_hkv dense_tiles dense_group dense_qo_len "
                  "dense_kv_len")
Work.__doc__ = """\
    The work items (_item_of): the work list and indptrs (ragged / paged), items per KV
    head, requests, KV heads, and dense mode's tiles per entry, pairs per group and lengths."""


Handoff = namedtuple("Handoff", "items item_full item_empty sched_ptr q_full q_empty q_desc "
                     "q_req_rows")
Handoff.__doc__ = """\
    Persistent programs: the item records' slots and barriers (_publish_item), the item
    counter, and Q's TMA slots (Q_TMA: barriers, descriptor, rows per dense request)."""


Gather = namedtuple("Gather", "k_ptr v_ptr stride_kr stride_vr")
Gather.__doc__ = """\
    K / V caches as pointers for PAGED_GATHER (their 2D views, rows stride_kr / stride_vr
    elements apart)."""


Ctx = namedtuple("Ctx", "io ring keys st work handoff gather")
Ctx.__doc__ = """\
    The launch's runtime values, built once by _gluon_fwd."""


Item = namedtuple("Item", "req row0 hkv qo_start qo_len kv_start kv_len page_base "
                  "npages n_tiles n_free valid")
Item.__doc__ = """\
    A work item (_item_of): request, first packed row, KV head, the request's rows
    (qo_start, qo_len) and keys (kv_start, kv_len; paged: first page-table entry, pages), its
    key tiles (n_tiles, the first n_free unmasked) and whether its rows exist (valid)."""


# ---- the launch arguments' bundles -------------------------------------------------------------
# The launched kernels take their scalars and constexprs in these named tuples, built by launch /
# launch_pod. Triton specialises a tuple argument's fields like top-level arguments (an integer 1
# becomes a constexpr, a multiple of 16 is marked so) and flattens them in place, so the compiled
# parameters are the flat signature's, in the same order (dev/ptx_fingerprint checks). Tensors
# and tensor descriptors stay top-level arguments: triton 3.6's launcher expands only top-level
# descriptors, and the bound launches (launch.Bound) substitute only top-level tensors. The
# kernels read a bundle's fields in place (bundle.field): a name assigned a tuple would turn its
# constexpr fields (an integer 1) into runtime values on triton 3.9.
PageRows = namedtuple("PageRows", "k_page_rows v_page_rows")
PageRows.__doc__ = """\
    Each K / V cache's rows from one page to the next (paged; else never read)."""


WorkSizes = namedtuple("WorkSizes", "n_items n_req n_hkv dense_tiles dense_group dense_qo_len "
                       "dense_kv_len")
WorkSizes.__doc__ = """\
    Work's sizes: items per KV head, requests, KV heads, and dense mode's tiles per entry,
    pairs per group and lengths (0 where not dense)."""


GatherStrides = namedtuple("GatherStrides", "stride_kr stride_vr")
GatherStrides.__doc__ = """\
    Elements from one row of the K / V caches' 2D views to the next (PAGED_GATHER)."""


PartScalars = namedtuple("PartScalars", "k_page_rows v_page_rows qt qh ot oh lt lh qk_scale "
                         "stride_kr stride_vr")
PartScalars.__doc__ = """\
    A POD part's scalars (_gluon_pod_fwd): its caches' page rows, the token and head strides of
    q, o and lse (ragged: no batch strides), its base-2 logit scale, and the row strides of its
    caches' 2D views (PAGED_GATHER)."""


Source = namedtuple("Source", "PAGED PAGE BOXES WIDE")
Source.__doc__ = """\
    Constexprs of a K / V source: PAGED (0, PAGED_BOXES or PAGED_GATHER), the page size, TMA
    boxes per key tile, and WIDE (the gather's int64 row offsets)."""


Shape = namedtuple("Shape", "GROUP CAUSAL BLOCK_M BLOCK_N D STAGES")
Shape.__doc__ = """\
    Constexprs of the tile: query heads per KV head, the causal mask, rows and keys per tile,
    head dim, K / V ring slots."""


Schedule = namedtuple("Schedule", "DENSE Q_TMA P_SMEM WS PERSISTENT PINGPONG PRODUCER_REGS "
                      "GROUP_REGS Q_ROWS SWAP", defaults=(False, False))
Schedule.__doc__ = """\
    _gluon_fwd's constexprs of the work and its schedule: dense work items, Q by TMA, P through
    shared memory, warp specialization, persistent programs, ping-pong groups, the load and
    second compute partitions' registers, Q_ROWS (Q's rows through a row map: launch's
    q_rows) and SWAP (decode rows' swapped products, _group_swap)."""


PodSizes = namedtuple("PodSizes", "n_items n_hkv")
PodSizes.__doc__ = """\
    _gluon_pod_fwd's work items per KV head (work rows) and KV heads."""


PodConfig = namedtuple("PodConfig", "SOURCE SOURCE_D SHAPE PINGPONG GROUP_REGS PRODUCER_REGS "
                       "Q_ROWS_D SWAP_D", defaults=(False, False))
PodConfig.__doc__ = """\
    _gluon_pod_fwd's constexprs: each part's K / V Source (prefill, decodes), the tile's Shape,
    ping-pong groups, the second compute and the load partitions' registers, whether the
    decodes' Q rows go through a row map, and SWAP_D: the decodes' items on the swapped
    products (_group_swap; one compute group), the prefill's on the tile's own."""


@constexpr_function
def _row_layout(d, num_warps):
    """A blocked layout for [rows, d] tiles read or written through pointers: 16-byte vectors
    along d, the warp's threads across rows then d."""
    tpw_d = min(d // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // tpw_d, tpw_d], [num_warps, 1], [1, 0])


@constexpr_function
def _mma_layout(n, num_warps):
    """The wgmma accumulator layout of a [rows, n] result (scores: n = BLOCK_N; O: n = D)."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                     instr_shape=[16, n, 16])


@gluon.jit
def _softmax_tile(s, m_i, l_i, t, kv_len, p_row, qk_scale,
                  MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr,
                  col_layout: gl.constexpr):
    """Online-softmax step on the raw scores s [BLOCK_M, BLOCK_N] of key tile t: returns
    (p, new max, new row sums, alpha = the factor the accumulator takes). Unmasked tiles fold
    the scale into the exp2 argument; masked ones hide keys past kv_len (and, causal, past
    each row's position p_row [BLOCK_M])."""
    if MASKED:
        j = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        see = j[None, :] < kv_len
        if CAUSAL:
            see = see & (j[None, :] <= p_row[:, None])
        s = gl.where(see, s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1))
        # A row that has seen nothing yet keeps m = -inf; subtract 0 instead (no NaN).
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_sub[:, None])
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * qk_scale)
        m_sub = m_new
        p = gl.exp2(s * qk_scale - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, m_new, l_i, alpha


# ---- ring slots and their barriers ----------------------------------------------------------
# Every ring here (K / V: STAGES slots; the item records and Q's TMA slots: 2) is used by
# position: its counter-th use takes slot counter % N (_slot), on the slot's barriers' phase
# (counter // N) & 1 (_phase). The producer waits on the slot's "empty" barrier, fills it and
# arrives on (or lets the copy complete) "full"; the consumer waits on "full", reads and arrives
# on "empty". A fresh barrier's phase 1 reads as complete: the producer's first pass goes through.
@gluon.jit
def _slot(counter, N: gl.constexpr):
    """The slot of a ring of N slots' counter-th use."""
    return counter % N


@gluon.jit
def _phase(counter, N: gl.constexpr):
    """The phase parity of a ring of N slots' counter-th use."""
    return (counter // N) & 1


@gluon.jit
def _wait_full(full, counter, N: gl.constexpr):
    """Consumer: wait until the counter-th use's slot is filled; returns the slot."""
    slot = _slot(counter, N)
    mbarrier.wait(full.index(slot), _phase(counter, N))
    return slot


@gluon.jit
def _wait_empty(empty, counter, N: gl.constexpr):
    """Producer: wait until the counter-th use's slot is released (its use N before read);
    returns the slot."""
    slot = _slot(counter, N)
    mbarrier.wait(empty.index(slot), _phase(counter, N) ^ 1)
    return slot


@gluon.jit
def _arrive_slot(bars, counter, N: gl.constexpr):
    """Arrive once on the counter-th use's slot's barrier: the producer on "full" (a filled
    slot), the consumer on "empty" (a released one)."""
    mbarrier.arrive(bars.index(_slot(counter, N)), count=1)


@gluon.jit
def _load_kv(desc, ring, bar, t, kv_start, hkv, pred, page, page_rows, PAGED: gl.constexpr,
             PAGE: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """TMA of key tile t of this request and KV head into slot t % STAGES of ring (when pred).
    Contiguous keys: one box from row kv_start + t * BLOCK_N. Paged (the cache seen as rows of
    Hkv * D, page p from row p * page_rows; PAGE a multiple of BLOCK_N): one box inside page
    ``page``, the one holding tile t (_page_of)."""
    slot = _slot(t, STAGES)
    _fill_slot(desc, ring.index(slot), bar.index(slot), t, kv_start, hkv, page, page, page_rows,
               pred, PAGED, PAGE, BLOCK_N, D, 1)


@gluon.jit
def _page_of(page_idx_ptr, page_base, npages, t, PAGED: gl.constexpr, PAGE: gl.constexpr,
             BLOCK_N: gl.constexpr):
    """The page holding key tile t (page 0 past the request's pages, whose rows lie past
    kv_len: masked and zeroed); 0 when not PAGED. Read a tile ahead of its TMA."""
    if PAGED:
        j = (t * BLOCK_N) // PAGE
        page = gl.load(page_idx_ptr + page_base + j, mask=j < npages, other=0)
    else:
        page = 0
    return page


@gluon.jit
def _tile_pages(page_idx_ptr, page_base, npages, t, PAGED: gl.constexpr, PAGE: gl.constexpr,
                BLOCK_N: gl.constexpr, BOXES: gl.constexpr):
    """(page, pages) of key tile t for _fill_slot: one box, the page holding it (_page_of);
    BOXES boxes, (the address of its first page-table entry, the request's pages from there
    on)."""
    if BOXES == 1:
        page = _page_of(page_idx_ptr, page_base, npages, t, PAGED, PAGE, BLOCK_N)
        pages = page
    else:
        pages = (page_idx_ptr + page_base + t * BOXES, npages - t * BOXES)
        page = 0
    return page, pages


@gluon.jit
def _fill_slot(src, buf, bar, t, kv_start, hkv, page, pages, stride_p, pred,
               PAGED: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
               BOXES: gl.constexpr):
    """TMA of key tile t into slot buf [BLOCK_N, D], completing on bar (when pred; boxes
    always): one box (contiguous keys, or a page holding whole tiles: ``page``, page p from
    row p * stride_p), or BOXES boxes of one page each (pages smaller than a tile, issued by
    the warp-specialized kernel's load warp: ``pages`` from _tile_pages; entries past the
    request's pages read page 0, whose rows lie past kv_len: masked, zeroed)."""
    mbarrier.expect(bar, BLOCK_N * D * src.dtype.primitive_bitwidth // 8, pred=pred)
    if BOXES == 1:
        if PAGED:
            row = page * stride_p + (t * BLOCK_N) % PAGE
        else:
            row = kv_start + t * BLOCK_N
        _tma_load(src, [row, hkv * D], bar, buf, pred=pred)
    else:
        # Each box's page read by a warp-uniform load of its own: a [BOXES] vector read once per
        # tile costs a cross-lane reduction per box (benchmarks/NOTES.md, 2026-11-23, page 8).
        table, left = pages
        for b in gl.static_range(BOXES):
            page_b = gl.load(table + b, mask=b < left, other=0)
            _tma_load(src, [page_b * stride_p, hkv * D], bar, buf.slice(b * PAGE, PAGE))


@gluon.jit
def _ws_producer(k_src, v_src, k_ring, v_ring, k_full, v_full, k_empty, v_empty, n_tiles, it,
                 kv_start, hkv, page_idx_ptr, page_base, npages, stride_kp, stride_vp,
                 PAGED: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                 D: gl.constexpr, STAGES: gl.constexpr, BOXES: gl.constexpr):
    """The load partition's (one warp's) work on one work item: its key tile t's K and V into
    ring slot (it + t) % STAGES (it: the tiles the program's earlier items used) once the
    compute groups have released it (k_empty / v_empty; a fresh barrier counts as released),
    signalling k_full / v_full. Its page reads and TMA issues leave the compute warps'
    critical path (and Gluon's barrier before each copy into a buffer already written syncs
    this one warp only)."""
    for t in range(n_tiles):
        g = it + t
        # the K and V waits' slot and phase (_wait_empty's), computed once ahead of the page reads
        slot = _slot(g, STAGES)
        phase = _phase(g, STAGES) ^ 1
        page, pages = _tile_pages(page_idx_ptr, page_base, npages, t, PAGED, PAGE, BLOCK_N,
                                  BOXES)
        mbarrier.wait(k_empty.index(slot), phase)
        _fill_slot(k_src, k_ring.index(slot), k_full.index(slot), t, kv_start, hkv, page, pages,
                   stride_kp, True, PAGED, PAGE, BLOCK_N, D, BOXES)
        mbarrier.wait(v_empty.index(slot), phase)
        _fill_slot(v_src, v_ring.index(slot), v_full.index(slot), t, kv_start, hkv, page, pages,
                   stride_vp, True, PAGED, PAGE, BLOCK_N, D, BOXES)


@gluon.jit
def _gather_keys(page_idx_ptr, page_base, t, kv_len, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                 layout: gl.constexpr):
    """Key tile t's keys [BLOCK_N] in a paged cache: each one's page and its position in the
    page, keys past kv_len clamped to the last one (so every read is of the request's own
    pages, and no copy needs a mask; nothing is read when kv_len is 0). K and V share them."""
    j = gl.minimum(t * BLOCK_N + gl.arange(0, BLOCK_N, layout=layout), kv_len - 1)
    page = gl.load(page_idx_ptr + page_base + j // PAGE, mask=kv_len > 0, other=0)
    return page, j % PAGE


@gluon.jit
def _row_offsets(page, pos, page_rows, stride_r, WIDE: gl.constexpr):
    """Element offsets of keys [BLOCK_N] at (page, pos) in a cache whose page p starts at row
    p * page_rows, rows stride_r elements apart: int32 unless WIDE (a cache of 2^31 elements or
    more). Int32 is the gather's fast path: the 64-bit products cost its warp group several
    instructions a row (benchmarks/NOTES.md, 2026-11-24)."""
    if WIDE:
        return (page.to(gl.int64) * page_rows + pos) * stride_r.to(gl.int64)
    else:
        return (page * page_rows + pos) * stride_r


@gluon.jit
def _gather_producer(k_ptr, v_ptr, k_ring, v_ring, k_full, v_full, k_empty, v_empty, n_tiles, it,
                     hkv, page_idx_ptr, page_base, kv_len, stride_kr, stride_vr, k_page_rows,
                     v_page_rows, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                     STAGES: gl.constexpr, WIDE: gl.constexpr):
    """The load partition of PAGED_GATHER launches (GATHER_WARPS warps) on one work item: key
    tile t's K and V rows, each from its own page (page p from row p * page_rows, rows
    stride_r elements apart), copied by cp.async into ring slot (it + t) % STAGES once the
    compute groups have released it, each thread arriving on k_full / v_full (counting all
    GATHER_WARPS * 32) when its copies have landed. Slots past kv_len hold copies of the last
    key's row (_gather_keys): masked scores, and p = 0 on finite values, so V's tail needs no
    _zero_tail. A warp's copy instruction covers GATHER_TPW rows of 16 * 32 / GATHER_TPW bytes
    (4 x 128: whole 128-byte lines; a thread 8 rows of a 128-key tile). Tile t + 1's
    page-table entries are read (once for K and V) before tile t's slot wait, so their latency
    hides under it. Lean on purpose, since the compute warps beside it on the SM pay for its
    instructions (benchmarks/NOTES.md, 2026-11-24): keys past kv_len clamped rather than masked
    (no predicates), one page-table read for K and V, the thread's column folded into its base
    pointer, row offsets in int32 unless WIDE (_row_offsets)."""
    blk: gl.constexpr = gl.BlockedLayout([1, 8], [GATHER_TPW, 32 // GATHER_TPW], [GATHER_WARPS, 1],
                                         [1, 0])
    rows_l: gl.constexpr = gl.SliceLayout(1, blk)
    col = hkv * D + gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    k_base = k_ptr + col[None, :]
    v_base = v_ptr + col[None, :]
    page, pos = _gather_keys(page_idx_ptr, page_base, 0, kv_len, PAGE, BLOCK_N, rows_l)
    for t in range(n_tiles):
        g = it + t
        # the K and V waits' slot and phase (_wait_empty's), computed once ahead of the page reads
        slot = _slot(g, STAGES)
        phase = _phase(g, STAGES) ^ 1
        page_next, pos_next = _gather_keys(page_idx_ptr, page_base, t + 1, kv_len, PAGE, BLOCK_N,
                                           rows_l)
        k_rows = _row_offsets(page, pos, k_page_rows, stride_kr, WIDE)
        mbarrier.wait(k_empty.index(slot), phase)
        _async_load(k_ring.index(slot), k_base + k_rows[:, None])
        async_copy.mbarrier_arrive(k_full.index(slot), increment_count=False)
        v_rows = _row_offsets(page, pos, v_page_rows, stride_vr, WIDE)
        mbarrier.wait(v_empty.index(slot), phase)
        _async_load(v_ring.index(slot), v_base + v_rows[:, None])
        async_copy.mbarrier_arrive(v_full.index(slot), increment_count=False)
        page, pos = page_next, pos_next


@gluon.jit
def _item_producer(k_desc, v_desc, k_ptr, v_ptr, k_ring, v_ring, k_full, v_full, k_empty, v_empty,
                   n_tiles, it, kv_start, kv_len, hkv, page_idx_ptr, page_base, npages,
                   k_page_rows, v_page_rows, stride_kr, stride_vr, PAGED: gl.constexpr,
                   PAGE: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                   STAGES: gl.constexpr, BOXES: gl.constexpr, WIDE: gl.constexpr):
    """The load partition's work on one work item: a warp group's gathers (PAGED_GATHER,
    _gather_producer) or a warp's TMAs (_ws_producer). The one producer every warp-specialized
    launch names (its warps: _load_warps)."""
    if PAGED == PAGED_GATHER:
        _gather_producer(k_ptr, v_ptr, k_ring, v_ring, k_full, v_full, k_empty, v_empty, n_tiles,
                         it, hkv, page_idx_ptr, page_base, kv_len, stride_kr, stride_vr,
                         k_page_rows, v_page_rows, PAGE, BLOCK_N, D, STAGES, WIDE)
    else:
        _ws_producer(k_desc, v_desc, k_ring, v_ring, k_full, v_full, k_empty, v_empty, n_tiles,
                     it, kv_start, hkv, page_idx_ptr, page_base, npages, k_page_rows,
                     v_page_rows, PAGED, PAGE, BLOCK_N, D, STAGES, BOXES)


@constexpr_function
def _load_warps(paged):
    """Warps of the load partition: a warp group to gather pages (PAGED_GATHER), else one."""
    return GATHER_WARPS.value if paged == PAGED_GATHER.value else 1


@gluon.jit
def _wait_kv(full, g, STAGES: gl.constexpr, PAGED: gl.constexpr):
    """A compute group's wait for K / V ring position g's slot (_wait_full); returns the slot.
    PAGED_GATHER: the cp.async copies wrote it through the generic proxy; fence before the
    wgmma reads it through the async proxy."""
    slot = _wait_full(full, g, STAGES)
    if PAGED == PAGED_GATHER:
        fence_async_shared()
    return slot


@gluon.jit
def _zero_tail(v_ring, slot, rows, D: gl.constexpr, BLOCK_N: gl.constexpr,
               num_warps: gl.constexpr):
    """Zero the rows >= rows of a V slot: past kv_len they hold the next request's values,
    which p = 0 would turn into NaN if they are not finite. 16 rows at a time (few registers
    beside the live accumulator). Under ping-pong both groups zero the slot they share: each
    before its own P V reads it, and the other's writes are zeros or the values already
    there."""
    CHUNK: gl.constexpr = 16
    blk: gl.constexpr = _row_layout(D, num_warps)
    buf = v_ring.index(slot)
    r = gl.arange(0, CHUNK, layout=gl.SliceLayout(1, blk))
    for c in gl.static_range(BLOCK_N // CHUNK):
        part = buf.slice(c * CHUNK, CHUNK)
        part.store(gl.where((c * CHUNK + r < rows)[:, None], part.load(blk), 0.0))
    fence_async_shared()
    _cta_barrier()


@gluon.jit
def _take_turn(turn, t, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: group WG waits, before issuing tile t's wgmmas, until the other group has
    issued its previous round (group 0 first: a fresh barrier's phase 1 reads as complete).
    The groups alternate on the tensor cores, so each one's softmax runs under the other's
    matmuls (FA3's inter-warpgroup schedule). A group can never be two rounds ahead: its next
    turn needs the other's arrival on this round."""
    if PINGPONG:
        mbarrier.wait(turn.index(WG), (t & 1) ^ WG ^ 1)


@gluon.jit
def _pass_turn(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: group WG's wgmmas of this round are issued; the other group's turn."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _step(t, acc, p_op, m_i, l_i, q_smem, p_row, s_zero, it, ring, keys, item,
          P_SMEM: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr, WS: gl.constexpr,
          MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
          STAGES: gl.constexpr, dtype: gl.constexpr, col_layout: gl.constexpr,
          row_o: gl.constexpr, p_layout: gl.constexpr, WG: gl.constexpr,
          PINGPONG: gl.constexpr, num_warps: gl.constexpr):
    """Key tile t (>= 1): S_t and P_{t-1} V_{t-1} issued together (PINGPONG: in group WG's
    turn), the softmax of S_t under the second, then the rescale; refills the K slot of tile t
    and the V slot of tile t - 1 (WS: releases them to the load partition instead). Tile t
    sits in ring position it + t (it: the program's earlier items' tiles; 0 without WS)."""
    g = it + t
    slot = _slot(g, STAGES)
    if not WS:
        # the refills' pages, read now: their latency hides under this tile's work
        k_page = _page_of(keys.page_idx_ptr, item.page_base, item.npages, t + STAGES, PAGED,
                          PAGE, BLOCK_N)
        v_page = _page_of(keys.page_idx_ptr, item.page_base, item.npages, t - 1 + STAGES, PAGED,
                          PAGE, BLOCK_N)
    _take_turn(ring.turn, g, WG, PINGPONG)
    _wait_kv(ring.k_bar, g, STAGES, PAGED)
    s_tok = warpgroup_mma(q_smem, ring.k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    prev = _wait_kv(ring.v_bar, g - 1, STAGES, PAGED)
    if MASKED and PAGED != PAGED_GATHER:  # (gathered tails repeat the last key: finite)
        if t * BLOCK_N > item.kv_len:  # tile t - 1 is the request's partial last tile
            _zero_tail(ring.v_ring, prev, item.kv_len - (t - 1) * BLOCK_N, D, BLOCK_N, num_warps)
    if P_SMEM:
        o_tok = warpgroup_mma(ring.p_ring.index((t - 1) % 2), ring.v_ring.index(prev), acc,
                              is_async=True)
    else:
        o_tok = warpgroup_mma(p_op, ring.v_ring.index(prev), acc, is_async=True)
    _pass_turn(ring.turn, WG, PINGPONG)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    if WS:
        _arrive_slot(ring.k_empty, g, STAGES)
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, t, item.kv_len, p_row, keys.qk_scale, MASKED,
                                       CAUSAL, BLOCK_N, col_layout)
    if P_SMEM:
        ring.p_ring.index(t % 2).store(p.to(dtype))
        fence_async_shared()
        p_next = p_op
    else:
        p_next = gl.convert_layout(p.to(dtype), p_layout)
    alpha = gl.convert_layout(alpha, row_o)
    # The softmax's results pass through the wait as dependencies (LLVM keeps them before
    # it; ptxas still waits for P V first when P sits in registers, see TILES).
    acc, p_op, p_next, alpha, m_i, l_i = warpgroup_mma_wait(
        0, deps=(o_tok, p_op, p_next, alpha, m_i, l_i))
    acc = acc * alpha[:, None]
    if WS:
        _arrive_slot(ring.v_empty, g - 1, STAGES)
    else:
        # Both wgmmas reading the two slots have completed (in every warp group: Gluon puts a
        # CTA barrier before each TMA into a buffer read earlier): refill them.
        _load_kv(keys.k_desc, ring.k_ring, ring.k_bar, t + STAGES, item.kv_start, item.hkv,
                 t + STAGES < item.n_tiles, k_page, keys.k_page_rows, PAGED, PAGE, BLOCK_N, D,
                 STAGES)
        _load_kv(keys.v_desc, ring.v_ring, ring.v_bar, t - 1 + STAGES, item.kv_start, item.hkv,
                 t - 1 + STAGES < item.n_tiles, v_page, keys.v_page_rows, PAGED, PAGE, BLOCK_N,
                 D, STAGES)
    return acc, p_next, m_i, l_i


@gluon.jit
def _consume(acc, m_i, l_i, p_row, q, q_smem, ring, keys, item, it, WG: gl.constexpr,
             P_SMEM: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr, WS: gl.constexpr,
             PINGPONG: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr, NW: gl.constexpr,
             Q_READY: gl.constexpr):
    """A compute group's walk over the work item's (Item) key tiles [0, n_tiles) (the first
    n_free unmasked) from the Ring's slots k_ring / v_ring filled on k_bar / v_bar (K / V from
    the Keys), after storing q [BLOCK_M, D] into q_smem: returns (acc [BLOCK_M, D], m_i, l_i).
    Without WS it also refills the slots (the first STAGES tiles are in flight already); WS:
    releases each slot on k_empty / v_empty to the load partition. PINGPONG: group WG of two,
    issuing its wgmmas in turns with the other (_take_turn). Tile t sits in ring position
    it + t (WS: it counts the program's earlier items' tiles; else 0)."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NW)
    o_layout: gl.constexpr = _mma_layout(D, NW)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    if not Q_READY:  # (Q_READY: the load warp's TMA has filled q_smem)
        if it > 0:
            _cta_barrier()  # every warp of the group is done with q_smem (the last item's O)
        q_smem.store(q)  # (Q's loads were in flight under the first K / V copies)
        fence_async_shared()
        _cta_barrier()
    if not WS:
        # tile STAGES's page, for the K refill once tile 0's scores are in
        k_next = _page_of(keys.page_idx_ptr, item.page_base, item.npages, STAGES, PAGED, PAGE,
                          BLOCK_N)

    # tile 0: its scores alone (nothing to overlap yet)
    s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    slot0 = _slot(it, STAGES)
    _take_turn(ring.turn, it, WG, PINGPONG)
    _wait_kv(ring.k_bar, it, STAGES, PAGED)
    s = warpgroup_mma(q_smem, ring.k_ring.index(slot0).permute((1, 0)), s_zero, use_acc=False)
    _pass_turn(ring.turn, WG, PINGPONG)
    if item.n_free > 0:
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, item.kv_len, p_row, keys.qk_scale,
                                           False, CAUSAL, BLOCK_N, col_s)
    else:
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, item.kv_len, p_row, keys.qk_scale,
                                           True, CAUSAL, BLOCK_N, col_s)
    if WS:
        _arrive_slot(ring.k_empty, it, STAGES)
    else:
        _cta_barrier()
        _load_kv(keys.k_desc, ring.k_ring, ring.k_bar, STAGES, item.kv_start, item.hkv,
                 STAGES < item.n_tiles, k_next, keys.k_page_rows, PAGED, PAGE, BLOCK_N, D, STAGES)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    if P_SMEM:
        ring.p_ring.index(0).store(p.to(dtype))
        fence_async_shared()

    for t in range(1, gl.maximum(item.n_free, 1)):
        acc, p_op, m_i, l_i = _step(
            t, acc, p_op, m_i, l_i, q_smem, p_row, s_zero, it, ring, keys, item, P_SMEM, PAGED,
            PAGE, WS, False, CAUSAL, BLOCK_N, D, STAGES, dtype, col_s, row_o, p_layout, WG,
            PINGPONG, NW)
    for t in range(gl.maximum(item.n_free, 1), item.n_tiles):
        acc, p_op, m_i, l_i = _step(
            t, acc, p_op, m_i, l_i, q_smem, p_row, s_zero, it, ring, keys, item, P_SMEM, PAGED,
            PAGE, WS, True, CAUSAL, BLOCK_N, D, STAGES, dtype, col_s, row_o, p_layout, WG,
            PINGPONG, NW)

    # the last tile's P V
    last = item.n_tiles - 1
    g_last = it + last
    v_last = _wait_kv(ring.v_bar, g_last, STAGES, PAGED)
    if PAGED != PAGED_GATHER and item.n_tiles * BLOCK_N > item.kv_len:
        _zero_tail(ring.v_ring, v_last, item.kv_len - last * BLOCK_N, D, BLOCK_N, NW)
    if P_SMEM:
        acc = warpgroup_mma(ring.p_ring.index(last % 2), ring.v_ring.index(v_last), acc)
    else:
        acc = warpgroup_mma(p_op, ring.v_ring.index(v_last), acc)
    if WS:  # the last V slot back to the load partition
        _arrive_slot(ring.v_empty, g_last, STAGES)
    return acc, m_i, l_i


@gluon.jit
def _row_map(r0, qo_len, hkv, GROUP: gl.constexpr, ROWS: gl.constexpr, layout: gl.constexpr):
    """Packed rows [r0, r0 + ROWS) in ``layout``: (token, query head, row < the request's)."""
    offs = r0 + gl.arange(0, ROWS, layout=layout)
    tok = offs // GROUP
    return tok, hkv * GROUP + offs % GROUP, tok < qo_len


@gluon.jit
def _load_q(q_ptr, q_base, qo_start, qo_len, hkv, r0, stride_qt, stride_qh, q_rows_ptr, map_on,
            GROUP: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr, NW: gl.constexpr,
            Q_ROWS: gl.constexpr):
    """Q of packed rows [r0, r0 + ROWS) [ROWS, D] through registers (rows past qo_len read 0).
    Q_ROWS, where map_on (a POD launch: the part's items with a map): the launch's row t reads
    q's row q_rows_ptr[t] (int32); else row t."""
    blk: gl.constexpr = _row_layout(D, NW)
    tok, head, ok = _row_map(r0, qo_len, hkv, GROUP, ROWS, gl.SliceLayout(1, blk))
    src = (qo_start + tok).to(gl.int64)
    if Q_ROWS:
        mapped = ok & map_on
        src = gl.where(mapped, gl.load(q_rows_ptr + qo_start + tok, mask=mapped, other=0), src)
    rows = q_base + src * stride_qt + head.to(gl.int64) * stride_qh
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    return gl.load(q_ptr + rows[:, None] + offs_d[None, :], mask=ok[:, None], other=0.0)


@gluon.jit
def _out_rows(o_base, qo_start, qo_len, hkv, r0, stride_ot, stride_oh, GROUP: gl.constexpr,
              ROWS: gl.constexpr, D: gl.constexpr, NW: gl.constexpr):
    """(element offsets [ROWS, D], rows < the request's [ROWS]) of O's packed rows [r0, r0 +
    ROWS), in _row_layout(D, NW)."""
    blk: gl.constexpr = _row_layout(D, NW)
    tok, head, ok = _row_map(r0, qo_len, hkv, GROUP, ROWS, gl.SliceLayout(1, blk))
    rows = o_base + (qo_start + tok).to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh
    return rows[:, None] + gl.arange(0, D, layout=gl.SliceLayout(0, blk))[None, :], ok


@gluon.jit
def _store_lse(lse, lse_ptr, l_base, qo_start, qo_len, hkv, r0, stride_lt, stride_lh,
               GROUP: gl.constexpr, ROWS: gl.constexpr, layout: gl.constexpr):
    """Store the base-2 LSE [ROWS] (in ``layout``) of packed rows [r0, r0 + ROWS)."""
    tok, head, ok = _row_map(r0, qo_len, hkv, GROUP, ROWS, layout)
    gl.store(lse_ptr + l_base + (qo_start + tok).to(gl.int64) * stride_lt
             + head.to(gl.int64) * stride_lh, lse, mask=ok)


@gluon.jit
def _store_rows(acc, m_i, l_i, r0, scratch, o_ptr, lse_ptr, o_base, l_base, qo_start, qo_len,
                hkv, stride_ot, stride_oh, stride_lt, stride_lh, GROUP: gl.constexpr,
                ROWS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr, NW: gl.constexpr,
                SWAP: gl.constexpr = False):
    """Epilogue of packed rows [r0, r0 + ROWS): O = acc / l and the base-2 LSE m + log2(l);
    rows that saw nothing (l = 0) write 0 and -inf. O changes layout for 16-byte stores
    through ``scratch`` [ROWS, D] (the group's Q buffer, free once its last wgmma is done: a
    layout conversion's own scratch could not reuse the rings, live across the partition).
    SWAP: the swapped products' acc^T [D, ROWS] (m_i, l_i along its columns), transposed back
    on its way through scratch."""
    dtype: gl.constexpr = o_ptr.dtype.element_ty
    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    if SWAP:
        lse_layout: gl.constexpr = gl.SliceLayout(0, _mma_layout(ROWS, NW))
        _cta_barrier()  # every warp's last product (reading Q) is done before O overwrites it
        scratch.store(gl.permute((acc / l_safe[None, :]).to(dtype), (1, 0)))
        _cta_barrier()
    else:
        lse_layout: gl.constexpr = gl.SliceLayout(1, _mma_layout(BLOCK_N, NW))
        row_o: gl.constexpr = gl.SliceLayout(1, _mma_layout(D, NW))
        scratch.store((acc / gl.convert_layout(l_safe, row_o)[:, None]).to(dtype))
    offs, ok = _out_rows(o_base, qo_start, qo_len, hkv, r0, stride_ot, stride_oh, GROUP, ROWS, D,
                         NW)
    gl.store(o_ptr + offs, scratch.load(_row_layout(D, NW)), mask=ok[:, None])
    _store_lse(gl.where(seen, m_i + gl.log2(l_safe), float("-inf")), lse_ptr, l_base, qo_start,
               qo_len, hkv, r0, stride_lt, stride_lh, GROUP, ROWS, lse_layout)


# ---- decode rows: the swapped products ----------------------------------------------------------
# A tile of at most SWAP_ROWS packed rows (decode rows: a request's query group, a token or a
# few) runs the products transposed: S^T = K Q^T [BLOCK_N, ROWS] and O^T += V^T P^T [D, ROWS],
# the keys (and V's dims) as the wgmma's M and the query rows as its N (a multiple of 8). A
# 64-row tile computes, exponentiates and multiplies 64 rows for the few it holds; these do an
# eighth of that. (That math did not set a program's read rate: a 64-key swap tile read what
# the 64-row tile reads, ~50 GB/s; the 128-key slots of SWAP_TILE read 64, benchmarks/NOTES.md,
# 2026-11-30.) The softmax runs down the key axis (a reduction across the warp group's warps
# for the max; the row sums stay per-thread partials, reduced once at the end) and P^T goes
# through shared memory as P [ROWS, BLOCK_N] read transposed, the B operand of the second
# product.
SWAP_ROWS = gl.constexpr(16)


@gluon.jit
def _consume_swap(q, q_smem, p_row, ring, keys, item, it, PAGED: gl.constexpr,
                  CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                  D: gl.constexpr, STAGES: gl.constexpr, NW: gl.constexpr):
    """A compute group's walk over the work item's key tiles with the swapped products (the
    section's comment), after storing q [ROWS, D] into q_smem: returns (acc^T [D, ROWS], m_i,
    l_i [ROWS]). p_row [ROWS]: each row's position (SliceLayout(0, the MMA layout)). Each K /
    V slot goes back to the load partition as soon as its product is done (WS only); tile t
    sits in ring position it + t. Every tile is masked (a few registers a thread)."""
    dtype: gl.constexpr = q_smem.dtype
    mma: gl.constexpr = _mma_layout(ROWS, NW)  # both products' [M, ROWS] results
    key_l: gl.constexpr = gl.SliceLayout(1, mma)
    if it > 0:
        _cta_barrier()  # every warp of the group is done with q_smem (the last item's O)
    q_smem.store(q)
    fence_async_shared()
    _cta_barrier()
    s_zero = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=mma)
    acc = gl.zeros([D, ROWS], gl.float32, layout=mma)
    m_i = gl.full([ROWS], float("-inf"), gl.float32, layout=gl.SliceLayout(0, mma))
    l_acc = gl.zeros([BLOCK_N, ROWS], gl.float32, layout=mma)
    for t in range(item.n_tiles):
        g = it + t
        slot = _wait_kv(ring.k_bar, g, STAGES, PAGED)
        s = warpgroup_mma(ring.k_ring.index(slot), q_smem.permute((1, 0)), s_zero,
                          use_acc=False)
        _arrive_slot(ring.k_empty, g, STAGES)
        j = t * BLOCK_N + gl.arange(0, BLOCK_N, layout=key_l)
        see = j[:, None] < item.kv_len
        if CAUSAL:
            see = see & (j[:, None] <= p_row[None, :])
        s = gl.where(see, s * keys.qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 0))
        # A row that has seen nothing yet keeps m = -inf; subtract 0 instead (no NaN).
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        p = gl.exp2(s - m_sub[None, :])
        alpha = gl.exp2(m_i - m_sub)
        l_acc = l_acc * alpha[None, :] + p
        m_i = m_new
        # P's two slots in turn: a warp writes tile t's P while another may still be reading
        # tile t - 1's slot in its product (the barrier below orders only this tile's)
        p_smem = ring.p_ring.index(t % 2)
        p_smem.store(gl.permute(p.to(dtype), (1, 0)))
        fence_async_shared()
        vslot = _wait_kv(ring.v_bar, g, STAGES, PAGED)
        if PAGED != PAGED_GATHER and (t + 1) * BLOCK_N > item.kv_len:
            _zero_tail(ring.v_ring, vslot, item.kv_len - t * BLOCK_N, D, BLOCK_N, NW)
        _cta_barrier()  # every warp's P is in p_smem before the warp group's product reads it
        acc = warpgroup_mma(ring.v_ring.index(vslot).permute((1, 0)), p_smem.permute((1, 0)),
                            acc * alpha[None, :])
        _arrive_slot(ring.v_empty, g, STAGES)
    return acc, m_i, gl.sum(l_acc, 0)


@gluon.jit
def _zero_rows(o_ptr, lse_ptr, o_base, l_base, qo_start, qo_len, hkv, r0, stride_ot, stride_oh,
               stride_lt, stride_lh, GROUP: gl.constexpr, ROWS: gl.constexpr, D: gl.constexpr,
               NW: gl.constexpr):
    """Packed rows [r0, r0 + ROWS) that see no key: O = 0 and LSE -inf (NW warps)."""
    dtype: gl.constexpr = o_ptr.dtype.element_ty
    offs, ok = _out_rows(o_base, qo_start, qo_len, hkv, r0, stride_ot, stride_oh, GROUP, ROWS, D,
                         NW)
    gl.store(o_ptr + offs, gl.zeros([ROWS, D], dtype, layout=_row_layout(D, NW)),
             mask=ok[:, None])
    row_l: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    _store_lse(gl.full([ROWS], float("-inf"), gl.float32, layout=row_l), lse_ptr, l_base,
               qo_start, qo_len, hkv, r0, stride_lt, stride_lh, GROUP, ROWS, row_l)


@gluon.jit
def _passes(item, BLOCK_M: gl.constexpr, GROUP: gl.constexpr):
    """The swapped products' passes over a work item with keys: its rows (at most BLOCK_M
    from row0) SWAP_ROWS at a time, each pass over all its key tiles."""
    rows = gl.minimum(item.qo_len * GROUP - item.row0, BLOCK_M)
    return (rows + SWAP_ROWS - 1) // SWAP_ROWS


@gluon.jit
def _ring_tiles(item, SWAP, BLOCK_M: gl.constexpr, GROUP: gl.constexpr):
    """The K / V ring positions a work item takes, the same count in the load partition and
    the compute groups: its key tiles, once for each of its passes with the swapped products
    (SWAP, a constexpr or, in POD, whether the item's part takes them: _passes, pass ps from
    position it + ps * n_tiles)."""
    n = item.n_tiles
    if SWAP:
        if n > 0:
            n = n * _passes(item, BLOCK_M, GROUP)
    return n


@gluon.jit
def _swap_passes(c, item, it, q_ring, PAGED: gl.constexpr, GROUP: gl.constexpr,
                 CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                 D: gl.constexpr, STAGES: gl.constexpr, NW: gl.constexpr,
                 Q_ROWS: gl.constexpr, map_on):
    """A work item with keys on the swapped products: its rows SWAP_ROWS at a time
    (_group_swap, pass ps over its key tiles from ring position it + ps * n_tiles), Q and O
    staged through the first SWAP_ROWS rows of Q slot 0 (q_ring [slots, BLOCK_M, D])."""
    for ps in range(_passes(item, BLOCK_M, GROUP)):
        _group_swap(c, item, item.row0 + ps * SWAP_ROWS, it + ps * item.n_tiles,
                    q_ring.index(0).slice(0, SWAP_ROWS), PAGED, GROUP, CAUSAL, BLOCK_N, D,
                    STAGES, NW, Q_ROWS, map_on)


@gluon.jit
def _group_swap(ctx, item, r0, it, q_buf, PAGED: gl.constexpr, GROUP: gl.constexpr,
                CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
                STAGES: gl.constexpr, NW: gl.constexpr, Q_ROWS: gl.constexpr = False,
                map_on=True):
    """_group with the swapped products (_consume_swap, _store_rows with SWAP; one compute
    group, K / V through the load partition) on packed rows [r0, r0 + SWAP_ROWS) of the work item,
    its key tiles from ring position it; q_buf [SWAP_ROWS, D] holds their Q, then O."""
    ROWS: gl.constexpr = SWAP_ROWS
    io = ctx.io
    st = ctx.st
    col: gl.constexpr = gl.SliceLayout(0, _mma_layout(ROWS, NW))
    p_row = item.kv_len - item.qo_len + (r0 + gl.arange(0, ROWS, layout=col)) // GROUP
    q = _load_q(io.q_ptr, item.req.to(gl.int64) * st.qb, item.qo_start, item.qo_len,
                item.hkv, r0, st.qt, st.qh, io.q_rows_ptr, map_on, GROUP, ROWS, D, NW,
                Q_ROWS)
    acc, m_i, l_i = _consume_swap(q, q_buf, p_row, ctx.ring, ctx.keys, item, it, PAGED,
                                  CAUSAL, ROWS, BLOCK_N, D, STAGES, NW)
    _store_rows(acc, m_i, l_i, r0, q_buf, io.o_ptr, io.lse_ptr, item.req.to(gl.int64) * st.ob,
                item.req.to(gl.int64) * st.lb, item.qo_start, item.qo_len, item.hkv, st.ot, st.oh,
                st.lt, st.lh, GROUP, ROWS, BLOCK_N, D, NW, True)


@gluon.jit
def _group(WG: gl.constexpr, ctx, item, it, q_buf, Q_TMA: gl.constexpr,
           P_SMEM: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr, WS: gl.constexpr,
           PINGPONG: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
           ROWS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
           STAGES: gl.constexpr, NW: gl.constexpr, Q_ROWS: gl.constexpr = False,
           map_on=True):
    """Compute group WG (NW warps) on one work item with keys (n_tiles > 0): packed rows
    [row0 + WG * ROWS, + ROWS) of the tile, from Q's load to the epilogue (a worker partition
    returns nothing, so each group writes its own rows). ctx: the launch's Ctx (_gluon_fwd
    builds it); item: the work Item (_item_of); it: the ring position of its first key tile.
    q_buf [BLOCK_M, D]: the Q buffer whose ROWS-row slice is the group's (Q_TMA: filled
    already; else the group stores its Q there), then its O's staging. Q_ROWS: Q's rows
    through ctx's row map where map_on (_load_q)."""
    io = ctx.io
    st = ctx.st
    s_layout: gl.constexpr = _mma_layout(BLOCK_N, NW)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    r0 = item.row0 + WG * ROWS
    p_row = item.kv_len - item.qo_len + (r0 + gl.arange(0, ROWS, layout=row_s)) // GROUP
    if Q_TMA:  # q_buf holds Q already (the load warp's TMA)
        q = p_row  # (a stand-in)
    else:
        q = _load_q(io.q_ptr, item.req.to(gl.int64) * st.qb, item.qo_start, item.qo_len,
                    item.hkv, r0, st.qt, st.qh, io.q_rows_ptr, map_on, GROUP, ROWS, D, NW,
                    Q_ROWS)
    acc, m_i, l_i = _consume(
        gl.zeros([ROWS, D], gl.float32, layout=_mma_layout(D, NW)),
        gl.full([ROWS], float("-inf"), gl.float32, layout=row_s),
        gl.zeros([ROWS], gl.float32, layout=row_s), p_row, q, q_buf.slice(WG * ROWS, ROWS),
        ctx.ring, ctx.keys, item, it, WG, P_SMEM, PAGED, PAGE, WS, PINGPONG, CAUSAL, ROWS,
        BLOCK_N, D, STAGES, NW, Q_TMA)
    _store_rows(acc, m_i, l_i, r0, q_buf.slice(WG * ROWS, ROWS), io.o_ptr, io.lse_ptr,
                item.req.to(gl.int64) * st.ob, item.req.to(gl.int64) * st.lb, item.qo_start,
                item.qo_len, item.hkv, st.ot, st.oh, st.lt, st.lh, GROUP, ROWS, BLOCK_N, D, NW)


@gluon.jit
def _item_of(lin, ctx, DENSE: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr,
             GROUP: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
             BLOCK_N: gl.constexpr):
    """Work item ``lin`` (of n_items * n_hkv: the work list's items for KV head 0, then head
    1, ...) of the launch ctx, as an Item (_span_item)."""
    w = ctx.work
    if DENSE:
        req, row0, hkv = _dense_item(lin, w.n_items, w.dense_tiles, w.dense_group, w.n_req,
                                     w.n_hkv, BLOCK_M)
        return _span_item(req, row0, hkv, 0, w.dense_qo_len, req * w.dense_kv_len,
                          w.dense_kv_len, 0, 0, GROUP, CAUSAL, BLOCK_M, BLOCK_N)
    else:
        hkv = lin // w.n_items
        x = lin - hkv * w.n_items
        return _request_item(gl.load(w.work_ptr + x * 2), gl.load(w.work_ptr + x * 2 + 1), hkv,
                             w, PAGED, PAGE, False, GROUP, CAUSAL, BLOCK_M, BLOCK_N)


@gluon.jit
def _request_item(req, row0, hkv, w, PAGED: gl.constexpr, PAGE: gl.constexpr,
                  ONE_PAGE: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """The Item of work row (request, first packed row) for KV head hkv on the Work w's
    indptrs (request -1: a padding item, no rows). PAGED: kv_indptr counts pages of PAGE keys
    (last_page_len in the last); else it counts rows, or with ONE_PAGE pages of a one-page cache,
    whose request reads the first last_page_len rows of that page (POD's prefill part:
    _pod_item)."""
    req_c = gl.maximum(req, 0)
    qo_start = gl.load(w.qo_indptr_ptr + req_c)
    qo_len = gl.load(w.qo_indptr_ptr + req_c + 1) - qo_start
    if PAGED:
        page_base = gl.load(w.kv_indptr_ptr + req_c)
        npages = gl.load(w.kv_indptr_ptr + req_c + 1) - page_base
        last = gl.load(w.last_page_len_ptr + req_c)
        kv_len = gl.where(npages > 0, (npages - 1) * PAGE + last, 0)
        kv_start = 0
    elif ONE_PAGE:
        npages = gl.load(w.kv_indptr_ptr + req_c + 1) - gl.load(w.kv_indptr_ptr + req_c)
        kv_len = gl.where(npages > 0, gl.load(w.last_page_len_ptr + req_c), 0)
        kv_start = 0
        page_base = 0
        npages = 0
    else:
        kv_start = gl.load(w.kv_indptr_ptr + req_c)
        kv_len = gl.load(w.kv_indptr_ptr + req_c + 1) - kv_start
        page_base = 0
        npages = 0
    qo_len = gl.where(req < 0, 0, qo_len)  # padding item: no rows
    return _span_item(req_c, row0, hkv, qo_start, qo_len, kv_start, kv_len, page_base, npages,
                      GROUP, CAUSAL, BLOCK_M, BLOCK_N)


@gluon.jit
def _span_item(req, row0, hkv, qo_start, qo_len, kv_start, kv_len, page_base, npages,
               GROUP: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr,
               BLOCK_N: gl.constexpr):
    """The Item of packed rows [row0, row0 + BLOCK_M) of a request's rows (qo_start, qo_len)
    against its keys: key tiles [0, n_free) visible to every row, [n_free, n_tiles) masked;
    n_tiles is 0 when the item is not valid (rows past the request's)."""
    valid = row0 < qo_len * GROUP
    tok_lo = row0 // GROUP
    tok_hi = gl.minimum((row0 + BLOCK_M - 1) // GROUP, qo_len - 1)
    if CAUSAL:
        n_end = gl.minimum(kv_len, kv_len - qo_len + tok_hi + 1)
        free = gl.minimum(kv_len, kv_len - qo_len + tok_lo + 1)
    else:
        n_end = kv_len
        free = kv_len
    n_tiles = gl.where(valid, (gl.maximum(n_end, 0) + BLOCK_N - 1) // BLOCK_N, 0)
    n_free = gl.maximum(free, 0) // BLOCK_N
    return Item(req, row0, hkv, qo_start, qo_len, kv_start, kv_len, page_base, npages, n_tiles,
                n_free, valid)


@gluon.jit
def _pod_item(lin, ctx, pod, PAGED: gl.constexpr, PAGE: gl.constexpr, PAGED_D: gl.constexpr,
              PAGE_D: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr):
    """POD's work item ``lin`` as (part, Item): work rows int32 [W, 3] of (part, request,
    first packed row), item lin = x + head * W. Part 0, the prefill, on ctx's Work: paged
    (PAGED) or a one-page cache (PAGED 0, ONE_PAGE); part 1, the decodes, on pod's Work
    (PAGED_D, PAGE_D)."""
    w = ctx.work
    hkv = lin // w.n_items
    x = lin - hkv * w.n_items
    part = gl.load(w.work_ptr + x * 3)
    req = gl.load(w.work_ptr + x * 3 + 1)
    row0 = gl.load(w.work_ptr + x * 3 + 2)
    if part == 0:
        item = _request_item(req, row0, hkv, w, PAGED, PAGE, not PAGED, GROUP, CAUSAL, BLOCK_M,
                             BLOCK_N)
    else:
        item = _request_item(req, row0, hkv, pod.work, PAGED_D, PAGE_D, False, GROUP, CAUSAL,
                             BLOCK_M, BLOCK_N)
    return part, item


# POD's work item records carry the item's part in this lane (after lin and Item's 12 fields)
POD_PART_LANE = gl.constexpr(13)


@constexpr_function
def _lane_layout(num_warps):
    """A [32] tensor over num_warps warps: a lane's value in every warp (the load warp's item
    record, _pack_item)."""
    return gl.BlockedLayout([1], [32], [num_warps], [0])


@constexpr_function
def _rec_layout(num_warps):
    """A [32] record every thread of num_warps warps holds whole (fields read without
    shuffles)."""
    return gl.BlockedLayout([32], [32], [num_warps], [0])


@gluon.jit
def _next_item(sched_ptr, total, NW: gl.constexpr):
    """The load partition's (NW warps') next work item: num_programs + a global counter's old
    value (every program starts on item program_id; the counter, 0 when the launch starts,
    hands out the rest in order, so each item goes to the first program free for it, as the
    hardware hands out programs, and concurrent items stay neighbours in the work list, their
    K / V shared in L2). One thread's atomic, summed over the partition.
    The launch claims exactly ``total`` times (the items past the first num_programs, then one
    claim past the end by each program that had an item), so the claim that finds total - 1
    is the last one: it puts the counter back to 0, and the next launch given this counter (a
    CUDA graph's replay: launch.counter) needs no zeroing."""
    idx = gl.arange(0, 32 * NW, layout=gl.BlockedLayout([1], [32], [NW], [0]))
    first = idx == 0
    old = gl.atomic_add(sched_ptr + idx * 0, idx * 0 + 1, mask=first)
    gl.atomic_xchg(sched_ptr + idx * 0, idx * 0, mask=first & (old == total - 1))
    return gl.num_programs(0) + gl.sum(gl.where(first, old, 0), 0)


@gluon.jit
def _pack_item(lin, item, NW: gl.constexpr):
    """The load partition's (NW warps') record of work item lin for the compute groups: [32]
    int32 in _lane_layout(NW), lane 0 lin, lane f + 1 the Item's field f (_ws_group reads
    them back by the same rule)."""
    lane = gl.arange(0, 32, layout=_lane_layout(NW))
    v = gl.full([32], 0, gl.int32, layout=_lane_layout(NW))
    v = gl.where(lane == 0, lin, v)
    for f in gl.static_range(12):  # (Item's fields)
        v = gl.where(lane == f + 1, item[f].to(gl.int32), v)
    return v


@gluon.jit
def _field(v, f: gl.constexpr):
    """Lane f of a record v (_pack_item) as a scalar."""
    lane = gl.arange(0, 32, layout=v.type.layout)
    return gl.sum(gl.where(lane == f, v, 0), 0)


@gluon.jit
def _publish_item(items, item_full, item_empty, k, rec):
    """The load warp hands the program's k-th work item's record ``rec`` [32] (_pack_item; a
    lin past the launch's items: stop) to the compute groups through slot k % 2 of ``items``
    [2, 32], once every group has read the item two before it."""
    slot = _wait_empty(item_empty, k, 2)
    items.index(slot).store(rec)
    _arrive_slot(item_full, k, 2)


@gluon.jit
def _take_item(items, item_full, item_empty, k, NW: gl.constexpr):
    """A compute group's (NW warps') k-th work item's record from the load warp
    (_publish_item), every thread holding it whole (_rec_layout)."""
    slot = _wait_full(item_full, k, 2)
    rec = items.index(slot).load(_rec_layout(NW))
    _arrive_slot(item_empty, k, 2)
    return rec


@gluon.jit
def _ws_group(WG: gl.constexpr, ctx, DENSE: gl.constexpr, Q_TMA: gl.constexpr,
              P_SMEM: gl.constexpr, PAGED: gl.constexpr, PAGE: gl.constexpr,
              PINGPONG: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
              BLOCK_M: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
              STAGES: gl.constexpr, NW: gl.constexpr, pod=None, POD: gl.constexpr = False,
              Q_ROWS: gl.constexpr = False, SWAP: gl.constexpr = False,
              SWAP_D: gl.constexpr = False):
    """Compute group WG of a persistent program: its rows of the work items the load warp
    hands it (_take_item; _group, or _zero_rows for rows that see no key), the ring position
    and (Q_TMA) the Q slot running on across items in step with the load warp's; a Q slot
    goes back to the load warp once the item's O, staged through it, is written. POD: an item
    of part 1 (the record's lane 13) reads Q and writes O / LSE through pod (_part_ctx).
    Q_ROWS: as _group's (POD: part 1's rows through pod's row map). SWAP: every item's rows
    SWAP_ROWS at a time with the swapped products (_group_swap; _passes of its key tiles,
    which the load warp issues as many times); SWAP_D (POD): part 1's items alike."""
    h = ctx.handoff
    total = ctx.work.n_items * ctx.work.n_hkv
    it = 0
    k = 0
    qk = 0  # items with keys so far: Q_TMA's slot qk % 2
    rec = _take_item(h.items, h.item_full, h.item_empty, k, NW)
    while _field(rec, 0) < total:
        # (lane f + 1 of the record holds the Item's field f: _pack_item)
        item = Item(_field(rec, 1), _field(rec, 2), _field(rec, 3), _field(rec, 4),
                    _field(rec, 5), _field(rec, 6), _field(rec, 7), _field(rec, 8),
                    _field(rec, 9), _field(rec, 10), _field(rec, 11), _field(rec, 12) != 0)
        if POD:
            part = _field(rec, POD_PART_LANE)
            c = _part_ctx(ctx, pod, part)
            map_on = part != 0  # (Q_ROWS: the decodes' row map)
        else:
            c = ctx
            map_on = True
        if item.n_tiles > 0:
            if SWAP or (SWAP_D and part != 0):  # (SWAP_D: POD's decodes)
                _swap_passes(c, item, it, ctx.ring.q_ring, PAGED, GROUP, CAUSAL, BLOCK_M,
                             BLOCK_N, D, STAGES, NW, Q_ROWS, map_on)
            else:
                if Q_TMA:
                    q_buf = ctx.ring.q_ring.index(_wait_full(h.q_full, qk, 2))
                else:
                    q_buf = ctx.ring.q_ring.index(0)
                _group(WG, c, item, it, q_buf, Q_TMA, P_SMEM, PAGED, PAGE, True, PINGPONG,
                       GROUP, CAUSAL, ROWS, BLOCK_N, D, STAGES, NW, Q_ROWS, map_on)
                if Q_TMA:  # the slot (its O written through it) back to the load warp
                    fence_async_shared()
                    _arrive_slot(h.q_empty, qk, 2)
                qk += 1
        elif item.valid:
            io, st = c.io, c.st
            _zero_rows(io.o_ptr, io.lse_ptr, item.req.to(gl.int64) * st.ob,
                       item.req.to(gl.int64) * st.lb, item.qo_start, item.qo_len, item.hkv,
                       item.row0 + WG * ROWS, st.ot, st.oh, st.lt, st.lh, GROUP, ROWS, D, NW)
        it += _ring_tiles(item, (part != 0) if SWAP_D else SWAP, BLOCK_M, GROUP)
        k += 1
        rec = _take_item(h.items, h.item_full, h.item_empty, k, NW)


@gluon.jit
def _part_ctx(ctx, pod, part):
    """The Ctx a POD work item's compute groups run on: ctx for part 0, for part 1 pod's Io,
    RowStrides and logit scale over ctx's rings (K / V sources are the load warp's alone)."""
    if part == 0:
        io, st, qk_scale = ctx.io, ctx.st, ctx.keys.qk_scale
    else:
        io, st, qk_scale = pod.io, pod.st, pod.keys.qk_scale
    keys = ctx.keys
    return Ctx(io, ctx.ring, Keys(keys.k_desc, keys.v_desc, qk_scale, keys.page_idx_ptr,
                                  keys.k_page_rows, keys.v_page_rows),
               st, ctx.work, ctx.handoff, ctx.gather)


@gluon.jit
def _produce_passes(keys, ctx, item, it, SWAP: gl.constexpr, PAGED: gl.constexpr,
                    PAGE: gl.constexpr, GROUP: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                    BOXES: gl.constexpr, WIDE: gl.constexpr):
    """_produce of a work item from ring position it, once for each of its compute group's
    passes where it runs the swapped products (SWAP: _passes, pass ps from it + ps * n_tiles),
    else once."""
    if SWAP:
        if item.n_tiles > 0:
            for ps in range(_passes(item, BLOCK_M, GROUP)):
                _produce(keys, ctx, item, it + ps * item.n_tiles, PAGED, PAGE, BLOCK_N, D,
                         STAGES, BOXES, WIDE)
    else:
        _produce(keys, ctx, item, it, PAGED, PAGE, BLOCK_N, D, STAGES, BOXES, WIDE)


@gluon.jit
def _produce(keys, ctx, item, it, PAGED: gl.constexpr, PAGE: gl.constexpr,
             BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
             BOXES: gl.constexpr, WIDE: gl.constexpr):
    """The load partition's K / V copies of one work item (_item_producer) from the Keys
    ``keys`` (PAGED_GATHER: from ctx's Gather) into ctx's rings."""
    ring, gather = ctx.ring, ctx.gather
    _item_producer(keys.k_desc, keys.v_desc, gather.k_ptr, gather.v_ptr, ring.k_ring,
                   ring.v_ring, ring.k_bar, ring.v_bar, ring.k_empty, ring.v_empty, item.n_tiles,
                   it, item.kv_start, item.kv_len, item.hkv, keys.page_idx_ptr,
                   item.page_base, item.npages, keys.k_page_rows, keys.v_page_rows,
                   gather.stride_kr, gather.stride_vr, PAGED, PAGE, BLOCK_N, D, STAGES, BOXES,
                   WIDE)


@gluon.jit
def _ws_loader(ctx, DENSE: gl.constexpr, Q_TMA: gl.constexpr, PAGED: gl.constexpr,
               PAGE: gl.constexpr, GROUP: gl.constexpr, CAUSAL: gl.constexpr,
               BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
               STAGES: gl.constexpr, BOXES: gl.constexpr, WIDE: gl.constexpr, pod=None,
               POD: gl.constexpr = False, PAGED_D: gl.constexpr = 0, PAGE_D: gl.constexpr = 0,
               BOXES_D: gl.constexpr = 1, SWAP: gl.constexpr = False,
               SWAP_D: gl.constexpr = False):
    """The load partition of a persistent program: takes work items (program_id first, then
    _next_item), decodes each and hands its record to the compute groups (_publish_item),
    brings its Q rows by TMA into Q slot qk % 2 (Q_TMA, items with keys) and issues its K / V
    tiles (_ws_producer; PAGED_GATHER: _gather_producer, the partition a warp group), running
    on into the next item while the groups finish this one; a last index past the items stops
    them. POD: the items of POD's work rows (_pod_item), part 0's K / V from ctx's Keys
    (PAGED 0: the one-page prefill, read as contiguous rows), part 1's from pod's (PAGED_D,
    PAGE_D, BOXES_D); the record's lane POD_PART_LANE carries the part. SWAP (SWAP_D: part
    1's items): an item's tiles go out once for each of its compute group's passes
    (_passes)."""
    ring, keys, h = ctx.ring, ctx.keys, ctx.handoff
    total = ctx.work.n_items * ctx.work.n_hkv
    LOAD_WARPS: gl.constexpr = _load_warps(PAGED)
    it = 0
    k = 0
    qk = 0
    lin = gl.program_id(0)
    while lin < total:
        if POD:
            part, item = _pod_item(lin, ctx, pod, PAGED, PAGE, PAGED_D, PAGE_D, GROUP, CAUSAL,
                                   BLOCK_M, BLOCK_N)
            lane = gl.arange(0, 32, layout=_lane_layout(LOAD_WARPS))
            rec = gl.where(lane == POD_PART_LANE, part, _pack_item(lin, item, LOAD_WARPS))
        else:
            item = _item_of(lin, ctx, DENSE, PAGED, PAGE, GROUP, CAUSAL, BLOCK_M, BLOCK_N)
            rec = _pack_item(lin, item, LOAD_WARPS)
        _publish_item(h.items, h.item_full, h.item_empty, k, rec)
        n_tiles = item.n_tiles
        if Q_TMA:
            if n_tiles > 0:  # the item's Q rows (GROUP 1: packed row = token) into slot qk % 2
                qs = _wait_empty(h.q_empty, qk, 2)
                mbarrier.expect(h.q_full.index(qs),
                                BLOCK_M * D * h.q_desc.dtype.primitive_bitwidth // 8)
                _tma_load(h.q_desc,
                          [item.req * h.q_req_rows + item.qo_start + item.row0, item.hkv * D],
                          h.q_full.index(qs), ring.q_ring.index(qs))
                qk += 1
        if POD:
            if part == 0:
                _produce(keys, ctx, item, it, PAGED, PAGE, BLOCK_N, D, STAGES, BOXES, WIDE)
            else:
                _produce_passes(pod.keys, pod, item, it, SWAP_D, PAGED_D, PAGE_D, GROUP,
                                BLOCK_M, BLOCK_N, D, STAGES, BOXES_D, WIDE)
        else:
            _produce_passes(keys, ctx, item, it, SWAP, PAGED, PAGE, GROUP, BLOCK_M, BLOCK_N, D,
                            STAGES, BOXES, WIDE)
        it += _ring_tiles(item, (part != 0) if SWAP_D else SWAP, BLOCK_M, GROUP)
        k += 1
        lin = _next_item(h.sched_ptr, total, LOAD_WARPS)
    _publish_item(h.items, h.item_full, h.item_empty, k,
                  gl.full([32], lin, gl.int32, layout=_lane_layout(LOAD_WARPS)))


@gluon.jit
def _dense_item(lin, n_items, dense_tiles, dense_group, n_req, n_hkv, BLOCK_M: gl.constexpr):
    """(batch entry, first packed row, KV head) of dense item ``lin`` in launch order: the
    (entry, KV head) pairs taken dense_group at a time, a group's tiles heaviest first with its
    pairs side by side (the order of prefill_kernel._work_item's dense mode, which
    prefill_kernel._dense_group sizes)."""
    per_group = dense_group * dense_tiles
    g = lin // per_group
    r = lin - g * per_group
    pairs = gl.minimum(dense_group, n_req * n_hkv - g * dense_group)
    pair = g * dense_group + r % pairs
    return pair % n_req, (dense_tiles - 1 - r // pairs) * BLOCK_M, pair // n_req


@gluon.jit
def _shared_state(dtype: gl.constexpr, k_desc, v_desc, q_desc, Q_TMA: gl.constexpr,
                  P_SMEM: gl.constexpr,
                  PAGED: gl.constexpr, PINGPONG: gl.constexpr, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                  SWAP: gl.constexpr = False):
    """A program's shared memory, barriers initialised: the Ring, and the persistent
    programs' handoff (item records, their barriers, Q's TMA slot barriers). K / V slots in
    the layouts of the descriptors k_desc / v_desc; Q_TMA: two Q slots in q_desc's."""
    RELEASES: gl.constexpr = 2 if PINGPONG else 1  # arrivals that free a slot (WS)
    # P's slots: [BLOCK_M, BLOCK_N] (P_SMEM), [SWAP_ROWS, BLOCK_N] (SWAP: the swapped
    # products' two, taken in turn), else a stand-in
    P_ROWS: gl.constexpr = SWAP_ROWS if SWAP else (BLOCK_M if P_SMEM else 8)
    P_COLS: gl.constexpr = BLOCK_N if P_SMEM or SWAP else 64
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth, rank=2)
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
    # k_bar / v_bar: slot filled; k_empty / v_empty (WS): slot released by the compute
    # warps; turn (PINGPONG): the groups' turns to issue their wgmmas
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    p_ring = gl.allocate_shared_memory(dtype, [2, P_ROWS, P_COLS], q_smem_layout)
    # Q: two slots with Q_TMA (filled by the load warp's TMA, an item ahead), else one (stored
    # by the compute groups)
    if Q_TMA:
        q_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_M, D], q_desc.layout)
    else:
        q_ring = gl.allocate_shared_memory(dtype, [1, BLOCK_M, D], q_smem_layout)
    q_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    # a slot is filled by one TMA (its expected bytes) or, PAGED_GATHER, by every producer
    # thread's copies (each arriving when its own have landed)
    FILLS: gl.constexpr = GATHER_WARPS * 32 if PAGED == PAGED_GATHER else 1
    for i in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(i), count=FILLS)
        mbarrier.init(v_bar.index(i), count=FILLS)
        mbarrier.init(k_empty.index(i), count=RELEASES)
        mbarrier.init(v_empty.index(i), count=RELEASES)
    mbarrier.init(turn.index(0), count=1)
    mbarrier.init(turn.index(1), count=1)
    # PERSISTENT: the work item's record handed from the load warp to the compute groups
    # (_publish_item): two slots, each read by every group before it is refilled
    items = gl.allocate_shared_memory(gl.int32, [2, 32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    item_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    item_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(item_full.index(i), count=1)
        mbarrier.init(item_empty.index(i), count=RELEASES)
        mbarrier.init(q_full.index(i), count=1)
        mbarrier.init(q_empty.index(i), count=RELEASES)
    fence_async_shared()
    return (Ring(q_ring, k_ring, v_ring, k_bar, v_bar, k_empty, v_empty, p_ring, turn),
            (items, item_full, item_empty, q_full, q_empty))


@gluon.jit
def _release_state(ring, item_bars, STAGES: gl.constexpr):
    """Invalidate the barriers _shared_state initialised."""
    items, item_full, item_empty, q_full, q_empty = item_bars
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ring.k_bar.index(i))
        mbarrier.invalidate(ring.v_bar.index(i))
        mbarrier.invalidate(ring.k_empty.index(i))
        mbarrier.invalidate(ring.v_empty.index(i))
    mbarrier.invalidate(ring.turn.index(0))
    mbarrier.invalidate(ring.turn.index(1))
    for i in gl.static_range(2):
        mbarrier.invalidate(item_full.index(i))
        mbarrier.invalidate(item_empty.index(i))
        mbarrier.invalidate(q_full.index(i))
        mbarrier.invalidate(q_empty.index(i))


@gluon.jit
def _gluon_fwd(
    work_ptr, q_ptr, k_desc, v_desc, o_ptr, lse_ptr, qo_indptr_ptr, kv_indptr_ptr,
    page_idx_ptr, last_page_len_ptr, page_rows, row_strides, qk_scale, work_sizes, sched_ptr,
    q_desc, q_req_rows, k_ptr, v_ptr, gather_strides, q_rows_ptr,
    SOURCE: gl.constexpr, SHAPE: gl.constexpr, SCHEDULE: gl.constexpr, num_warps: gl.constexpr,
):
    """Scalars and constexprs come in bundles (the named tuples above): page_rows a PageRows,
    row_strides a RowStrides, work_sizes a WorkSizes, gather_strides a GatherStrides; SOURCE a
    Source, SHAPE a Shape, SCHEDULE a Schedule. Below, a field goes by its own name (PAGED is
    SOURCE.PAGED, n_items work_sizes.n_items). Work items: n_items per KV head, item lin = x +
    head * n_items. Without PERSISTENT the grid is (n_items, KV heads), a program per item;
    PERSISTENT programs (WS) take their items from the load warp (_ws_loader): program_id
    first, then the next from sched_ptr (int32 [1], 0 at the start, 0 again at the end:
    _next_item) until none is left, a 1D grid of at most the programs the GPU holds at once.
    Q_TMA (PERSISTENT, GROUP 1): the load warp also brings each item's Q rows by TMA through
    q_desc (Q seen as [rows, Hq * D], blocks [BLOCK_M, D]; request b's rows from b *
    q_req_rows), an item ahead. Ragged (DENSE off): work_ptr int32 [W, 2] of (request, first
    packed row) as plan.build_work makes it, indptrs int32 [R + 1], q [N, Hq, D], o [N, Hq, D],
    lse float32 [N, Hq] (batch strides 0). Dense: n_items = n_req * dense_tiles items derived by
    _dense_item, every request dense_qo_len rows against dense_kv_len keys, q / o [B, Sq, Hq,
    D], lse [B, Sq, Hq]. k_desc / v_desc: host descriptors over K / V seen as [rows, Hkv * D]
    (ragged N_kv rows; dense B * Skv, request b's keys from b * Skv), blocks [BLOCK_N, D]. PAGED
    (ragged work list and rows; PAGE a multiple of BLOCK_N): K / V caches [pages, PAGE, Hkv, D]
    seen as rows of Hkv * D, page p from row p * k_page_rows / v_page_rows (a combined [pages,
    2, PAGE, Hkv, D] cache interleaves them), kv_indptr the page indptr, page_idx_ptr the page
    table, last_page_len_ptr each request's keys in its last page; PAGED_GATHER reads the caches
    through k_ptr / v_ptr (the same 2D views, rows stride_kr / stride_vr elements apart) instead
    of the descriptors, whose layout then only shapes the rings. Unit dim strides; the LSE is
    base 2. PINGPONG (with WS): two compute groups of num_warps warps and BLOCK_M / 2 rows each,
    the second a worker partition at GROUP_REGS registers. Q_ROWS (not with Q_TMA): row t of
    the work's rows (o's and the LSE's row t) reads q's row q_rows_ptr[t], int32 [rows],
    instead of q's row t. SWAP (PERSISTENT, one compute group, not Q_TMA): the swapped
    products, each item's rows SWAP_ROWS at a time (_group_swap)."""
    PAGED: gl.constexpr = SOURCE.PAGED
    PAGE: gl.constexpr = SOURCE.PAGE
    BOXES: gl.constexpr = SOURCE.BOXES
    WIDE: gl.constexpr = SOURCE.WIDE
    GROUP: gl.constexpr = SHAPE.GROUP
    CAUSAL: gl.constexpr = SHAPE.CAUSAL
    BLOCK_M: gl.constexpr = SHAPE.BLOCK_M
    BLOCK_N: gl.constexpr = SHAPE.BLOCK_N
    D: gl.constexpr = SHAPE.D
    STAGES: gl.constexpr = SHAPE.STAGES
    DENSE: gl.constexpr = SCHEDULE.DENSE
    Q_TMA: gl.constexpr = SCHEDULE.Q_TMA
    P_SMEM: gl.constexpr = SCHEDULE.P_SMEM
    WS: gl.constexpr = SCHEDULE.WS
    PERSISTENT: gl.constexpr = SCHEDULE.PERSISTENT
    PINGPONG: gl.constexpr = SCHEDULE.PINGPONG
    PRODUCER_REGS: gl.constexpr = SCHEDULE.PRODUCER_REGS
    GROUP_REGS: gl.constexpr = SCHEDULE.GROUP_REGS
    Q_ROWS: gl.constexpr = SCHEDULE.Q_ROWS
    SWAP: gl.constexpr = SCHEDULE.SWAP
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    # PINGPONG: two compute groups of ROWS rows; else one of BLOCK_M (num_warps warps each)
    ROWS: gl.constexpr = BLOCK_M // 2 if PINGPONG else BLOCK_M
    ring, item_bars = _shared_state(dtype, k_desc, v_desc, q_desc, Q_TMA, P_SMEM, PAGED,
                                    PINGPONG, BLOCK_M, BLOCK_N, D, STAGES, SWAP)
    items, item_full, item_empty, q_full, q_empty = item_bars
    q_ring, k_ring, v_ring, k_bar, v_bar, k_empty, v_empty = (
        ring.q_ring, ring.k_ring, ring.v_ring, ring.k_bar, ring.v_bar, ring.k_empty, ring.v_empty)
    # the launch's runtime values (Ctx)
    ctx = Ctx(Io(q_ptr, o_ptr, lse_ptr, q_rows_ptr),
              ring,
              Keys(k_desc, v_desc, qk_scale, page_idx_ptr, page_rows.k_page_rows,
                   page_rows.v_page_rows),
              row_strides,
              Work(work_ptr, qo_indptr_ptr, kv_indptr_ptr, last_page_len_ptr, work_sizes.n_items,
                   work_sizes.n_req, work_sizes.n_hkv, work_sizes.dense_tiles,
                   work_sizes.dense_group, work_sizes.dense_qo_len, work_sizes.dense_kv_len),
              Handoff(items, item_full, item_empty, sched_ptr, q_full, q_empty, q_desc,
                      q_req_rows),
              Gather(k_ptr, v_ptr, gather_strides.stride_kr, gather_strides.stride_vr))
    LOAD_WARPS: gl.constexpr = _load_warps(PAGED)
    if PERSISTENT:
        # The load warp takes the work items (program_id, then a global counter's) and starts
        # the next item's Q and K / V while the groups finish this one.
        if PINGPONG:
            gl.warp_specialize([
                (_ws_group, (0, ctx, DENSE, Q_TMA, P_SMEM, PAGED, PAGE, PINGPONG, GROUP, CAUSAL,
                             BLOCK_M, ROWS, BLOCK_N, D, STAGES, num_warps, ctx, False,
                             Q_ROWS)),
                (_ws_group, (1, ctx, DENSE, Q_TMA, P_SMEM, PAGED, PAGE, PINGPONG, GROUP, CAUSAL,
                             BLOCK_M, ROWS, BLOCK_N, D, STAGES, num_warps, ctx, False,
                             Q_ROWS)),
                (_ws_loader, (ctx, DENSE, Q_TMA, PAGED, PAGE, GROUP, CAUSAL, BLOCK_M, BLOCK_N, D,
                              STAGES, BOXES, WIDE, ctx, False, 0, 0, 1)),
            ], [num_warps, LOAD_WARPS], [GROUP_REGS, PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_ws_group, (0, ctx, DENSE, Q_TMA, P_SMEM, PAGED, PAGE, PINGPONG, GROUP, CAUSAL,
                             BLOCK_M, ROWS, BLOCK_N, D, STAGES, num_warps, ctx, False,
                             Q_ROWS, SWAP)),
                (_ws_loader, (ctx, DENSE, Q_TMA, PAGED, PAGE, GROUP, CAUSAL, BLOCK_M, BLOCK_N, D,
                              STAGES, BOXES, WIDE, ctx, False, 0, 0, 1, SWAP)),
            ], [LOAD_WARPS], [PRODUCER_REGS])
    else:  # one work item per program, every partition decoding it (grid (items, KV heads))
        item = _item_of(gl.program_id(0) + gl.program_id(1) * work_sizes.n_items, ctx, DENSE,
                        PAGED, PAGE, GROUP, CAUSAL, BLOCK_M, BLOCK_N)
        n_tiles = item.n_tiles
        q_smem = q_ring.index(0)
        if n_tiles > 0:
            # The first K / V copies go out before Q's loads (WS: the load partition from the
            # split on, a warp issuing TMAs or, PAGED_GATHER, a warp group gathering pages;
            # else the first STAGES tiles, here); each group then loads and stores Q.
            if PINGPONG:
                gl.warp_specialize([
                    (_group, (0, ctx, item, 0, q_smem, False, P_SMEM, PAGED, PAGE, WS, PINGPONG,
                              GROUP, CAUSAL, ROWS, BLOCK_N, D, STAGES, num_warps, Q_ROWS)),
                    (_group, (1, ctx, item, 0, q_smem, False, P_SMEM, PAGED, PAGE, WS, PINGPONG,
                              GROUP, CAUSAL, ROWS, BLOCK_N, D, STAGES, num_warps, Q_ROWS)),
                    (_item_producer, (k_desc, v_desc, k_ptr, v_ptr, k_ring, v_ring, k_bar, v_bar,
                                      k_empty, v_empty, n_tiles, 0, item.kv_start, item.kv_len,
                                      item.hkv, page_idx_ptr, item.page_base, item.npages,
                                      page_rows.k_page_rows, page_rows.v_page_rows,
                                      gather_strides.stride_kr, gather_strides.stride_vr, PAGED,
                                      PAGE, BLOCK_N, D, STAGES, BOXES, WIDE)),
                ], [num_warps, LOAD_WARPS], [GROUP_REGS, PRODUCER_REGS])
            elif WS:
                gl.warp_specialize([
                    (_group, (0, ctx, item, 0, q_smem, False, P_SMEM, PAGED, PAGE, WS, PINGPONG,
                              GROUP, CAUSAL, ROWS, BLOCK_N, D, STAGES, num_warps, Q_ROWS)),
                    (_item_producer, (k_desc, v_desc, k_ptr, v_ptr, k_ring, v_ring, k_bar, v_bar,
                                      k_empty, v_empty, n_tiles, 0, item.kv_start, item.kv_len,
                                      item.hkv, page_idx_ptr, item.page_base, item.npages,
                                      page_rows.k_page_rows, page_rows.v_page_rows,
                                      gather_strides.stride_kr, gather_strides.stride_vr, PAGED,
                                      PAGE, BLOCK_N, D, STAGES, BOXES, WIDE)),
                ], [LOAD_WARPS], [PRODUCER_REGS])
            else:
                for i in gl.static_range(STAGES):
                    page = _page_of(page_idx_ptr, item.page_base, item.npages, i, PAGED, PAGE,
                                    BLOCK_N)
                    _load_kv(k_desc, k_ring, k_bar, i, item.kv_start, item.hkv, i < n_tiles, page,
                             page_rows.k_page_rows, PAGED, PAGE, BLOCK_N, D, STAGES)
                    _load_kv(v_desc, v_ring, v_bar, i, item.kv_start, item.hkv, i < n_tiles, page,
                             page_rows.v_page_rows, PAGED, PAGE, BLOCK_N, D, STAGES)
                _group(0, ctx, item, 0, q_smem, False, P_SMEM, PAGED, PAGE, WS, PINGPONG, GROUP,
                       CAUSAL, ROWS, BLOCK_N, D, STAGES, num_warps, Q_ROWS)
        elif item.valid:  # no key for any row of the tile: 0 and LSE -inf
            _zero_rows(o_ptr, lse_ptr, item.req.to(gl.int64) * row_strides.ob,
                       item.req.to(gl.int64) * row_strides.lb, item.qo_start, item.qo_len,
                       item.hkv, item.row0, row_strides.ot, row_strides.oh, row_strides.lt,
                       row_strides.lh, GROUP, BLOCK_M, D, num_warps)
    _release_state(ring, item_bars, STAGES)


@gluon.jit
def _pod_part_ctx(io, keys, strides, indptrs, gather, shared):
    """A POD part's Ctx (_gluon_pod_fwd): its Io and Keys, its row strides (qt, qh, ot, oh,
    lt, lh; ragged: no batch strides), its indptrs (qo, kv, last page lengths), its caches as
    pointers (Gather, PAGED_GATHER) and what the parts share (the work list, items, KV heads,
    rings, handoff)."""
    qt, qh, ot, oh, lt, lh = strides
    qo_indptr_ptr, kv_indptr_ptr, last_page_len_ptr = indptrs
    work_ptr, n_items, n_hkv, ring, handoff = shared
    return Ctx(io, ring, keys, RowStrides(0, qt, qh, 0, ot, oh, 0, lt, lh),
               Work(work_ptr, qo_indptr_ptr, kv_indptr_ptr, last_page_len_ptr, n_items, 0, n_hkv,
                    0, 0, 0, 0),
               handoff, gather)


@gluon.jit
def _gluon_pod_fwd(
    work_ptr, sizes, sched_ptr,
    q_ptr, k_desc, v_desc, o_ptr, lse_ptr, qo_indptr_ptr, kv_indptr_ptr, page_idx_ptr,
    last_page_len_ptr, k_ptr, v_ptr, scalars,
    q_ptr_d, k_desc_d, v_desc_d, o_ptr_d, lse_ptr_d, qo_indptr_ptr_d, kv_indptr_ptr_d,
    page_idx_ptr_d, last_page_len_ptr_d, k_ptr_d, v_ptr_d, scalars_d, q_rows_ptr_d,
    CONFIG: gl.constexpr, num_warps: gl.constexpr,
):
    """POD on the persistent warp-specialized kernel: one launch whose work items are a
    prefill's tiles (part 0: the arguments without suffix) and a decode batch's items (part 1:
    suffix _d) in one list, work_ptr int32 [W, 3] of (part, request, first packed row), item lin
    = x + head * W (sizes a PodSizes: n_items = W, n_hkv KV heads), taken by resident programs
    from sched_ptr as in _gluon_fwd. The parts share the tile, the K / V rings and the mask
    (CAUSAL: a decode row, its request's last position, sees every key either way); each has its
    own Q, O and LSE ([N, Hq, D], [N, Hq]; ragged row strides), indptrs, logit scale and K / V
    source: part 0 a paged cache (PAGED_BOXES, PAGE, BOXES) or a one-page cache whose request
    reads that page's first last_page_len rows (PAGED 0: PODWithPagedKVCacheWrapper's contiguous
    k_p / v_p), part 1 a paged cache (PAGED_D, PAGE_D, BOXES_D). Or both parts' caches gathered
    (PAGED_GATHER, pages of 1-7 keys; a one-page prefill cache gathered as one page of PAGE keys
    or more) through k_ptr / v_ptr (_d), the load partition then a warp group at PRODUCER_REGS
    registers: the ring barriers' arrivals, the consumers' fences and tails depend on how slots
    are filled, so the parts fill them alike (the launcher checks). Descriptors and page rows as
    in _gluon_fwd; both parts' boxes fill slots of one shared layout (the launcher checks; a
    gathered part's descriptor only shapes the rings). Bundles: each part's scalars a
    PartScalars (scalars, scalars_d); the constexprs a PodConfig (CONFIG): each part's K / V
    source a Source (SOURCE, SOURCE_D: PAGED, PAGE, BOXES, WIDE), the tile a Shape (SHAPE),
    PINGPONG, GROUP_REGS, PRODUCER_REGS and Q_ROWS_D: the decodes' row t reads q_d's row
    q_rows_ptr_d[t] (int32; decode key chunks), else row t."""
    PAGED: gl.constexpr = CONFIG.SOURCE.PAGED
    PAGE: gl.constexpr = CONFIG.SOURCE.PAGE
    BOXES: gl.constexpr = CONFIG.SOURCE.BOXES
    PAGED_D: gl.constexpr = CONFIG.SOURCE_D.PAGED
    PAGE_D: gl.constexpr = CONFIG.SOURCE_D.PAGE
    BOXES_D: gl.constexpr = CONFIG.SOURCE_D.BOXES
    WIDE: gl.constexpr = CONFIG.SOURCE.WIDE or CONFIG.SOURCE_D.WIDE
    GROUP: gl.constexpr = CONFIG.SHAPE.GROUP
    CAUSAL: gl.constexpr = CONFIG.SHAPE.CAUSAL
    BLOCK_M: gl.constexpr = CONFIG.SHAPE.BLOCK_M
    BLOCK_N: gl.constexpr = CONFIG.SHAPE.BLOCK_N
    D: gl.constexpr = CONFIG.SHAPE.D
    STAGES: gl.constexpr = CONFIG.SHAPE.STAGES
    PINGPONG: gl.constexpr = CONFIG.PINGPONG
    GROUP_REGS: gl.constexpr = CONFIG.GROUP_REGS
    PRODUCER_REGS: gl.constexpr = CONFIG.PRODUCER_REGS
    Q_ROWS_D: gl.constexpr = CONFIG.Q_ROWS_D
    SWAP_D: gl.constexpr = CONFIG.SWAP_D
    LOAD_WARPS: gl.constexpr = _load_warps(PAGED)
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    ROWS: gl.constexpr = BLOCK_M // 2 if PINGPONG else BLOCK_M
    gl.static_assert(not (SWAP_D and PINGPONG), "SWAP_D: one compute group")
    ring, item_bars = _shared_state(dtype, k_desc, v_desc, k_desc, False, False, PAGED,
                                    PINGPONG, BLOCK_M, BLOCK_N, D, STAGES, SWAP_D)
    items, item_full, item_empty, q_full, q_empty = item_bars
    handoff = Handoff(items, item_full, item_empty, sched_ptr, q_full, q_empty, k_desc, 0)
    # what both parts' Ctx share: the work list, the rings and the item hand-off
    shared = (work_ptr, sizes.n_items, sizes.n_hkv, ring, handoff)
    ctx = _pod_part_ctx(
        Io(q_ptr, o_ptr, lse_ptr, q_rows_ptr_d),  # (the decodes' map: never read for part 0)
        Keys(k_desc, v_desc, scalars.qk_scale, page_idx_ptr, scalars.k_page_rows,
             scalars.v_page_rows),
        (scalars.qt, scalars.qh, scalars.ot, scalars.oh, scalars.lt, scalars.lh),
        (qo_indptr_ptr, kv_indptr_ptr, last_page_len_ptr),
        Gather(k_ptr, v_ptr, scalars.stride_kr, scalars.stride_vr), shared)
    pod = _pod_part_ctx(
        Io(q_ptr_d, o_ptr_d, lse_ptr_d, q_rows_ptr_d),
        Keys(k_desc_d, v_desc_d, scalars_d.qk_scale, page_idx_ptr_d, scalars_d.k_page_rows,
             scalars_d.v_page_rows),
        (scalars_d.qt, scalars_d.qh, scalars_d.ot, scalars_d.oh, scalars_d.lt, scalars_d.lh),
        (qo_indptr_ptr_d, kv_indptr_ptr_d, last_page_len_ptr_d),
        Gather(k_ptr_d, v_ptr_d, scalars_d.stride_kr, scalars_d.stride_vr), shared)
    if PINGPONG:
        gl.warp_specialize([
            (_ws_group, (0, ctx, False, False, False, PAGED, PAGE, PINGPONG, GROUP, CAUSAL,
                         BLOCK_M, ROWS, BLOCK_N, D, STAGES, num_warps, pod, True,
                         Q_ROWS_D)),
            (_ws_group, (1, ctx, False, False, False, PAGED, PAGE, PINGPONG, GROUP, CAUSAL,
                         BLOCK_M, ROWS, BLOCK_N, D, STAGES, num_warps, pod, True,
                         Q_ROWS_D)),
            (_ws_loader, (ctx, False, False, PAGED, PAGE, GROUP, CAUSAL, BLOCK_M, BLOCK_N, D,
                          STAGES, BOXES, WIDE, pod, True, PAGED_D, PAGE_D, BOXES_D)),
        ], [num_warps, LOAD_WARPS], [GROUP_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_ws_group, (0, ctx, False, False, False, PAGED, PAGE, PINGPONG, GROUP, CAUSAL,
                         BLOCK_M, ROWS, BLOCK_N, D, STAGES, num_warps, pod, True,
                         Q_ROWS_D, False, SWAP_D)),
            (_ws_loader, (ctx, False, False, PAGED, PAGE, GROUP, CAUSAL, BLOCK_M, BLOCK_N, D,
                          STAGES, BOXES, WIDE, pod, True, PAGED_D, PAGE_D, BOXES_D, False,
                          SWAP_D)),
        ], [LOAD_WARPS], [PRODUCER_REGS])
    _release_state(ring, item_bars, STAGES)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}

class Tile(NamedTuple):
    """A launch's tile: block_n keys a slot, warps compute warps, stages K / V slots, p_smem
    (P through shared memory), ws (warp-specialized), pingpong (two compute groups of half the
    warps), persistent (WS: resident programs taking items from a counter; None:
    persistent_default), swap (persistent, one compute group: every item's rows run the
    swapped products, SWAP_ROWS at a time: _group_swap)."""
    block_n: int
    warps: int
    stages: int
    p_smem: bool
    ws: bool
    pingpong: bool
    persistent: bool | None = None
    swap: bool = False


# Tiles by (tile height, head dim), the height plan() chose (choose.tile):
# 64-row tiles are warp-specialized with P in registers (two programs per SM), 128-row tiles
# ping-pong two 64-row warp groups; D 256 reads 64-key tiles (two 128-key slots would not fit
# beside Q) and has no 64-row tile (ptxas needs more registers than two programs per SM leave).
# Measured in benchmarks/NOTES.md (2026-11-23: warp specialization, ping-pong; 2026-11-24: D 64
# and D 256).
_T64 = Tile(block_n=64, warps=4, stages=2, p_smem=False, ws=True, pingpong=False)
TILES = {(64, 64): _T64, (64, 128): _T64,
         (128, 64): Tile(block_n=128, warps=8, stages=3, p_smem=False, ws=True, pingpong=True),
         (128, 128): Tile(block_n=128, warps=8, stages=2, p_smem=False, ws=True, pingpong=True),
         (128, 256): Tile(block_n=64, warps=8, stages=2, p_smem=False, ws=True, pingpong=True)}
# Decode rows on the swapped products in at most one program a SM (choose._gluon_launch):
# 128-key slots two deep (a program's shared memory is then ~153 KB, sm_90).
SWAP_TILE = Tile(block_n=128, warps=4, stages=2, p_smem=False, ws=True, pingpong=False,
                 persistent=True, swap=True)
# Gathered pages (page_gathered) on the 128-row tile where requests are short (gather_short):
# 64-key slots three deep and persistent programs, where longer requests keep TILES' 128-key
# slots, two deep, a program per item; the 64-row tile would re-read each key tile for every 64
# rows (benchmarks/NOTES.md, 2026-11-24, gathered pages on short requests).
GATHER_SHORT_TILE = Tile(block_n=64, warps=8, stages=3, p_smem=False, ws=True, pingpong=True,
                         persistent=True)
# Programs per SM the register budget is split for under warp specialization (the load
# partition's warp group included): 64-row tiles keep two, 128-row ones have one.
_WS_CTAS = {4: 2, 8: 1}


def resident(tile: Tile) -> int:
    """Programs of a warp-specialized tile that one SM holds at once, which a persistent grid
    is sized by: _WS_CTAS[warps], but one for a swap tile (its K / V slots take ~153 KB of
    shared memory)."""
    return 1 if tile.swap else _WS_CTAS[tile.warps]


def persistent_programs(work: int, sms: int, tile: Tile, cap: int = 0) -> int:
    """A persistent launch's programs for ``work`` (work items times KV heads) on ``sms`` SMs:
    as many as the SMs hold at once (resident), at most the work, at most ``cap`` where one is
    in force (launch.programs_cap), at least one. choose._gluon_launch and the launchers
    size their grids by it."""
    return max(1, min(work, sms * resident(tile), cap or work))


# setmaxnreg of a ping-pong launch's worker compute group (the load warp keeps 24)
PINGPONG_REGS = 240
# PAGED_GATHER: (a ping-pong launch's worker compute group, the gathering warp group). The
# default partition gets what the two leave of a warp group's 512 (Triton's warp
# specialization): 240 for the worker group left it 176, which spilled 236 bytes (offline
# sm_90 compile, triton 3.9); at 232 / 40 both groups hold 232 and nothing spills.
GATHER_REGS = (224, 64)


def partition_regs(gather: bool) -> tuple[int, int]:
    """(a ping-pong launch's worker compute group, the load partition) registers: GATHER_REGS
    where a warp group gathers pages, else PINGPONG_REGS beside a TMA warp's 24."""
    return GATHER_REGS if gather else (PINGPONG_REGS, 24)


def _wide(*views: torch.Tensor) -> bool:
    """Whether the gather's row offsets need int64 (_row_offsets): a cache view of 2^31
    elements or more."""
    return max(t.shape[0] * t.stride(0) for t in views) >= 2 ** 31


def persistent_default(pingpong: bool, boxes: int) -> bool:
    """Whether a warp-specialized launch runs persistent programs (they stay resident and take
    work items from a counter; the load warp brings the next item's Q and first K / V tiles
    under this one's last tiles): 64-row tiles and ping-pong tiles with a box per page gain;
    ping-pong tiles on contiguous K / V lose and keep a program per item, and gathered pages
    follow contiguous K / V (benchmarks/NOTES.md, 2026-11-23 and 2026-11-24)."""
    return not pingpong or boxes > 1


def gather_short(pages: int, page: int, requests: int, causal: bool) -> bool:
    """Whether a gathered launch's requests are short (GATHER_SHORT_TILE): ``pages`` table
    entries of ``page`` keys over ``requests`` requests average at most GLUON_SHORT_KV keys
    (causal; half that without a mask), the bound block_m_for puts on contiguous K/V's 64-row
    tiles (on purpose: block_m_for reads the longest request, this the mean)."""
    return pages * page <= max(requests, 1) * (GLUON_SHORT_KV if causal else GLUON_SHORT_KV // 2)


def _sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of the device (the persistent grid's size): its description
    in the launch decision (choose.device_of), so this grid and choose's agree."""
    from .choose import device_of  # (choose imports this module)

    return device_of(device).sm_count


def ws_maxnreg(warps: int) -> int:
    """The per-thread register cap of a warp-specialized launch with this many compute warps:
    the register file split over _WS_CTAS[warps] programs of warps + 4 (the load partition's
    warp group) warps; setmaxnreg then moves the load warps' share to the compute warps."""
    return 65536 // (_WS_CTAS[warps] * (warps + 4) * 32) // 8 * 8


def kv_2d_layout(t: torch.Tensor, kind: str, known=bool) -> bool:
    """kv_2d's layout conditions but the pointer's alignment, which a trace cannot know (its
    storage offset it can): heads and dims packed, 16-byte rows, no empty dim, and a dense
    batch packed over its tokens or pages a whole number of rows apart. known reads each
    condition (prefill_kernel._known where sizes may be symbolic); the one test of both the
    eager launch (kv_2d) and compiled_attn.ops.dispatch."""
    es, d, rows = t.element_size(), t.shape[-1], t.stride(-3)
    if not (known(t.stride(-1) == 1) and known(t.stride(-2) == d)
            and known(rows * es % 16 == 0) and known(t.storage_offset() * es % 16 == 0)
            and all(known(x > 0) for x in t.shape)):  # a descriptor needs every dim positive
        return False
    if kind == "dense":
        return known(t.stride(0) == t.shape[1] * rows)
    return kind == "ragged" or (kind == "paged" and known(t.stride(0) % rows == 0))


def kv_2d(t: torch.Tensor, kind: str) -> torch.Tensor | None:
    """K or V as the 2D [rows, Hkv * D] view the descriptors read (kind "ragged": [N, Hkv, D];
    "dense": [B, S, Hkv, D], request b from row b * S; "paged": a cache [P, page, Hkv, D], page
    p from row p * page_rows(t), so a combined [P, 2, page, Hkv, D] cache's K and V views
    interleave, each spanning the other's rows), or None where the layout has no such view
    (kv_2d_layout) or the pointer is not 16-byte aligned."""
    if not kv_2d_layout(t, kind) or t.data_ptr() % 16:
        return None
    rows = t.stride(-3)
    if kind == "ragged":
        n = t.shape[0]
    elif kind == "dense":
        n = t.shape[0] * t.shape[1]
    else:
        n = (t.shape[0] - 1) * page_rows(t) + t.shape[1]
    return t.as_strided((n, t.shape[-2] * t.shape[-1]), (rows, 1))


def page_rows(t: torch.Tensor) -> int:
    """Rows of a kv_2d "paged" view from one page of t [P, page, Hkv, D] to the next."""
    return t.stride(0) // t.stride(-3)


@functools.lru_cache(maxsize=None)
def _smem_layout(block_n: int, d: int, dtype: torch.dtype):
    """The shared layout of a [block_n, d] box (built once: ~10 us each, two per launch)."""
    return gl.NVMMASharedLayout.get_default_for([block_n, d], _GL_DTYPES[dtype])


def kv_descriptor(t2: torch.Tensor, d: int, block_n: int) -> TensorDescriptor:
    """Host descriptor over a kv_2d view, blocks [block_n, d] (one KV head's rows)."""
    layout = _smem_layout(block_n, d, t2.dtype)
    return TensorDescriptor(t2, list(t2.shape), [t2.stride(0), 1], [block_n, d], layout)


def launch(q, k2, v2, out, lse, qo_indptr, kv_indptr, work, *, dense: tuple | None,
           qk_scale: float, causal: bool, block_m: int, tile: Tile | tuple | None = None,
           paged: tuple | None = None, q_rows: torch.Tensor | None = None):
    """One launch of the Gluon kernel. Ragged (dense None): q [N, Hq, D], work int32 [W, 2],
    indptrs int32 [R + 1], out [N, Hq, D], lse [N, Hq]. Dense: dense = (B, Sq, Skv, tiles per
    entry, pairs per group), q / out [B, Sq, Hq, D], lse [B, Sq, Hq]. k2 / v2: the kv_2d
    views. qk_scale: sm_scale * log2(e). tile: a Tile (or a tuple of its fields),
    TILES[block_m, D] if None. paged: (page size, page
    table int32 [P], last page lengths int32 [R], K and V page_rows) with k2 / v2 the caches'
    views and kv_indptr the page indptr; pages smaller than BLOCK_N (page_fits) are read a
    box per page by the warp-specialized kernel, pages of 1-7 keys (page_gathered) gathered by
    its producer warp group. q_rows (ragged only): None, or int32 [R] on q's device: the
    launch's rows (those of qo_indptr, out and lse, R of them) read q's rows q_rows, Q then
    through registers."""
    if q_rows is not None and dense is not None:
        raise ValueError("q_rows: a row map is for ragged and paged launches, not dense ones")
    d = q.shape[-1]
    hq = q.shape[-2]
    hkv = k2.shape[1] // d
    if tile is None and (block_m, d) not in TILES:
        raise ValueError(f"no Gluon tile for block_m {block_m} at head dim {d} (TILES: "
                         f"{sorted(TILES)}); pass tile=")
    page, page_idx, last, k_rows, v_rows = paged or (0, None, None, 0, 0)
    if (tile is None and paged is not None and block_m == 128 and d == 128
            and page_gathered(page, GATHER_SHORT_TILE.block_n, d)
            and gather_short(page_idx.shape[0], page, qo_indptr.shape[0] - 1, causal)):
        tile = GATHER_SHORT_TILE
    tile = Tile(*(tile or TILES[block_m, d]))
    block_n, warps, stages, p_smem = tile.block_n, tile.warps, tile.stages, tile.p_smem
    ws, pingpong, swap = tile.ws, tile.pingpong, tile.swap
    gather = paged is not None and page_gathered(page, block_n, d)
    if paged is not None and not page_read(page, block_n, d):
        raise ValueError(f"page size {page} at D {d}: neither TMA boxes (page_fits: pages holding "
                         f"whole {block_n}-key tiles, or at D 128 of {MIN_BOX_PAGE} keys or more "
                         f"dividing them) nor gathers (pages below {MIN_BOX_PAGE} keys)")
    boxes = block_n // page if 0 < page < block_n and not gather else 1
    ws = ws or boxes > 1 or pingpong or gather
    if pingpong and (warps != 8 or p_smem or block_m != 128):
        raise ValueError("a ping-pong tile is 128 rows, 8 compute warps (two groups of 4), P in "
                         f"registers; got block_m {block_m}, warps {warps}, p_smem {p_smem}")
    opts = {}
    if ws:  # the register budget split over the compute warps and the load warp group
        opts["maxnreg"] = ws_maxnreg(warps)
    if dense is None:
        n_items, n_req, tiles, group, sq, skv = work.shape[0], 0, 0, 1, 0, 0
        qs = (0, q.stride(0), q.stride(1))
        os_ = (0, out.stride(0), out.stride(1))
        ls = (0, lse.stride(0), lse.stride(1))
        work_arg, qo_arg, kv_arg = work, qo_indptr, kv_indptr
    else:
        n_req, sq, skv, tiles, group = dense
        n_items = n_req * tiles
        qs, os_, ls = q.stride()[:3], out.stride()[:3], lse.stride()
        work_arg = qo_arg = kv_arg = lse  # never read in dense mode
    if paged is None:  # never read
        page_idx = last = work_arg
    box = block_n // boxes
    wide = _wide(k2, v2)
    group_regs, producer_regs = partition_regs(gather)
    # persistent (WS only): a 1D grid of as many programs as fit on the GPU at once
    # (persistent_programs); else a program per item
    persistent = ws and (tile.persistent if tile.persistent is not None
                         else persistent_default(pingpong, boxes))
    if swap and (pingpong or not persistent or warps != 4 or block_m % SWAP_ROWS.value):
        raise ValueError(f"a swap tile (the swapped products) runs persistent warp-specialized "
                         f"programs of one compute group of 4 warps over tiles of a multiple of "
                         f"{SWAP_ROWS.value} rows: persistent=True, pingpong=False, warps=4; got "
                         f"persistent {persistent}, pingpong {pingpong}, warps {warps}, block_m "
                         f"{block_m}")
    if persistent:  # (at most launch.programs_cap's programs, where one is in force)
        grid = (persistent_programs(n_items * hkv, _sm_count(q.device), tile,
                                    _launch.programs_cap_now()), )
    else:
        grid = (n_items, hkv)
    # the persistent programs' item counter (never read otherwise; the launch leaves it 0)
    sched = _launch.counter(q.device, resets=True) if persistent else work_arg
    # Q by the load warp's TMA (persistent, one query head per KV head, Q's rows a 2D view;
    # not with P through shared memory: a 128-row tile's P ring leaves no room for Q's second
    # slot)
    q2 = None
    if (persistent and not p_smem and not swap and hq == hkv and q_rows is None and q.numel()
            and q.stride(-1) == 1
            and q.stride(-2) == d and q.data_ptr() % 16 == 0):
        if dense is None and (q.stride(0) * q.element_size()) % 16 == 0:
            q2, q_req_rows = q.as_strided((q.shape[0], hq * d), (q.stride(0), 1)), 0
        elif dense is not None and q.stride(0) == q.shape[1] * q.stride(1) \
                and (q.stride(1) * q.element_size()) % 16 == 0:
            q2 = q.as_strided((q.shape[0] * q.shape[1], hq * d), (q.stride(1), 1))
            q_req_rows = q.shape[1]
    k_desc = kv_descriptor(k2, d, box)
    if q2 is not None:
        q_desc = TensorDescriptor(q2, list(q2.shape), [q2.stride(0), 1], [block_m, d],
                                  _smem_layout(block_m, d, q.dtype))
    else:
        q_desc, q_req_rows = k_desc, 0  # (never read)
    _launch.run_direct(
        _gluon_fwd, grid, work_arg, q, k_desc, kv_descriptor(v2, d, box), out, lse,
        qo_arg, kv_arg, page_idx, last, PageRows(k_rows, v_rows), RowStrides(*qs, *os_, *ls),
        qk_scale, WorkSizes(n_items, n_req, hkv, tiles, group, sq, skv), sched, q_desc,
        q_req_rows, k2, v2, GatherStrides(k2.stride(0), v2.stride(0)),
        work_arg if q_rows is None else q_rows,  # (never read without a row map)
        SOURCE=Source(PAGED=(PAGED_GATHER.value if gather else PAGED_BOXES.value) if paged
                      else 0, PAGE=page, BOXES=boxes, WIDE=gather and wide),
        SHAPE=Shape(GROUP=hq // hkv, CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, D=d,
                    STAGES=stages),
        SCHEDULE=Schedule(DENSE=dense is not None, Q_TMA=q2 is not None, P_SMEM=p_smem, WS=ws,
                          PERSISTENT=persistent, PINGPONG=pingpong,
                          PRODUCER_REGS=producer_regs, GROUP_REGS=group_regs,
                          Q_ROWS=q_rows is not None, SWAP=swap),
        num_warps=warps // 2 if pingpong else warps, **opts)
    return out, lse


class PodPart(NamedTuple):
    """One part of a POD launch (launch_pod): q [N, Hq, D], the K / V caches' kv_2d "paged"
    views k2 / v2, out [N, Hq, D], lse float32 [N, Hq], indptrs int32 [R + 1] (kv_indptr in
    pages), the page table int32 [P] and last page lengths int32 [R], K and V page_rows, the
    page size (0: a one-page cache read as contiguous rows, the prefill part only), the
    base-2 logit scale, and q_rows: None, or (the decode part only) int32 [N] on q's device,
    row t of out / lse reading q's row q_rows[t] (q then has its own rows)."""
    q: torch.Tensor
    k2: torch.Tensor
    v2: torch.Tensor
    out: torch.Tensor
    lse: torch.Tensor
    qo_indptr: torch.Tensor
    kv_indptr: torch.Tensor
    page_idx: torch.Tensor
    last_page_len: torch.Tensor
    k_rows: int
    v_rows: int
    page: int
    qk_scale: float
    q_rows: torch.Tensor | None = None


def pod_boxes(page: int, block_n: int) -> int:
    """TMA boxes per key tile of a POD part with pages of ``page`` keys (0: a one-page cache,
    one box a tile)."""
    return block_n // page if 0 < page < block_n else 1


def launch_pod(prefill: PodPart, decode: PodPart, work: torch.Tensor, *, causal: bool,
               tile: Tile | tuple | None = None, block_m: int = 128, swap_d: bool = False):
    """One launch of _gluon_pod_fwd: the parts' work items (work int32 [W, 3] of (part,
    request, first packed row)) taken by persistent warp-specialized programs on one tile
    (TILES[block_m, D] unless given; its K / V rings shared by both parts, so their boxes'
    shared layouts must agree). The decodes' pages are read by TMA boxes (page_fits) or
    gathered (page_gathered); the prefill's alike, a one-page cache (page 0) as rows beside
    boxes or as one gathered page beside gathers. swap_d: the decodes' items on the swapped
    products (PodConfig.SWAP_D; a tile of one compute group). Writes each part's out and
    lse."""
    q = prefill.q
    d = q.shape[-1]
    hkv = prefill.k2.shape[1] // d
    tile = Tile(*(tile or TILES[block_m, d]))
    block_n = tile.block_n
    paged = pod_read(prefill.page, decode.page, block_n, d)
    if paged is None:
        raise ValueError(
            f"POD's pages at D {d}: prefill {prefill.page} keys, decodes {decode.page}; both "
            f"parts' pages must be read alike, by TMA boxes (page_fits; a one-page prefill cache "
            f"as rows) or gathered (page_gathered; a one-page prefill cache as one page)")
    if prefill.q_rows is not None:
        raise ValueError("launch_pod: a row map is the decode part's only (PodPart.q_rows)")
    gather = paged == PAGED_GATHER.value
    page_p = prefill.page
    if gather and page_p == 0:  # a one-page cache: its one page as long as its rows, or more
        page_p = one_page_size(prefill.k2.shape[0])
    boxes = [1 if gather else pod_boxes(page, block_n) for page in (page_p, decode.page)]
    descs = []
    for part, nb in zip((prefill, decode), boxes):
        box = block_n // nb
        descs.append((kv_descriptor(part.k2, d, box), kv_descriptor(part.v2, d, box)))
    layouts = [x.layout for pair in descs for x in pair]
    if any(x != layouts[0] for x in layouts):
        raise ValueError(f"POD's parts need one shared layout for their K / V boxes: {layouts}")
    wide = gather and _wide(prefill.k2, prefill.v2, decode.k2, decode.v2)
    pingpong = tile.pingpong
    group = q.shape[-2] // hkv
    if swap_d and (pingpong or gather or group > SWAP_ROWS.value):
        raise ValueError(f"launch_pod: swap_d needs one compute group (not ping-pong), pages "
                         f"read by TMA boxes and a query group of at most {SWAP_ROWS.value}; "
                         f"got pingpong={pingpong}, gathered pages {gather}, group {group}")
    grid = (persistent_programs(work.shape[0] * hkv, _sm_count(q.device), tile), )

    def part_args(part, pair):
        return (part.q, pair[0], pair[1], part.out, part.lse, part.qo_indptr, part.kv_indptr,
                part.page_idx, part.last_page_len, part.k2, part.v2,
                PartScalars(part.k_rows, part.v_rows, part.q.stride(0), part.q.stride(1),
                            part.out.stride(0), part.out.stride(1), part.lse.stride(0),
                            part.lse.stride(1), part.qk_scale, part.k2.stride(0),
                            part.v2.stride(0)))

    group_regs, producer_regs = partition_regs(gather)
    _launch.run_direct(
        _gluon_pod_fwd, grid, work, PodSizes(work.shape[0], hkv),
        _launch.counter(q.device, resets=True),
        *part_args(prefill, descs[0]), *part_args(decode, descs[1]),
        decode.q if decode.q_rows is None else decode.q_rows,  # (never read without a map)
        CONFIG=PodConfig(
            SOURCE=Source(PAGED=paged if page_p else 0, PAGE=page_p, BOXES=boxes[0], WIDE=wide),
            SOURCE_D=Source(PAGED=paged, PAGE=decode.page, BOXES=boxes[1], WIDE=wide),
            SHAPE=Shape(GROUP=group, CAUSAL=causal, BLOCK_M=block_m,
                        BLOCK_N=block_n, D=d, STAGES=tile.stages),
            PINGPONG=pingpong, GROUP_REGS=group_regs, PRODUCER_REGS=producer_regs,
            Q_ROWS_D=decode.q_rows is not None, SWAP_D=bool(swap_d)),
        num_warps=tile.warps // 2 if pingpong else tile.warps, maxnreg=ws_maxnreg(tile.warps))
    return prefill.out, prefill.lse, decode.out, decode.lse


# The smallest page read a box per page: a TMA box into the 128-byte-swizzled slots spans at
# least the swizzle pattern's 8 rows (Triton's TMA lowering refuses fewer, "Illegal shared
# layout", triton 3.6 and 3.9), and each box costs the load warp (benchmarks/NOTES.md,
# 2026-11-23, page 8 through TMA boxes). Smaller pages are gathered (page_gathered).
MIN_BOX_PAGE = 8


def page_fits(page: int, block_n: int, d: int) -> bool:
    """Whether the Gluon kernel reads pages of this size at head dim d by TMA boxes: pages
    holding whole key tiles (one box per tile), or at D 128 pages of MIN_BOX_PAGE keys or more
    dividing a tile (a box per page, issued by the warp-specialized kernel's load warp: from the
    compute warps, Gluon's CTA barrier before each box is too slow; benchmarks/NOTES.md,
    2026-11-23). D 64 pages below a tile have no boxes (the one D 64 launch of them on the H100
    failed, cause not isolated; benchmarks/NOTES.md, 2026-11-23)."""
    whole = page > 0 and page % block_n == 0
    return whole or (d == 128 and page >= MIN_BOX_PAGE and block_n % page == 0)


def page_read(page: int, block_n: int, d: int) -> bool:
    """Whether the Gluon kernel reads pages of this size at head dim d at all: by TMA boxes
    (page_fits) or by gathers (page_gathered)."""
    return page_fits(page, block_n, d) or page_gathered(page, block_n, d)


def page_gathered(page: int, block_n: int, d: int) -> bool:
    """Whether the Gluon kernel reads pages of this size at head dim d by a producer warp
    group's cp.async gathers (PAGED_GATHER): pages of 1 to MIN_BOX_PAGE - 1 keys, where they
    beat the Triton kernel's pointer gathers; larger pages without boxes keep the Triton
    kernel's whole-page loads (benchmarks/NOTES.md, 2026-11-24, pages of 1-7 keys)."""
    return 0 < page < MIN_BOX_PAGE and not page_fits(page, block_n, d)


def pod_read(prefill_page: int, decode_page: int, block_n: int, d: int) -> int | None:
    """How a Gluon POD launch reads both parts' K / V (one way for both: the ring barriers'
    arrivals, fences and key tails follow how slots are filled): PAGED_BOXES where the decodes'
    pages take TMA boxes (page_fits), PAGED_GATHER where they are gathered (page_gathered), the
    prefill's pages alike or its cache one page (prefill_page 0: read as rows beside boxes, as
    one gathered page beside gathers); None where the parts cannot be read alike."""
    gather = page_gathered(decode_page, block_n, d)
    read = page_gathered if gather else page_fits
    if not (read(decode_page, block_n, d) and (prefill_page == 0
                                                or read(prefill_page, block_n, d))):
        return None
    return PAGED_GATHER.value if gather else PAGED_BOXES.value


def launch_ragged(q, k, v, qo_indptr, kv_indptr, work, out, lse, *, sm_scale: float,
                  causal: bool, block_m: int, block_n: int, stages: int, num_warps: int,
                  p_smem: bool = True, ws: bool = False, pingpong: bool = False,
                  persistent: bool | None = None, swap: bool = False):
    """A ragged launch with an explicit tile (tests and benchmarks): q [N, Hq, D], k / v
    [N_kv, Hkv, D] with a kv_2d view, indptrs int32 [R + 1], work int32 [W, 2] built for
    block_m; writes out [N, Hq, D] and lse float32 [N, Hq]."""
    k2, v2 = kv_2d(k, "ragged"), kv_2d(v, "ragged")
    if k2 is None or v2 is None:
        raise ValueError("k / v need packed heads and dims (stride(-2) == D, stride(-1) == 1) "
                         "and 16-byte aligned rows for the Gluon kernel")
    return launch(q, k2, v2, out, lse, qo_indptr, kv_indptr, work, dense=None,
                  qk_scale=sm_scale * LOG2E, causal=causal, block_m=block_m,
                  tile=Tile(block_n, num_warps, stages, p_smem, ws, pingpong, persistent, swap))
