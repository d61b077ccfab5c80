"""Hopper prefill kernel written in Gluon (Triton's explicit-layout dialect), for the hot path.

The Triton kernel (prefill_kernel.py) cannot keep a Q K^T wgmma in flight while the softmax of
the previous scores runs: Triton's Hopper pipeliner waits on every wgmma whose result the same
iteration reads (docs/design.md, "Not built"). Gluon exposes the wgmma's issue and wait
(``warpgroup_mma(..., is_async=True)``, ``warpgroup_mma_wait``), TMA copies and mbarriers, so
this kernel writes FA3's intra-warpgroup schedule by hand: each iteration issues S_t = Q K_t^T
and O += P_{t-1} V_{t-1} back to back, waits for S_t only, runs the softmax of S_t while
P_{t-1} V_{t-1} is still on the tensor cores, then waits for it and rescales O. K and V stream
through STAGES-deep shared-memory rings filled by TMA (host-built descriptors), each slot
refilled as soon as the wgmma reading it has completed.

Scope (the caller checks it; everything else takes the Triton kernel): ragged K/V through
host descriptors (dense batches are ragged ones with uniform offsets), bf16 / fp16, head dim
64 or 128 for Q/K and V alike, causal or no mask, none of the logit transforms, positional
encodings, sinks or fp8 K/V. Invariants as in prefill_kernel.py: packed row r of a request is
token r // GROUP of query head hkv * GROUP + r % GROUP; positions are bottom-right aligned;
logits are base 2 (log2(e) folded into qk_scale) and the LSE written is base 2; a row that
sees no key writes 0 and LSE -inf; element offsets are int64.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma,
                                                             warpgroup_mma, warpgroup_mma_wait)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import constexpr_function

# The CTA-wide barrier is gl.thread_barrier in triton 3.6 and gl.barrier from 3.7 on.
_cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier
# The TMA load is tma.async_copy_global_to_shared in triton 3.6 and tma.async_load from 3.7 on.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared


@constexpr_function
def _row_layout(d, num_warps):
    """A blocked layout for [rows, d] tiles read or written through pointers: 16-byte vectors
    along d, the warp's threads across rows then d."""
    tpw_d = min(d // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // tpw_d, tpw_d], [num_warps, 1], [1, 0])


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


@gluon.jit
def _load_kv(desc, ring, bar, t, kv_start, hkv, pred, BLOCK_N: gl.constexpr, D: gl.constexpr,
             STAGES: gl.constexpr):
    """TMA of key tile t of this request and KV head into slot t % STAGES of ring (when pred)."""
    slot = t % STAGES
    mbarrier.expect(bar.index(slot), BLOCK_N * D * desc.dtype.primitive_bitwidth // 8, pred=pred)
    _tma_load(desc, [kv_start + t * BLOCK_N, hkv * D], bar.index(slot),
                ring.index(slot), pred=pred)


@gluon.jit
def _zero_tail(v_ring, slot, rows, D: gl.constexpr, BLOCK_N: gl.constexpr,
               num_warps: gl.constexpr):
    """Zero the rows >= rows of a V slot: past kv_len they hold the next request's values,
    which p = 0 would turn into NaN if they are not finite."""
    blk: gl.constexpr = _row_layout(D, num_warps)
    buf = v_ring.index(slot)
    x = buf.load(blk)
    r = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, blk))
    buf.store(gl.where((r < rows)[:, None], x, 0.0))
    fence_async_shared()
    _cta_barrier()


@gluon.jit
def _step(t, acc, p_op, m_i, l_i, q_smem, k_ring, v_ring, k_bar, v_bar, k_desc, v_desc,
          kv_start, kv_len, hkv, n_tiles, p_row, qk_scale, s_zero, p_ring, P_SMEM: gl.constexpr,
          MASKED: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_N: gl.constexpr, D: gl.constexpr,
          STAGES: gl.constexpr, dtype: gl.constexpr, col_layout: gl.constexpr,
          row_o: gl.constexpr, p_layout: gl.constexpr, num_warps: gl.constexpr):
    """Key tile t (>= 1): S_t and P_{t-1} V_{t-1} issued together, the softmax of S_t under
    the second, then the rescale; refills the K slot of tile t and the V slot of tile t - 1."""
    slot = t % STAGES
    mbarrier.wait(k_bar.index(slot), (t // STAGES) & 1)
    s_tok = warpgroup_mma(q_smem, k_ring.index(slot).permute((1, 0)), s_zero, use_acc=False,
                          is_async=True)
    prev = (t - 1) % STAGES
    mbarrier.wait(v_bar.index(prev), ((t - 1) // STAGES) & 1)
    if MASKED:
        if t * BLOCK_N > kv_len:  # tile t - 1 is the request's partial last tile
            _zero_tail(v_ring, prev, kv_len - (t - 1) * BLOCK_N, D, BLOCK_N, num_warps)
    if P_SMEM:
        o_tok = warpgroup_mma(p_ring.index((t - 1) % 2), v_ring.index(prev), acc, is_async=True)
    else:
        o_tok = warpgroup_mma(p_op, v_ring.index(prev), acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s_tok, ))
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, t, kv_len, p_row, qk_scale, MASKED, CAUSAL,
                                       BLOCK_N, col_layout)
    if P_SMEM:
        p_ring.index(t % 2).store(p.to(dtype))
        fence_async_shared()
        p_next = p_op
    else:
        p_next = gl.convert_layout(p.to(dtype), p_layout)
    alpha = gl.convert_layout(alpha, row_o)
    # The softmax's results pass through the wait as dependencies: the compiler may not sink
    # the softmax below it, so it runs while P_{t-1} V_{t-1} is on the tensor cores.
    acc, p_op, p_next, alpha, m_i, l_i = warpgroup_mma_wait(
        0, deps=(o_tok, p_op, p_next, alpha, m_i, l_i))
    acc = acc * alpha[:, None]
    # Both wgmmas reading the two slots have completed in every warp group: refill them.
    _load_kv(k_desc, k_ring, k_bar, t + STAGES, kv_start, hkv, t + STAGES < n_tiles, BLOCK_N, D,
             STAGES)
    _load_kv(v_desc, v_ring, v_bar, t - 1 + STAGES, kv_start, hkv, t - 1 + STAGES < n_tiles,
             BLOCK_N, D, STAGES)
    return acc, p_next, m_i, l_i


@gluon.jit
def _ragged_fwd(
    work_ptr, q_ptr, k_desc, v_desc, o_ptr, lse_ptr, qo_indptr_ptr, kv_indptr_ptr,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_lt, stride_lh, qk_scale,
    GROUP: gl.constexpr, CAUSAL: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    D: gl.constexpr, STAGES: gl.constexpr, P_SMEM: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (work items, KV heads); work_ptr int32 [W, 2] of (request, first packed row) as
    plan.build_work makes it. q [N, Hq, D] (strides stride_qt, stride_qh, unit dim stride);
    k_desc / v_desc: host descriptors over K / V seen as [N_kv, Hkv * D], blocks [BLOCK_N, D];
    o [N, Hq, D]; lse float32 [N, Hq] (base 2); indptrs int32 [R + 1]."""
    dtype: gl.constexpr = q_ptr.dtype.element_ty
    x = gl.program_id(0)
    hkv = gl.program_id(1)
    req = gl.load(work_ptr + x * 2)
    row0 = gl.load(work_ptr + x * 2 + 1)
    req_c = gl.maximum(req, 0)
    qo_start = gl.load(qo_indptr_ptr + req_c)
    qo_len = gl.load(qo_indptr_ptr + req_c + 1) - qo_start
    kv_start = gl.load(kv_indptr_ptr + req_c)
    kv_len = gl.load(kv_indptr_ptr + req_c + 1) - kv_start
    qo_len = gl.where(req < 0, 0, qo_len)  # padding item: no rows
    if row0 >= qo_len * GROUP:
        return

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    col_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    blk: gl.constexpr = _row_layout(D, num_warps)
    q_smem_layout: gl.constexpr = gl.NVMMASharedLayout(
        swizzle_byte_width=128, element_bitwidth=dtype.primitive_bitwidth, rank=2)

    # ---- Q through registers into shared memory (any GROUP, rows past qo_len read 0) --------
    offs_m = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, blk))
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, blk))
    tok = offs_m // GROUP
    head = hkv * GROUP + offs_m % GROUP
    row_ok = tok < qo_len
    q_rows = (qo_start + tok).to(gl.int64) * stride_qt + head.to(gl.int64) * stride_qh
    q = gl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=row_ok[:, None], other=0.0)
    q_smem = gl.allocate_shared_memory(dtype, [BLOCK_M, D], q_smem_layout, q)
    fence_async_shared()
    _cta_barrier()

    # ---- the key range: tiles [0, n_free) are visible to every row, [n_free, n_tiles) masked -
    tok_lo = row0 // GROUP
    tok_hi = gl.minimum((row0 + BLOCK_M - 1) // GROUP, qo_len - 1)
    if CAUSAL:
        n_end = gl.minimum(kv_len, kv_len - qo_len + tok_hi + 1)
        free = gl.minimum(kv_len, kv_len - qo_len + tok_lo + 1)
    else:
        n_end = kv_len
        free = kv_len
    n_tiles = (gl.maximum(n_end, 0) + BLOCK_N - 1) // BLOCK_N
    n_free = gl.maximum(free, 0) // BLOCK_N
    p_row = kv_len - qo_len + (row0 + gl.arange(0, BLOCK_M, layout=row_s)) // GROUP

    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=row_s)
    acc = gl.zeros([BLOCK_M, D], gl.float32, layout=o_layout)
    if n_tiles > 0:
        k_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], k_desc.layout)
        v_ring = gl.allocate_shared_memory(dtype, [STAGES, BLOCK_N, D], v_desc.layout)
        k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bar.index(i), count=1)
            mbarrier.init(v_bar.index(i), count=1)
        fence_async_shared()
        for i in gl.static_range(STAGES):
            _load_kv(k_desc, k_ring, k_bar, i, kv_start, hkv, i < n_tiles, BLOCK_N, D, STAGES)
            _load_kv(v_desc, v_ring, v_bar, i, kv_start, hkv, i < n_tiles, BLOCK_N, D, STAGES)

        # tile 0: its scores alone (nothing to overlap yet)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        mbarrier.wait(k_bar.index(0), 0)
        s = warpgroup_mma(q_smem, k_ring.index(0).permute((1, 0)), s_zero, use_acc=False)
        if n_free > 0:
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, kv_len, p_row, qk_scale, False,
                                               CAUSAL, BLOCK_N, col_s)
        else:
            p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, 0, kv_len, p_row, qk_scale, True,
                                               CAUSAL, BLOCK_N, col_s)
        _cta_barrier()
        _load_kv(k_desc, k_ring, k_bar, STAGES, kv_start, hkv, STAGES < n_tiles, BLOCK_N, D,
                 STAGES)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        p_ring = gl.allocate_shared_memory(dtype, [2, BLOCK_M, BLOCK_N], q_smem_layout)
        if P_SMEM:
            p_ring.index(0).store(p.to(dtype))
            fence_async_shared()

        for t in range(1, gl.maximum(n_free, 1)):
            acc, p_op, m_i, l_i = _step(
                t, acc, p_op, m_i, l_i, q_smem, k_ring, v_ring, k_bar, v_bar, k_desc, v_desc,
                kv_start, kv_len, hkv, n_tiles, p_row, qk_scale, s_zero, p_ring, P_SMEM, False, CAUSAL,
                BLOCK_N, D, STAGES, dtype, col_s, row_o, p_layout, num_warps)
        for t in range(gl.maximum(n_free, 1), n_tiles):
            acc, p_op, m_i, l_i = _step(
                t, acc, p_op, m_i, l_i, q_smem, k_ring, v_ring, k_bar, v_bar, k_desc, v_desc,
                kv_start, kv_len, hkv, n_tiles, p_row, qk_scale, s_zero, p_ring, P_SMEM, True, CAUSAL,
                BLOCK_N, D, STAGES, dtype, col_s, row_o, p_layout, num_warps)

        # the last tile's P V
        last = n_tiles - 1
        mbarrier.wait(v_bar.index(last % STAGES), (last // STAGES) & 1)
        if n_tiles * BLOCK_N > kv_len:
            _zero_tail(v_ring, last % STAGES, kv_len - last * BLOCK_N, D, BLOCK_N, num_warps)
        if P_SMEM:
            acc = warpgroup_mma(p_ring.index(last % 2), v_ring.index(last % STAGES), acc)
        else:
            acc = warpgroup_mma(p_op, v_ring.index(last % STAGES), acc)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bar.index(i))
            mbarrier.invalidate(v_bar.index(i))

    # ---- epilogue: rows that saw nothing write 0 and -inf -----------------------------------
    seen = l_i > 0
    l_safe = gl.where(seen, l_i, 1.0)
    out = (acc / gl.convert_layout(l_safe, row_o)[:, None]).to(dtype)
    out = gl.convert_layout(out, blk)
    o_rows = (qo_start + tok).to(gl.int64) * stride_ot + head.to(gl.int64) * stride_oh
    gl.store(o_ptr + o_rows[:, None] + offs_d[None, :], out, mask=row_ok[:, None])
    lse = gl.where(seen, m_i + gl.log2(l_safe), float("-inf"))
    offs_l = row0 + gl.arange(0, BLOCK_M, layout=row_s)
    tok_l = offs_l // GROUP
    head_l = hkv * GROUP + offs_l % GROUP
    gl.store(lse_ptr + (qo_start + tok_l).to(gl.int64) * stride_lt
             + head_l.to(gl.int64) * stride_lh, lse, mask=tok_l < qo_len)


_GL_DTYPES = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}


def kv_descriptor(t: torch.Tensor, block_n: int) -> TensorDescriptor:
    """Host descriptor over K or V [N, Hkv, D] seen as [N, Hkv * D], blocks [block_n, D]."""
    n, hkv, d = t.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_n, d], _GL_DTYPES[t.dtype])
    return TensorDescriptor(t, [n, hkv * d], [t.stride(0), 1], [block_n, d], layout)


def launch_ragged(q, k, v, qo_indptr, kv_indptr, work, out, lse, *, sm_scale: float,
                  causal: bool, block_m: int, block_n: int, stages: int, num_warps: int,
                  p_smem: bool = True):
    """q [N, Hq, D], k / v [N_kv, Hkv, D] (unit dim stride, heads packed: stride(1) == D),
    indptrs int32 [R + 1], work int32 [W, 2]; writes out [N, Hq, D] and lse float32 [N, Hq]."""
    d = q.shape[-1]
    grid = (work.shape[0], k.shape[1])
    _ragged_fwd[grid](
        work, q, kv_descriptor(k, block_n), kv_descriptor(v, block_n), out, lse, qo_indptr,
        kv_indptr, q.stride(0), q.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        lse.stride(1), sm_scale * 1.4426950408889634,
        GROUP=q.shape[1] // k.shape[1], CAUSAL=causal, BLOCK_M=block_m, BLOCK_N=block_n, D=d,
        STAGES=stages, P_SMEM=p_smem, num_warps=num_warps)
    return out, lse
