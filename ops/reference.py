"""The pure-PyTorch oracle for every compiled_attn op, and their CPU implementation.

Every entry point reduces to one problem (docs/design.md): ragged query rows against KV slots
that belong to requests, with a visibility rule per (row, slot) pair and a transform of the
logits. ``attend`` solves that problem densely: it scores every query row against every KV
slot, masks pairs from different requests or outside the visibility rule, and normalises. The
three addressing front-ends (dense batch, ragged offsets, page table) only say which request and
position each row and slot has. Nothing here reads a tensor's value on the host, so the
reference traces under FakeTensor / torch.compile / torch.export like any torch code.

The arithmetic runs in float64 when q is float64 and in float32 otherwise. The LSE is base 2
(``log2(sum_j 2^(s_j * log2 e))`` = natural logsumexp / ln 2) over the final logits (scale, soft
cap and ALiBi included; an attention sink is not part of it). A row that sees no key gets output 0
and LSE -inf.
"""

from __future__ import annotations

import math

import torch

from .modes import MASK_CAUSAL, MASK_CUSTOM, POS_ALIBI, POS_ROPE_LLAMA

__all__ = [
    "attend",
    "single_prefill",
    "batch_ragged_prefill",
    "batch_paged_prefill",
    "rope_llama",
    "unpack_bits",
]

LN2 = math.log(2.0)


def _compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def unpack_bits(packed: torch.Tensor, bit_index: torch.Tensor) -> torch.Tensor:
    """Bit ``bit_index`` of the little-endian bit string ``packed`` (uint8 [nbytes]), as bool.

    bit_index: int64, any shape; entries outside [0, 8 * nbytes) read as False (callers mask them).
    """
    nbits = packed.numel() * 8
    inside = (bit_index >= 0) & (bit_index < nbits)
    if nbits == 0:  # no bits (every request's qo_len * kv_len is 0): nothing to read
        return inside
    idx = torch.where(inside, bit_index, torch.zeros_like(bit_index))
    byte = packed.reshape(-1)[torch.div(idx, 8, rounding_mode="floor")].to(torch.int32)
    bit = (byte >> (idx % 8).to(torch.int32)) & 1
    return (bit == 1) & inside


def rope_llama(x: torch.Tensor, pos: torch.Tensor, rope_scale: float,
               rope_theta: float) -> torch.Tensor:
    """Rotate-half RoPE (LLaMA): pairs (c, c + D/2), angle = pos / rope_scale * theta^(-2c/D).

    x: [N, H, D] in the compute dtype; pos: [N] positions (any integer or float dtype).
    """
    d = x.shape[-1]
    half = d // 2
    c = torch.arange(half, device=x.device, dtype=x.dtype)
    inv_freq = torch.pow(torch.tensor(rope_theta, dtype=x.dtype, device=x.device), -2.0 * c / d)
    ang = (pos.to(x.dtype) / rope_scale)[:, None] * inv_freq[None, :]  # [N, D/2]
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attend(
    q: torch.Tensor,
    q_req: torch.Tensor,
    q_pos: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_req: torch.Tensor,
    kv_pos: torch.Tensor,
    kv_valid: torch.Tensor,
    qo_len: torch.Tensor,
    kv_len: torch.Tensor,
    *,
    packed_mask: torch.Tensor | None,
    mask_bit_offset: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    sinks: torch.Tensor | None,
    mask_mode: int,
    window_left: int,
    chunk_size: int,
    sm_scale: float,
    logits_soft_cap: float,
    pos_encoding_mode: int,
    rope_scale: float,
    rope_theta: float,
    v_scale: float,
    out_dtype: torch.dtype,
    matmul_dtype: torch.dtype | None = None,
    row_max: bool = False,
    skip_softmax: float = 0.0,
    skip_tile: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of every query row against every KV slot, with the request rules.

    q: [Nq, Hq, Dqk]; q_req, q_pos: [Nq] int64, the request of each row and its row index i in
    that request (q_req = -1 for rows outside every request: they get output 0, LSE -inf).
    k: [Nk, Hkv, Dqk]; v: [Nk, Hkv, Dvo]; kv_req, kv_pos: [Nk] int64, kv_valid: [Nk] bool.
    qo_len, kv_len: [B] int64 per-request lengths.
    packed_mask: uint8 bits, read at ``mask_bit_offset[req] + i * kv_len + j`` when
    mask_mode == MASK_CUSTOM. alibi_slopes, sinks: float [Hq].
    matmul_dtype: when set (fp16/bf16), the two matrix products take operands in that dtype and
    the probabilities are rounded to it before the second, as eager low-precision attention does
    (HF's eager path); tests use it to measure PyTorch's own error in a dtype.
    row_max, skip_softmax: as the ragged / paged ops (contracts._stats_skip); skip_tile: the key
    tile of the skip rule (default SKIP_TILE; the kernel's is its BLOCK_N).
    Returns out [Nq, Hq, Dvo] in out_dtype and lse [Nq, Hq] float32, base 2 (row_max:
    [Nq, Hq, 2] = (LSE, row max), base 2).
    """
    ct = _compute_dtype(q)
    hq, hkv = q.shape[1], k.shape[1]
    group = hq // hkv
    qf = q.to(ct)
    # Slots of no request (past the last kv_indptr, unused page slots) may hold anything: they
    # are masked out of the scores, and zeroed so that 0 * inf never reaches the output.
    kf = torch.where(kv_valid[:, None, None], k.to(ct), 0)
    vf = torch.where(kv_valid[:, None, None], v.to(ct), 0)

    b = qo_len.shape[0]
    has_req = q_req >= 0
    r = torch.where(has_req, q_req, torch.zeros_like(q_req)).clamp(max=max(b - 1, 0))
    if b > 0:
        row_qo, row_kv = qo_len[r], kv_len[r]
    else:
        row_qo = row_kv = torch.zeros_like(q_req)
    p = row_kv - row_qo + q_pos  # [Nq] bottom-right aligned position of each row

    if pos_encoding_mode == POS_ROPE_LLAMA:
        qf = rope_llama(qf, p, rope_scale, rope_theta)
        kf = rope_llama(kf, kv_pos, rope_scale, rope_theta)

    kf = kf.repeat_interleave(group, dim=1)  # [Nk, Hq, D]: query head h reads kv head h // group
    vf = vf.repeat_interleave(group, dim=1)
    mm = matmul_dtype or ct
    s = torch.einsum("qhd,khd->hqk", qf.to(mm), kf.to(mm)).to(ct) * sm_scale  # [Hq, Nq, Nk]
    if logits_soft_cap > 0:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)

    j = kv_pos[None, :]
    pi = p[:, None]
    see = (q_req[:, None] == kv_req[None, :]) & has_req[:, None] & kv_valid[None, :]
    if mask_mode == MASK_CAUSAL:
        see = see & (j <= pi)
    elif mask_mode == MASK_CUSTOM:
        assert packed_mask is not None and mask_bit_offset is not None
        bit = mask_bit_offset[r][:, None] + q_pos[:, None] * row_kv[:, None] + j
        see = see & unpack_bits(packed_mask, bit)
    if window_left >= 0:
        see = see & (j >= pi - window_left)
    if chunk_size > 0:
        see = see & (j >= torch.div(pi, chunk_size, rounding_mode="floor") * chunk_size) & (j <= pi)

    if pos_encoding_mode == POS_ALIBI:
        assert alibi_slopes is not None
        s = s + alibi_slopes.to(ct)[:, None, None] * (j - pi).to(ct)[None]

    s = s.masked_fill(~see[None], float("-inf"))
    if skip_softmax > 0:
        s = _skip_tiles(s, kv_pos, row_kv, skip_softmax, skip_tile or SKIP_TILE)
    lse = torch.logsumexp(s, dim=-1)  # [Hq, Nq], natural units, -inf where nothing is seen
    finite = torch.isfinite(lse)
    safe_lse = torch.where(finite, lse, torch.zeros_like(lse))
    pexp = torch.exp(s - safe_lse[..., None])  # exp(-inf) = 0 for masked pairs
    out = torch.einsum("hqk,khd->qhd", pexp.to(mm), vf.to(mm)).to(ct)  # normalised by keys alone
    if sinks is not None:
        # The sink adds e^sink to the denominator: out *= Z / (Z + e^sink).
        sink = sinks.to(ct)[:, None]
        out = out * torch.sigmoid(safe_lse - sink).transpose(0, 1)[..., None]
    out = torch.where(finite.transpose(0, 1)[..., None], out, torch.zeros_like(out)) * v_scale
    lse2 = torch.where(finite, lse / LN2, lse).transpose(0, 1).to(torch.float32).contiguous()
    if row_max:
        mx = s.amax(dim=-1) if s.shape[-1] else torch.full_like(lse, float("-inf"))
        mx2 = torch.where(finite, mx / LN2, lse).transpose(0, 1).to(torch.float32)
        lse2 = torch.stack([lse2, mx2], dim=-1)
    return out.to(out_dtype).contiguous(), lse2


# The key tile of the reference's skip-softmax rule (the GPU kernel's BLOCK_N is 64 or 128,
# the interpreter's 32: tests pass skip_tile to match it).
SKIP_TILE = 64


def _skip_tiles(s, kv_pos, row_kv, factor: float, tile: int):
    """s [Hq, Nq, Nk] (natural logits, -inf where unseen) with the key tiles each row skips set
    to -inf: tiles of ``tile`` request positions, visited in ascending order; a row skips a tile
    whose max is below its running max over the tiles it kept by more than ln(kv_len / factor)
    (contracts._stats_skip). The loop runs over the static tile count of Nk keys."""
    hq, nq, nk = s.shape
    ntiles = -(-nk // tile)
    tid = (kv_pos // tile).clamp(min=0, max=max(ntiles - 1, 0))[None, None, :].expand(hq, nq, nk)
    tmax = s.new_full((hq, nq, ntiles), float("-inf"))
    tmax = tmax.scatter_reduce(2, tid, s, "amax", include_self=True)
    thr = torch.log(factor / row_kv.clamp(min=1).to(s.dtype))[None, :]  # [1, Nq]
    run = s.new_full((hq, nq), float("-inf"))
    keep = []
    for t in range(ntiles):
        m_t = tmax[..., t]
        k_t = (m_t > float("-inf")) & (m_t >= run + thr)
        run = torch.where(k_t, torch.maximum(run, m_t), run)
        keep.append(k_t)
    if not keep:
        return s
    kept = torch.stack(keep, dim=-1).gather(2, tid)
    return s.masked_fill(~kept, float("-inf"))


def _segments(indptr: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For n items split by indptr [B+1]: each item's segment (-1 when past indptr[-1]) and its
    index inside the segment."""
    idx = torch.arange(n, device=indptr.device, dtype=torch.int64)
    ind = indptr.to(torch.int64)
    seg = torch.bucketize(idx, ind[1:], right=True)
    inside = (idx < ind[-1]) & (idx >= ind[0])
    seg = torch.where(inside, seg, torch.full_like(seg, -1))
    start = ind[:-1][seg.clamp(min=0, max=max(ind.numel() - 2, 0))] if ind.numel() > 1 else idx
    return seg, idx - start


def single_prefill(q, k, v, packed_mask, alibi_slopes, sinks, *, out_dtype, **params):
    """Dense batch: q [B, Sq, Hq, Dqk], k [B, Skv, Hkv, Dqk], v [B, Skv, Hkv, Dvo] (any strides).

    packed_mask: bits of a bool [B, Sq, Skv] flattened row-major. Returns out [B, Sq, Hq, Dvo],
    lse [B, Sq, Hq].
    """
    bsz, sq, hq, _ = q.shape
    skv = k.shape[1]
    dev = q.device
    ar = torch.arange(bsz, device=dev, dtype=torch.int64)
    q_req = ar.repeat_interleave(sq)
    q_pos = torch.arange(sq, device=dev, dtype=torch.int64).repeat(bsz)
    kv_req = ar.repeat_interleave(skv)
    kv_pos = torch.arange(skv, device=dev, dtype=torch.int64).repeat(bsz)
    kv_valid = torch.ones(bsz * skv, dtype=torch.bool, device=dev)
    qo_len = torch.full((bsz,), sq, dtype=torch.int64, device=dev)
    kv_len = torch.full((bsz,), skv, dtype=torch.int64, device=dev)
    out, lse = attend(
        q.reshape(bsz * sq, hq, q.shape[-1]),
        q_req, q_pos,
        k.reshape(bsz * skv, k.shape[2], k.shape[3]),
        v.reshape(bsz * skv, v.shape[2], v.shape[3]),
        kv_req, kv_pos, kv_valid, qo_len, kv_len,
        packed_mask=packed_mask, mask_bit_offset=ar * (sq * skv),
        alibi_slopes=alibi_slopes, sinks=sinks, out_dtype=out_dtype, **params,
    )
    return out.reshape(bsz, sq, hq, v.shape[-1]), lse.reshape(bsz, sq, hq)


def batch_ragged_prefill(q, k, v, qo_indptr, kv_indptr, packed_mask, mask_indptr, alibi_slopes,
                         sinks, *, out_dtype, **params):
    """Ragged batch: q [Nq, Hq, Dqk] split by qo_indptr [B+1]; k [Nk, Hkv, Dqk], v [Nk, Hkv, Dvo]
    split by kv_indptr [B+1]; packed_mask segments start at byte mask_indptr[b]."""
    q_req, q_pos = _segments(qo_indptr, q.shape[0])
    kv_req, kv_pos = _segments(kv_indptr, k.shape[0])
    qo_len = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
    kv_len = (kv_indptr[1:] - kv_indptr[:-1]).to(torch.int64)
    bit_off = None if mask_indptr is None else mask_indptr[:-1].to(torch.int64) * 8
    return attend(
        q, q_req, q_pos, k, v, kv_req, kv_pos, kv_req >= 0, qo_len, kv_len,
        packed_mask=packed_mask, mask_bit_offset=bit_off,
        alibi_slopes=alibi_slopes, sinks=sinks, out_dtype=out_dtype, **params,
    )


def paged_kv_slots(k_cache, v_cache, kv_page_indptr, kv_page_indices, kv_last_page_len):
    """The KV slots of a page table, in page-table order.

    k_cache: [P, page, Hkv, Dqk], v_cache: [P, page, Hkv, Dvo] (logical NHD order, any strides).
    Returns k, v [npages * page, Hkv, D], and per slot its request, position and validity, plus
    kv_len [B].
    """
    page = k_cache.shape[1]
    npages = kv_page_indices.shape[0]
    page_req, page_in_req = _segments(kv_page_indptr, npages)
    # Entries past kv_page_indptr[-1] (a CUDA-graph buffer's tail) are padding: their slots are
    # invalid below, and they read page 0, or nothing from a cache without pages.
    idx = torch.where(page_req >= 0, kv_page_indices.to(torch.int64), 0)
    if k_cache.shape[0] == 0:
        if bool((page_req >= 0).any()):
            raise IndexError("kv_page_indices: the page table has pages but the cache has none")
        k = k_cache.new_zeros((npages * page, k_cache.shape[2], k_cache.shape[3]))
        v = v_cache.new_zeros((npages * page, v_cache.shape[2], v_cache.shape[3]))
    else:
        k = k_cache[idx].reshape(npages * page, k_cache.shape[2], k_cache.shape[3])
        v = v_cache[idx].reshape(npages * page, v_cache.shape[2], v_cache.shape[3])
    slot = torch.arange(page, device=k.device, dtype=torch.int64)
    kv_req = page_req.repeat_interleave(page)
    kv_pos = (page_in_req[:, None] * page + slot[None, :]).reshape(-1)
    npages_req = (kv_page_indptr[1:] - kv_page_indptr[:-1]).to(torch.int64)
    kv_len = torch.where(
        npages_req > 0,
        (npages_req - 1) * page + kv_last_page_len.to(torch.int64),
        torch.zeros_like(npages_req),
    )
    safe_req = kv_req.clamp(min=0)
    kv_valid = (kv_req >= 0) & (kv_pos < kv_len[safe_req] if kv_len.numel() else kv_req >= 0)
    return k, v, kv_req, kv_pos, kv_valid, kv_len


def batch_paged_prefill(q, k_cache, v_cache, qo_indptr, kv_page_indptr, kv_page_indices,
                        kv_last_page_len, packed_mask, mask_indptr, alibi_slopes, sinks, *,
                        out_dtype, **params):
    """Paged batch: q [Nq, Hq, Dqk] split by qo_indptr [B+1]; KV through the page table
    (kv_page_indptr [B+1] in pages, kv_page_indices [npages], kv_last_page_len [B])."""
    k, v, kv_req, kv_pos, kv_valid, kv_len = paged_kv_slots(
        k_cache, v_cache, kv_page_indptr, kv_page_indices, kv_last_page_len
    )
    q_req, q_pos = _segments(qo_indptr, q.shape[0])
    qo_len = (qo_indptr[1:] - qo_indptr[:-1]).to(torch.int64)
    bit_off = None if mask_indptr is None else mask_indptr[:-1].to(torch.int64) * 8
    return attend(
        q, q_req, q_pos, k, v, kv_req, kv_pos, kv_valid, qo_len, kv_len,
        packed_mask=packed_mask, mask_bit_offset=bit_off,
        alibi_slopes=alibi_slopes, sinks=sinks, out_dtype=out_dtype, **params,
    )
