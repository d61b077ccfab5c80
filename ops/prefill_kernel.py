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
from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.fx.experimental.symbolic_shapes import guard_int

from triton.tools.tensor_descriptor import TensorDescriptor

try:  # Triton's allocator slot (private): None where this Triton lacks it
    from triton.runtime._allocation import NullAllocator, _allocator
except ImportError:
    NullAllocator = _allocator = None
from . import choose, launch
from .choose import KV_DENSE, KV_PAGED, KV_RAGGED, known as _known
from .modes import (INTERPRET, LOG2E, MASK_CAUSAL, MASK_CUSTOM, MASK_NONE, POS_ALIBI,
                    POS_ROPE_LLAMA)
from .tiles import one_page_size
from .tiles import SMALL_PAGE_BLOCK_M  # noqa: F401 (tests read it here)
from .contracts import check_kernel_head_dims

_gluon = choose._gluon  # the Gluon Hopper kernel's module (None where this Triton lacks Gluon)

_LOG2E = tl.constexpr(LOG2E)  # (the kernels' view of it)

# ---- the kernel's argument bundles ------------------------------------------------------------
# The launched kernels (_prefill_fwd, _pod_fwd) keep flat signatures: torch's wrap_triton, its
# mutation analysis and the bound-launch replay (launch.py) bind kernel arguments one by one.
# They gather those arguments into plain tuples, which the inner functions (_prefill_items,
# _program, _attend_range) take instead of long positional lists; a field is read by the
# tl.constexpr index below (``st[ST_KT]``, ``C[O_BLOCK_N]``). Triton passes a tuple's fields
# like separate arguments, constexpr fields as constexprs, as long as the tuple is built in the
# call (assigned to a name, its constexprs, such as strides specialised to 1, turn into
# tensors). Plain tuples and tl.constexpr globals, not named tuples: torch.compile and
# AOTInductor inline a launch by regenerating the kernel's source in a module of their own,
# which carries jit functions and tl.constexpr / int / str / bool globals only
# (tests/test_mutation_analysis.py). Each bundle's fields, in order (the prefix names it):
#
# ptrs (P_): a launch's tensors but K and V (pointers; unused ones stand in for an option that
#   is off): q, o, lse and the ragged / paged indptrs, page table, mask and per-head vectors.
(P_Q, P_O, P_LSE, P_QO_INDPTR, P_KV_INDPTR, P_PAGE_IDX, P_LAST_PAGE_LEN, P_MASK, P_MASK_INDPTR,
 P_ALIBI, P_SINKS) = map(tl.constexpr, range(11))
# st (ST_): element strides: q (batch, token, head, dim), k / v (batch, token, page, head, dim),
#   o and lse (batch, token, head) (STRIDE_FIELDS spells them on the host).
(ST_QB, ST_QT, ST_QH, ST_QD, ST_KB, ST_KT, ST_KP, ST_KH, ST_KD, ST_VB, ST_VT, ST_VP, ST_VH,
 ST_VD, ST_OB, ST_OT, ST_OH, ST_LB, ST_LT, ST_LH) = map(tl.constexpr, range(20))
# sc (SC_): runtime scalars (floats in fp32): dense mode's lengths, the base-2 logit scale and
#   the options' values (_flags).
(SC_DENSE_QO_LEN, SC_DENSE_KV_LEN, SC_QK_SCALE, SC_SOFT_CAP, SC_WINDOW_LEFT, SC_CHUNK_SIZE,
 SC_ROPE_RCP_SCALE, SC_LOG2_THETA, SC_V_SCALE) = map(tl.constexpr, range(9))
# C (O_): the constexpr switches and tile sizes (_program_args' consts; SPLIT, ROW: the work
#   list's split fields and row length; STATS, SKIP, SKIP_LOG2: _program).
(O_KV_MODE, O_PAGE_SIZE, O_GROUP, O_MASK_MODE, O_HAS_WINDOW, O_HAS_CHUNK, O_SOFT_CAP, O_ALIBI,
 O_ROPE, O_SINKS, O_FOLD, O_BLOCK_M, O_BLOCK_N, O_BLOCK_DQK, O_BLOCK_DVO, O_DQK, O_DVO,
 O_NUM_STAGES, O_TMA, O_SPLIT, O_ROW, O_STATS, O_SKIP, O_SKIP_LOG2) = map(tl.constexpr, range(24))
# rows (R_): a tile's query rows for _attend_range: q (RoPE: first half; q2 the second), each
#   row's position, token and validity, ALiBi slope, and the custom mask's first bit.
R_Q, R_Q2, R_P_ROW, R_TOK, R_ROW_OK, R_SLOPE, R_MASK_BASE = map(tl.constexpr, range(7))
# keys (KEY_): a work item's keys for _attend_range: kv_len, the TMA coordinate of its first
#   key, the KV head, K / V at this head (pointers, or descriptors over the whole K / V), the
#   per-item descriptors (TMA 1; else the same as k / v) and the first page-table entry.
(KEY_KV_LEN, KEY_KV_COORD, KEY_HKV, KEY_K_HEAD, KEY_V_HEAD, KEY_K_DESC, KEY_V_DESC,
 KEY_PAGE_BASE) = map(tl.constexpr, range(8))

# ptxas of triton 3.6 crashes on 2-stage pipelines that load K/V through tensor descriptors or
# as whole-page 3D blocks (seen on the H100): the launch (choose.config) and the kernel (PAGE3D)
# turn both kinds of load off for this stage count.
CRASH_STAGES = tl.constexpr(choose.CRASH_STAGES)


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
    rows (R_ fields) against the item's keys (KEY_ fields); ptrs, st, sc, C: the launch's
    bundles (P_, ST_, SC_, O_ fields). MASKED tiles apply the visibility rule; unmasked ones
    are known to be fully visible to every row. With TMA 1, K and V tiles come through the
    per-program descriptors KEY_K_DESC / KEY_V_DESC (shape [kv_len, D] of this request and
    head: keys past kv_len and dims past D read as 0), with TMA 2 / 3 through descriptors over
    the whole K / V: both by _load_tile. SKIP: a row drops a tile whose max is below its
    running max by more than log2(kv_len) - SKIP_LOG2 (base 2; SKIP_LOG2 = log2 of the factor,
    contracts._stats_skip); a tile no row keeps skips its P.V."""
    q = rows[R_Q]
    kv_len = keys[KEY_KV_LEN]
    page_base = keys[KEY_PAGE_BASE]
    page_idx = ptrs[P_PAGE_IDX]
    offs_n = tl.arange(0, C[O_BLOCK_N])
    HALF: tl.constexpr = C[O_BLOCK_DQK] // 2
    RH: tl.constexpr = C[O_DQK] // 2  # RoPE: where the second half starts (HALF lanes, RH real)
    if C[O_ROPE]:
        offs_d1 = tl.arange(0, HALF)
    else:
        offs_d1 = tl.arange(0, C[O_BLOCK_DQK])
    offs_dv = tl.arange(0, C[O_BLOCK_DVO])
    # Paged: the page indices of a tile are read one tile ahead (loop-carried), so that its K/V
    # addresses do not wait on a load of the same iteration (the pipeliner then streams K/V as
    # deep as for contiguous keys). Per-key reads (page 1, pages that do not tile BLOCK_N)
    # carry the [BLOCK_N] pages; whole-page tiles carry their [NP] page indices.
    AHEAD: tl.constexpr = C[O_KV_MODE] == 2 and C[O_PAGE_SIZE] % C[O_BLOCK_N] != 0 and (
        C[O_PAGE_SIZE] == 1 or C[O_BLOCK_N] % C[O_PAGE_SIZE] != 0)
    AHEAD_NP: tl.constexpr = C[O_KV_MODE] == 2 and C[O_PAGE_SIZE] > 1 and \
        C[O_PAGE_SIZE] % C[O_BLOCK_N] != 0 and C[O_BLOCK_N] % C[O_PAGE_SIZE] == 0
    NP: tl.constexpr = C[O_BLOCK_N] // C[O_PAGE_SIZE] if AHEAD_NP else 1
    # Whole-page tiles load K/V as [NP, PAGE_SIZE, D] blocks (one page per slice, reshaped to
    # [BLOCK_N, D]): a thread's vectors then lie in one page, so it needs one page index and one
    # 64-bit page offset per load instead of one per key it touches. Not with CRASH_STAGES
    # (custom masks, D 256).
    PAGE3D: tl.constexpr = AHEAD_NP and not C[O_ROPE] and C[O_NUM_STAGES] != CRASH_STAGES
    if PAGE3D:
        offs_p3 = (tl.arange(0, NP) * C[O_PAGE_SIZE])[:, None, None] + \
            tl.arange(0, C[O_PAGE_SIZE])[None, :, None]
        slot3 = tl.arange(0, C[O_PAGE_SIZE]).to(tl.int64)[None, :, None]
    if AHEAD:
        pages = _page_of_keys(n_lo, kv_len, page_base, page_idx, C[O_PAGE_SIZE],
                              C[O_BLOCK_N])
    if AHEAD_NP:
        pnp = _whole_pages(n_lo, kv_len, page_base, page_idx, C[O_PAGE_SIZE], NP)
    for n in tl.range(n_lo, n_hi, C[O_BLOCK_N], num_stages=C[O_NUM_STAGES]):
        j = n + offs_n
        j_ok = j < kv_len
        if PAGE3D:
            pg3 = pnp.to(tl.int64)[:, None, None]
            pnp = _whole_pages(n + C[O_BLOCK_N], kv_len, page_base, page_idx,
                               C[O_PAGE_SIZE], NP)
            ok3 = (n + offs_p3) < kv_len
        elif not C[O_TMA]:
            if C[O_KV_MODE] == 2:
                if AHEAD:
                    pg = pages.to(tl.int64)
                    pages = _page_of_keys(n + C[O_BLOCK_N], kv_len, page_base, page_idx,
                                          C[O_PAGE_SIZE], C[O_BLOCK_N])
                elif AHEAD_NP:
                    pg = tl.reshape(tl.broadcast_to(pnp[:, None], [NP, C[O_PAGE_SIZE]]),
                                    [C[O_BLOCK_N]])
                    pg = pg.to(tl.int64)
                    pnp = _whole_pages(n + C[O_BLOCK_N], kv_len, page_base, page_idx,
                                       C[O_PAGE_SIZE], NP)
                else:
                    pg = _page_of_keys(n, kv_len, page_base, page_idx, C[O_PAGE_SIZE],
                                       C[O_BLOCK_N]).to(tl.int64)
                slot = (j % C[O_PAGE_SIZE]).to(tl.int64)
                k_off = pg * st[ST_KP] + slot * st[ST_KT]
                v_off = pg * st[ST_VP] + slot * st[ST_VT]
            else:
                k_off = j.to(tl.int64) * st[ST_KT]
                v_off = j.to(tl.int64) * st[ST_VT]
            kt_ptrs = keys[KEY_K_HEAD] + k_off[None, :] + offs_d1[:, None].to(tl.int64) * st[ST_KD]
        if C[O_TMA]:
            k = _load_tile(keys[KEY_K_DESC], keys[KEY_KV_COORD], keys[KEY_HKV], n, C[O_TMA],
                           C[O_KV_MODE], C[O_BLOCK_N], C[O_BLOCK_DQK])
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        elif PAGE3D:
            k = _load_pages(keys[KEY_K_HEAD], pg3, slot3, ok3, offs_d1, st[ST_KP], st[ST_KT],
                            st[ST_KD], MASKED, C[O_DQK], C[O_BLOCK_N], C[O_BLOCK_DQK])
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        elif C[O_ROPE]:
            k_ok = j_ok[None, :]
            if RH != HALF:
                k_ok = k_ok & (offs_d1[:, None] < RH)
            k1 = tl.load(kt_ptrs, mask=k_ok, other=0.0).to(tl.float32)
            k2 = tl.load(kt_ptrs + RH * st[ST_KD], mask=k_ok, other=0.0).to(tl.float32)
            k1, k2 = _rope(k1, k2, j, sc[SC_ROPE_RCP_SCALE], sc[SC_LOG2_THETA], HALF, False,
                           C[O_DQK])
            s = tl.dot(q, k1.to(q.dtype)) + tl.dot(rows[R_Q2], k2.to(q.dtype))
        elif MASKED or C[O_DQK] != C[O_BLOCK_DQK]:
            k = tl.load(kt_ptrs, mask=j_ok[None, :] & (offs_d1[:, None] < C[O_DQK]), other=0.0)
            s = tl.dot(q, k.to(q.dtype))
        else:
            k = tl.load(kt_ptrs)  # unmasked range: every key is < kv_len
            s = tl.dot(q, k.to(q.dtype))
        # FOLD (no cap, no ALiBi, positive scale): an unmasked tile keeps the raw products and
        # folds the scale into the exp2 argument (one FMA per logit).
        UNSCALED: tl.constexpr = C[O_FOLD] and not MASKED
        if C[O_SOFT_CAP]:
            s = _tanh(s * (sc[SC_QK_SCALE] / sc[SC_SOFT_CAP])) * (sc[SC_SOFT_CAP] * _LOG2E)
        elif not UNSCALED:
            s = s * sc[SC_QK_SCALE]
        if C[O_ALIBI]:
            dist = (j[None, :] - rows[R_P_ROW][:, None]).to(tl.float32)
            s += (rows[R_SLOPE] * _LOG2E)[:, None] * dist
        if MASKED:
            see = j_ok[None, :] & rows[R_ROW_OK][:, None]
            if C[O_MASK_MODE] == 1:
                see = see & (j[None, :] <= rows[R_P_ROW][:, None])
            if C[O_MASK_MODE] == 2:
                bit = rows[R_MASK_BASE] + rows[R_TOK].to(tl.int64)[:, None] * kv_len + j[None, :]
                byte = tl.load(ptrs[P_MASK] + (bit >> 3), mask=see, other=0)
                see = see & (((byte.to(tl.int32) >> (bit & 7).to(tl.int32)) & 1) != 0)
            if C[O_HAS_WINDOW]:
                see = see & (j[None, :] >= rows[R_P_ROW][:, None] - sc[SC_WINDOW_LEFT])
            if C[O_HAS_CHUNK]:
                see = see & (j[None, :] >= (rows[R_P_ROW][:, None] // sc[SC_CHUNK_SIZE]) *
                             sc[SC_CHUNK_SIZE])
                see = see & (j[None, :] <= rows[R_P_ROW][:, None])
            s = tl.where(see, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row that has seen nothing yet keeps m = -inf; subtract 0 instead (no NaN).
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            if UNSCALED:
                m_new = tl.maximum(m_i, tl.max(s, 1) * sc[SC_QK_SCALE])
            else:
                m_new = tl.maximum(m_i, tl.max(s, 1))
            m_sub = m_new
        use_tile = True
        if C[O_SKIP]:
            if UNSCALED:
                t_max = tl.max(s, 1) * sc[SC_QK_SCALE]
            else:
                t_max = tl.max(s, 1)
            thr = C[O_SKIP_LOG2] - tl.log2(kv_len.to(tl.float32))
            keep = (t_max > float("-inf")) & (t_max >= m_i + thr)
            m_new = tl.where(keep, m_new, m_i)
            m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
            use_tile = tl.max(keep.to(tl.int32), 0) > 0
        if UNSCALED:
            p = tl.exp2(s * sc[SC_QK_SCALE] - m_sub[:, None])
        else:
            p = tl.exp2(s - m_sub[:, None])
        if C[O_SKIP]:
            p = tl.where(keep[:, None], p, 0.0)
        alpha = tl.exp2(m_i - m_sub)
        l_i = l_i * alpha + tl.sum(p, 1)
        if C[O_TMA]:
            v = _load_tile(keys[KEY_V_DESC], keys[KEY_KV_COORD], keys[KEY_HKV], n, C[O_TMA],
                           C[O_KV_MODE], C[O_BLOCK_N], C[O_BLOCK_DVO])
            if C[O_TMA] >= 2 and MASKED and C[O_KV_MODE] == 1:
                # Ragged rows past kv_len belong to the next request (finite or not): p is 0
                # there, but 0 * inf is NaN, so they are zeroed (TMA 1 reads them as 0).
                v = tl.where(j_ok[:, None], v, 0.0)
        elif PAGE3D:
            v = _load_pages(keys[KEY_V_HEAD], pg3, slot3, ok3, offs_dv, st[ST_VP], st[ST_VT],
                            st[ST_VD], MASKED, C[O_DVO], C[O_BLOCK_N], C[O_BLOCK_DVO])
        else:
            v_ptrs = keys[KEY_V_HEAD] + v_off[:, None] + offs_dv[None, :].to(tl.int64) * st[ST_VD]
            if MASKED or C[O_DVO] != C[O_BLOCK_DVO]:
                v = tl.load(v_ptrs, mask=j_ok[:, None] & (offs_dv[None, :] < C[O_DVO]), other=0.0)
            else:
                v = tl.load(v_ptrs)
        if use_tile:  # (SKIP: no row kept the tile, whose P.V then adds nothing)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype))
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
    the launch's bundles (P_, ST_, SC_, O_ fields; the names below are theirs)."""
    # ---- the work item -------------------------------------------------------------------------
    # Its row is read here, in the function that uses it, not by a helper: torch's mutation
    # analysis (torch.compile / export tracing this launch) follows a helper's results back to
    # all of the helper's arguments, so a work list passed to one would read as written (dense
    # mode: q, which stands in for it) in the traced node's dependencies
    # (tests/test_mutation_analysis.py). A load's result is not followed back to its pointer.
    split = 0
    nsplit = 1
    if C[O_KV_MODE] != 0:
        req = tl.load(work_ptr + x * C[O_ROW])
        row0 = tl.load(work_ptr + x * C[O_ROW] + 1)
        if C[O_SPLIT]:
            split = tl.load(work_ptr + x * C[O_ROW] + 2)
            nsplit = tl.load(work_ptr + x * C[O_ROW] + 3)

    # ---- the request's rows and keys ---------------------------------------------------------
    if C[O_KV_MODE] == 0:
        qo_len = sc[SC_DENSE_QO_LEN]
        kv_len = sc[SC_DENSE_KV_LEN]
        q_base = req.to(tl.int64) * st[ST_QB]
        o_base = req.to(tl.int64) * st[ST_OB]
        l_base = req.to(tl.int64) * st[ST_LB]
        kv_base = req.to(tl.int64) * st[ST_KB]
        vv_base = req.to(tl.int64) * st[ST_VB]
        kv_coord = req
        page_base = 0
        mask_base = req.to(tl.int64) * sc[SC_DENSE_QO_LEN] * sc[SC_DENSE_KV_LEN]
    else:
        req_c = tl.maximum(req, 0)
        qo_start = tl.load(ptrs[P_QO_INDPTR] + req_c)
        qo_len = tl.load(ptrs[P_QO_INDPTR] + req_c + 1) - qo_start
        q_base = qo_start.to(tl.int64) * st[ST_QT]
        o_base = qo_start.to(tl.int64) * st[ST_OT]
        l_base = qo_start.to(tl.int64) * st[ST_LT]
        if C[O_KV_MODE] == 1:
            kv_start = tl.load(ptrs[P_KV_INDPTR] + req_c)
            kv_len = tl.load(ptrs[P_KV_INDPTR] + req_c + 1) - kv_start
            kv_base = kv_start.to(tl.int64) * st[ST_KT]
            vv_base = kv_start.to(tl.int64) * st[ST_VT]
            kv_coord = kv_start
            page_base = 0
        else:
            page_base = tl.load(ptrs[P_KV_INDPTR] + req_c)
            npages = tl.load(ptrs[P_KV_INDPTR] + req_c + 1) - page_base
            last = tl.load(ptrs[P_LAST_PAGE_LEN] + req_c)
            kv_len = tl.where(npages > 0, (npages - 1) * C[O_PAGE_SIZE] + last, 0)
            kv_base = 0
            vv_base = 0
            kv_coord = 0
        if C[O_MASK_MODE] == 2:
            mask_base = tl.load(ptrs[P_MASK_INDPTR] + req_c).to(tl.int64) * 8
        else:
            mask_base = 0
        qo_len = tl.where(req < 0, 0, qo_len)  # padding item: no rows
    if C[O_TMA] == 3:
        # Called in the persistent loop, where Triton allows no early return: an item past the
        # request's rows (a padding item) sees no keys and stores nothing (row_ok is all off).
        kv_len = tl.where(row0 < qo_len * C[O_GROUP], kv_len, 0)
    elif row0 >= qo_len * C[O_GROUP]:
        return

    offs_m = row0 + tl.arange(0, C[O_BLOCK_M])
    tok = offs_m // C[O_GROUP]
    head = hkv * C[O_GROUP] + offs_m % C[O_GROUP]
    row_ok = tok < qo_len
    p_row = kv_len - qo_len + tok
    # positions of the tile's first and last valid rows
    tok_lo = row0 // C[O_GROUP]
    tok_hi = tl.minimum((row0 + C[O_BLOCK_M] - 1) // C[O_GROUP], qo_len - 1)
    p_lo = kv_len - qo_len + tok_lo
    p_hi = kv_len - qo_len + tok_hi

    # ---- load q (int64 offsets), RoPE'd in place when asked ---------------------------------
    q_rows = ptrs[P_Q] + q_base + tok.to(tl.int64) * st[ST_QT] + head.to(tl.int64) * st[ST_QH]
    HALF: tl.constexpr = C[O_BLOCK_DQK] // 2
    RH: tl.constexpr = C[O_DQK] // 2  # RoPE: where the second half starts (HALF lanes, RH real)
    if C[O_ROPE]:
        lanes = tl.arange(0, HALF)
        offs_h = lanes.to(tl.int64) * st[ST_QD]
        q_ok = row_ok[:, None] & (lanes[None, :] < RH)
        q1 = tl.load(q_rows[:, None] + offs_h[None, :], mask=q_ok, other=0.0)
        q2 = tl.load(q_rows[:, None] + offs_h[None, :] + RH * st[ST_QD], mask=q_ok, other=0.0)
        r1, r2 = _rope(q1.to(tl.float32), q2.to(tl.float32), p_row, sc[SC_ROPE_RCP_SCALE],
                       sc[SC_LOG2_THETA], HALF, True, C[O_DQK])
        q = r1.to(q1.dtype)
        q2 = r2.to(q1.dtype)
    else:
        offs_d = tl.arange(0, C[O_BLOCK_DQK])
        q = tl.load(q_rows[:, None] + offs_d[None, :].to(tl.int64) * st[ST_QD],
                    mask=row_ok[:, None] & (offs_d[None, :] < C[O_DQK]), other=0.0)
        q2 = q

    if C[O_ALIBI]:
        slope = tl.load(ptrs[P_ALIBI] + head).to(tl.float32)
    else:
        slope = tl.zeros([C[O_BLOCK_M]], dtype=tl.float32)

    # ---- the key ranges: [n0, u0) masked, [u0, u1) unmasked, [u1, n1) masked ----------------
    n0 = 0
    n1 = kv_len
    u0 = 0
    u1 = kv_len
    if C[O_MASK_MODE] == 1 or C[O_HAS_CHUNK]:
        n1 = tl.minimum(n1, p_hi + 1)
        u1 = tl.minimum(u1, p_lo + 1)
    if C[O_HAS_WINDOW]:
        n0 = tl.maximum(n0, p_lo - sc[SC_WINDOW_LEFT])
        u0 = tl.maximum(u0, p_hi - sc[SC_WINDOW_LEFT])
    if C[O_HAS_CHUNK]:
        n0 = tl.maximum(n0, (p_lo // sc[SC_CHUNK_SIZE]) * sc[SC_CHUNK_SIZE])
        u0 = tl.maximum(u0, (p_hi // sc[SC_CHUNK_SIZE]) * sc[SC_CHUNK_SIZE])
    n0 = (n0 // C[O_BLOCK_N]) * C[O_BLOCK_N]
    u0 = ((u0 + C[O_BLOCK_N] - 1) // C[O_BLOCK_N]) * C[O_BLOCK_N]
    u1 = (u1 // C[O_BLOCK_N]) * C[O_BLOCK_N]
    if C[O_MASK_MODE] == 2:
        u0 = n1
    n1 = tl.maximum(n1, n0)
    if C[O_SPLIT]:
        # Chunk `split` of `nsplit` of [n0, n1), in whole BLOCK_N blocks.
        per = ((n1 - n0 + C[O_BLOCK_N] - 1) // C[O_BLOCK_N] + nsplit - 1) // nsplit
        lo = tl.minimum(n0 + split * per * C[O_BLOCK_N], n1)
        n1 = tl.minimum(lo + per * C[O_BLOCK_N], n1)
        n0 = lo
    u0 = tl.minimum(tl.maximum(u0, n0), n1)
    u1 = tl.minimum(tl.maximum(u1, u0), n1)

    m_i = tl.full([C[O_BLOCK_M]], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([C[O_BLOCK_M]], dtype=tl.float32)
    acc = tl.zeros([C[O_BLOCK_M], C[O_BLOCK_DVO]], dtype=tl.float32)
    # k_head / v_head: the request's first key (dense, ragged) or the cache (paged), this head.
    if C[O_TMA] >= 2:
        # Descriptors over the whole K/V (built on the host, or by _prefill_fwd once per
        # persistent program): dense [B, Hkv, S, D] or ragged [Hkv, N, D], where this request's
        # keys start at kv_coord.
        k_head = k_ptr
        v_head = v_ptr
    else:
        k_head = k_ptr + kv_base + hkv.to(tl.int64) * st[ST_KH]
        v_head = v_ptr + vv_base + hkv.to(tl.int64) * st[ST_VH]
    if C[O_TMA] == 1:
        # Dense / ragged only (the launch checks 16-byte alignment and unit dim strides).
        k_desc = tl.make_tensor_descriptor(k_head, shape=[kv_len, C[O_DQK]], strides=[st[ST_KT], 1],
                                           block_shape=[C[O_BLOCK_N], C[O_BLOCK_DQK]])
        v_desc = tl.make_tensor_descriptor(v_head, shape=[kv_len, C[O_DVO]], strides=[st[ST_VT], 1],
                                           block_shape=[C[O_BLOCK_N], C[O_BLOCK_DVO]])
    else:
        k_desc = k_head
        v_desc = v_head
    # [n0, u0) masked, [u0, u1) unmasked, [u1, n1) masked. The bundles rows (R_ fields) and
    # keys (KEY_ fields) are built in the call, as in _prefill_fwd.
    for r in tl.static_range(3):
        acc, l_i, m_i = _attend_range(
            acc, l_i, m_i, (n0, u0, u1, n1)[r], (n0, u0, u1, n1)[r + 1], r != 1,
            (q, q2, p_row, tok, row_ok, slope, mask_base),
            (kv_len, kv_coord, hkv, k_head, v_head, k_desc, v_desc, page_base), ptrs, st, sc,
            C)

    # ---- epilogue: rows that saw nothing write 0 and -inf -----------------------------------
    if C[O_SPLIT]:
        if nsplit > 1:
            # A partial: normalised over this chunk's keys; _merge_fwd applies sinks, v_scale.
            seen = l_i > 0
            l_safe = tl.where(seen, l_i, 1.0)
            offs_r = tl.arange(0, C[O_BLOCK_M])
            offs_dv = tl.arange(0, C[O_BLOCK_DVO])
            slot = (x.to(tl.int64) * n_hkv + hkv) * C[O_BLOCK_M]
            tl.store(part_o_ptr + (slot + offs_r)[:, None] * C[O_BLOCK_DVO] + offs_dv[None, :],
                     acc / l_safe[:, None])
            lslot = slot * 2 if C[O_STATS] else slot
            tl.store(part_l_ptr + lslot + offs_r,
                     tl.where(seen, m_i + tl.log2(l_safe), float("-inf")))
            if C[O_STATS]:
                tl.store(part_l_ptr + lslot + C[O_BLOCK_M] + offs_r,
                         tl.where(seen, m_i, float("-inf")))
        else:
            _store_final(acc, l_i, m_i, ptrs[P_O], ptrs[P_LSE], ptrs[P_SINKS], o_base, l_base, tok,
                         head, row_ok, st[ST_OT], st[ST_OH], st[ST_LT], st[ST_LH], sc[SC_V_SCALE],
                         C[O_SINKS], C[O_BLOCK_DVO], C[O_DVO], m_i, C[O_STATS])
    else:
        _store_final(acc, l_i, m_i, ptrs[P_O], ptrs[P_LSE], ptrs[P_SINKS], o_base, l_base, tok,
                     head, row_ok, st[ST_OT], st[ST_OH], st[ST_LT], st[ST_LH], sc[SC_V_SCALE],
                     C[O_SINKS], C[O_BLOCK_DVO], C[O_DVO], m_i, C[O_STATS])


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
    items a persistent program draws (arguments: _prefill_fwd's, the rest bundled as ptrs, st,
    sc and C: P_, ST_, SC_, O_ fields)."""
    if C[O_TMA] == 3:
        # Persistent: each program builds descriptors over the whole K/V once (TMA 1 builds
        # two per work item, and graphs traced by torch.compile / export cannot carry the
        # host-built ones of TMA 2), then draws items from a global counter in the order the
        # hardware would launch them (_work_item's launch order; heaviest first): a
        # program that drew light items draws more, as with hardware scheduling. The next
        # item is drawn before this one runs, so the atomic's latency hides behind it.
        if C[O_KV_MODE] == 0:
            k_desc = tl.make_tensor_descriptor(
                k_ptr, shape=[kv_rows, n_hkv, sc[SC_DENSE_KV_LEN], C[O_DQK]],
                strides=[st[ST_KB], st[ST_KH], st[ST_KT], 1],
                block_shape=[1, 1, C[O_BLOCK_N], C[O_BLOCK_DQK]])
            v_desc = tl.make_tensor_descriptor(
                v_ptr, shape=[kv_rows, n_hkv, sc[SC_DENSE_KV_LEN], C[O_DVO]],
                strides=[st[ST_VB], st[ST_VH], st[ST_VT], 1],
                block_shape=[1, 1, C[O_BLOCK_N], C[O_BLOCK_DVO]])
        else:
            k_desc = tl.make_tensor_descriptor(
                k_ptr, shape=[n_hkv, kv_rows, C[O_DQK]], strides=[st[ST_KH], st[ST_KT], 1],
                block_shape=[1, C[O_BLOCK_N], C[O_BLOCK_DQK]])
            v_desc = tl.make_tensor_descriptor(
                v_ptr, shape=[n_hkv, kv_rows, C[O_DVO]], strides=[st[ST_VH], st[ST_VT], 1],
                block_shape=[1, C[O_BLOCK_N], C[O_BLOCK_DVO]])
        total = n_items * n_hkv
        item = tl.atomic_add(counter_ptr, 1, sem="relaxed")
        while item < total:
            nxt = tl.atomic_add(counter_ptr, 1, sem="relaxed")
            req, row0, hkv, x = _work_item(
                item, n_items, dense_tiles, dense_group, kv_rows, n_hkv, C[O_KV_MODE], C[O_BLOCK_M])
            _program(req, row0, hkv, n_hkv, x, work_ptr, part_o_ptr, part_l_ptr, k_desc, v_desc,
                     ptrs, st, sc, C)
            item = nxt
    else:
        req, row0, hkv, x = _work_item(
            tl.program_id(0) + tl.program_id(1) * n_items, n_items, dense_tiles, dense_group,
            kv_rows, n_hkv, C[O_KV_MODE], C[O_BLOCK_M])
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
    # Inductor passes Python floats as fp64: the arithmetic stays in fp32. The bundles ptrs,
    # st, sc and C (P_, ST_, SC_, O_ fields, in order) are built in the call: assigned to a
    # name, a tuple's constexprs, such as strides the launch specialised to 1, would turn into
    # tensors.
    _prefill_items(
        work_ptr, dense_tiles, dense_group, part_o_ptr, part_l_ptr, n_items, n_hkv, kv_rows,
        counter_ptr, k_ptr, v_ptr,
        (q_ptr, o_ptr, lse_ptr, qo_indptr_ptr, kv_indptr_ptr, page_idx_ptr,
         last_page_len_ptr, mask_ptr, mask_indptr_ptr, alibi_ptr, sinks_ptr),
        (stride_qb, stride_qt, stride_qh, stride_qd, stride_kb, stride_kt, stride_kp,
         stride_kh, stride_kd, stride_vb, stride_vt, stride_vp, stride_vh, stride_vd,
         stride_ob, stride_ot, stride_oh, stride_lb, stride_lt, stride_lh),
        (dense_qo_len, dense_kv_len, tl.cast(qk_scale, tl.float32),
         tl.cast(soft_cap, tl.float32), window_left, chunk_size,
         tl.cast(rope_rcp_scale, tl.float32), tl.cast(log2_theta, tl.float32),
         tl.cast(v_scale, tl.float32)),
        (KV_MODE, PAGE_SIZE, GROUP, MASK_MODE, HAS_WINDOW, HAS_CHUNK, SOFT_CAP, ALIBI, ROPE,
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
                 (q_ptr_p, o_ptr_p, lse_ptr_p, qo_indptr_ptr_p, kv_indptr_ptr_p,
                  page_idx_ptr_p, last_page_len_ptr_p, mask_ptr_p, mask_indptr_ptr_p,
                  alibi_ptr_p, sinks_ptr_p),
                 (stride_qb_p, stride_qt_p, stride_qh_p, stride_qd_p, stride_kb_p,
                  stride_kt_p, stride_kp_p, stride_kh_p, stride_kd_p, stride_vb_p,
                  stride_vt_p, stride_vp_p, stride_vh_p, stride_vd_p, stride_ob_p,
                  stride_ot_p, stride_oh_p, stride_lb_p, stride_lt_p, stride_lh_p),
                 (dense_qo_len_p, dense_kv_len_p, tl.cast(qk_scale_p, tl.float32),
                  tl.cast(soft_cap_p, tl.float32), window_left_p, chunk_size_p,
                  tl.cast(rope_rcp_scale_p, tl.float32),
                  tl.cast(log2_theta_p, tl.float32), tl.cast(v_scale_p, tl.float32)),
                 (KV_MODE_P, PAGE_SIZE_P, GROUP_P, MASK_MODE_P, HAS_WINDOW_P,
                  HAS_CHUNK_P, SOFT_CAP_P, ALIBI_P, ROPE_P, SINKS_P, FOLD_P,
                  BLOCK_M_P, BLOCK_N_P, BLOCK_DQK_P, BLOCK_DVO_P, DQK_P, DVO_P,
                  NUM_STAGES_P, TMA_P, False, 3, False, False, 0.0))
    else:
        _program(0, 0, hkv, tl.num_programs(1), pid, item, work_ptr, work_ptr, k_ptr_d, v_ptr_d,
                 (q_ptr_d, o_ptr_d, lse_ptr_d, qo_indptr_ptr_d, kv_indptr_ptr_d,
                  page_idx_ptr_d, last_page_len_ptr_d, mask_ptr_d, mask_indptr_ptr_d,
                  alibi_ptr_d, sinks_ptr_d),
                 (stride_qb_d, stride_qt_d, stride_qh_d, stride_qd_d, stride_kb_d,
                  stride_kt_d, stride_kp_d, stride_kh_d, stride_kd_d, stride_vb_d,
                  stride_vt_d, stride_vp_d, stride_vh_d, stride_vd_d, stride_ob_d,
                  stride_ot_d, stride_oh_d, stride_lb_d, stride_lt_d, stride_lh_d),
                 (dense_qo_len_d, dense_kv_len_d, tl.cast(qk_scale_d, tl.float32),
                  tl.cast(soft_cap_d, tl.float32), window_left_d, chunk_size_d,
                  tl.cast(rope_rcp_scale_d, tl.float32),
                  tl.cast(log2_theta_d, tl.float32), tl.cast(v_scale_d, tl.float32)),
                 (KV_MODE_D, PAGE_SIZE_D, GROUP_D, MASK_MODE_D, HAS_WINDOW_D,
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
    v_scale and store like _store_final. STATS: the row max is the largest chunk max. A row of
    request -1 is padding (a CUDA-graph plan's merge buffer past this plan's rows)."""
    t = tl.program_id(0)
    hkv = tl.program_id(1)
    req = tl.load(merge_ptr + t * 4)
    if req < 0:
        return
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
    if pos_encoding_mode == POS_ALIBI and alibi_slopes is None:  # (else a stand-in is read)
        raise ValueError("alibi_slopes: the position encoding is ALiBi but no slopes were "
                         "given; pass float32 [Hq] slopes (get_alibi_slopes)")
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


# The fields of each tensor's strides in st (ST_ fields; stride_qb ... stride_lh on the kernels).
STRIDE_FIELDS = dict(q="bthd", k="btphd", v="btphd", o="bth", l="bth")


class ProgramArgs(NamedTuple):
    """What _program_args assembles for one launch: args, the runtime arguments of
    _prefill_fwd from q_ptr to v_scale by parameter name, in parameter order (a POD launch
    suffixes each part's names); consts, the constexprs by name (C's O_ fields); cfg, the
    launch configuration (_config, plus kv_rows and gluon)."""
    args: dict
    consts: dict
    cfg: dict


def _program_args(kv_mode, q, k, v, out, lse, q_strides, k_strides, v_strides, o_strides,
                  l_strides, qo_indptr, kv_indptr, page_idx, last_page_len, packed_mask,
                  mask_indptr, alibi_slopes, sinks, dense, block_m, page_size, params, ask,
                  flags=None):
    """A launch's ProgramArgs: the kernel's runtime arguments by name, its constexprs and the
    launch configuration. q_strides (batch, token, head, dim), k_strides / v_strides (batch,
    token, page, head, dim), o_strides / l_strides (batch, token, head): STRIDE_FIELDS.
    block_m: the plan's tile height (None: the dense launch's, choose.dense_tile). ask: the
    launch's own arguments to choose.choose (work rows, requests, pages, split, whether it may
    take the Gluon kernel, POD); cfg["launch"] holds its answer,
    and cfg["gluon"] the Gluon kernel's arguments where it takes that kernel (no Triton
    descriptors are built then). flags: _flags(q, alibi_slopes, sinks, **params) where the
    caller has them already."""
    hq, hkv = q.shape[-2], k.shape[-2]
    scalars, consts = flags or _flags(q, alibi_slopes, sinks, **params)
    choice = choose.choose(kv_mode, q, k, v, consts, scalars, out.dtype, block_m=block_m, **ask)
    block_m = choice.block_m
    dims = _dims(q.shape[-1], v.shape[-1], consts["ROPE"])
    # eager: whether the kernel runs now rather than being traced (cfg's, for _launch_prefill)
    eager = choose.eager_launch()
    cfg = dict(num_warps=choice.warps, num_stages=choice.stages, launch=choice, eager=eager)
    # A pointer the launch does not read (its constexpr is off): an eager launch passes a
    # tensor there; a traced one passes None (a constexpr), so Inductor's wrapper passes
    # nothing (it re-views the stand-in for each such argument, every call).
    dummy = (qo_indptr if qo_indptr is not None else q) if eager else None
    opt = lambda t: dummy if t is None else t  # noqa: E731
    args = dict(q_ptr=q, k_ptr=k, v_ptr=v, o_ptr=out, lse_ptr=lse, qo_indptr_ptr=opt(qo_indptr),
                kv_indptr_ptr=opt(kv_indptr), page_idx_ptr=opt(page_idx),
                last_page_len_ptr=opt(last_page_len), mask_ptr=opt(packed_mask),
                mask_indptr_ptr=opt(mask_indptr), alibi_ptr=opt(alibi_slopes),
                sinks_ptr=opt(sinks))
    for x, strides in zip("qkvol", (q_strides, k_strides, v_strides, o_strides, l_strides)):
        args.update(zip((f"stride_{x}{f}" for f in STRIDE_FIELDS[x]), strides, strict=True))
    args.update(dense_qo_len=dense[0], dense_kv_len=dense[1], **scalars)
    if choice.kernel == "gluon":
        cfg["gluon"] = _gluon_views(kv_mode, k, v, scalars, page_size)
    elif choice.tma == 2:
        args["k_ptr"] = _host_descriptor(k, kv_mode, choice.block_n, dims["BLOCK_DQK"])
        args["v_ptr"] = _host_descriptor(v, kv_mode, choice.block_n, dims["BLOCK_DVO"])
    cfg["kv_rows"] = k.shape[0]  # dense B, ragged N: the whole K/V's leading dim (TMA 3)
    consts = dict(KV_MODE=kv_mode, PAGE_SIZE=page_size, GROUP=hq // hkv, **consts,
                  BLOCK_M=block_m, BLOCK_N=choice.block_n, **dims,
                  NUM_STAGES=choice.stages, TMA=choice.tma)
    return ProgramArgs(args, consts, cfg)


_KV_KIND = {KV_DENSE: "dense", KV_RAGGED: "ragged", KV_PAGED: "paged"}


def _gluon_views(kv_mode, k, v, scalars, page_size=0):
    """The 2D K / V views, base-2 scale and page layout for the Gluon kernel (prefill_gluon.py)
    of a launch choose.choose gave it (its layout and alignment checked there)."""
    kind = _KV_KIND[kv_mode]
    paged = None
    if kv_mode == KV_PAGED:
        paged = (page_size, _gluon.page_rows(k), _gluon.page_rows(v))
    return dict(k2=_gluon.kv_2d(k, kind), v2=_gluon.kv_2d(v, kind),
                qk_scale=scalars["qk_scale"], paged=paged)


def _host_descriptor(t: torch.Tensor, kv_mode: int, block_n: int, block_d: int):
    """A host tensor descriptor over K or V (dense [B, S, Hkv, D] seen as [B, Hkv, S, D], block
    [1, 1, block_n, block_d]; ragged [N, Hkv, D] seen as [Hkv, N, D], block [1, block_n,
    block_d]); choose.choose checked the layout (TMA 2)."""
    # the permuted views' shapes and strides, without building the views
    order = (0, 2, 1, 3) if kv_mode == KV_DENSE else (1, 0, 2)
    shape, strides = t.shape, t.stride()
    return TensorDescriptor(t, [shape[i] for i in order], [strides[i] for i in order],
                            [1] * (len(order) - 2) + [block_n, block_d])


def _dense_args(q, k, v, packed_mask, alibi_slopes, sinks, out_dtype, params, gluon=False):
    """single_prefill: q [B, Sq, Hq, Dqk], k/v [B, Skv, Hkv, D]."""
    bsz, sq, hq, _ = q.shape
    skv = k.shape[1]
    out = q.new_empty((bsz, sq, hq, v.shape[-1]), dtype=out_dtype)
    lse = q.new_empty((bsz, sq, hq), dtype=torch.float32)
    args = _program_args(
        KV_DENSE, q, k, v, out, lse,
        (q.stride(0), q.stride(1), q.stride(2), q.stride(3)),
        choose.kv_strides(KV_DENSE, k), choose.kv_strides(KV_DENSE, v),
        (out.stride(0), out.stride(1), out.stride(2)),
        (lse.stride(0), lse.stride(1), lse.stride(2)),
        None, None, None, None, packed_mask, None, alibi_slopes, sinks,
        (sq, skv), None, 1, params, dict(gluon=gluon))
    return out, lse, args


def _ask(work, qo_indptr, page_idx=None, pod=False) -> dict:
    """choose.choose's arguments of a batch launch: work rows, split plan (work [W, 4]: the
    Triton kernel and its merge; the Gluon kernel takes neither these nor POD), requests and
    page-table entries."""
    split = work.shape[1] == 4
    return dict(items=work.shape[0], split=split, gluon=not (split or pod), pod=pod,
                requests=qo_indptr.shape[0] - 1,
                pages=None if page_idx is None else page_idx.shape[0])


def _lse_out(q, params, rows=None) -> torch.Tensor:
    """The LSE output of a ragged / paged launch: float32 [rows, Hq] (rows: q's by default),
    or [rows, Hq, 2] (LSE, row max) with row_max (_store_final's STATS)."""
    rows = q.shape[0] if rows is None else rows
    shape = (rows, q.shape[1], 2) if params.get("row_max") else (rows, q.shape[1])
    return q.new_empty(shape, dtype=torch.float32)


def _ragged_args(q, k, v, qo_indptr, kv_indptr, packed_mask, mask_indptr, alibi_slopes,
                 sinks, block_m, out_dtype, params, work):
    """batch_ragged_prefill: q [Nq, Hq, Dqk], k/v [Nk, Hkv, D]; work [W, 2] or a split plan's
    [W, 4] (choose.choose's items and split)."""
    out = q.new_empty((q.shape[0], q.shape[1], v.shape[-1]), dtype=out_dtype)
    lse = _lse_out(q, params)
    args = _program_args(
        KV_RAGGED, q, k, v, out, lse,
        (0, q.stride(0), q.stride(1), q.stride(2)),
        choose.kv_strides(KV_RAGGED, k), choose.kv_strides(KV_RAGGED, v),
        (0, out.stride(0), out.stride(1)),
        (0, lse.stride(0), lse.stride(1)),
        qo_indptr, kv_indptr, None, None, packed_mask, mask_indptr, alibi_slopes, sinks,
        (0, 0), block_m, 1, params, _ask(work, qo_indptr))
    return out, lse, args


def _paged_args(q, kc, vc, qo_indptr, kv_page_indptr, kv_page_indices, kv_last_page_len,
                packed_mask, mask_indptr, alibi_slopes, sinks, block_m, out_dtype, params,
                work, pod=False, page_size=None, flags=None, rows=None):
    """batch_paged_prefill: q [Nq, Hq, Dqk], caches [P, page, Hkv, D] (any strides); work as
    _ragged_args'; pod: a part of POD's launch; page_size: the kernel's page-size constexpr
    (default the cache's; a one-page cache may pass any size at least its page's); flags as
    _program_args'; rows: the outputs' rows (default q's: a row map's count)."""
    rows = q.shape[0] if rows is None else rows
    out = q.new_empty((rows, q.shape[1], vc.shape[-1]), dtype=out_dtype)
    lse = _lse_out(q, params, rows)
    args = _program_args(
        KV_PAGED, q, kc, vc, out, lse,
        (0, q.stride(0), q.stride(1), q.stride(2)),
        choose.kv_strides(KV_PAGED, kc), choose.kv_strides(KV_PAGED, vc),
        (0, out.stride(0), out.stride(1)),
        (0, lse.stride(0), lse.stride(1)),
        qo_indptr, kv_page_indptr, kv_page_indices, kv_last_page_len, packed_mask, mask_indptr,
        alibi_slopes, sinks, (0, 0), block_m, kc.shape[1] if page_size is None else page_size,
        params, _ask(work, qo_indptr, kv_page_indices, pod), flags)
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


def _launch_prefill(grid, work, tiles, out, lse, args, merge=None, sinks=None, v_scale=1.0,
                    q_rows=None):
    """The prefill launch as choose.choose decided it (cfg["launch"]); with a split plan (work
    [W, 4], merge [T, 4]) the chunks of a split tile write float32 partials and _merge_fwd
    combines them (a second launch). Dense mode: tiles per batch entry. q_rows: the Gluon
    kernel's row map (launch_paged: only where that kernel launches)."""
    prog_args, consts, cfg = args
    choice = cfg["launch"]
    group = choice.group
    n_items, n_hkv = grid
    split = work is not None and work.shape[1] == 4
    # what the pointers this launch does not read get (as _program_args' dummy): dense mode's
    # work list, the partials of a plan without splits, the counter of a plain grid
    unread = (work if work is not None else prog_args["q_ptr"]) if cfg["eager"] else None
    if work is None:
        work = unread
    part_o = part_l = unread
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
        # The Gluon kernel on the chosen tile; dense mode keeps this launch's item order.
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
                             causal=consts["MASK_MODE"] == MASK_CAUSAL, block_m=consts["BLOCK_M"],
                             tile=choice.gluon_tile, q_rows=q_rows)
    counter = unread
    if consts["TMA"] == 3:
        grid = (choice.programs,)
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
    return _launch_prefill((bsz * tiles, k.shape[2]), None, tiles, out, lse, args)


def launch_ragged(q, k, v, qo_indptr, kv_indptr, work, packed_mask, mask_indptr, alibi_slopes,
                  sinks, block_m, merge=None, *, out_dtype, **params):
    """batch_ragged_prefill: grid (work items, Hkv)."""
    out, lse, args = _ragged_args(q, k, v, qo_indptr, kv_indptr, packed_mask, mask_indptr,
                                  alibi_slopes, sinks, block_m, out_dtype, params, work)
    if work.shape[0] == 0 or q.shape[0] == 0:
        return out, lse
    return _launch_prefill((work.shape[0], k.shape[1]), work, 1, out, lse, args, merge, sinks,
                           params["v_scale"])


def launch_paged(q, k_cache, v_cache, qo_indptr, kv_page_indptr, kv_page_indices,
                 kv_last_page_len, work, packed_mask, mask_indptr, alibi_slopes, sinks, block_m,
                 merge=None, q_rows=None, *, out_dtype, **params):
    """batch_paged_prefill: grid (work items, Hkv). q_rows: the op's row map (contracts): the
    Gluon kernel reads q's rows through it; any other launch takes q[q_rows]."""
    def prepare(q, rows=None):
        return _paged_args(q, k_cache, v_cache, qo_indptr, kv_page_indptr, kv_page_indices,
                           kv_last_page_len, packed_mask, mask_indptr, alibi_slopes, sinks,
                           block_m, out_dtype, params, work, rows=rows)

    rows = q.shape[0] if q_rows is None else q_rows.shape[0]
    out, lse, args = prepare(q, rows)
    if q_rows is not None and args.cfg.get("gluon") is None:
        # the Triton kernel takes no row map: q's rows gathered first (a launch of the call,
        # so that a bound call replays it)
        from .decode_chunks import gather_rows

        q, q_rows = gather_rows(q, q_rows), None
        out, lse, args = prepare(q)
    if work.shape[0] == 0 or rows == 0:
        return out, lse
    return _launch_prefill((work.shape[0], k_cache.shape[2]), work, 1, out, lse, args, merge,
                           sinks, params["v_scale"], q_rows)


def pod_choice(q_p, k_cache_p, v_cache_p, kv_page_indices_p, q_d, k_cache_d, v_cache_d,
               alibi_slopes, block_m, p_params: dict, d_params: dict, *, static: bool = False,
               device=None):
    """What a POD launch decides before launching, from its tensors and each part's options
    (contracts.pod_part_params, out_dtype included): (whether it is the Gluon POD launch,
    choose.pod_gluon; the out dtype; one_page, choose.one_page_cache of the prefill's cache;
    (params, flags) of each part, params without out_dtype, flags _flags'). static: a traced
    call's question (ops.dispatch), as pod_gluon's."""
    p_params, d_params = dict(p_params), dict(d_params)
    out_dtype = p_params.pop("out_dtype")
    d_params.pop("out_dtype")
    flags_p = _flags(q_p, alibi_slopes, None, **p_params)
    flags_d = _flags(q_d, alibi_slopes, None, **d_params)
    one_page = choose.one_page_cache(k_cache_p, v_cache_p, kv_page_indices_p)
    gluon = choose.pod_gluon(q_p, k_cache_p, v_cache_p, q_d, k_cache_d, v_cache_d, flags_p[1],
                             flags_p[0], flags_d[1], flags_d[0], out_dtype, block_m,
                             one_page=one_page, device=device, static=static)
    return gluon, out_dtype, one_page, (p_params, flags_p), (d_params, flags_d)


def launch_pod(q_p, k_cache_p, v_cache_p, qo_indptr_p, kv_page_indptr_p, kv_page_indices_p,
               kv_last_page_len_p, q_d, k_cache_d, v_cache_d, qo_indptr_d, kv_page_indptr_d,
               kv_page_indices_d, kv_last_page_len_d, work, packed_mask_p, mask_indptr_p,
               alibi_slopes, block_m, p_params, d_params, q_rows_d=None):
    """pod_prefill_decode: one launch, grid (work items, Hkv); work rows (part, req, row).
    q_rows_d: the decode part's row map (contracts): the Gluon POD launch reads q_d's rows
    through it; the Triton kernel's launch takes q_d's rows gathered first."""
    if k_cache_p.shape[2] != k_cache_d.shape[2] or q_p.shape[1] != q_d.shape[1]:
        raise ValueError(
            "pod_prefill_decode: the prefill and decode parts must have the same numbers of "
            f"query heads ({q_p.shape[1]} vs {q_d.shape[1]}) and KV heads "
            f"({k_cache_p.shape[2]} vs {k_cache_d.shape[2]}): they share one launch grid")
    gluon, out_dtype, one_page, (p_params, flags_p), (d_params, flags_d) = pod_choice(
        q_p, k_cache_p, v_cache_p, kv_page_indices_p, q_d, k_cache_d, v_cache_d, alibi_slopes,
        block_m, p_params, d_params)
    if gluon:
        parts = [_pod_part(*x, out_dtype, params, flags[0]["qk_scale"], rows)
                 for x, params, flags, rows in (
            ((q_p, k_cache_p, v_cache_p, qo_indptr_p, kv_page_indptr_p, kv_page_indices_p,
              kv_last_page_len_p, one_page), p_params, flags_p, None),
            ((q_d, k_cache_d, v_cache_d, qo_indptr_d, kv_page_indptr_d, kv_page_indices_d,
              kv_last_page_len_d, False), d_params, flags_d, q_rows_d))]
        if work.shape[0] == 0 or (q_p.shape[0] == 0 and parts[1].out.shape[0] == 0):
            return parts[0].out, parts[0].lse, parts[1].out, parts[1].lse
        swap_d = choose.pod_swap_decodes(block_m, q_p.shape[-1], parts[1].page,
                                         parts[1].out.shape[0],
                                         q_d.shape[1] // k_cache_d.shape[2],
                                         qo_indptr_d.shape[0] - 1)
        return _gluon.launch_pod(*parts, work, causal=flags_p[1]["MASK_MODE"] == MASK_CAUSAL,
                                 block_m=block_m, swap_d=swap_d)
    if q_rows_d is not None:  # (the Triton kernel takes no row map)
        from .decode_chunks import gather_rows

        q_d = gather_rows(q_d, q_rows_d)
    # A one-page prefill cache (its page as long as the prefill's keys) is launched with a
    # fixed page-size constexpr of at least its length (tiles.one_page_size).
    out_p, lse_p, args_p = _paged_args(
        q_p, k_cache_p, v_cache_p, qo_indptr_p, kv_page_indptr_p, kv_page_indices_p,
        kv_last_page_len_p, packed_mask_p, mask_indptr_p, alibi_slopes, None, block_m,
        out_dtype, p_params, work, pod=True,
        page_size=one_page_size(k_cache_p.shape[1])
        if one_page else None, flags=flags_p)
    out_d, lse_d, args_d = _paged_args(
        q_d, k_cache_d, v_cache_d, qo_indptr_d, kv_page_indptr_d, kv_page_indices_d,
        kv_last_page_len_d, None, None, alibi_slopes, None, block_m, out_dtype, d_params, work,
        pod=True, flags=flags_d)
    if work.shape[0] == 0:
        return out_p, lse_p, out_d, lse_d
    # (choose.choose halved each part's pipeline: both live in one kernel)
    choice = args_p.cfg["launch"]
    consts = {**{f"{k}_P": v for k, v in args_p.consts.items()},
              **{f"{k}_D": v for k, v in args_d.consts.items()}}
    launch.run(
        _pod_fwd, (work.shape[0], k_cache_p.shape[2]), work, *args_p.args.values(),
        *args_d.args.values(), **consts, num_warps=choice.warps, num_stages=choice.stages)
    return out_p, lse_p, out_d, lse_d


def _pod_part(q, kc, vc, qo_indptr, kv_page_indptr, kv_page_indices, kv_last_page_len,
              one_page, out_dtype, params, qk_scale, q_rows=None):
    """A POD part for prefill_gluon.launch_pod (its out and lse allocated): q [N, Hq, D],
    caches [P, page, Hkv, D] (one_page: a one-page cache, read as rows); q_rows: a row map
    (the outputs then have its rows)."""
    rows = q.shape[0] if q_rows is None else q_rows.shape[0]
    out = q.new_empty((rows, q.shape[1], vc.shape[-1]), dtype=out_dtype)
    # (a one-page cache's rows from page to page: never read, its one page is page 0; 0, not
    # its key count, so that launches of any key count are alike: launch.Memo's free sizes)
    k_rows, v_rows = (0, 0) if one_page else (_gluon.page_rows(kc), _gluon.page_rows(vc))
    return _gluon.PodPart(q, _gluon.kv_2d(kc, "paged"), _gluon.kv_2d(vc, "paged"), out,
                          _lse_out(q, params, rows), qo_indptr, kv_page_indptr, kv_page_indices,
                          kv_last_page_len, k_rows, v_rows, 0 if one_page else kc.shape[1],
                          qk_scale, q_rows)
