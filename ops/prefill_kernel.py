"""The Triton prefill kernel family behind every compiled_attn op.

One kernel body (``_tile``) computes one tile of packed query rows of one request against that
request's keys, for one KV head; constexpr switches select the KV addressing (dense batch, ragged
offsets, page table), the mask mode, the logit transforms (soft cap, ALiBi), in-kernel RoPE, and
sinks. The launchers here translate an op's arguments into one grid of (work item, KV head).

Invariants the kernel relies on (the op layer and plan() guarantee them):
- packed row r of a request is token ``r // GROUP`` and query head ``hkv * GROUP + r % GROUP``:
  the GROUP query heads of a KV head share the tile and one pass over K/V (GQA of any size);
- a work item whose request is negative, or whose first row is past the request's rows, does
  nothing (fixed-size work buffers for CUDA graphs and uniform plans are padded that way);
- positions are bottom-right aligned: row token i sits at ``p = kv_len - qo_len + i``;
- the key loop is split into [masked | unmasked | masked] ranges so that only tiles on a mask
  boundary (window edge, causal diagonal, kv_len tail) pay for masking;
- logits are kept in base 2 (log2(e) folded into the scale); the LSE written is base 2;
- a row that sees no key ends with l = 0: it writes output 0 and LSE -inf, never NaN;
- all element offsets are computed in int64.
"""

from __future__ import annotations

import math
from collections import namedtuple
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch._subclasses.fake_tensor import is_fake
from torch.fx.experimental.symbolic_shapes import guard_int, statically_known_true

from triton.tools.tensor_descriptor import TensorDescriptor

try:  # Triton's allocator slot (private): None where this Triton lacks it
    from triton.runtime._allocation import NullAllocator, _allocator
except ImportError:
    NullAllocator = _allocator = None
try:  # whether wrap_triton traces (private): None where this torch lacks it
    from torch._library.triton import is_wrap_triton_enabled
except ImportError:
    is_wrap_triton_enabled = None

from . import launch
from .device import _device_properties, _sm_major, sm_count  # noqa: F401 (the cache, for tests)
from .modes import (INTERPRET, LOG2E, MASK_CAUSAL, MASK_CUSTOM, MASK_NONE, POS_ALIBI,
                    POS_ROPE_LLAMA)
from .policy import POLICY
from .tiles import (GATHER_MIN_KV, GLUON_SHORT_KV, SHORT_KV, SMALL_PAGE_BLOCK_M, SMALL_PAGE_MAX,
                    SMALL_PAGE_PAD)
from .contracts import check_kernel_head_dims

try:  # the Gluon Hopper kernel (Triton's Gluon dialect): None where this Triton lacks it
    from . import prefill_gluon as _gluon
except (ImportError, AttributeError):
    _gluon = None

_LOG2E = tl.constexpr(LOG2E)  # (the kernels' view of it)

KV_DENSE, KV_RAGGED, KV_PAGED = 0, 1, 2


# ---- the kernel's argument bundles ------------------------------------------------------------
# The launched kernels (_prefill_fwd, _pod_fwd) keep flat signatures: torch's wrap_triton, its
# mutation analysis and the bound-launch replay (launch.py) bind kernel arguments one by one.
# They gather those arguments into these named tuples, which the inner functions (_prefill_items,
# _program, _attend_range) take instead of long positional lists: Triton passes a named tuple's
# fields like separate arguments, constexpr fields as constexprs, as long as the tuple is built
# in the call (assigned to a name, its constexprs, such as strides specialised to 1, turn into
# tensors).
Tensors = namedtuple("Tensors", "q o lse qo_indptr kv_indptr page_idx last_page_len mask "
                     "mask_indptr alibi sinks")
Tensors.__doc__ = """\
    A launch's tensors but K and V (pointers; unused ones stand in for an option that is
    off): q, o, lse and the ragged / paged indptrs, page table, mask and per-head vectors."""


Strides = namedtuple("Strides", "qb qt qh qd kb kt kp kh kd vb vt vp vh vd ob ot oh lb lt lh")
Strides.__doc__ = """\
    Element strides: q (batch, token, head, dim), k / v (batch, token, page, head, dim),
    o and lse (batch, token, head)."""


Scalars = namedtuple("Scalars", "dense_qo_len dense_kv_len qk_scale soft_cap window_left "
                     "chunk_size rope_rcp_scale log2_theta v_scale")
Scalars.__doc__ = """\
    Runtime scalars (floats in fp32): dense mode's lengths, the base-2 logit scale and the
    options' values (_flags)."""


Options = namedtuple("Options", "KV_MODE PAGE_SIZE GROUP MASK_MODE HAS_WINDOW HAS_CHUNK "
                     "SOFT_CAP ALIBI ROPE SINKS FOLD BLOCK_M BLOCK_N BLOCK_DQK "
                     "BLOCK_DVO DQK DVO NUM_STAGES TMA SPLIT ROW STATS SKIP "
                     "SKIP_LOG2")
Options.__doc__ = """\
    The constexpr switches and tile sizes (_program_args' consts; SPLIT, ROW: the work
    list's split fields and row length; STATS, SKIP, SKIP_LOG2: _program)."""


Rows = namedtuple("Rows", "q q2 p_row tok row_ok slope mask_base")
Rows.__doc__ = """\
    A tile's query rows for _attend_range: q (RoPE: first half; q2 the second), each row's
    position, token and validity, ALiBi slope, and the custom mask's first bit."""


Keys = namedtuple("Keys", "kv_len kv_coord hkv k v k_desc v_desc page_base")
Keys.__doc__ = """\
    A work item's keys for _attend_range: kv_len, the TMA coordinate of its first key, the KV
    head, K / V at this head (pointers, or descriptors over the whole K / V), the per-item
    descriptors (TMA 1; else the same as k / v) and the first page-table entry."""

# ptxas of triton 3.6 crashes on 2-stage pipelines that load K/V through tensor descriptors or
# as whole-page 3D blocks (seen on the H100): the launch (_config) and the kernel (PAGE3D) turn
# both kinds of load off for this stage count.
CRASH_STAGES = tl.constexpr(2)


def block_m_for(head_dim_qk: int, head_dim_vo: int, group_size: int,
                max_kv_len: int | None = None, causal: bool = True, paged: bool = False, *,
                page_size: int = 0, qo_lens: Sequence[int] | None = None,
                kv_dtype: torch.dtype | None = None) -> int:
    """Tile height in packed rows for these head dims (plan() and the launch agree on it; the
    bounds and their reasons: tiles.py).
    max_kv_len: the longest request's KV length when the caller knows it (None: the tile for
    any length; CUDA-graph plans pass None so that one capture serves every re-plan).
    page_size: the paged cache's page size (0: unknown or not paged); qo_lens: each request's
    query rows as the work list tiles them (None: unknown); kv_dtype: the K/V dtype (None:
    fp16 / bf16; fp8 K/V never take the Gluon kernel, so their small pages keep 256-row
    tiles)."""
    if INTERPRET:
        return 64
    d = max(head_dim_qk, head_dim_vo)
    gluon_pages = paged and _gluon_pages(page_size, head_dim_qk, head_dim_vo, kv_dtype)
    if (paged and 0 < page_size <= SMALL_PAGE_MAX and 64 < d <= 128 and max_kv_len is not None
            and qo_lens is not None and _fills(qo_lens, group_size, SMALL_PAGE_BLOCK_M, 128)
            and not gluon_pages):
        return SMALL_PAGE_BLOCK_M
    if d > 256:
        return 64  # D 512: a 128-row tile's Q alone would take 128 KB of shared memory
    if d > 128 or max_kv_len is None:
        return 128
    if (gluon_pages and d == 128 and _gluon.page_gathered(page_size, _gluon.TILES[128, d][0], d)
            and max_kv_len > GATHER_MIN_KV // (1 if causal else 2)):
        return 128  # gathered pages (on short requests prefill_gluon.GATHER_SHORT_TILE)
    if max_kv_len <= POLICY.tma_min_kv:
        return 64
    if d <= 64 or (paged and not gluon_pages):
        return 128
    short = GLUON_SHORT_KV if _gluon_tiles(head_dim_qk, head_dim_vo) else SHORT_KV
    return 64 if max_kv_len <= (short if causal else short // 2) else 128


def _gluon_tiles(dqk: int, dvo: int) -> bool:
    """Whether eager launches at these head dims go to the Gluon kernel in this process (USE_GLUON,
    a Hopper GPU, D 128), whose tiles block_m_for then sizes (GLUON_SHORT_KV). Graphs that inline
    the op (AOTInductor; torch.compile keeps such calls opaque: compiled_attn.ops.dispatch) run
    the Triton kernel on the same tiles (a plan serves both)."""
    return (POLICY.use_gluon and _gluon is not None and dqk == dvo == 128
            and torch.cuda.is_available() and _gluon_device(torch.device("cuda")))


def _gluon_pages(page_size: int, dqk: int, dvo: int,
                 kv_dtype: torch.dtype | None = None) -> bool:
    """Whether eager paged launches of this page size, head dims and K/V dtype (None: fp16 /
    bf16) go to the Gluon kernel in this process (a Hopper GPU, use_gluon, D 128, fp16 / bf16
    K/V, pages it reads on either tile height, by TMA boxes or gathers: _gluon_scope): they are
    then tiled as contiguous K/V are (pages 1-8 too, rather than the small pages' 256-row
    tiles), since on the Gluon kernel paged K/V prefer contiguous K/V's tile heights
    (benchmarks/NOTES.md, 2026-11-23). (Graphs that inline the op run the Triton kernel, which
    prefers 128-row tiles for paged K/V: they take these tiles too.)"""
    return (page_size > 0 and kv_dtype in (None, torch.float16, torch.bfloat16)
            and _gluon_tiles(dqk, dvo)
            and all(_gluon.page_read(page_size, tile.block_n, dqk)
                    for (_, d), tile in _gluon.TILES.items() if d == dqk))


def _fills(qo_lens: Sequence[int], group_size: int, block_m: int, smaller: int) -> bool:
    """Whether tiles of block_m packed rows cover these requests with at most SMALL_PAGE_PAD
    times the rows (padding included) that tiles of ``smaller`` rows would."""
    def padded(m):
        return sum(-(-int(n) * group_size // m) * m for n in qo_lens)
    rows = padded(smaller)
    return rows > 0 and padded(block_m) <= SMALL_PAGE_PAD * rows


def _config(block_m: int, dqk: int, dvo: int, kv_mode: int = 0, mask_mode: int = 0) -> dict:
    """Launch configuration (BLOCK_N, warps, stages, whether K/V may use tensor descriptors)
    for a tile height, head dims, KV addressing and mask mode."""
    if INTERPRET:
        return dict(BLOCK_N=32, num_warps=4, num_stages=1, TMA=True)
    # 64x64 tiles with 4 warps, 128x64 (D <= 64) and 128x128 with 8 (3 stages); D 256 needs
    # fewer stages to fit shared memory, and so does a custom mask (its bytes are pipelined
    # through shared memory with K and V). The Triton kernel's descriptors never with
    # CRASH_STAGES nor for 128-row D <= 64 tiles (slower there) nor D 256 (ptxas of triton
    # 3.6); the Gluon kernel, asked first (_gluon_launch), has its own tiles for those. D 512
    # (64-row tiles: block_m_for) streams 32-key K / V tiles two deep: compiled for sm_90 by
    # triton 3.6 on 2026-11-27 it took 96-128 KB of shared memory (split-KV and custom masks
    # the most), 192 KB at most if Q and both stages of K and V were all held there.
    # Head dims between powers of two run their power of two's tiles (_dims).
    d = max(dqk, dvo)
    stages = 2 if mask_mode == MASK_CUSTOM else 3
    tma = stages != CRASH_STAGES.value
    if block_m == SMALL_PAGE_BLOCK_M and d <= 128:  # four warpgroups of 64 rows (small pages)
        return dict(BLOCK_N=64, num_warps=16, num_stages=stages, TMA=tma)
    if d <= 128 and block_m == 64:
        return dict(BLOCK_N=64, num_warps=4, num_stages=stages, TMA=tma)
    if d <= 64:
        return dict(BLOCK_N=64, num_warps=8, num_stages=stages, TMA=False)
    if d <= 128:
        return dict(BLOCK_N=128, num_warps=8, num_stages=stages, TMA=tma)
    if d <= 256:
        return dict(BLOCK_N=64, num_warps=8, num_stages=2, TMA=False)
    return dict(BLOCK_N=32, num_warps=8, num_stages=2, TMA=False)


@triton.jit
def _tanh(x):
    # tanh through exp2 of a non-positive argument: no overflow for large |x|.
    e = tl.exp2(tl.abs(x) * (-2.0 * _LOG2E))
    t = (1.0 - e) / (1.0 + e)
    return tl.where(x < 0, -t, t)


@triton.jit
def _rope(x1, x2, pos, rope_rcp_scale, log2_theta, HALF: tl.constexpr, ROWS: tl.constexpr,
          D: tl.constexpr):
    """Rotate-half RoPE of the two halves x1, x2 (float32) of a head dim D (HALF >= D / 2 lanes;
    lanes past D / 2 hold zeros). ROWS: pos indexes dim 0 (x is [N, HALF]); otherwise dim 1 (x
    is [HALF, N])."""
    c = tl.arange(0, HALF).to(tl.float32)
    inv_freq = tl.exp2(-2.0 * c / D * log2_theta)
    if ROWS:
        ang = (pos.to(tl.float32) * rope_rcp_scale)[:, None] * inv_freq[None, :]
    else:
        ang = inv_freq[:, None] * (pos.to(tl.float32) * rope_rcp_scale)[None, :]
    cos = tl.cos(ang)
    sin = tl.sin(ang)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _page_of_keys(n, kv_len, page_base, page_idx_ptr,
                  PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """int32 [BLOCK_N]: the page of each key n + arange(BLOCK_N) (0 past kv_len), from the
    request's row of the page table (one scalar read when the tile lies in one page)."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(page_idx_ptr + page_base + n // PAGE_SIZE, mask=n < kv_len, other=0)
        return tl.zeros([BLOCK_N], dtype=tl.int32) + page
    else:
        j = n + tl.arange(0, BLOCK_N)
        return tl.load(page_idx_ptr + page_base + j // PAGE_SIZE, mask=j < kv_len, other=0)


@triton.jit
def _whole_pages(n, kv_len, page_base, page_idx_ptr, PAGE_SIZE: tl.constexpr, NP: tl.constexpr):
    """int32 [NP]: the NP pages holding keys [n, n + NP * PAGE_SIZE) (n a page start; 0 past
    kv_len): one contiguous, vectorised read of the page table instead of one per key."""
    first = n + tl.arange(0, NP) * PAGE_SIZE
    return tl.load(page_idx_ptr + page_base + n // PAGE_SIZE + tl.arange(0, NP),
                   mask=first < kv_len, other=0)


@triton.jit
def _load_pages(base, pg3, slot3, ok3, offs_d, stride_p, stride_t, stride_d, MASKED: tl.constexpr,
                D: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_N, BLOCK_D] rows of K or V from whole pages: pg3 [NP, 1, 1] page indices (int64),
    slot3 [1, PAGE_SIZE, 1] slots, ok3 [NP, PAGE_SIZE, 1] keys < kv_len (used when MASKED),
    loaded as [NP, PAGE_SIZE, BLOCK_D] so a thread's vectors lie in one page; dims past D read 0."""
    ptrs = base + pg3 * stride_p + slot3 * stride_t + offs_d.to(tl.int64)[None, None, :] * stride_d
    if MASKED or D != BLOCK_D:
        x = tl.load(ptrs, mask=ok3 & (offs_d[None, None, :] < D), other=0.0)
    else:
        x = tl.load(ptrs)
    return tl.reshape(x, [BLOCK_N, BLOCK_D])


@triton.jit
def _load_tile(desc, kv_coord, hkv, n, TMA: tl.constexpr, KV_MODE: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    """[BLOCK_N, BLOCK_D] keys n.. of K or V through a tensor descriptor. TMA 1: the work
    item's own descriptor, [kv_len, D] of this request and head (keys past kv_len read 0).
    TMA 2 / 3: a descriptor over the whole tensor (built on the host, or once per persistent
    program): dense [B, Hkv, S, D] (kv_coord = batch entry; keys past S read 0) or ragged
    [Hkv, N, D] (kv_coord = the request's first key row; keys past its kv_len are the next
    request's)."""
    if TMA == 1:
        x = desc.load([n, 0])
    elif KV_MODE == 0:
        x = tl.reshape(desc.load([kv_coord, hkv, n, 0]), [BLOCK_N, BLOCK_D])
    else:
        x = tl.reshape(desc.load([hkv, kv_coord + n, 0]), [BLOCK_N, BLOCK_D])
    return x


@triton.jit
def _attend_range(acc, l_i, m_i, n_lo, n_hi, MASKED: tl.constexpr, rows, keys, ptrs, st, sc, C):
    """Online softmax over keys [n_lo, n_hi) (multiples of BLOCK_N except n_hi) of the tile's
    rows (Rows) against the item's keys (Keys); ptrs, st, sc, C: the launch's Tensors, Strides,
    Scalars and Options. MASKED tiles apply the visibility rule; unmasked ones are known to be
    fully visible to every row. With TMA 1, K and V tiles come through the per-program
    descriptors keys.k_desc / v_desc (shape [kv_len, D] of this request and head: keys past
    kv_len and dims past D read as 0), with TMA 2 / 3 through descriptors over the whole K / V:
    both by _load_tile. SKIP: a row drops a tile whose max is below its running max by more
    than log2(kv_len) - SKIP_LOG2 (base 2; SKIP_LOG2 = log2 of the factor,
    contracts._stats_skip); a tile no row keeps skips its P.V."""
    offs_n = tl.arange(0, C.BLOCK_N)
    HALF: tl.constexpr = C.BLOCK_DQK // 2
    RH: tl.constexpr = C.DQK // 2  # RoPE: where the second half starts (HALF lanes, RH real)
    if C.ROPE:
        offs_d1 = tl.arange(0, HALF)
    else:
        offs_d1 = tl.arange(0, C.BLOCK_DQK)
    offs_dv = tl.arange(0, C.BLOCK_DVO)
    # Paged: the page indices of a tile are read one tile ahead (loop-carried), so that its K/V
    # addresses do not wait on a load of the same iteration (the pipeliner then streams K/V as
    # deep as for contiguous keys). Per-key reads (page 1, pages that do not tile BLOCK_N)
    # carry the [BLOCK_N] pages; whole-page tiles carry their [NP] page indices.
    AHEAD: tl.constexpr = C.KV_MODE == 2 and C.PAGE_SIZE % C.BLOCK_N != 0 and (
        C.PAGE_SIZE == 1 or C.BLOCK_N % C.PAGE_SIZE != 0)
    AHEAD_NP: tl.constexpr = C.KV_MODE == 2 and C.PAGE_SIZE > 1 and \
        C.PAGE_SIZE % C.BLOCK_N != 0 and C.BLOCK_N % C.PAGE_SIZE == 0
    NP: tl.constexpr = C.BLOCK_N // C.PAGE_SIZE if AHEAD_NP else 1
    # Whole-page tiles load K/V as [NP, PAGE_SIZE, D] blocks (one page per slice, reshaped to
    # [BLOCK_N, D]): a thread's vectors then lie in one page, so it needs one page index and one
    # 64-bit page offset per load instead of one per key it touches. Not with CRASH_STAGES
    # (custom masks, D 256).
    PAGE3D: tl.constexpr = AHEAD_NP and not C.ROPE and C.NUM_STAGES != CRASH_STAGES
    if PAGE3D:
        offs_p3 = (tl.arange(0, NP) * C.PAGE_SIZE)[:, None, None] + \
            tl.arange(0, C.PAGE_SIZE)[None, :, None]
        slot3 = tl.arange(0, C.PAGE_SIZE).to(tl.int64)[None, :, None]
    if AHEAD:
        pages = _page_of_keys(n_lo, keys.kv_len, keys.page_base, ptrs.page_idx, C.PAGE_SIZE,
                              C.BLOCK_N)
    if AHEAD_NP:
        pnp = _whole_pages(n_lo, keys.kv_len, keys.page_base, ptrs.page_idx, C.PAGE_SIZE, NP)
    for n in tl.range(n_lo, n_hi, C.BLOCK_N, num_stages=C.NUM_STAGES):
        j = n + offs_n
        j_ok = j < keys.kv_len
        if PAGE3D:
            pg3 = pnp.to(tl.int64)[:, None, None]
            pnp = _whole_pages(n + C.BLOCK_N, keys.kv_len, keys.page_base, ptrs.page_idx,
                               C.PAGE_SIZE, NP)
            ok3 = (n + offs_p3) < keys.kv_len
        elif not C.TMA:
            if C.KV_MODE == 2:
                if AHEAD:
                    pg = pages.to(tl.int64)
                    pages = _page_of_keys(n + C.BLOCK_N, keys.kv_len, keys.page_base, ptrs.page_idx,
                                          C.PAGE_SIZE, C.BLOCK_N)
                elif AHEAD_NP:
                    pg = tl.reshape(tl.broadcast_to(pnp[:, None], [NP, C.PAGE_SIZE]), [C.BLOCK_N])
                    pg = pg.to(tl.int64)
                    pnp = _whole_pages(n + C.BLOCK_N, keys.kv_len, keys.page_base, ptrs.page_idx,
                                       C.PAGE_SIZE, NP)
                else:
                    pg = _page_of_keys(n, keys.kv_len, keys.page_base, ptrs.page_idx, C.PAGE_SIZE,
                                       C.BLOCK_N).to(tl.int64)
                slot = (j % C.PAGE_SIZE).to(tl.int64)
                k_off = pg * st.kp + slot * st.kt
                v_off = pg * st.vp + slot * st.vt
            else:
                k_off = j.to(tl.int64) * st.kt
                v_off = j.to(tl.int64) * st.vt
            kt_ptrs = keys.k + k_off[None, :] + offs_d1[:, None].to(tl.int64) * st.kd
        if C.TMA:
            k = _load_tile(keys.k_desc, keys.kv_coord, keys.hkv, n, C.TMA, C.KV_MODE, C.BLOCK_N,
                           C.BLOCK_DQK)
            s = tl.dot(rows.q, tl.trans(k.to(rows.q.dtype)))
        elif PAGE3D:
            k = _load_pages(keys.k, pg3, slot3, ok3, offs_d1, st.kp, st.kt, st.kd,
                            MASKED, C.DQK, C.BLOCK_N, C.BLOCK_DQK)
            s = tl.dot(rows.q, tl.trans(k.to(rows.q.dtype)))
        elif C.ROPE:
            k_ok = j_ok[None, :]
            if RH != HALF:
                k_ok = k_ok & (offs_d1[:, None] < RH)
            k1 = tl.load(kt_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            k2 = tl.load(kt_ptrs + RH * st.kd, mask=k_ok, other=0.0).to(tl.float32)
            k1, k2 = _rope(k1, k2, j, sc.rope_rcp_scale, sc.log2_theta, HALF, False, C.DQK)
            s = tl.dot(rows.q, k1.to(rows.q.dtype)) + tl.dot(rows.q2, k2.to(rows.q.dtype))
        elif MASKED or C.DQK != C.BLOCK_DQK:
            k = tl.load(kt_ptrs, mask=j_ok[None, :] & (offs_d1[:, None] < C.DQK), other=0.0)
            s = tl.dot(rows.q, k.to(rows.q.dtype))
        else:
            k = tl.load(kt_ptrs)  # unmasked range: every key is < kv_len
            s = tl.dot(rows.q, k.to(rows.q.dtype))
        # FOLD (no cap, no ALiBi, positive scale): an unmasked tile keeps the raw products and
        # folds the scale into the exp2 argument (one FMA per logit).
        UNSCALED: tl.constexpr = C.FOLD and not MASKED
        if C.SOFT_CAP:
            s = _tanh(s * (sc.qk_scale / sc.soft_cap)) * (sc.soft_cap * _LOG2E)
        elif not UNSCALED:
            s = s * sc.qk_scale
        if C.ALIBI:
            dist = (j[None, :] - rows.p_row[:, None]).to(tl.float32)
            s += (rows.slope * _LOG2E)[:, None] * dist
        if MASKED:
            see = j_ok[None, :] & rows.row_ok[:, None]
            if C.MASK_MODE == 1:
                see = see & (j[None, :] <= rows.p_row[:, None])
            if C.MASK_MODE == 2:
                bit = rows.mask_base + rows.tok.to(tl.int64)[:, None] * keys.kv_len + j[None, :]
                byte = tl.load(ptrs.mask + (bit >> 3), mask=see, other=0)
                see = see & (((byte.to(tl.int32) >> (bit & 7).to(tl.int32)) & 1) != 0)
            if C.HAS_WINDOW:
                see = see & (j[None, :] >= rows.p_row[:, None] - sc.window_left)
            if C.HAS_CHUNK:
                see = see & (j[None, :] >= (rows.p_row[:, None] // sc.chunk_size) * sc.chunk_size)
                see = see & (j[None, :] <= rows.p_row[:, None])
            s = tl.where(see, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen nothing yet keeps m = -inf; subtract 0 instead (no NaN).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            if UNSCALED:
                m_new = tl.maximum(m_i, tl.max(s, 1) * sc.qk_scale)
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = m_new
        use_tile = True
        if C.SKIP:
            if UNSCALED:
                t_max = tl.max(s, 1) * sc.qk_scale
            else:
                t_max = tl.max(s, 1)
            thr = C.SKIP_LOG2 - tl.log2(keys.kv_len.to(tl.float32))
            keep = (t_max > float("-inf")) & (t_max >= m_i + thr)
            m_new = tl.where(keep, m_new, m_i)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            use_tile = tl.max(keep.to(tl.int32), 0) > 0
        if UNSCALED:
            p = tl.exp2(s * sc.qk_scale - m_sub[:, None])
        else:
            p = tl.exp2(s - m_sub[:, None])
        if C.SKIP:
            p = tl.where(keep[:, None], p, 0.0)
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        if C.TMA:
            v = _load_tile(keys.v_desc, keys.kv_coord, keys.hkv, n, C.TMA, C.KV_MODE, C.BLOCK_N,
                           C.BLOCK_DVO)
            if C.TMA >= 2 and MASKED and C.KV_MODE == 1:
                # Ragged rows past kv_len belong to the next request (finite or not): p is 0
                # there, but 0 * inf is NaN, so they are zeroed (TMA 1 reads them as 0).
                v = tl.where(j_ok[:, None], v, 0.0)
        elif PAGE3D:
            v = _load_pages(keys.v, pg3, slot3, ok3, offs_dv, st.vp, st.vt, st.vd,
                            MASKED, C.DVO, C.BLOCK_N, C.BLOCK_DVO)
        else:
            v_ptrs = keys.v + v_off[:, None] + offs_dv[None, :].to(tl.int64) * st.vd
            if MASKED or C.DVO != C.BLOCK_DVO:
                v = tl.load(v_ptrs, mask=j_ok[:, None] & (offs_dv[None, :] < C.DVO), other=0.0)
            else:
                v = tl.load(v_ptrs)
        if use_tile:  # (SKIP: no row kept the tile, whose P.V then adds nothing)
            acc = acc * alpha[:, None] + tl.dot(p.to(rows.q.dtype), v.to(rows.q.dtype))
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _program(req, row0, hkv, n_hkv, x, work_ptr, part_o_ptr, part_l_ptr, k_ptr, v_ptr, ptrs, st,
             sc, C):
    """One work item: BLOCK_M packed rows from row0 of request req, KV head hkv. Dense mode
    (KV_MODE 0) takes req and row0 as given; ragged / paged read them from row x of the work
    list work_ptr (int32, ROW fields a row, the item's fields from the first: request, first
    row, and with SPLIT key chunk and number of chunks). With SPLIT, the item covers key chunk
    ``split`` of ``nsplit`` of the tile's key range; when nsplit > 1 it writes its normalised
    partial output and LSE to slot x of the partial buffers (part_o [W, Hkv, BLOCK_M,
    BLOCK_DVO], part_l [W, Hkv, BLOCK_M], float32) for _merge_fwd. STATS: lse_ptr's rows
    also take the row max (base 2) one element after the LSE, and part_l is [W, Hkv, 2,
    BLOCK_M] (chunk LSEs, then chunk maxima). SKIP, SKIP_LOG2: _attend_range. k_ptr / v_ptr:
    K and V (pointers, or with TMA 2 / 3 descriptors over the whole tensors); ptrs, st, sc, C:
    the launch's Tensors, Strides, Scalars and Options (the names below are theirs)."""
    # ---- the work item -------------------------------------------------------------------------
    # Its row is read here, in the function that uses it, not by a helper: torch's mutation
    # analysis (torch.compile / export tracing this launch) follows a helper's results back to
    # all of the helper's arguments, so a work list passed to one would read as written (dense
    # mode: q, which stands in for it) in the traced node's dependencies
    # (tests/test_mutation_analysis.py). A load's result is not followed back to its pointer.
    split = 0
    nsplit = 1
    if C.KV_MODE != 0:
        req = tl.load(work_ptr + x * C.ROW)
        row0 = tl.load(work_ptr + x * C.ROW + 1)
        if C.SPLIT:
            split = tl.load(work_ptr + x * C.ROW + 2)
            nsplit = tl.load(work_ptr + x * C.ROW + 3)

    # ---- the request's rows and keys ---------------------------------------------------------
    if C.KV_MODE == 0:
        qo_len = sc.dense_qo_len
        kv_len = sc.dense_kv_len
        q_base = req.to(tl.int64) * st.qb
        o_base = req.to(tl.int64) * st.ob
        l_base = req.to(tl.int64) * st.lb
        kv_base = req.to(tl.int64) * st.kb
        vv_base = req.to(tl.int64) * st.vb
        kv_coord = req
        page_base = 0
        mask_base = req.to(tl.int64) * sc.dense_qo_len * sc.dense_kv_len
    else:
        req_c = tl.maximum(req, 0)
        qo_start = tl.load(ptrs.qo_indptr + req_c)
        qo_len = tl.load(ptrs.qo_indptr + req_c + 1) - qo_start
        q_base = qo_start.to(tl.int64) * st.qt
        o_base = qo_start.to(tl.int64) * st.ot
        l_base = qo_start.to(tl.int64) * st.lt
        if C.KV_MODE == 1:
            kv_start = tl.load(ptrs.kv_indptr + req_c)
            kv_len = tl.load(ptrs.kv_indptr + req_c + 1) - kv_start
            kv_base = kv_start.to(tl.int64) * st.kt
            vv_base = kv_start.to(tl.int64) * st.vt
            kv_coord = kv_start
            page_base = 0
        else:
            page_base = tl.load(ptrs.kv_indptr + req_c)
            npages = tl.load(ptrs.kv_indptr + req_c + 1) - page_base
            last = tl.load(ptrs.last_page_len + req_c)
            kv_len = tl.where(npages > 0, (npages - 1) * C.PAGE_SIZE + last, 0)
            kv_base = 0
            vv_base = 0
            kv_coord = 0
        if C.MASK_MODE == 2:
            mask_base = tl.load(ptrs.mask_indptr + req_c).to(tl.int64) * 8
        else:
            mask_base = 0
        qo_len = tl.where(req < 0, 0, qo_len)  # padding item: no rows
    if C.TMA == 3:
        # Called in the persistent loop, where Triton allows no early return: an item past the
        # request's rows (a padding item) sees no keys and stores nothing (row_ok is all off).
        kv_len = tl.where(row0 < qo_len * C.GROUP, kv_len, 0)
    elif row0 >= qo_len * C.GROUP:
        return

    offs_m = row0 + tl.arange(0, C.BLOCK_M)
    tok = offs_m // C.GROUP
    head = hkv * C.GROUP + offs_m % C.GROUP
    row_ok = tok < qo_len
    p_row = kv_len - qo_len + tok
    # positions of the tile's first and last valid rows
    tok_lo = row0 // C.GROUP
    tok_hi = tl.minimum((row0 + C.BLOCK_M - 1) // C.GROUP, qo_len - 1)
    p_lo = kv_len - qo_len + tok_lo
    p_hi = kv_len - qo_len + tok_hi

    # ---- load q (int64 offsets), RoPE'd in place when asked ---------------------------------
    q_rows = ptrs.q + q_base + tok.to(tl.int64) * st.qt + head.to(tl.int64) * st.qh
    HALF: tl.constexpr = C.BLOCK_DQK // 2
    RH: tl.constexpr = C.DQK // 2  # RoPE: where the second half starts (HALF lanes, RH real)
    if C.ROPE:
        lanes = tl.arange(0, HALF)
        offs_h = lanes.to(tl.int64) * st.qd
        q_ok = row_ok[:, None] & (lanes[None, :] < RH)
        q1 = tl.load(q_rows[:, None] + offs_h[None, :], mask=q_ok, other=0.0)
        q2 = tl.load(q_rows[:, None] + offs_h[None, :] + RH * st.qd, mask=q_ok, other=0.0)
        r1, r2 = _rope(q1.to(tl.float32), q2.to(tl.float32), p_row, sc.rope_rcp_scale,
                       sc.log2_theta, HALF, True, C.DQK)
        q = r1.to(q1.dtype)
        q2 = r2.to(q1.dtype)
    else:
        offs_d = tl.arange(0, C.BLOCK_DQK)
        q = tl.load(q_rows[:, None] + offs_d[None, :].to(tl.int64) * st.qd,
                    mask=row_ok[:, None] & (offs_d[None, :] < C.DQK), other=0.0)
        q2 = q

    if C.ALIBI:
        slope = tl.load(ptrs.alibi + head).to(tl.float32)
    else:
        slope = tl.zeros([C.BLOCK_M], dtype=tl.float32)

    # ---- the key ranges: [n0, u0) masked, [u0, u1) unmasked, [u1, n1) masked ----------------
    n0 = 0
    n1 = kv_len
    u0 = 0
    u1 = kv_len
    if C.MASK_MODE == 1 or C.HAS_CHUNK:
        n1 = tl.minimum(n1, p_hi + 1)
        u1 = tl.minimum(u1, p_lo + 1)
    if C.HAS_WINDOW:
        n0 = tl.maximum(n0, p_lo - sc.window_left)
        u0 = tl.maximum(u0, p_hi - sc.window_left)
    if C.HAS_CHUNK:
        n0 = tl.maximum(n0, (p_lo // sc.chunk_size) * sc.chunk_size)
        u0 = tl.maximum(u0, (p_hi // sc.chunk_size) * sc.chunk_size)
    n0 = (n0 // C.BLOCK_N) * C.BLOCK_N
    u0 = ((u0 + C.BLOCK_N - 1) // C.BLOCK_N) * C.BLOCK_N
    u1 = (u1 // C.BLOCK_N) * C.BLOCK_N
    if C.MASK_MODE == 2:
        u0 = n1
    n1 = tl.maximum(n1, n0)
    if C.SPLIT:
        # Chunk `split` of `nsplit` of [n0, n1), in whole BLOCK_N blocks.
        per = ((n1 - n0 + C.BLOCK_N - 1) // C.BLOCK_N + nsplit - 1) // nsplit
        lo = tl.minimum(n0 + split * per * C.BLOCK_N, n1)
        n1 = tl.minimum(lo + per * C.BLOCK_N, n1)
        n0 = lo
    u0 = tl.minimum(tl.maximum(u0, n0), n1)
    u1 = tl.minimum(tl.maximum(u1, u0), n1)

    m_i = tl.full([C.BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([C.BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([C.BLOCK_M, C.BLOCK_DVO], dtype=tl.float32)
    # k_head / v_head: the request's first key (dense, ragged) or the cache (paged), this head.
    if C.TMA >= 2:
        # Descriptors over the whole K/V (built on the host, or by _prefill_fwd once per
        # persistent program): dense [B, Hkv, S, D] or ragged [Hkv, N, D], where this request's
        # keys start at kv_coord.
        k_head = k_ptr
        v_head = v_ptr
    else:
        k_head = k_ptr + kv_base + hkv.to(tl.int64) * st.kh
        v_head = v_ptr + vv_base + hkv.to(tl.int64) * st.vh
    if C.TMA == 1:
        # Dense / ragged only (the launch checks 16-byte alignment and unit dim strides).
        k_desc = tl.make_tensor_descriptor(k_head, shape=[kv_len, C.DQK], strides=[st.kt, 1],
                                           block_shape=[C.BLOCK_N, C.BLOCK_DQK])
        v_desc = tl.make_tensor_descriptor(v_head, shape=[kv_len, C.DVO], strides=[st.vt, 1],
                                           block_shape=[C.BLOCK_N, C.BLOCK_DVO])
    else:
        k_desc = k_head
        v_desc = v_head
    # [n0, u0) masked, [u0, u1) unmasked, [u1, n1) masked. (Bundles holding values that may be
    # constexprs are built in the call: assigned to a name, a tuple's constexprs turn into
    # tensors.)
    for r in tl.static_range(3):
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, (n0, u0, u1, n1)[r], (n0, u0, u1, n1)[r + 1], r != 1,
            Rows(q, q2, p_row, tok, row_ok, slope, mask_base),
            Keys(kv_len, kv_coord, hkv, k_head, v_head, k_desc, v_desc, page_base), ptrs, st, sc,
            C)

    # ---- epilogue: rows that saw nothing write 0 and -inf -----------------------------------
    if C.SPLIT:
        if nsplit > 1:
            # A partial: normalised over this chunk's keys; _merge_fwd applies sinks, v_scale.
            seen = l_i > 0
            l_safe = tl.where(seen, l_i, 1.0)
            offs_r = tl.arange(0, C.BLOCK_M)
            offs_dv = tl.arange(0, C.BLOCK_DVO)
            slot = (x.to(tl.int64) * n_hkv + hkv) * C.BLOCK_M
            tl.store(part_o_ptr + (slot + offs_r)[:, None] * C.BLOCK_DVO + offs_dv[None, :],
                     acc / l_safe[:, None])
            lslot = slot * 2 if C.STATS else slot
            tl.store(part_l_ptr + lslot + offs_r,
                     tl.where(seen, m_i + tl.log2(l_safe), float("-inf")))
            if C.STATS:
                tl.store(part_l_ptr + lslot + C.BLOCK_M + offs_r,
                         tl.where(seen, m_i, float("-inf")))
        else:
            _store_final(acc, l_i, m_i, ptrs.o, ptrs.lse, ptrs.sinks, o_base, l_base, tok, head,
                         row_ok, st.ot, st.oh, st.lt, st.lh, sc.v_scale, C.SINKS,
                         C.BLOCK_DVO, C.DVO, m_i, C.STATS)
    else:
        _store_final(acc, l_i, m_i, ptrs.o, ptrs.lse, ptrs.sinks, o_base, l_base, tok, head,
                     row_ok, st.ot, st.oh, st.lt, st.lh, sc.v_scale, C.SINKS,
                     C.BLOCK_DVO, C.DVO, m_i, C.STATS)


@triton.jit
def _store_final(acc, l_i, m_i, o_ptr, lse_ptr, sinks_ptr, o_base, l_base, tok, head, row_ok,
                 stride_ot, stride_oh, stride_lt, stride_lh, v_scale,
                 SINKS: tl.constexpr, BLOCK_DVO: tl.constexpr, DVO: tl.constexpr, mx,
                 STATS: tl.constexpr):
    """Normalise (sinks add e^sink to the denominator; v_scale multiplies) and store the rows
    of a tile: out (q's token/head layout) and the base-2 LSE; a row with l = 0 writes 0 and
    -inf. STATS: also the row max mx (base 2, -inf where l = 0) one element after the LSE."""
    seen = l_i > 0
    l_safe = tl.where(seen, l_i, 1.0)
    scale = v_scale / l_safe
    if SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * _LOG2E
        m_safe = tl.where(seen, m_i, 0.0)
        scale = v_scale / (l_safe + tl.exp2(sink - m_safe))
    out = acc * tl.where(seen, scale, 0.0)[:, None]
    lse = tl.where(seen, m_i + tl.log2(l_safe), float("-inf"))
    offs_dv = tl.arange(0, BLOCK_DVO)
    o_rows = o_ptr + o_base + tok.to(tl.int64) * stride_ot + head.to(tl.int64) * stride_oh
    tl.store(o_rows[:, None] + offs_dv[None, :], out.to(o_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < DVO))
    l_ptrs = lse_ptr + l_base + tok.to(tl.int64) * stride_lt + head.to(tl.int64) * stride_lh
    tl.store(l_ptrs, lse, mask=row_ok)
    if STATS:
        tl.store(l_ptrs + 1, tl.where(seen, mx, float("-inf")), mask=row_ok)


@triton.jit
def _work_item(lin, n_items, dense_tiles, dense_group, n_req, n_hkv,
               KV_MODE: tl.constexpr, BLOCK_M: tl.constexpr):
    """(request, first row, KV head, work-list row) of the item at place ``lin`` in launch
    order (program x of KV head h on the plain grid: x + h * n_items). Ragged / paged: row
    x = lin % n_items of the work list, KV head lin // n_items; _program reads the row's fields
    (request and first row are 0 here). Dense mode derives them: the n_req * n_hkv (batch
    entry, KV head) pairs are taken dense_group at a time (the last group may hold fewer), and
    a group's tiles run heaviest first (causal's last rows see the most keys) with the group's
    pairs side by side. One pair at a time, the last pairs' heaviest tiles would start in the
    last wave and run on alone (_dense_group)."""
    req = 0
    row0 = 0
    x = lin % n_items
    hkv = lin // n_items
    if KV_MODE == 0:
        per_group = dense_group * dense_tiles
        g = lin // per_group
        r = lin - g * per_group
        pairs = tl.minimum(dense_group, n_req * n_hkv - g * dense_group)
        pair = g * dense_group + r % pairs
        hkv = pair // n_req
        req = pair % n_req
        row0 = (dense_tiles - 1 - r // pairs) * BLOCK_M
    return req, row0, hkv, x


@triton.jit
def _prefill_items(work_ptr, dense_tiles, dense_group, part_o_ptr, part_l_ptr, n_items, n_hkv,
                   kv_rows, counter_ptr, k_ptr, v_ptr, ptrs, st, sc, C):
    """_prefill_fwd's work items, each by _program: a program's own item, or with TMA 3 the
    items a persistent program draws (arguments: _prefill_fwd's, the rest bundled as Tensors,
    Strides, Scalars and Options)."""
    if C.TMA == 3:
        # Persistent: each program builds descriptors over the whole K/V once (TMA 1 builds
        # two per work item, and graphs traced by torch.compile / export cannot carry the
        # host-built ones of TMA 2), then draws items from a global counter in the order the
        # hardware would launch them (_work_item's launch order; heaviest first): a
        # program that drew light items draws more, as with hardware scheduling. The next
        # item is drawn before this one runs, so the atomic's latency hides behind it.
        if C.KV_MODE == 0:
            k_desc = tl.make_tensor_descriptor(
                k_ptr, shape=[kv_rows, n_hkv, sc.dense_kv_len, C.DQK],
                strides=[st.kb, st.kh, st.kt, 1],
                block_shape=[1, 1, C.BLOCK_N, C.BLOCK_DQK])
            v_desc = tl.make_tensor_descriptor(
                v_ptr, shape=[kv_rows, n_hkv, sc.dense_kv_len, C.DVO],
                strides=[st.vb, st.vh, st.vt, 1],
                block_shape=[1, 1, C.BLOCK_N, C.BLOCK_DVO])
        else:
            k_desc = tl.make_tensor_descriptor(
                k_ptr, shape=[n_hkv, kv_rows, C.DQK], strides=[st.kh, st.kt, 1],
                block_shape=[1, C.BLOCK_N, C.BLOCK_DQK])
            v_desc = tl.make_tensor_descriptor(
                v_ptr, shape=[n_hkv, kv_rows, C.DVO], strides=[st.vh, st.vt, 1],
                block_shape=[1, C.BLOCK_N, C.BLOCK_DVO])
        total = n_items * n_hkv
        item = tl.atomic_add(counter_ptr, 1, sem="relaxed")
        while item < total:
            nxt = tl.atomic_add(counter_ptr, 1, sem="relaxed")
            req, row0, hkv, x = _work_item(
                item, n_items, dense_tiles, dense_group, kv_rows, n_hkv, C.KV_MODE, C.BLOCK_M)
            _program(req, row0, hkv, n_hkv, x, work_ptr, part_o_ptr, part_l_ptr, k_desc, v_desc,
                     ptrs, st, sc, C)
            item = nxt
    else:
        req, row0, hkv, x = _work_item(
            tl.program_id(0) + tl.program_id(1) * n_items, n_items, dense_tiles, dense_group,
            kv_rows, n_hkv, C.KV_MODE, C.BLOCK_M)
        _program(req, row0, hkv, n_hkv, x, work_ptr, part_o_ptr, part_l_ptr, k_ptr, v_ptr, ptrs,
                 st, sc, C)


@triton.jit
def _prefill_fwd(
    work_ptr, dense_tiles, dense_group, part_o_ptr, part_l_ptr, n_items, n_hkv, kv_rows,
    counter_ptr,
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr,
    qo_indptr_ptr, kv_indptr_ptr, page_idx_ptr, last_page_len_ptr,
    mask_ptr, mask_indptr_ptr, alibi_ptr, sinks_ptr,
    stride_qb, stride_qt, stride_qh, stride_qd,
    stride_kb, stride_kt, stride_kp, stride_kh, stride_kd,
    stride_vb, stride_vt, stride_vp, stride_vh, stride_vd,
    stride_ob, stride_ot, stride_oh,
    stride_lb, stride_lt, stride_lh,
    dense_qo_len, dense_kv_len,
    qk_scale, soft_cap, window_left, chunk_size, rope_rcp_scale, log2_theta, v_scale,
    KV_MODE: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr,
    MASK_MODE: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_CHUNK: tl.constexpr,
    SOFT_CAP: tl.constexpr, ALIBI: tl.constexpr, ROPE: tl.constexpr, SINKS: tl.constexpr,
    FOLD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_DQK: tl.constexpr,
    BLOCK_DVO: tl.constexpr, DQK: tl.constexpr, DVO: tl.constexpr, NUM_STAGES: tl.constexpr,
    TMA: tl.constexpr, SPLIT: tl.constexpr,
    STATS: tl.constexpr = False, SKIP: tl.constexpr = False, SKIP_LOG2: tl.constexpr = 0.0,
):
    """Grid (work items, KV heads), or with TMA 3 (persistent programs,). A work item is
    (batch entry, tile) in dense mode, else a row of the work list: (request, first row), or
    with SPLIT (request, first row, key chunk, number of chunks). n_items: work items per KV
    head; n_hkv: KV heads; kv_rows: dense B, ragged N (the whole K/V's shape for TMA 3);
    dense_tiles, dense_group: dense mode's tiles per batch entry and (entry, KV head) pairs
    per group of its launch order (_work_item); counter_ptr: int32 [1], zero at launch (TMA
    3's item counter)."""
    # Inductor passes Python floats as fp64: the arithmetic stays in fp32. (The bundles are
    # built in the call: assigned to a name, a tuple's constexprs, such as strides the launch
    # specialised to 1, would turn into tensors.)
    _prefill_items(
        work_ptr, dense_tiles, dense_group, part_o_ptr, part_l_ptr, n_items, n_hkv, kv_rows,
        counter_ptr, k_ptr, v_ptr,
        Tensors(q_ptr, o_ptr, lse_ptr, qo_indptr_ptr, kv_indptr_ptr, page_idx_ptr,
                last_page_len_ptr, mask_ptr, mask_indptr_ptr, alibi_ptr, sinks_ptr),
        Strides(stride_qb, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kp,
                stride_kh, stride_kd, stride_vb, stride_vt, stride_vp, stride_vh, stride_vd,
                stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh),
        Scalars(dense_qo_len, dense_kv_len, tl.cast(qk_scale, tl.float32),
                tl.cast(soft_cap, tl.float32), window_left, chunk_size,
                tl.cast(rope_rcp_scale, tl.float32), tl.cast(log2_theta, tl.float32),
                tl.cast(v_scale, tl.float32)),
        Options(KV_MODE, PAGE_SIZE, GROUP, MASK_MODE, HAS_WINDOW, HAS_CHUNK, SOFT_CAP, ALIBI, ROPE,
                SINKS, FOLD, BLOCK_M, BLOCK_N, BLOCK_DQK, BLOCK_DVO, DQK, DVO, NUM_STAGES, TMA,
                SPLIT, 4 if SPLIT else 2, STATS, SKIP, SKIP_LOG2))


@triton.jit
def _pod_fwd(
    work_ptr,
    q_ptr_p, k_ptr_p, v_ptr_p, o_ptr_p, lse_ptr_p,
    qo_indptr_ptr_p, kv_indptr_ptr_p, page_idx_ptr_p, last_page_len_ptr_p,
    mask_ptr_p, mask_indptr_ptr_p, alibi_ptr_p, sinks_ptr_p,
    stride_qb_p, stride_qt_p, stride_qh_p, stride_qd_p,
    stride_kb_p, stride_kt_p, stride_kp_p, stride_kh_p, stride_kd_p,
    stride_vb_p, stride_vt_p, stride_vp_p, stride_vh_p, stride_vd_p,
    stride_ob_p, stride_ot_p, stride_oh_p,
    stride_lb_p, stride_lt_p, stride_lh_p,
    dense_qo_len_p, dense_kv_len_p,
    qk_scale_p, soft_cap_p, window_left_p, chunk_size_p, rope_rcp_scale_p, log2_theta_p, v_scale_p,
    q_ptr_d, k_ptr_d, v_ptr_d, o_ptr_d, lse_ptr_d,
    qo_indptr_ptr_d, kv_indptr_ptr_d, page_idx_ptr_d, last_page_len_ptr_d,
    mask_ptr_d, mask_indptr_ptr_d, alibi_ptr_d, sinks_ptr_d,
    stride_qb_d, stride_qt_d, stride_qh_d, stride_qd_d,
    stride_kb_d, stride_kt_d, stride_kp_d, stride_kh_d, stride_kd_d,
    stride_vb_d, stride_vt_d, stride_vp_d, stride_vh_d, stride_vd_d,
    stride_ob_d, stride_ot_d, stride_oh_d,
    stride_lb_d, stride_lt_d, stride_lh_d,
    dense_qo_len_d, dense_kv_len_d,
    qk_scale_d, soft_cap_d, window_left_d, chunk_size_d, rope_rcp_scale_d, log2_theta_d, v_scale_d,
    KV_MODE_P: tl.constexpr, PAGE_SIZE_P: tl.constexpr, GROUP_P: tl.constexpr, MASK_MODE_P:
    tl.constexpr, HAS_WINDOW_P: tl.constexpr, HAS_CHUNK_P: tl.constexpr, SOFT_CAP_P:
    tl.constexpr, ALIBI_P: tl.constexpr, ROPE_P: tl.constexpr, SINKS_P: tl.constexpr, FOLD_P:
    tl.constexpr, BLOCK_M_P: tl.constexpr, BLOCK_N_P: tl.constexpr, BLOCK_DQK_P: tl.constexpr,
    BLOCK_DVO_P: tl.constexpr, DQK_P: tl.constexpr, DVO_P: tl.constexpr, NUM_STAGES_P:
    tl.constexpr, TMA_P: tl.constexpr,
    KV_MODE_D: tl.constexpr, PAGE_SIZE_D: tl.constexpr, GROUP_D: tl.constexpr, MASK_MODE_D:
    tl.constexpr, HAS_WINDOW_D: tl.constexpr, HAS_CHUNK_D: tl.constexpr, SOFT_CAP_D:
    tl.constexpr, ALIBI_D: tl.constexpr, ROPE_D: tl.constexpr, SINKS_D: tl.constexpr, FOLD_D:
    tl.constexpr, BLOCK_M_D: tl.constexpr, BLOCK_N_D: tl.constexpr, BLOCK_DQK_D: tl.constexpr,
    BLOCK_DVO_D: tl.constexpr, DQK_D: tl.constexpr, DVO_D: tl.constexpr, NUM_STAGES_D:
    tl.constexpr, TMA_D: tl.constexpr,
):
    """POD: grid (work items, KV heads); work item (part, request, first row), part 0 the
    prefill batch (suffix _p) and part 1 the decode batch (suffix _d), in one launch."""
    # Each part's bundles are built in its call, as in _prefill_fwd (fp32 scalars; work rows of
    # three fields, no split, no row max, no skipping).
    pid = tl.program_id(0)
    hkv = tl.program_id(1)
    part = tl.load(work_ptr + pid * 3)
    item = work_ptr + 1  # rows (part, request, first row): _program reads the last two
    if part == 0:
        _program(0, 0, hkv, tl.num_programs(1), pid, item, work_ptr, work_ptr, k_ptr_p, v_ptr_p,
                 Tensors(q_ptr_p, o_ptr_p, lse_ptr_p, qo_indptr_ptr_p, kv_indptr_ptr_p,
                         page_idx_ptr_p, last_page_len_ptr_p, mask_ptr_p, mask_indptr_ptr_p,
                         alibi_ptr_p, sinks_ptr_p),
                 Strides(stride_qb_p, stride_qt_p, stride_qh_p, stride_qd_p, stride_kb_p,
                         stride_kt_p, stride_kp_p, stride_kh_p, stride_kd_p, stride_vb_p,
                         stride_vt_p, stride_vp_p, stride_vh_p, stride_vd_p, stride_ob_p,
                         stride_ot_p, stride_oh_p, stride_lb_p, stride_lt_p, stride_lh_p),
                 Scalars(dense_qo_len_p, dense_kv_len_p, tl.cast(qk_scale_p, tl.float32),
                         tl.cast(soft_cap_p, tl.float32), window_left_p, chunk_size_p,
                         tl.cast(rope_rcp_scale_p, tl.float32),
                         tl.cast(log2_theta_p, tl.float32), tl.cast(v_scale_p, tl.float32)),
                 Options(KV_MODE_P, PAGE_SIZE_P, GROUP_P, MASK_MODE_P, HAS_WINDOW_P,
                         HAS_CHUNK_P, SOFT_CAP_P, ALIBI_P, ROPE_P, SINKS_P, FOLD_P,
                         BLOCK_M_P, BLOCK_N_P, BLOCK_DQK_P, BLOCK_DVO_P, DQK_P, DVO_P,
                         NUM_STAGES_P, TMA_P, False, 3, False, False, 0.0))
    else:
        _program(0, 0, hkv, tl.num_programs(1), pid, item, work_ptr, work_ptr, k_ptr_d, v_ptr_d,
                 Tensors(q_ptr_d, o_ptr_d, lse_ptr_d, qo_indptr_ptr_d, kv_indptr_ptr_d,
                         page_idx_ptr_d, last_page_len_ptr_d, mask_ptr_d, mask_indptr_ptr_d,
                         alibi_ptr_d, sinks_ptr_d),
                 Strides(stride_qb_d, stride_qt_d, stride_qh_d, stride_qd_d, stride_kb_d,
                         stride_kt_d, stride_kp_d, stride_kh_d, stride_kd_d, stride_vb_d,
                         stride_vt_d, stride_vp_d, stride_vh_d, stride_vd_d, stride_ob_d,
                         stride_ot_d, stride_oh_d, stride_lb_d, stride_lt_d, stride_lh_d),
                 Scalars(dense_qo_len_d, dense_kv_len_d, tl.cast(qk_scale_d, tl.float32),
                         tl.cast(soft_cap_d, tl.float32), window_left_d, chunk_size_d,
                         tl.cast(rope_rcp_scale_d, tl.float32),
                         tl.cast(log2_theta_d, tl.float32), tl.cast(v_scale_d, tl.float32)),
                 Options(KV_MODE_D, PAGE_SIZE_D, GROUP_D, MASK_MODE_D, HAS_WINDOW_D,
                         HAS_CHUNK_D, SOFT_CAP_D, ALIBI_D, ROPE_D, SINKS_D, FOLD_D,
                         BLOCK_M_D, BLOCK_N_D, BLOCK_DQK_D, BLOCK_DVO_D, DQK_D, DVO_D,
                         NUM_STAGES_D, TMA_D, False, 3, False, False, 0.0))

@triton.jit
def _merge_fwd(
    merge_ptr, part_o_ptr, part_l_ptr, o_ptr, lse_ptr, qo_indptr_ptr, sinks_ptr,
    stride_ot, stride_oh, stride_lt, stride_lh, v_scale,
    GROUP: tl.constexpr, SINKS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DVO: tl.constexpr,
    DVO: tl.constexpr, STATS: tl.constexpr = False,
):
    """Grid (split tiles, KV heads): combine a tile's partials (merge row: request, first
    row, first work item, number of chunks) by their base-2 LSEs, then apply sinks and
    v_scale and store like _store_final. STATS: the row max is the largest chunk max."""
    t = tl.program_id(0)
    hkv = tl.program_id(1)
    req = tl.load(merge_ptr + t * 4)
    row0 = tl.load(merge_ptr + t * 4 + 1)
    first = tl.load(merge_ptr + t * 4 + 2)
    n = tl.load(merge_ptr + t * 4 + 3)
    qo_start = tl.load(qo_indptr_ptr + req)
    qo_len = tl.load(qo_indptr_ptr + req + 1) - qo_start
    offs_r = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DVO)
    rows = row0 + offs_r
    tok = rows // GROUP
    head = hkv * GROUP + rows % GROUP
    row_ok = tok < qo_len
    m_run = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    s_run = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DVO], dtype=tl.float32)
    mx = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    for i in range(n):
        slot = ((first + i).to(tl.int64) * tl.num_programs(1) + hkv) * BLOCK_M
        lslot = slot * 2 if STATS else slot
        lse_i = tl.load(part_l_ptr + lslot + offs_r)
        if STATS:
            mx = tl.maximum(mx, tl.load(part_l_ptr + lslot + BLOCK_M + offs_r))
        o_i = tl.load(part_o_ptr + (slot + offs_r)[:, None] * BLOCK_DVO + offs_dv[None, :])
        m_new = tl.maximum(m_run, lse_i)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        a = tl.exp2(m_run - m_sub)
        w = tl.exp2(lse_i - m_sub)
        acc = acc * a[:, None] + o_i * w[:, None]
        s_run = s_run * a + w
        m_run = m_new
    # In base-2 units: l = s_run * 2^m_run is the softmax denominator over all chunks.
    _store_final(acc, s_run, m_run, o_ptr, lse_ptr, sinks_ptr, qo_start.to(tl.int64) * stride_ot,
                 qo_start.to(tl.int64) * stride_lt, tok, head, row_ok, stride_ot, stride_oh,
                 stride_lt, stride_lh, tl.cast(v_scale, tl.float32), SINKS, BLOCK_DVO, DVO, mx,
                 STATS)


# ---------------------------------------------------------------------------------------------
# launchers (called from the op implementations in contracts.py)
# ---------------------------------------------------------------------------------------------
def _flags(q, alibi_slopes, sinks, mask_mode, window_left, chunk_size, sm_scale,
           logits_soft_cap, pos_encoding_mode, rope_scale, rope_theta, v_scale,
           row_max=False, skip_softmax=0.0):
    """Scalar kernel arguments and constexpr switches shared by every launch. row_max and
    skip_softmax (ragged and paged ops only) add STATS / SKIP, SKIP_LOG2 when set (POD's
    kernel has neither; _launch_prefill passes their off values explicitly: torch's tracing of
    a Triton launch fills no defaults)."""
    scalars = dict(
        qk_scale=float(sm_scale) * (1.0 if logits_soft_cap > 0 else LOG2E),
        soft_cap=float(logits_soft_cap) if logits_soft_cap > 0 else 1.0,
        window_left=int(window_left),
        chunk_size=int(chunk_size) if chunk_size > 0 else 1,
        rope_rcp_scale=1.0 / float(rope_scale),
        log2_theta=math.log2(float(rope_theta)),
        v_scale=float(v_scale),
    )
    consts = dict(
        MASK_MODE=int(mask_mode),
        HAS_WINDOW=window_left >= 0,
        HAS_CHUNK=chunk_size > 0,
        SOFT_CAP=logits_soft_cap > 0,
        ALIBI=pos_encoding_mode == POS_ALIBI,
        ROPE=pos_encoding_mode == POS_ROPE_LLAMA,
        SINKS=sinks is not None,
        FOLD=logits_soft_cap <= 0 and pos_encoding_mode != POS_ALIBI and sm_scale > 0,
    )
    if row_max:
        consts["STATS"] = True
    if skip_softmax > 0:
        consts.update(SKIP=True, SKIP_LOG2=math.log2(skip_softmax))
    return scalars, consts


def _known(cond) -> bool:
    """A launch-time condition: plain ints compare to a bool directly (eager calls, no
    statically_known_true per check); symbolic ones must be known true."""
    return cond if type(cond) is bool else statically_known_true(cond)


def _pow2(n):
    """triton.next_power_of_2 without its constexpr-function wrapper for plain ints."""
    return 1 << (n - 1).bit_length() if type(n) is int and n > 0 else triton.next_power_of_2(n)


def _dims(dqk: int, dvo: int, rope: bool) -> dict:
    """The head dims' constexprs: real dims (contracts.KERNEL_HEAD_DIMS, else ValueError) and
    their tiles, padded to a power of two; RoPE's half tiles are dot operands of 16 or more."""
    dqk, dvo = guard_int(dqk), guard_int(dvo)
    check_kernel_head_dims(dqk, dvo)
    bdqk = max(_pow2(dqk), 32 if rope else 16)
    return dict(BLOCK_DQK=bdqk, BLOCK_DVO=_pow2(dvo), DQK=dqk, DVO=dvo)


# The fields of each tensor's strides in Strides (stride_qb ... stride_lh on the kernels).
STRIDE_FIELDS = dict(q="bthd", k="btphd", v="btphd", o="bth", l="bth")


class ProgramArgs(NamedTuple):
    """What _program_args assembles for one launch: args, the runtime arguments of
    _prefill_fwd from q_ptr to v_scale by parameter name, in parameter order (a POD launch
    suffixes each part's names); consts, the constexprs by name (Options' fields); cfg, the
    launch configuration (_config, plus kv_rows and gluon)."""
    args: dict
    consts: dict
    cfg: dict


def _program_args(kv_mode, q, k, v, out, lse, q_strides, k_strides, v_strides, o_strides,
                  l_strides, qo_indptr, kv_indptr, page_idx, last_page_len, packed_mask,
                  mask_indptr, alibi_slopes, sinks, dense, block_m, page_size, params,
                  mean_kv=None, gluon=False):
    """A launch's ProgramArgs: the kernel's runtime arguments, its constexprs and the launch
    configuration. q_strides (batch, token, head, dim), k_strides / v_strides (batch, token,
    page, head, dim), o_strides / l_strides (batch, token, head): STRIDE_FIELDS. mean_kv: the
    batch's mean KV length when the shapes give it (descriptors are skipped for short ones).
    gluon: the launcher can run the Gluon kernel
    (single, ragged and paged launches without a split plan; not POD): cfg["gluon"] then holds
    its arguments where the launch takes it (_gluon_launch), and no Triton descriptors are
    built."""
    hq, hkv = q.shape[-2], k.shape[-2]
    scalars, consts = _flags(q, alibi_slopes, sinks, **params)
    dims = _dims(q.shape[-1], v.shape[-1], consts["ROPE"])
    cfg = _config(block_m, q.shape[-1], v.shape[-1], kv_mode, consts["MASK_MODE"])
    dummy = qo_indptr if qo_indptr is not None else q  # never read: its constexpr is off
    opt = lambda t: dummy if t is None else t  # noqa: E731
    args = dict(q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, qo_indptr_ptr=opt(qo_indptr),
                kv_indptr_ptr=opt(kv_indptr), page_idx_ptr=opt(page_idx),
                last_page_len_ptr=opt(last_page_len), mask_ptr=opt(packed_mask),
                mask_indptr_ptr=opt(mask_indptr), alibi_ptr=opt(alibi_slopes),
                sinks_ptr=opt(sinks))
    for x, strides in zip("qkvol", (q_strides, k_strides, v_strides, o_strides, l_strides)):
        args.update(zip((f"stride_{x}{f}" for f in STRIDE_FIELDS[x]), strides, strict=True))
    args.update(dense_qo_len=dense[0], dense_kv_len=dense[1], **scalars)
    # The Gluon kernel first (_gluon_launch: its scope, layout and size rules); what it does not
    # take runs the Triton kernel, whose K/V go through tensor descriptors where its tile and
    # the layout allow: over the whole K/V, built once on the host (TMA 2: eager launches) or
    # once per program of a persistent grid (TMA 3: traced graphs, 64-row tiles); else per
    # program and work item on the device (TMA 1), which short key ranges do not amortise
    # (pointer loads then, TMA 0).
    tma = 0
    if gluon:
        cfg["gluon"] = _gluon_launch(kv_mode, q, k, v, out, k_strides, v_strides, block_m,
                                     consts, scalars, page_size, mean_kv)
        tma = 2 if cfg["gluon"] is not None else 0
    if (not tma and cfg["TMA"] and _kv_descriptors(consts, kv_mode)
            and _tma_hardware(k.device) and _tma_ok(k, k_strides) and _tma_ok(v, v_strides)):
        whole = _whole_tensor_ok(k) and _whole_tensor_ok(v)
        # An eager launch too small to outlast its own host-side cost takes neither whole-tensor
        # path (both cost more CPU per call than the pointer loads or per-item descriptors),
        # unless a CUDA graph is capturing it: replays skip the host, so the faster kernel wins.
        eager = _eager_launch()
        small = eager and POLICY.host_tma and _too_small(q, kv_mode, mean_kv, v.shape[-1],
                                                  consts["MASK_MODE"])
        if whole and POLICY.host_tma and eager and not small:
            args["k_ptr"] = _host_descriptor(k, kv_mode, cfg["BLOCK_N"], dims["BLOCK_DQK"])
            args["v_ptr"] = _host_descriptor(v, kv_mode, cfg["BLOCK_N"], dims["BLOCK_DVO"])
            tma = 2
        elif whole and block_m in POLICY.persist_tma and not small:
            tma = 3
        elif not (isinstance(mean_kv, (int, float)) and mean_kv <= POLICY.tma_min_kv):
            tma = 1
    cfg["kv_rows"] = k.shape[0]  # dense B, ragged N: the whole K/V's leading dim (TMA 3)
    consts = dict(KV_MODE=kv_mode, PAGE_SIZE=page_size, GROUP=hq // hkv, **consts,
                  BLOCK_M=block_m, BLOCK_N=cfg["BLOCK_N"], **dims, NUM_STAGES=cfg["num_stages"],
                  TMA=tma)
    return ProgramArgs(args, consts, cfg)


def _kv_descriptors(consts: dict, kv_mode: int) -> bool:
    """Whether these options let contiguous K/V (dense or ragged) be read through tensor
    descriptors, the tile (cfg TMA: the Triton kernel's; the Gluon kernel's always) and the
    layout (_tma_ok) aside."""
    return POLICY.use_tma and kv_mode != KV_PAGED and not consts["ROPE"]


def _too_small(q, kv_mode, mean_kv, dvo, mask_mode) -> bool:
    """_small_launch, unless a CUDA graph is capturing the launch (its replays skip the host,
    so the faster kernel wins at any size)."""
    return (_small_launch(q, kv_mode, mean_kv, dvo, mask_mode)
            and not torch.cuda.is_current_stream_capturing())


def _gluon_rule(consts: dict, kv_mode: int, q, mean_kv, dvo: int,
                launch: bool = False) -> bool:
    """Whether an eager launch with these options and this much work may run the Gluon kernel,
    its scope (_gluon_scope), the tensors' layout and the hardware aside: paged K/V always;
    contiguous K/V where they may take descriptors (_kv_descriptors) and the launch is worth
    their host cost (not _small_launch; launch True: the launch itself asking, where a CUDA-graph
    capture exempts a small launch, _too_small). Asked by _gluon_launch and by
    compiled_attn.ops.dispatch.eager_gluon."""
    small = _too_small if launch else _small_launch
    return kv_mode == KV_PAGED or (
        _kv_descriptors(consts, kv_mode)
        and not small(q, kv_mode, mean_kv, dvo, consts["MASK_MODE"]))


def _gluon_launch(kv_mode, q, k, v, out, k_strides, v_strides, block_m, consts, scalars,
                  page_size, mean_kv):
    """The Gluon kernel's arguments (_gluon_views) when this launch takes it, else None (the
    Triton kernel runs it): an eager launch with host descriptors on (policy host_tma; traced graphs
    cannot capture them), _gluon_rule, and for contiguous K/V a layout that whole-tensor
    descriptors read (_tma_ok, _whole_tensor_ok) on TMA hardware. The rule goes first: a small
    launch then skips the layout checks."""
    if not (POLICY.host_tma and _eager_launch()
            and _gluon_rule(consts, kv_mode, q, mean_kv, v.shape[-1], launch=True)):
        return None
    if kv_mode != KV_PAGED and not (_tma_hardware(k.device)
                                    and _tma_ok(k, k_strides) and _tma_ok(v, v_strides)
                                    and _whole_tensor_ok(k) and _whole_tensor_ok(v)):
        return None
    return _gluon_views(kv_mode, q, k, v, out, block_m, consts, scalars, page_size)


def _gluon_device(device: torch.device) -> bool:
    """A Hopper GPU (the Gluon kernel's wgmma and TMA are sm_90's; not under the interpreter)."""
    return not INTERPRET and device.type == "cuda" and _sm_major(device) == 9


_KV_KIND = {KV_DENSE: "dense", KV_RAGGED: "ragged", KV_PAGED: "paged"}


def _gluon_scope(kv_mode, q, k, v, out_dtype, block_m, page_size, consts, scalars,
                 kv_layout: bool = True) -> bool:
    """Whether a launch is in the Gluon kernel's scope as far as its static properties tell:
    use_gluon, a Hopper GPU, a tile for this height and head dim (TILES: D 64 and 128 on 64-
    and 128-row tiles, D 256 on 128-row ones), pages it reads (prefill_gluon.page_read: TMA
    boxes or a producer warp group's gathers), fp16 / bf16
    throughout, V's head dim equal to Q's, unit stride, causal or no mask with a positive
    scale, none of window, chunks, soft cap, ALiBi, RoPE, sinks, a V scale, the row-max output
    or skip-softmax (the Gluon kernel writes neither), and K/V with
    packed heads and dims (prefill_gluon.kv_2d_layout). q / k / v may be traced tensors
    (sizes read by _known; block_m, page_size and head dims plain ints): the one test of both
    the eager launch (_gluon_views, which adds the pointers' alignment) and
    compiled_attn.ops.dispatch (which keeps a traced call opaque when it passes). kv_layout
    False leaves the K/V layout to the caller (the eager launch's kv_2d checks it)."""
    if not (POLICY.use_gluon and _gluon is not None):
        return False
    # (the head dim compared, not hashed: a traced q's is a SymInt; ops.dispatch has
    # guarded it to an int already)
    d = q.shape[-1]
    tile = next((t for (bm, dd), t in _gluon.TILES.items() if bm == block_m and d == dd), None)
    if tile is None or not _gluon_device(q.device):
        return False
    dt = q.dtype
    if dt not in (torch.float16, torch.bfloat16) or not (k.dtype == v.dtype == out_dtype == dt):
        return False
    if kv_mode == KV_PAGED and not _gluon.page_read(page_size, tile[0], d):
        return False
    if v.shape[-1] != d or not _known(q.stride(-1) == 1):
        return False
    if consts["MASK_MODE"] not in (MASK_NONE, MASK_CAUSAL) or not consts["FOLD"]:
        return False
    if any(consts.get(f) for f in ("HAS_WINDOW", "HAS_CHUNK", "SOFT_CAP", "ALIBI", "ROPE",
                                   "SINKS", "STATS", "SKIP")) or scalars["v_scale"] != 1.0:
        return False
    kind = _KV_KIND[kv_mode]
    return not kv_layout or (_gluon.kv_2d_layout(k, kind, _known)
                             and _gluon.kv_2d_layout(v, kind, _known))


def _gluon_views(kv_mode, q, k, v, out, block_m, consts, scalars, page_size=0):
    """The 2D K / V views, base-2 scale and page layout for the Gluon kernel (prefill_gluon.py)
    when this eager launch (_gluon_launch's rules) is in its scope (_gluon_scope,
    and K/V pointers 16-byte aligned: prefill_gluon.kv_2d), else None (the Triton kernel runs
    it). (Split-KV plans and POD launches never ask: _program_args' gluon.)"""
    if not _gluon_scope(kv_mode, q, k, v, out.dtype, block_m, page_size, consts, scalars,
                        kv_layout=False):
        return None
    kind = _KV_KIND[kv_mode]
    k2, v2 = _gluon.kv_2d(k, kind), _gluon.kv_2d(v, kind)
    if k2 is None or v2 is None:
        return None
    paged = None
    if kv_mode == KV_PAGED:
        paged = (page_size, _gluon.page_rows(k), _gluon.page_rows(v))
    return dict(k2=k2, v2=v2, qk_scale=scalars["qk_scale"], paged=paged)


# Eager launches below this many FLOPs skip the whole-tensor descriptors. On the H100's host
# an eager call with host descriptors costs ~170-300 us of CPU against ~130 us with pointer
# loads, while the kernel of D128 causal B16 x 1k (69 GFLOP) takes ~200 us: such loops run at
# the host's pace (eager TFLOP/s, S 512 / 1k: 103 / 194 with host descriptors, 201 / 282 with
# pointer loads; at S 2k, 137 GFLOP, host descriptors win, 396 vs 372; benchmarks/NOTES.md).
# The interpreter has no such cost: CI runs the descriptor paths at any size.
# (POLICY.host_tma_min_flop)


def _small_launch(q, kv_mode, mean_kv, dvo, mask_mode) -> bool:
    """Whether an eager launch's work (query rows x mean keys x heads x 2(Dqk + Dvo), halved
    for causal) is below HOST_TMA_MIN_FLOP; False when a length is not a plain number."""
    rows = q.shape[0] * q.shape[1] if kv_mode == KV_DENSE else q.shape[0]
    if not isinstance(mean_kv, (int, float)) or type(rows) is not int:
        return False
    flop = 2.0 * rows * mean_kv * q.shape[-2] * (q.shape[-1] + dvo)
    return flop * (0.5 if mask_mode == MASK_CAUSAL else 1.0) < POLICY.host_tma_min_flop


def _eager_launch() -> bool:
    """Whether this launch runs the kernel directly (the interpreter, or triton_op's eager call
    on real tensors), not a wrap_triton trace: wrap_triton does not capture host descriptors
    while tracing ("TMA descriptor capturing not yet supported in non-dynamo tracing", torch
    2.11-2.13), so graphs traced by torch.compile / export build theirs per program."""
    if INTERPRET:
        return True
    return is_wrap_triton_enabled is not None and not is_wrap_triton_enabled()


def _whole_tensor_ok(t: torch.Tensor) -> bool:
    """Whether K or V can be seen through one descriptor over the whole tensor (TMA 2 / 3):
    no empty dim and no zero stride (an expanded batch or head is not left to the tensor-map
    checks of the driver or the device); otherwise descriptors per work item (TMA 1)."""
    return all(_known(x > 0) for x in t.shape) and all(_known(x > 0) for x in t.stride())


def _host_descriptor(t: torch.Tensor, kv_mode: int, block_n: int, block_d: int):
    """A host tensor descriptor over K or V (dense [B, S, Hkv, D] seen as [B, Hkv, S, D], block
    [1, 1, block_n, block_d]; ragged [N, Hkv, D] seen as [Hkv, N, D], block [1, block_n,
    block_d]); the caller checked _whole_tensor_ok."""
    # the permuted views' shapes and strides, without building the views
    order = (0, 2, 1, 3) if kv_mode == KV_DENSE else (1, 0, 2)
    shape, strides = t.shape, t.stride()
    return TensorDescriptor(t, [shape[i] for i in order], [strides[i] for i in order],
                            [1] * (len(order) - 2) + [block_n, block_d])


# Tensor descriptors (TMA) for K/V: on by default where the hardware has them; benchmarks and
# tests turn them off to compare with the pointer loads (same results). HOST_TMA: built once
# per launch on the host and passed to every program (3-10% faster at S <= 4k on the H100 than
# two per program built on the device, benchmarks/NOTES.md) in eager calls. PERSIST_TMA: the
# tile heights that, where host descriptors cannot go (traced graphs, or HOST_TMA off), run a
# persistent grid whose programs build theirs once (H100, kernel time: +3-16% over per-item
# descriptors or pointer loads at S <= 2k, even at 4k-8k; with 128-row tiles, which the policy
# gives long keys, 5% slower at S 16k): other tiles build them per program and work item.
# (The switches live on ops.policy.POLICY: use_tma, host_tma, persist_tma, and use_gluon for
# the Gluon Hopper kernel, off in every KV_PATHS entry but "gluon", so that forcing a path
# forces the Triton kernel on it.)

# The module settings that force each K/V load path of dense and ragged launches (tests and
# benchmarks compare them; the results are the same): name -> (TMA constexpr, settings).
# "host" even for small eager launches, "persistent" for both tile heights, "device" even for
# short keys.
KV_PATHS = {
    "gluon": (2, dict(use_gluon=True, use_tma=True, host_tma=True, host_tma_min_flop=0,
                      persist_tma=frozenset())),
    "host": (2, dict(use_gluon=False, use_tma=True, host_tma=True, host_tma_min_flop=0,
                     persist_tma=frozenset())),
    "persistent": (3, dict(use_gluon=False, use_tma=True, host_tma=False,
                           persist_tma=frozenset({64, 128}))),
    "device": (1, dict(use_gluon=False, use_tma=True, host_tma=False, persist_tma=frozenset(),
                       tma_min_kv=0)),
    "pointers": (0, dict(use_gluon=False, use_tma=False, host_tma=False,
                         persist_tma=frozenset())),
}


def _tma_hardware(device: torch.device) -> bool:
    """Device tensor descriptors exist: Hopper or newer (or the interpreter)."""
    return INTERPRET or (device.type == "cuda" and _sm_major(device) >= 9)


def _tma_ok(t: torch.Tensor, strides) -> bool:
    """Whether K or V (strides: batch, token, page, head, dim) is laid out for a device tensor
    descriptor: unit dim stride, and every other stride and the start 16-byte aligned (the
    storage itself is allocator-aligned; a real tensor's pointer is checked too). Decided per
    launch; otherwise pointer loads."""
    es = t.element_size()
    if not _known(strides[4] == 1):
        return False
    for x in (strides[0], strides[1], strides[3], t.storage_offset()):
        if not _known((x * es) % 16 == 0):
            return False
    return INTERPRET or (type(t) is not torch.Tensor and is_fake(t)) or t.data_ptr() % 16 == 0


def _mean(total, count):
    """total / count for plain ints (None when symbolic or count is 0)."""
    if isinstance(total, int) and isinstance(count, int) and count > 0:
        return total / count
    return None


def dense_block_m(q, k, v, mask_mode: int) -> int:
    """single_prefill's tile height (block_m_for): q [B, Sq, Hq, Dqk], k / v [B, Skv, Hkv, D],
    real, fake or traced. Head dims and the head ratio are constexprs of either kernel, so a
    symbolic one is specialised (guard_int); a symbolic Skv counts as unknown. The launch's
    rule and compiled_attn.ops.dispatch's."""
    skv = k.shape[1]
    return block_m_for(guard_int(q.shape[-1]), guard_int(v.shape[-1]),
                       guard_int(q.shape[-2]) // guard_int(k.shape[-2]),
                       skv if isinstance(skv, int) else None, mask_mode != MASK_NONE)


def ragged_mean_kv(k, qo_indptr):
    """A ragged batch's mean KV length, k [Nk, Hkv, D], qo_indptr [R + 1] (None when either
    size is symbolic or R is 0): what _program_args and ops.dispatch size the launch by."""
    return _mean(k.shape[0], qo_indptr.shape[0] - 1)


def _dense_args(q, k, v, packed_mask, alibi_slopes, sinks, out_dtype, params, gluon=False):
    """single_prefill: q [B, Sq, Hq, Dqk], k/v [B, Skv, Hkv, D]."""
    bsz, sq, hq, _ = q.shape
    skv = k.shape[1]
    block_m = dense_block_m(q, k, v, params["mask_mode"])
    out = q.new_empty((bsz, sq, hq, v.shape[-1]), dtype=out_dtype)
    lse = q.new_empty((bsz, sq, hq), dtype=torch.float32)
    args = _program_args(
        KV_DENSE, q, k, v, out, lse,
        (q.stride(0), q.stride(1), q.stride(2), q.stride(3)),
        (k.stride(0), k.stride(1), 0, k.stride(2), k.stride(3)),
        (v.stride(0), v.stride(1), 0, v.stride(2), v.stride(3)),
        (out.stride(0), out.stride(1), out.stride(2)),
        (lse.stride(0), lse.stride(1), lse.stride(2)),
        None, None, None, None, packed_mask, None, alibi_slopes, sinks,
        (sq, skv), block_m, 1, params, skv, gluon)
    return out, lse, args


def _lse_out(q, params) -> torch.Tensor:
    """The LSE output of a ragged / paged launch: float32 [Nq, Hq], or [Nq, Hq, 2] (LSE, row
    max) with row_max (_store_final's STATS)."""
    shape = (q.shape[0], q.shape[1], 2) if params.get("row_max") else (q.shape[0], q.shape[1])
    return q.new_empty(shape, dtype=torch.float32)


def _ragged_args(q, k, v, qo_indptr, kv_indptr, packed_mask, mask_indptr, alibi_slopes,
                 sinks, block_m, out_dtype, params, gluon=False):
    """batch_ragged_prefill: q [Nq, Hq, Dqk], k/v [Nk, Hkv, D]."""
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=out_dtype)
    lse = _lse_out(q, params)
    args = _program_args(
        KV_RAGGED, q, k, v, out, lse,
        (0, q.stride(0), q.stride(1), q.stride(2)),
        (0, k.stride(0), 0, k.stride(1), k.stride(2)),
        (0, v.stride(0), 0, v.stride(1), v.stride(2)),
        (0, out.stride(0), out.stride(1)),
        (0, lse.stride(0), lse.stride(1)),
        qo_indptr, kv_indptr, None, None, packed_mask, mask_indptr, alibi_slopes, sinks,
        (0, 0), block_m, 1, params, ragged_mean_kv(k, qo_indptr), gluon)
    return out, lse, args


def _paged_args(q, kc, vc, qo_indptr, kv_page_indptr, kv_page_indices, kv_last_page_len,
                packed_mask, mask_indptr, alibi_slopes, sinks, block_m, out_dtype, params,
                gluon=False):
    """batch_paged_prefill: q [Nq, Hq, Dqk], caches [P, page, Hkv, D] (any strides)."""
    out = q.new_empty((q.shape[0], q.shape[1], vc.shape[-1]), dtype=out_dtype)
    lse = _lse_out(q, params)
    args = _program_args(
        KV_PAGED, q, kc, vc, out, lse,
        (0, q.stride(0), q.stride(1), q.stride(2)),
        (0, kc.stride(1), kc.stride(0), kc.stride(2), kc.stride(3)),
        (0, vc.stride(1), vc.stride(0), vc.stride(2), vc.stride(3)),
        (0, out.stride(0), out.stride(1)),
        (0, lse.stride(0), lse.stride(1)),
        qo_indptr, kv_page_indptr, kv_page_indices, kv_last_page_len, packed_mask, mask_indptr,
        alibi_slopes, sinks, (0, 0), block_m, kc.shape[1], params, gluon=gluon)
    return out, lse, args


def _scratch(size: int, alignment: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator() -> None:
    """Device-built tensor descriptors need a little global scratch per program, which Triton
    asks its allocator for at launch. Inductor's generated code installs its own; for eager
    launches install a torch-backed one unless the caller already set one."""
    if INTERPRET:
        return
    if _allocator is not None and not isinstance(_allocator.get(), NullAllocator):
        return
    triton.set_allocator(_scratch)


# Tiles resident per SM: two 64-row tiles (4 warps, ~113 KB of shared memory each) or one
# 128-row tile fit an H100 SM at once. Persistent launches (TMA 3) start twice that many
# programs per SM in case more fit: programs that start late find the counter spent and exit.
RESIDENT_PER_SM = {64: 2, 128: 1}


def _resident_tiles(device: torch.device, block_m: int) -> int:
    """Tiles of this height that the device runs at once (RESIDENT_PER_SM on every SM)."""
    return RESIDENT_PER_SM.get(block_m, 1) * sm_count(device.index)


def _persistent_programs(device: torch.device, items, block_m: int):
    """Programs of a persistent launch: twice the resident tiles (3 under the interpreter, so
    that programs take several items), at most one per item."""
    cap = 3 if INTERPRET else 2 * _resident_tiles(device, block_m)
    return min(items, cap) if type(items) is int else torch.sym_min(items, cap)


def _dense_group(device: torch.device, tiles, pairs, block_m: int, causal: bool):
    """(batch entry, KV head) pairs per group of the dense launch order (_work_item). Causal:
    the largest divisor of ``pairs`` whose tiles fit one wave of resident programs. A group
    then runs its tiles heaviest first side by side, so the launch ends on light tiles instead
    of the last pair's heaviest ones, while the pairs running together are no more than one
    pair at a time would have resident (their K/V stays in L2; groups twice as large measured
    2-5% slower, benchmarks/NOTES.md). Tiles of equal weight (no causal mask) and symbolic
    sizes keep one pair at a time. The interpreter takes 12 resident programs, so that small
    test shapes form groups."""
    if not causal or type(tiles) is not int or type(pairs) is not int or tiles <= 0:
        return 1
    resident = 12 if INTERPRET else _resident_tiles(device, block_m)
    cap = max(1, min(pairs, resident // tiles))
    return next(g for g in range(cap, 0, -1) if pairs % g == 0)  # the largest divisor <= cap


def _launch_prefill(grid, work, tiles, out, lse, args, merge=None, sinks=None, v_scale=1.0,
                    group=1):
    """The prefill launch; with a split plan (work [W, 4], merge [T, 4]) the chunks of a split
    tile write float32 partials and _merge_fwd combines them (a second launch). Dense mode:
    tiles per batch entry and (entry, KV head) pairs per group of the launch order."""
    prog_args, consts, cfg = args
    n_items, n_hkv = grid
    split = work is not None and work.shape[1] == 4
    if work is None:
        work = prog_args["q_ptr"]  # dense mode reads no work list; any tensor stands in
    part_o = part_l = work
    if split:
        # Allocated for every split plan (a chunk never writes outside these buffers, even if
        # a plan forgot its merge row).
        part_o = launch.scratch((work.shape[0], n_hkv, consts["BLOCK_M"], consts["BLOCK_DVO"]),
                                torch.float32, work.device)
        stats = 2 if consts.get("STATS") else 1  # chunk LSEs (and chunk maxima)
        part_l = launch.scratch((work.shape[0], n_hkv, stats * consts["BLOCK_M"]),
                                torch.float32, work.device)
    gl_args = cfg.get("gluon")
    if gl_args is not None:
        # The Gluon kernel (_gluon_launch chose it); dense mode keeps this launch's item order.
        q = prog_args["q_ptr"]
        dense = paged = None
        if consts["KV_MODE"] == KV_DENSE:
            dense = (q.shape[0], q.shape[1], prog_args["k_ptr"].shape[1], tiles, group)
        if consts["KV_MODE"] == KV_PAGED:
            page, k_rows, v_rows = gl_args["paged"]
            paged = (page, prog_args["page_idx_ptr"], prog_args["last_page_len_ptr"], k_rows,
                     v_rows)
        return _gluon.launch(q, gl_args["k2"], gl_args["v2"], out, lse,
                             prog_args["qo_indptr_ptr"], prog_args["kv_indptr_ptr"], work,
                             dense=dense, paged=paged,
                             qk_scale=gl_args["qk_scale"],
                             causal=consts["MASK_MODE"] == MASK_CAUSAL, block_m=consts["BLOCK_M"])
    counter = work
    if consts["TMA"] == 3:
        grid = (_persistent_programs(out.device, n_items * n_hkv, consts["BLOCK_M"]),)
        counter = launch.counter(out.device)
    if consts["TMA"] in (1, 3):
        _ensure_allocator()
    opts = dict(STATS=False, SKIP=False, SKIP_LOG2=0.0)  # (the kernel's defaults)
    opts.update((k, consts[k]) for k in opts if k in consts)
    launch.run(
        _prefill_fwd, grid, work, tiles, group, part_o, part_l, n_items, n_hkv, cfg["kv_rows"],
        counter, *prog_args.values(), **{k: v for k, v in consts.items() if k not in opts},
        **opts,
        SPLIT=split, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if split and merge is not None and merge.shape[0] > 0:
        qo_indptr = prog_args["qo_indptr_ptr"]
        launch.run(
            _merge_fwd, (merge.shape[0], n_hkv), merge, part_o, part_l, out, lse, qo_indptr,
            sinks if sinks is not None else qo_indptr,
            out.stride(0), out.stride(1), lse.stride(0), lse.stride(1), float(v_scale),
            GROUP=consts["GROUP"], SINKS=sinks is not None, BLOCK_M=consts["BLOCK_M"],
            BLOCK_DVO=consts["BLOCK_DVO"], DVO=consts["DVO"], STATS=opts["STATS"], num_warps=4)
    return out, lse


def launch_single(q, k, v, packed_mask, alibi_slopes, sinks, *, out_dtype, **params):
    """single_prefill: grid (B * tiles, Hkv)."""
    out, lse, args = _dense_args(q, k, v, packed_mask, alibi_slopes, sinks, out_dtype, params,
                                 gluon=True)
    bsz, sq = q.shape[0], q.shape[1]
    if bsz == 0 or sq == 0:
        return out, lse
    consts = args.consts
    tiles = (sq * consts["GROUP"] + consts["BLOCK_M"] - 1) // consts["BLOCK_M"]  # cdiv
    group = _dense_group(q.device, tiles, bsz * k.shape[2], consts["BLOCK_M"],
                         consts["MASK_MODE"] == MASK_CAUSAL)
    return _launch_prefill((bsz * tiles, k.shape[2]), None, tiles, out, lse, args, group=group)


def launch_ragged(q, k, v, qo_indptr, kv_indptr, work, packed_mask, mask_indptr, alibi_slopes,
                  sinks, block_m, merge=None, *, out_dtype, **params):
    """batch_ragged_prefill: grid (work items, Hkv)."""
    out, lse, args = _ragged_args(q, k, v, qo_indptr, kv_indptr, packed_mask, mask_indptr,
                                  alibi_slopes, sinks, block_m, out_dtype, params,
                                  gluon=work.shape[1] == 2)  # not a split plan
    if work.shape[0] == 0 or q.shape[0] == 0:
        return out, lse
    return _launch_prefill((work.shape[0], k.shape[1]), work, 1, out, lse, args, merge, sinks,
                           params["v_scale"])


def launch_paged(q, k_cache, v_cache, qo_indptr, kv_page_indptr, kv_page_indices,
                 kv_last_page_len, work, packed_mask, mask_indptr, alibi_slopes, sinks, block_m,
                 merge=None, *, out_dtype, **params):
    """batch_paged_prefill: grid (work items, Hkv)."""
    out, lse, args = _paged_args(q, k_cache, v_cache, qo_indptr, kv_page_indptr,
                                 kv_page_indices, kv_last_page_len, packed_mask, mask_indptr,
                                 alibi_slopes, sinks, block_m, out_dtype, params,
                                 gluon=work.shape[1] == 2)  # not a split plan
    if work.shape[0] == 0 or q.shape[0] == 0:
        return out, lse
    return _launch_prefill((work.shape[0], k_cache.shape[2]), work, 1, out, lse, args, merge,
                           sinks, params["v_scale"])


def launch_pod(q_p, k_cache_p, v_cache_p, qo_indptr_p, kv_page_indptr_p, kv_page_indices_p,
               kv_last_page_len_p, q_d, k_cache_d, v_cache_d, qo_indptr_d, kv_page_indptr_d,
               kv_page_indices_d, kv_last_page_len_d, work, packed_mask_p, mask_indptr_p,
               alibi_slopes, block_m, p_params, d_params):
    """pod_prefill_decode: one launch, grid (work items, Hkv); work rows (part, req, row)."""
    if k_cache_p.shape[2] != k_cache_d.shape[2] or q_p.shape[1] != q_d.shape[1]:
        raise ValueError(
            "pod_prefill_decode: the prefill and decode parts must have the same numbers of "
            f"query heads ({q_p.shape[1]} vs {q_d.shape[1]}) and KV heads "
            f"({k_cache_p.shape[2]} vs {k_cache_d.shape[2]}): they share one launch grid")
    p_params, d_params = dict(p_params), dict(d_params)
    out_dtype = p_params.pop("out_dtype")
    d_params.pop("out_dtype")
    out_p, lse_p, args_p = _paged_args(
        q_p, k_cache_p, v_cache_p, qo_indptr_p, kv_page_indptr_p, kv_page_indices_p,
        kv_last_page_len_p, packed_mask_p, mask_indptr_p, alibi_slopes, None, block_m,
        out_dtype, p_params)
    out_d, lse_d, args_d = _paged_args(
        q_d, k_cache_d, v_cache_d, qo_indptr_d, kv_page_indptr_d, kv_page_indices_d,
        kv_last_page_len_d, None, None, alibi_slopes, None, block_m, out_dtype, d_params)
    if work.shape[0] == 0:
        return out_p, lse_p, out_d, lse_d
    # Both parts' loops live in one kernel and Triton gives each its own shared memory: halve
    # each part's pipeline footprint (BLOCK_N and stages) so the sum fits.
    d = max(q_p.shape[-1], v_cache_p.shape[-1])
    pod_cfg = dict(BLOCK_N=32 if d > 128 else 64, NUM_STAGES=2)
    cfg = dict(num_warps=args_p.cfg["num_warps"], num_stages=2)
    consts = {**{f"{k}_P": pod_cfg.get(k, v) for k, v in args_p.consts.items()},
              **{f"{k}_D": pod_cfg.get(k, v) for k, v in args_d.consts.items()}}
    launch.run(
        _pod_fwd, (work.shape[0], k_cache_p.shape[2]), work, *args_p.args.values(),
        *args_d.args.values(), **consts, num_warps=cfg["num_warps"],
        num_stages=cfg["num_stages"])
    return out_p, lse_p, out_d, lse_d
