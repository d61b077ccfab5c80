"""Helpers that users of the prefill API call around it, in plain vectorised PyTorch.

These are FlashInfer's helper functions with its signatures: bit packing of custom masks
(``packbits``, ``segment_packbits``), paged-KV bookkeeping (``append_paged_kv_cache``,
``get_batch_indices_positions``, ``get_seq_lens``), merging of partial attention results by
their LSE (``merge_state``, ``merge_states``, ``merge_state_in_place``; LSE in base 2, as every
compiled_attn entry point returns it) and the ALiBi slopes (``get_alibi_slopes``). None of
them loops over tokens in Python; they run on any device. The few that must size an output
from tensor values (``segment_packbits``) read those values on the host, as FlashInfer's do,
and say so. The private helpers at the bottom (page-cache views, segment bit sources) are
shared with the wrappers in ``prefill.py`` and ``pod.py``.
"""

from __future__ import annotations

import math

import torch

from . import _validate as V

__all__ = [
    "packbits",
    "segment_packbits",
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
    "merge_state",
    "merge_states",
    "merge_state_in_place",
    "get_alibi_slopes",
]

LN2 = math.log(2.0)


# --------------------------------------------------------------------------------------------
# bit packing
# --------------------------------------------------------------------------------------------
def _bit_weights(bitorder: str, device) -> torch.Tensor:
    """int32 [8]: the value of bit k of a byte (little: element k is bit k; big: bit 7 - k)."""
    if bitorder not in ("little", "big"):
        raise ValueError(f"bitorder: got {bitorder!r}; use 'little' or 'big'")
    k = torch.arange(8, dtype=torch.int32, device=device)
    return (1 << k) if bitorder == "little" else (1 << (7 - k))


def _pack_groups(bits: torch.Tensor, bitorder: str) -> torch.Tensor:
    """bits: bool/int [nbytes, 8] -> uint8 [nbytes]."""
    w = _bit_weights(bitorder, bits.device)
    return (bits.to(torch.int32) * w).sum(dim=1).to(torch.uint8)


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """Pack a binary-valued tensor into bits, 8 elements per byte (numpy.packbits on the
    flattened tensor).

    x: any shape (bool or integer 0/1; non-zero counts as 1), read flattened in row-major
    order: n elements. Returns uint8 [ceil(n / 8)]; the last byte is zero-padded. bitorder:
    ``"big"`` (FlashInfer's default: element 0 is the most significant bit) or ``"little"``
    (element 0 is bit 0; the layout compiled_attn's ``packed_custom_mask`` arguments take, as
    FlashInfer's kernels do).
    """
    V.check_tensor("x", x)
    flat = x.reshape(-1) != 0
    # 7 zero bits appended, then the first ceil(n / 8) bytes' worth: no pad op and no branch
    # on n % 8, either of which guards on a symbolic size under torch.compile(dynamic=True)
    # (one recompile when it flips; hf's attention packs with this). n = 0 gives no byte.
    nbytes = (flat.numel() + 7) // 8
    bits = torch.cat([flat, flat.new_zeros(7)])[:nbytes * 8]
    return _pack_groups(bits.view(nbytes, 8), bitorder)


def _byte_offsets(seg_lens: list[int]) -> list[int]:
    """The byte offsets [B+1] of segments of seg_lens bits packed one after another, each
    padded to whole bytes (a batch's custom masks, one segment a request)."""
    byte_ptr = [0]
    for n in seg_lens:
        byte_ptr.append(byte_ptr[-1] + (int(n) + 7) // 8)
    return byte_ptr


def _segment_bit_sources(seg_lens: list[int], device) -> tuple[torch.Tensor, list[int]]:
    """For segments of seg_lens bits packed one after another, each padded to whole bytes:
    int64 [nbytes * 8], the index into the unpadded concatenation of each output bit (-1 for
    padding bits), and the byte offsets [B+1] of the segments. Host lengths in, no device
    reads."""
    byte_ptr = _byte_offsets(seg_lens)
    bit_ptr = [0]
    for n in seg_lens:
        bit_ptr.append(bit_ptr[-1] + int(n))
    nbytes = byte_ptr[-1]
    if nbytes == 0:
        return torch.zeros(0, dtype=torch.int64, device=device), byte_ptr
    bp = torch.tensor(byte_ptr, dtype=torch.int64, device=device)
    ip = torch.tensor(bit_ptr, dtype=torch.int64, device=device)
    out_bit = torch.arange(nbytes * 8, dtype=torch.int64, device=device)
    seg = torch.bucketize(out_bit // 8, bp[1:], right=True)  # segment of each output byte
    within = out_bit - bp[seg] * 8  # bit index inside the segment
    src = ip[seg] + within
    src = torch.where(within < (ip[seg + 1] - ip[seg]), src, torch.full_like(src, -1))
    return src, byte_ptr


def _pack_from_sources(x: torch.Tensor, src: torch.Tensor, bitorder: str) -> torch.Tensor:
    """Pack x.flatten()[src] (False where src < 0) into uint8 [src.numel() // 8]; device ops
    only (CUDA-graph capturable)."""
    flat = x.reshape(-1) != 0
    if src.numel() == 0:
        return torch.zeros(0, dtype=torch.uint8, device=x.device)
    bits = flat[src.clamp(min=0)] & (src >= 0)
    return _pack_groups(bits.view(-1, 8), bitorder)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` into its own whole bytes.

    x: binary-valued tensor of at least ``indptr[-1]`` elements (read flattened; FlashInfer's
    kernel reads it from indptr[0] to indptr[-1] too). indptr: integer ``[B+1]``, from 0 or
    more, non-decreasing. Returns ``(packed, new_indptr)``: packed uint8 ``[new_indptr[-1]]`` where
    ``packed[new_indptr[i]:new_indptr[i+1]]`` holds segment i's bits, zero-padded to a whole
    byte, and new_indptr int32 ``[B+1]`` (byte offsets, on indptr's device). This is the layout
    of a batch's ``packed_custom_mask`` with ``bitorder="little"``. The output size depends on
    indptr's values, so indptr is read on the host (a device sync when it lives on a GPU).
    """
    V.check_tensor("x", x)
    ind = V.host_indptr("indptr", indptr, start_zero=False)
    if int(ind[-1]) > x.numel():
        raise ValueError(f"indptr: ends at {int(ind[-1])} but x.numel() is {x.numel()}; "
                         "indptr[-1] must be at most x.numel()")
    lens = (ind[1:] - ind[:-1]).tolist()
    src, byte_ptr = _segment_bit_sources(lens, x.device)
    packed = _pack_from_sources(x.reshape(-1)[int(ind[0]):int(ind[-1])], src, bitorder)
    return packed, torch.tensor(byte_ptr, dtype=torch.int32, device=indptr.device)


# --------------------------------------------------------------------------------------------
# paged KV bookkeeping
# --------------------------------------------------------------------------------------------
def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int
                 ) -> torch.Tensor:
    """KV length of each request of a page table: ``(pages - 1) * page_size + last_page_len``,
    and 0 for a request with no pages.

    kv_indptr: ``[B+1]`` (in pages); kv_last_page_len: ``[B]`` (0 to page_size; 0 for a
    request with pages counts none in its last page, as FlashInfer computes it). Returns ``[B]``
    in the two dtypes' promotion (FlashInfer's arithmetic). FlashInfer returns last_page_len for
    a request with no pages (it clamps pages - 1 at 0); a request without pages holds no
    token, so this returns 0.
    """
    V.check_int("kv_indptr", V.check_tensor("kv_indptr", kv_indptr, ndim=1,
                                             what="[B+1] (pages per request, cumulated)"))
    V.check_int("kv_last_page_len", V.check_tensor(
        "kv_last_page_len", kv_last_page_len, shape=(kv_indptr.shape[0] - 1,),
        device=kv_indptr.device, device_of="kv_indptr",
        what="[B], one entry per request of kv_indptr"))
    V.check_count("page_size", page_size, 1)
    npages = kv_indptr[1:] - kv_indptr[:-1]
    V.device_check(npages >= 0, "get_seq_lens: kv_indptr decreases; pass cumulated page "
                   "counts (non-decreasing)")
    last = kv_last_page_len.to(npages.device)
    V.device_check((npages == 0) | ((last >= 0) & (last <= page_size)),
                   f"get_seq_lens: kv_last_page_len holds an entry outside [0, page_size="
                   f"{page_size}] for a request with pages")
    lens = (npages - 1) * page_size + last
    return torch.where(npages > 0, lens, torch.zeros_like(lens))


def get_batch_indices_positions(append_indptr: torch.Tensor, seq_lens: torch.Tensor, nnz: int,
                                batch_indices: torch.Tensor | None = None,
                                positions: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Request index and KV position of each appended token.

    append_indptr: ``[B+1]``, token i of the appended ragged tensor belongs to request b when
    ``append_indptr[b] <= i < append_indptr[b+1]``. seq_lens: ``[B]``, each request's KV length
    after the append, so the appended tokens take the last positions:
    ``position = seq_lens[b] - append_len[b] + (i - append_indptr[b])``. nnz: number of
    entries to produce (usually ``append_indptr[-1]``); entries outside
    ``[append_indptr[0], append_indptr[-1])`` (past the last request, or before the first when
    append_indptr does not start at 0) belong to no request: batch index -1 and position 0
    (a caller's positions buffer keeps its values there, as FlashInfer's). append_indptr[-1]
    past nnz fails a device-side check, as does a seq_lens entry of 2^31 or more (positions
    are int32). batch_indices, positions: optional int32 ``[nnz]``
    outputs, written in place. Returns (batch_indices, positions), int32 ``[nnz]``, on
    append_indptr's device. No host reads.
    """
    V.check_int("append_indptr", V.check_tensor("append_indptr", append_indptr, ndim=1,
                                                 what="[B+1]"))
    if append_indptr.shape[0] == 0:
        raise ValueError("append_indptr: is empty; pass [B+1] entries starting at 0")
    V.check_int("seq_lens", V.check_tensor(
        "seq_lens", seq_lens, shape=(append_indptr.shape[0] - 1,),
        what="[B], one KV length per request of append_indptr"))
    for name, t in (("append_indptr", append_indptr), ("seq_lens", seq_lens)):
        V.check_readable(name, t)
    V.check_count("nnz", nnz, 0)
    dev = append_indptr.device
    ind = append_indptr.to(torch.int64)
    i = torch.arange(nnz, dtype=torch.int64, device=dev)
    if ind.numel() == 1:  # no request: every entry is past append_indptr[-1]
        return _write_outputs(nnz, dev, torch.full_like(i, -1).to(torch.int32),
                              torch.zeros_like(i).to(torch.int32),
                              torch.zeros_like(i, dtype=torch.bool), batch_indices, positions)
    b = torch.bucketize(i, ind[1:], right=True)
    inside = (i >= ind[0]) & (i < ind[-1])
    bs = b.clamp(max=ind.numel() - 2)
    app_len = ind[1:] - ind[:-1]
    lens = seq_lens.to(torch.int64).to(dev)
    V.device_check(lens < 2 ** 31, "get_batch_indices_positions: a seq_lens entry is 2^31 or "
                   "more; positions are int32, so KV lengths must fit int32")
    V.device_check((app_len >= 0) & (lens >= app_len) & (ind[0] >= 0),
                   "get_batch_indices_positions: append_indptr decreases or starts below 0, or "
                   "a seq_lens entry is shorter than its request's appended tokens (seq_lens "
                   "is each KV length after the append)")
    V.device_check(ind[-1:] <= nnz, "get_batch_indices_positions: append_indptr[-1] is past "
                   "nnz; pass nnz >= append_indptr[-1] (the appended tokens)")
    pos = lens[bs] - app_len[bs] + (i - ind[bs])
    b_out = torch.where(inside, b, torch.full_like(b, -1)).to(torch.int32)
    p_out = torch.where(inside, pos, torch.zeros_like(pos)).to(torch.int32)
    return _write_outputs(nnz, dev, b_out, p_out, inside, batch_indices, positions)


def _write_outputs(nnz, dev, b_out, p_out, inside, batch_indices, positions):
    """get_batch_indices_positions' results, written into the caller's buffers if given (a
    positions buffer only where ``inside``: FlashInfer leaves the rest)."""
    for name, buf in (("batch_indices", batch_indices), ("positions", positions)):
        if buf is not None:
            V.check_tensor(name, buf, shape=(nnz,), dtypes=(torch.int32,), device=dev,
                           device_of="append_indptr")
    if batch_indices is not None:
        batch_indices.copy_(b_out)
    if positions is not None:
        positions.copy_(torch.where(inside, p_out, positions))
    return (batch_indices if batch_indices is not None else b_out,
            positions if positions is not None else p_out)


def _count(n) -> str:
    """A size (with a space) for an error message, or nothing in a traced call: formatting a
    symbolic size would specialise it (a recompile for every size)."""
    return "" if V.traced() else f"{n} "


def append_paged_kv_cache(append_key: torch.Tensor, append_value: torch.Tensor,
                          batch_indices: torch.Tensor, positions: torch.Tensor,
                          paged_kv_cache, kv_indices: torch.Tensor, kv_indptr: torch.Tensor,
                          kv_last_page_len: torch.Tensor, kv_layout: str = "NHD") -> None:
    """Write appended keys and values into a paged KV cache, in place.

    append_key: ``[nnz, Hkv, D_qk]``, append_value: ``[nnz, Hkv, D_vo]`` (ragged, NHD order);
    batch_indices, positions: ``[nnz]`` (from :func:`get_batch_indices_positions`; a token with
    batch index < 0 is skipped). paged_kv_cache: a 5-D tensor ``[P, 2, page, Hkv, D]`` (NHD) /
    ``[P, 2, Hkv, page, D]`` (HND) or a (k, v) tuple of 4-D tensors ``[P, page, Hkv, D]`` /
    ``[P, Hkv, page, D]`` (page size 1 may drop the page axis). kv_indices ``[kv_indptr[-1]]``,
    kv_indptr ``[B+1]``, kv_last_page_len ``[B]``: the page table after the append. Token t goes
    to page ``kv_indices[kv_indptr[b] + pos // page]``, slot ``pos % page``; the position fixes
    the slot, so kv_last_page_len is only checked for shape. A batch index past the page
    table, a position outside its request's pages (which FlashInfer writes into another
    request's page), or a page index outside the cache (kv_indices < 0 or >= P) fails a
    device-side check (no host read; on CPU it raises at once). Every tensor is on the cache's
    device (else a ValueError naming it) and every check runs before the first write, so an
    append is written whole or not at all. kv_indices may be longer than kv_indptr[-1] (a
    pre-allocated buffer); entries past it are not read. The keys, values and caches are of
    floating dtypes (float16, bfloat16, float32, float8; else a TypeError), the appended ones
    converted to the cache's.
    """
    layout = V.check_kv_layout(kv_layout)
    k_cache, v_cache = _paged_kv_views(paged_kv_cache, layout, "paged_kv_cache")
    dev = k_cache.device
    on = dict(device=dev, device_of="paged_kv_cache (its K cache)")
    V.check_tensor("paged_kv_cache (v)", v_cache, **on)
    page = k_cache.shape[1]
    if page == 0:
        raise ValueError("paged_kv_cache: has pages of 0 slots (its page axis is empty); pass "
                         f"a cache of pages of 1 or more tokens in kv_layout={layout!r}")
    if v_cache.shape[:2] != k_cache.shape[:2]:
        raise ValueError(f"paged_kv_cache: the V cache has {v_cache.shape[0]} pages of "
                         f"{v_cache.shape[1]} slots, the K cache {k_cache.shape[0]} of "
                         f"{k_cache.shape[1]}; pass K and V caches of the same pages")
    V.check_tensor("append_key", append_key, ndim=3, what="[nnz, Hkv, D_qk]")
    for name, t in (("paged_kv_cache (k)", k_cache), ("paged_kv_cache (v)", v_cache),
                    ("append_key", append_key), ("append_value", append_value)):
        if not t.dtype.is_floating_point:  # (FlashInfer's kernel refuses such a cache too)
            raise TypeError(f"{name}: dtype {t.dtype} is not a key / value dtype; pass float16, "
                            "bfloat16, float32 or float8 (an integer cache would hold the keys "
                            "and values truncated)")
    nnz = append_key.shape[0]
    V.check_tensor("append_key", append_key, shape=(nnz, k_cache.shape[2], k_cache.shape[3]),
                   **on)
    V.check_tensor("append_value", append_value,
                   shape=(nnz, v_cache.shape[2], v_cache.shape[3]), **on)
    for name, t in (("batch_indices", batch_indices), ("positions", positions)):
        V.check_int(name, V.check_tensor(name, t, shape=(nnz,), **on))
    for name, t in (("kv_indices", kv_indices), ("kv_indptr", kv_indptr)):
        V.check_int(name, V.check_tensor(name, t, ndim=1, **on))
    V.check_int("kv_last_page_len", V.check_tensor(
        "kv_last_page_len", kv_last_page_len, shape=(kv_indptr.shape[0] - 1,), **on))
    # Tokens with batch index < 0 (padding past append_indptr[-1]) are dropped by a boolean
    # selection: one device sync on a GPU, but no write can alias a real token's slot.
    keep = batch_indices >= 0
    b = batch_indices[keep].to(torch.int64)
    pos = positions[keep].to(torch.int64)
    ind = kv_indptr.to(torch.int64)
    bsz = ind.shape[0] - 1
    V.device_check(b < bsz, f"append_paged_kv_cache: batch_indices has entries >= the page "
                            f"table's {_count(bsz)}requests (kv_indptr)")
    b = b.clamp(max=max(bsz - 1, 0))
    entry = ind[b] + torch.div(pos, page, rounding_mode="floor")
    V.device_check((pos >= 0) & (entry < ind[b + 1]), "append_paged_kv_cache: positions holds "
                   "a position outside its request's pages (kv_indptr / kv_indices)")
    V.device_check(entry >= 0, "append_paged_kv_cache: kv_indptr holds a negative entry; "
                   "pass cumulated page counts from 0 or more")
    V.device_check(entry < kv_indices.shape[0], f"append_paged_kv_cache: kv_indptr points past "
                   f"kv_indices' {_count(kv_indices.shape[0])}entries; kv_indptr[-1] must not "
                   "exceed len(kv_indices)")
    # Clamped after the checks: a failed one surfaces later on a GPU, never as a wild write.
    entry = entry.clamp(0, max(kv_indices.shape[0] - 1, 0))
    page_idx = kv_indices.to(torch.int64)[entry]
    n_pages = k_cache.shape[0]
    V.device_check((page_idx >= 0) & (page_idx < n_pages), f"append_paged_kv_cache: kv_indices "
                   f"holds a page index outside the cache's {_count(n_pages)}pages; use indices "
                   "in [0, pages)")
    page_idx = page_idx.clamp(0, max(n_pages - 1, 0))
    slot = pos % page
    k_new, v_new = append_key[keep].to(k_cache.dtype), append_value[keep].to(v_cache.dtype)
    k_cache[page_idx, slot] = k_new
    v_cache[page_idx, slot] = v_new


# --------------------------------------------------------------------------------------------
# merging partial attention states
# --------------------------------------------------------------------------------------------
def merge_state(v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge attention outputs of two disjoint KV segments by their LSEs.

    v_a, v_b: ``[N, H, D]``; s_a, s_b: float ``[N, H]``, base-2 LSE
    (``log2(sum_j 2^(s_ij * log2 e))`` = natural logsumexp / ln 2, as every compiled_attn entry
    point returns). Returns (v ``[N, H, D]`` in v_a's dtype, s float32 ``[N, H]``), with
    ``s = log2(2^s_a + 2^s_b)`` and ``v = v_a 2^(s_a - s) + v_b 2^(s_b - s)``. A row where both
    LSEs are -inf (no key seen) merges to output 0, LSE -inf; a NaN LSE gives NaN (output and
    LSE). v_a / v_b are floating point (TypeError otherwise).
    """
    _check_two_states(("v_a", v_a), ("s_a", s_a), ("v_b", v_b), ("s_b", s_b))
    v, s = merge_states(torch.stack([v_a, v_b], dim=1), torch.stack([s_a, s_b], dim=1))
    return v, s


def merge_state_in_place(v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor,
                         s_other: torch.Tensor, mask: torch.Tensor | None = None) -> None:
    """merge_state of (v, s) and (v_other, s_other), written into v and s.

    v, v_other: ``[N, H, D]``; s, s_other: float ``[N, H]``, base-2 LSEs (s float32, as
    FlashInfer expects; another floating dtype is written rounded). mask: optional bool (or
    integer, nonzero = merge) ``[N]``: rows where it is False keep v and s unchanged (a CUDA
    graph captures one merge for a batch of any size up to N). The rule and its -inf / NaN
    rows are merge_state's. Returns None.
    """
    _check_two_states(("v", v), ("s", s), ("v_other", v_other), ("s_other", s_other))
    V.check_writable("v", v)
    V.check_writable("s", s)
    if mask is not None:
        V.check_tensor("mask", mask, shape=(v.shape[0],), device=v.device, device_of="v",
                       what="[N]")
        if mask.dtype.is_floating_point or mask.dtype.is_complex:
            raise TypeError(f"mask: expected a bool (or integer) [N] tensor; got {mask.dtype}")
    out, lse = merge_states(torch.stack([v, v_other], dim=1), torch.stack([s, s_other], dim=1))
    if mask is not None:
        keep = mask != 0
        out = torch.where(keep[:, None, None], out, v)
        lse = torch.where(keep[:, None], lse, s.to(lse.dtype))
    v.copy_(out)
    s.copy_(lse)


def _check_two_states(*named: tuple[str, torch.Tensor]) -> None:
    """(v_a, s_a, v_b, s_b) by name: v_a [N, H, D], v_b as v_a, both LSEs [N, H], one device,
    all floating point."""
    (va_name, v_a), (sa_name, s_a), (vb_name, v_b), (sb_name, s_b) = named
    V.check_tensor(va_name, v_a, ndim=3, what="[N, H, D]")
    V.check_tensor(vb_name, v_b, shape=v_a.shape, device=v_a.device, device_of=va_name,
                   what=f"[N, H, D] as {va_name}")
    for name, s in ((sa_name, s_a), (sb_name, s_b)):
        V.check_tensor(name, s, shape=v_a.shape[:2], device=v_a.device, device_of=va_name,
                       what=f"[N, H] of {va_name}")
    _check_floating(*named)


def _check_floating(*named: tuple[str, torch.Tensor]) -> None:
    """Merged outputs and LSEs are floating point: an integer merge would be truncated."""
    for name, t in named:
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name}: expected a floating dtype (float16 / bfloat16 / float32); "
                            f"got {t.dtype}; pass attention outputs and their LSEs")


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge the outputs of several disjoint KV segments by their base-2 LSEs.

    v: floating ``[N, S, H, D]`` (S states per row; an integer v raises TypeError: its merge
    would be truncated); s: floating ``[N, S, H]`` (base 2). Returns (v ``[N, H, D]`` in v's
    dtype, s float32 ``[N, H]``); rows whose states all have LSE -inf give output 0, LSE -inf;
    a NaN among a row's LSEs gives NaN output and LSE (never -inf, "no key seen").
    """
    V.check_tensor("v", v, ndim=4, what="[N, S, H, D]")
    V.check_tensor("s", s, shape=v.shape[:3], device=v.device, device_of="v",
                   what="[N, S, H] of v")
    _check_floating(("v", v), ("s", s))
    if v.shape[1] == 0:  # no state: as if every state had LSE -inf
        n, _, h, d = v.shape
        return v.new_zeros((n, h, d)), s.new_full((n, h), float("-inf"), dtype=torch.float32)
    ct = torch.float64 if v.dtype == torch.float64 else torch.float32
    w, denom, lse = _lse_weights(s.to(ct))
    out = (v.to(ct) * w[..., None]).sum(dim=1) / denom[..., None]
    return out.to(v.dtype), lse


def _lse_weights(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The merge rule of several states' base-2 LSEs s ``[N, S, H]`` (floating): each state's
    unnormalised weight w = 2^(s - m) ``[N, S, H]`` (m the row's finite max, 0 for -inf states),
    the divisor ``[N, H]`` (the weights' sum; 1 where every state is -inf) and the merged LSE
    float32 ``[N, H]`` (-inf where every state is -inf; NaN where one is NaN). The merged
    output is sum_s v_s w_s / divisor (merge_states; compiled_attn.cp's ring merge)."""
    m = s.amax(dim=1, keepdim=True)  # [N, 1, H]
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w = torch.exp2(s - m_safe)  # 0 for -inf states
    total = w.sum(dim=1)  # [N, H]; NaN where an LSE is NaN, which passes through
    unseen = total == 0
    denom = torch.where(unseen, torch.ones_like(total), total)
    lse = torch.where(unseen, torch.full_like(total, float("-inf")),
                      torch.log2(denom) + m_safe[:, 0])
    return w, denom, lse.to(torch.float32)


# --------------------------------------------------------------------------------------------
# ALiBi
# --------------------------------------------------------------------------------------------
def get_alibi_slopes(n_heads: int, device: torch.device | str | None = None) -> torch.Tensor:
    """ALiBi slopes, float32 ``[n_heads]``: with n = 2^floor(log2 n_heads), head h < n gets
    ``2^(-8 (h + 1) / n)``; the remaining heads take ``2^(-4 / n)`` to the odd powers 1, 3, 5..."""
    V.check_count("n_heads", n_heads, 1)
    n = 2 ** int(math.floor(math.log2(n_heads)))
    p = torch.arange(1, n + 1, dtype=torch.float64)
    slopes = torch.pow(2.0, -8.0 * p / n)
    if n < n_heads:
        odd = torch.arange(1, 2 * (n_heads - n), 2, dtype=torch.float64)
        slopes = torch.cat([slopes, torch.pow(2.0, -4.0 * odd / n)])
    return slopes.to(torch.float32).to(device)


# --------------------------------------------------------------------------------------------
# shared with the wrappers
# --------------------------------------------------------------------------------------------
def _paged_kv_views(paged_kv_cache, kv_layout: str, name: str
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, v) views ``[P, page, Hkv, D]`` in logical NHD order (any strides, no copy) of a
    paged cache given as a 5-D tensor or a (k, v) tuple of 4-D tensors, in kv_layout. Page size 1
    caches may drop the page axis (4-D single tensor, 3-D tuple entries)."""
    hnd = kv_layout == "HND"
    if isinstance(paged_kv_cache, (tuple, list)):
        if len(paged_kv_cache) != 2:
            raise ValueError(f"{name}: a tuple cache must be (k_cache, v_cache); got "
                             f"{len(paged_kv_cache)} entries")
        out = []
        for part, t in zip(("k", "v"), paged_kv_cache):
            if not torch.is_tensor(t) or t.dim() not in (3, 4):
                raise ValueError(
                    f"{name}[{0 if part == 'k' else 1}] ({part} cache): expected a 4-D tensor "
                    f"{'[pages, Hkv, page_size, D]' if hnd else '[pages, page_size, Hkv, D]'} "
                    f"(kv_layout={kv_layout!r}); got "
                    f"{tuple(t.shape) if torch.is_tensor(t) else type(t).__name__}")
            if t.dim() == 3:
                t = t.unsqueeze(2 if hnd else 1)  # page size 1: the page axis is re-inserted
            out.append(t.transpose(1, 2) if hnd else t)
        return out[0], out[1]
    if not torch.is_tensor(paged_kv_cache):
        raise TypeError(f"{name}: expected a 5-D tensor or a (k_cache, v_cache) tuple; got "
                        f"{type(paged_kv_cache).__name__}")
    t = paged_kv_cache
    if t.dim() == 4:
        t = t.unsqueeze(3 if hnd else 2)  # page size 1: the page axis is re-inserted
    if t.dim() != 5 or t.shape[1] != 2:
        raise ValueError(
            f"{name}: expected a 5-D tensor "
            f"{'[pages, 2, Hkv, page_size, D]' if hnd else '[pages, 2, page_size, Hkv, D]'} "
            f"(kv_layout={kv_layout!r}; dim 1 holds k and v) or a (k, v) tuple; got shape "
            f"{tuple(paged_kv_cache.shape)}")
    k, v = t[:, 0], t[:, 1]
    if hnd:
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return k, v
