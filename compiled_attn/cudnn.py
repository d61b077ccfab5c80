"""FlashInfer's cuDNN prefill entry point, ``cudnn_batch_prefill_with_kv_cache``, on our ops.

This module gives ``flashinfer.cudnn_batch_prefill_with_kv_cache`` (FlashInfer's current
signature, every argument accepted) on top of the ``compiled_attn`` torch.library ops: a paged
KV cache addressed by a rectangular ``block_tables`` [B, max_pages] becomes a call of
``torch.ops.compiled_attn.batch_paged_prefill`` (the table is compacted into the indptr/indices
form on the device), ragged K/V becomes ``torch.ops.compiled_attn.batch_ragged_prefill``, and the
work list comes from ``compiled_attn.ops.schedule``. The LSE is handed back in cuDNN's padded
``[B, max_token_per_sequence, Hq]`` layout. With ``is_cuda_graph_compatible=True`` nothing reads a
device value on the host: the work list is the uniform one over ``max_token_per_sequence`` and
the offsets are checked on the device.
"""

from __future__ import annotations

import math

import torch

from . import _validate as V
from .op_call import call_op, write_rows
from .ops import MASK_CAUSAL, MASK_NONE, POS_NONE, schedule
from .utils import LN2

__all__ = ["cudnn_batch_prefill_with_kv_cache"]

_NAME = "cudnn_batch_prefill_with_kv_cache"
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _fail(arg: str, problem: str, fix: str, exc=ValueError):
    raise exc(f"{_NAME}: {arg} {problem}; {fix}")


def _check_tensor(arg: str, t, dims: int | None = None):
    if not isinstance(t, torch.Tensor):
        _fail(arg, f"must be a torch.Tensor, got {type(t).__name__}", "pass a tensor")
    if dims is not None and t.dim() != dims:
        _fail(arg, f"must be {dims}-D, got shape {tuple(t.shape)}",
              "see the docstring for the expected shape")


# graph_mode: the host path, or the host-read-free path (taken where a host read cannot be:
# traced by torch.compile, or is_cuda_graph_compatible=True; truthy both)
_HOST, _TRACED, _CAPTURED = 0, 1, 2


def _lens(arg: str, t: torch.Tensor, q: torch.Tensor, graph_mode: int) -> torch.Tensor:
    """Per-request lengths, shape [B] or [B, 1, 1, 1], as int64 on q's device."""
    _check_tensor(arg, t)
    V.check_readable(f"{_NAME}: {arg}", t)
    if t.dtype not in (torch.int32, torch.int64):
        _fail(arg, f"must be int32 or int64, got {t.dtype}", "pass integer lengths")
    if t.dim() == 0 or t.numel() != t.shape[0]:
        _fail(arg, f"must have shape [B] or [B, 1, 1, 1], got {tuple(t.shape)}",
              "pass one length per request")
    if graph_mode == _CAPTURED and t.device != q.device:  # (a traced copy is a graph op)
        _fail(arg, f"is on {t.device} but q is on {q.device}",
              "with is_cuda_graph_compatible=True keep the lengths on q's device "
              "(a host copy cannot be captured)")
    return t.reshape(-1).to(device=q.device, dtype=torch.int64)


def _exclusive_cumsum(lens: torch.Tensor) -> torch.Tensor:
    return torch.cat([lens.new_zeros(1), torch.cumsum(lens, 0)])


def _offsets_in_tokens(arg: str, offs: torch.Tensor, batch: int, units: str, row_elems: int,
                       device) -> torch.Tensor:
    """Batch offsets [B+1] (any trailing unit dims) converted to token units, int64."""
    _check_tensor(arg, offs)
    V.check_readable(f"{_NAME}: {arg}", offs)
    if offs.dtype not in (torch.int32, torch.int64):
        _fail(arg, f"must be int32 or int64, got {offs.dtype}", "pass integer offsets")
    if offs.numel() != batch + 1:
        _fail(arg, f"must hold batch_size + 1 = {batch + 1} offsets, got {offs.numel()}",
              "pass cumulative offsets [0, off_1, ..., off_B]")
    o = offs.reshape(-1).to(device=device, dtype=torch.int64)
    return o if units == "tokens" else torch.div(o, row_elems, rounding_mode="floor")


def _check_packed(arg: str, offs_tok: torch.Tensor, indptr: torch.Tensor, units: str,
                  row_elems: int, raw: torch.Tensor, graph_mode: int):
    """Our ops read requests back to back: the offsets must be the exclusive cumsum of the
    lengths (what every FlashInfer caller passes). Checked on the host, or on the device
    (torch._assert_async) under is_cuda_graph_compatible."""
    if units == "elements":
        exact = (raw.reshape(-1).to(offs_tok.device, torch.int64) % row_elems) == 0
    else:
        exact = torch.ones_like(offs_tok, dtype=torch.bool)
    ok = (offs_tok == indptr) & exact
    if graph_mode:
        V.device_check(ok, f"{_NAME}: {arg} must equal the cumulative sum of the sequence "
                           "lengths (packed requests)")
    elif not bool(ok.all()):
        _fail(arg, f"= {raw.reshape(-1).tolist()} is not the packed layout "
                   f"{(indptr * (1 if units == 'tokens' else row_elems)).tolist()} "
                   f"({units}) of the sequence lengths",
              "gaps or reordering between requests are not implemented: pack the requests "
              "back to back and pass cumsum([0, *seq_lens]) in these units",
              NotImplementedError)


def _check_stats_offsets(starts: torch.Tensor, extents: torch.Tensor, size: int,
                         graph_mode: int) -> None:
    """Each request's LSE rows (``extents[b]`` elements from ``starts[b]``, both [B] int64)
    lie inside the lse buffer of ``size`` elements; a request without rows may point anywhere.
    Checked on the host, or on the device under is_cuda_graph_compatible."""
    ok = (extents == 0) | ((starts >= 0) & (starts + extents <= size))
    if graph_mode:
        V.device_check(ok, f"{_NAME}: batch_offsets_stats puts a request's LSE rows outside "
                           "the lse buffer (B * max_token_per_sequence * Hq elements)")
    elif not bool(ok.all()):
        b = int(torch.nonzero(~ok)[0, 0])
        _fail("batch_offsets_stats", f"entry {b} ({int(starts[b])} elements) puts request {b}'s "
              f"{int(extents[b])} LSE values outside the lse buffer's {size} elements "
              "(B * max_token_per_sequence * Hq)",
              "pass offsets whose requests' rows fit the [B, max_token_per_sequence, Hq] buffer")


def _pages_used(kv_lens: torch.Tensor, page: int, max_pages: int):
    """(npages [B], used [B, max_pages]): each request's page count and which of its
    block-table columns hold its pages."""
    npages = torch.div(kv_lens + page - 1, page, rounding_mode="floor")
    j = torch.arange(max_pages, device=kv_lens.device, dtype=torch.int64)[None, :]
    return npages, j < npages[:, None]


def _compact_block_tables(block_tables: torch.Tensor, kv_lens: torch.Tensor, page: int):
    """block_tables [B, M] + kv lengths -> (page_indptr [B+1], page_indices [B*M],
    last_page_len [B]) without host reads. Request b's first ceil(kv_len/page) table entries
    come first, request-major; the unused entries follow past page_indptr[-1] (set to page 0,
    never read as keys)."""
    bsz, m = block_tables.shape
    dev = block_tables.device
    npages, valid = _pages_used(kv_lens.to(dev), page, m)
    indptr = _exclusive_cumsum(npages)
    start = indptr[:-1, None]
    j = torch.arange(m, device=dev, dtype=torch.int64)[None, :]
    flat = torch.arange(bsz * m, device=dev, dtype=torch.int64).reshape(bsz, m)
    invalid_before = flat - (start + torch.minimum(j, npages[:, None]))
    dest = torch.where(valid, start + j, indptr[-1] + invalid_before)
    src = torch.where(valid, block_tables.to(torch.int64), torch.zeros_like(flat))
    indices = torch.zeros(bsz * m, device=dev, dtype=torch.int64)
    indices.scatter_(0, dest.reshape(-1), src.reshape(-1))
    last = torch.where(npages > 0, kv_lens - (npages - 1) * page, torch.full_like(npages, page))
    return indptr.to(torch.int32), indices.to(torch.int32), last.to(torch.int32)


def _scale_value(arg: str, s, graph_mode: int) -> float:
    """A per-tensor scale given as a number or a one-element tensor, as a finite float."""
    if s is None:
        return 1.0
    if not torch.is_tensor(s):
        return _finite(arg, s)
    _check_tensor(arg, s)
    V.check_readable(f"{_NAME}: {arg}", s)
    if s.numel() != 1:
        _fail(arg, f"must hold one value (shape [1, 1, 1, 1]), got shape {tuple(s.shape)}",
              "pass a per-tensor scale")
    if graph_mode == _CAPTURED:
        _fail(arg, "is a tensor, and folding it into the kernel's scales needs a host read, "
                   "which is not allowed with is_cuda_graph_compatible=True",
              "fold the fp8 scales into `scale` (q_scale * k_scale) and scale the output by "
              "v_scale yourself, or call with is_cuda_graph_compatible=False",
              NotImplementedError)
    if graph_mode:
        _fail(arg, "is a tensor, and folding it into the kernel's scales needs a host read, "
                   "which torch.compile would make a data-dependent guard",
              "pass the scale as a Python float (float(scale) outside the compiled region), "
              "or fold the fp8 scales into `scale` (q_scale * k_scale) and scale the output "
              "by v_scale yourself", NotImplementedError)
    return _finite(arg, s.reshape(()).item())


def _finite(arg: str, x) -> float:
    if not V.is_number(x):
        _fail(arg, f"must be a number, got {x!r}", "pass a finite float", TypeError)
    x = float(x)
    if not math.isfinite(x):
        _fail(arg, f"is {x}", "pass a finite float")
    return V.fits_float32(f"{_NAME}: {arg}", x)


def cudnn_batch_prefill_with_kv_cache(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    scale: float,
    workspace_buffer: torch.Tensor,
    *,
    max_token_per_sequence: int,
    max_sequence_kv: int,
    actual_seq_lens_q: torch.Tensor | None = None,
    actual_seq_lens_kv: torch.Tensor | None = None,
    block_tables: torch.Tensor | None = None,
    causal: bool,
    return_lse: bool,
    q_scale: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    batch_offsets_q: torch.Tensor | None = None,
    batch_offsets_o: torch.Tensor | None = None,
    batch_offsets_k: torch.Tensor | None = None,
    batch_offsets_v: torch.Tensor | None = None,
    batch_offsets_stats: torch.Tensor | None = None,
    batch_offsets_units: str = "elements",
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    is_cuda_graph_compatible: bool = False,
    backend: str | None = None,
    o_data_type: torch.dtype | None = None,
    lse_base: str = "log2",
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Batched prefill over a paged or ragged KV cache (FlashInfer's cuDNN entry point).

    Args:
        q: [Nq, Hq, Dqk] packed query tokens, requests back to back (fp16/bf16/fp32, or fp8
            which is upcast exactly to bf16).
        k_cache, v_cache: paged: [P, Hkv, page, Dqk] / [P, Hkv, page, Dvo] (any strides) with
            ``block_tables``; ragged: [Nk, Hkv, Dqk] / [Nk, Hkv, Dvo], requests back to back
            at ``batch_offsets_k`` / ``batch_offsets_v``, or, without both (B > 1), padded as
            FlashInfer's cuDNN graph reads them: request b's keys from row
            b * max_sequence_kv (Nk >= B * max_sequence_kv). fp8 (e4m3/e5m2) is upcast; pass
            its scales as k_scale/v_scale.
        scale: softmax scale on q.k.
        workspace_buffer: accepted for compatibility; our kernel needs no workspace.
        max_token_per_sequence: bound on each request's query length; the LSE's middle dim.
            Under is_cuda_graph_compatible the work list covers this many rows per request
            (rows past a request's length are skipped by the kernel).
        max_sequence_kv: bound on each request's KV length (checked on the host).
        actual_seq_lens_q, actual_seq_lens_kv: int [B] or [B, 1, 1, 1]. May be omitted with
            batch_offsets_units="tokens" and batch_offsets_q (resp. batch_offsets_k, ragged
            only): the lengths are then the differences of the offsets.
        block_tables: int32 [B, max_pages]; request b's token t sits in page
            ``block_tables[b, t // page]``, slot ``t % page``. None for ragged K/V. Columns
            past a request's ceil(kv_len / page) pages are never read (the table may be wider
            than needed, and hold anything there).
        causal: bottom-right aligned causal mask (row i sees keys j <= kv_len - qo_len + i).
        return_lse: also return the LSE.
        q_scale, k_scale: fp8 dequantisation scales (one value each), multiplied into
            ``scale``. v_scale: multiplies the output (not the LSE).
        batch_offsets_q, batch_offsets_o, batch_offsets_k, batch_offsets_v: [B+1] start
            offsets of each request in q / out / k / v, in
            ``batch_offsets_units`` ("elements": token offset * the tensor's token stride;
            "tokens": plain indptrs). Requests must be packed back to back (the offsets equal
            the cumulative lengths); other layouts raise NotImplementedError, as do ragged
            K/V with only one of batch_offsets_k / batch_offsets_v (B > 1; in token units
            batch_offsets_v defaults to batch_offsets_k, and batch_offsets_o to
            batch_offsets_q).
        batch_offsets_stats: [B+1] start offsets into the LSE buffer (elements: token offset *
            Hq); request b's row i, head h is written at flat element
            ``offset[b] + i * Hq + h``. Without it the LSE is padded: [b, i, h]. A request
            whose rows would fall outside the B * max_token_per_sequence * Hq buffer raises
            (a device assert under is_cuda_graph_compatible).
        out: optional [Nq, Hq, Dvo] output buffer (its rows of the requests written in place;
            rows past sum(actual_seq_lens_q) keep their values, as FlashInfer leaves them).
        lse: optional float32 [B, max_token_per_sequence, Hq] buffer on q's device
            (return_lse=True only).
        is_cuda_graph_compatible: no host reads (capturable; a call traced by torch.compile
            takes this path too): uniform work list, offsets checked on the device; tensor
            fp8 scales then raise.
        backend: None, "cudnn" or "cubin": all run our kernel (same numbers).
        o_data_type: output dtype (default: out's dtype, else q's).
        lse_base: "log2" (default) returns the LSE in base 2, as every FlashInfer backend;
            "ln" in natural log (cuDNN's own stats).

    Returns:
        (out [Nq, Hq, Dvo], lse or None). lse: float32 [B, max_token_per_sequence, Hq], base 2
        (natural logsumexp / ln 2 over the scaled logits; natural with lse_base="ln"); entries
        past a request's length and rows that see no key hold -inf, whose output rows are 0.
        Output rows past sum(actual_seq_lens_q) belong to no request: the kernel does not
        write them (as FlashInfer; the CPU reference writes 0); slice them off.
    """
    # traced by torch.compile: the host-read-free path too (a host read would be a
    # data-dependent guard), which computes the same numbers
    graph_mode = (_CAPTURED if is_cuda_graph_compatible else _TRACED if V.traced()
                  else _HOST)
    _check_arguments(q, k_cache, v_cache, scale, workspace_buffer, max_token_per_sequence,
                     max_sequence_kv, block_tables, return_lse, lse, batch_offsets_units,
                     backend, lse_base)
    paged = block_tables is not None
    offsets = dict(q=batch_offsets_q, o=batch_offsets_o, k=batch_offsets_k, v=batch_offsets_v)
    bsz, qo_lens, kv_lens = _lengths(q, k_cache, actual_seq_lens_q, actual_seq_lens_kv, offsets,
                                     batch_offsets_units, paged, graph_mode)
    if _padded_kv(paged, bsz, offsets, max_sequence_kv):
        k_cache, v_cache, block_tables = _padded_as_pages(k_cache, v_cache, bsz, max_sequence_kv)
        paged = True
    qo_indptr = _exclusive_cumsum(qo_lens)
    kv_indptr = _exclusive_cumsum(kv_lens)
    out_dtype = _out_dtype(q, v_cache, out, o_data_type)
    offs_stats = _packed_offsets(q, k_cache, v_cache, out, offsets, batch_offsets_stats,
                                 batch_offsets_units, qo_indptr, kv_indptr, paged, graph_mode)
    bm, work = _work_list(q, k_cache, v_cache, block_tables, qo_lens, kv_lens, qo_indptr,
                          kv_indptr, max_token_per_sequence, max_sequence_kv, causal,
                          graph_mode)
    if return_lse:
        _check_lse_buffer(q, lse, qo_lens, offs_stats, max_token_per_sequence, graph_mode)
    sm_scale = V.fits_float32(f"{_NAME}: scale * q_scale * k_scale", float(scale)
                              * _scale_value("q_scale", q_scale, graph_mode)
                              * _scale_value("k_scale", k_scale, graph_mode))
    params = (MASK_CAUSAL if causal else MASK_NONE, -1, 0, sm_scale, 0.0, POS_NONE, 1.0, 1e4,
              _scale_value("v_scale", v_scale, graph_mode), out_dtype)
    o, lse_tok = _call(q, k_cache, v_cache, block_tables, qo_indptr, kv_indptr, kv_lens, work,
                       bm, params)
    out = o if out is None else write_rows(out, o, qo_indptr[-1:])
    if not return_lse:
        return out, None
    padded = _lse_in_cudnn_layout(lse_tok, qo_indptr, offs_stats, bsz, max_token_per_sequence,
                                  lse_base)
    if lse is None:
        return out, padded
    lse.copy_(padded)
    return out, lse


# ---- the sections of cudnn_batch_prefill_with_kv_cache, in call order
def _check_arguments(q, k_cache, v_cache, scale, workspace_buffer, max_token_per_sequence,
                     max_sequence_kv, block_tables, return_lse, lse, units, backend, lse_base):
    """The call's options; the tensors' ranks, shapes, heads, head dims, dtypes and devices."""
    V.check_lse_base(lse_base)
    _check_tensor("q", q, 3)
    _check_tensor("workspace_buffer", workspace_buffer)
    if backend not in (None, "cudnn", "cubin"):
        _fail("backend", f"must be None, 'cudnn' or 'cubin', got {backend!r}",
              "leave it None (every backend runs compiled_attn's kernel)")
    if units not in ("elements", "tokens"):
        _fail("batch_offsets_units", f"must be 'elements' or 'tokens', got "
                                     f"{units!r}", "pick one of the two")
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        _fail("scale", f"must be a Python float, got {type(scale).__name__}",
              "pass e.g. 1 / sqrt(head_dim)")
    _finite("scale", scale)
    for arg, val in (("max_token_per_sequence", max_token_per_sequence),
                     ("max_sequence_kv", max_sequence_kv)):
        if not isinstance(val, int) or isinstance(val, bool) or val < 0:
            _fail(arg, f"must be a non-negative int, got {val!r}", "pass the bound as an int")
    if lse is not None and not return_lse:
        _fail("lse", "was given but return_lse=False", "pass return_lse=True or drop lse")

    paged = block_tables is not None
    kv_dims = 4 if paged else 3
    _check_tensor("k_cache", k_cache, kv_dims)
    _check_tensor("v_cache", v_cache, kv_dims)
    if not paged and (k_cache.dim() == 4):
        _fail("block_tables", "is None but k_cache is 4-D", "pass block_tables for a paged cache")
    nq, hq, dqk = q.shape
    hkv = k_cache.shape[1]
    dvo = v_cache.shape[-1]
    if k_cache.shape[-1] != dqk:
        _fail("k_cache", f"head dim {k_cache.shape[-1]} != q's {dqk}", "use the same D_qk")
    if v_cache.shape[:-1] != k_cache.shape[:-1]:
        _fail("v_cache", f"shape {tuple(v_cache.shape)} does not match k_cache "
                         f"{tuple(k_cache.shape)} except in the last dim", "pass matching caches")
    V.check_heads(hq, hkv, names=("q.shape[1] (query heads)", "k_cache.shape[1] (KV heads)"))
    V.check_head_dims(dqk, dvo, q.device.type,
                      names=("head_dim_qk (q.shape[-1])", "head_dim_vo (v_cache.shape[-1])"))
    if q.dtype not in _FP8:
        V.check_q_dtype("q", q.dtype, q.device.type)
    else:  # computed as bfloat16
        V.check_interpreter("q", torch.bfloat16, q.device.type)
    V.check_kv_dtype("k_cache", k_cache.dtype, q.device.type)
    V.check_kv_dtype("v_cache", v_cache.dtype, q.device.type)
    V.check_qkv_dtypes(q.dtype, k_cache.dtype, v_cache.dtype, names=("q", "k_cache", "v_cache"))
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.device != q.device:
            _fail(arg, f"is on {t.device} but q is on {q.device}", "move it to q's device")


def _lengths(q, k_cache, actual_seq_lens_q, actual_seq_lens_kv, offsets: dict, units: str,
             paged: bool, graph_mode: int):
    """(batch size, qo_lens, kv_lens) from the length arrays, or from token offsets.
    offsets: batch_offsets_q / _o / _k / _v by letter; in token units the output's and V's
    default to q's and K's (set here, in place)."""
    if actual_seq_lens_q is not None:
        qo_lens = _lens("actual_seq_lens_q", actual_seq_lens_q, q, graph_mode)
        bsz = qo_lens.shape[0]
    elif units == "tokens" and offsets["q"] is not None:
        bsz = offsets["q"].numel() - 1
        qo_lens = None
    else:
        _fail("actual_seq_lens_q", "is missing",
              "pass it, or pass batch_offsets_q with batch_offsets_units='tokens'")
    offs_q = None if offsets["q"] is None else _offsets_in_tokens(
        "batch_offsets_q", offsets["q"], bsz, units, q.stride(0), q.device)
    if qo_lens is None:
        qo_lens = offs_q[1:] - offs_q[:-1]
    if actual_seq_lens_kv is not None:
        kv_lens = _lens("actual_seq_lens_kv", actual_seq_lens_kv, q, graph_mode)
    elif units == "tokens" and offsets["k"] is not None and not paged:
        kv_lens = None
    else:
        _fail("actual_seq_lens_kv", "is missing",
              "pass it, or (ragged K/V) pass batch_offsets_k with batch_offsets_units='tokens'")
    if units == "tokens":
        offsets["o"] = offsets["q"] if offsets["o"] is None else offsets["o"]
        offsets["v"] = offsets["k"] if offsets["v"] is None else offsets["v"]
    if paged and (offsets["k"] is not None or offsets["v"] is not None):
        _fail("batch_offsets_k", "was given with block_tables",
              "K/V offsets apply to ragged K/V only; drop them for a paged cache")
    offs_k = None if offsets["k"] is None else _offsets_in_tokens(
        "batch_offsets_k", offsets["k"], bsz, units, k_cache.stride(0), q.device)
    if kv_lens is None:
        kv_lens = offs_k[1:] - offs_k[:-1]
    if kv_lens.shape[0] != bsz:
        _fail("actual_seq_lens_kv", f"has {kv_lens.shape[0]} entries, actual_seq_lens_q {bsz}",
              "pass one length per request to both")
    return bsz, qo_lens, kv_lens


def _padded_kv(paged: bool, bsz: int, offsets: dict, max_sequence_kv: int) -> bool:
    """Whether ragged K / V are read padded: without batch_offsets_k and batch_offsets_v,
    FlashInfer's cuDNN graph reads request b's keys and values from row b * max_sequence_kv
    (its K / V tensors declared [B, Hkv, max_sequence_kv, D]); with one of the two only, one
    would be packed and the other padded, which one launch cannot read."""
    if paged or bsz <= 1 or max_sequence_kv == 0:
        return False  # (one request, or no keys: packed and padded are the same rows)
    given = [offsets[x] is not None for x in ("k", "v")]
    if given == [True, True]:
        return False
    if any(given):
        _fail("batch_offsets_k / batch_offsets_v", "given one without the other: K would be read "
              "at its offsets and V padded (request b at row b * max_sequence_kv), or the "
              "other way round, which is not implemented",
              "pass both (packed requests) or neither (padded)", exc=NotImplementedError)
    return True


def _padded_as_pages(k_cache, v_cache, bsz: int, max_sequence_kv: int):
    """Ragged K / V in FlashInfer's padded layout (request b at row b * max_sequence_kv) as a
    paged cache of one max_sequence_kv-key page per request: (k [B, Hkv, M, Dqk],
    v [B, Hkv, M, Dvo], block_tables int32 [B, 1] = b)."""
    rows = bsz * max_sequence_kv
    for arg, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.shape[0] < rows:
            _fail(arg, f"has {t.shape[0]} rows; without batch_offsets_k / batch_offsets_v "
                  f"request b's keys are read from row b * max_sequence_kv (FlashInfer's "
                  f"padded layout), so {bsz} requests need {rows}",
                  "pass batch_offsets_k and batch_offsets_v for requests packed back to "
                  "back, or a [B * max_sequence_kv, Hkv, D] tensor")
    pages = [t[:rows].unflatten(0, (bsz, max_sequence_kv)).transpose(1, 2)
             for t in (k_cache, v_cache)]
    table = torch.arange(bsz, device=k_cache.device, dtype=torch.int32)[:, None]
    return pages[0], pages[1], table


def _out_dtype(q, v_cache, out, o_data_type) -> torch.dtype:
    """The output dtype (o_data_type, else out's, else q's); out checked against it."""
    nq, hq, _ = q.shape
    dvo = v_cache.shape[-1]
    out_dtype = o_data_type or (out.dtype if out is not None else q.dtype)
    out_dtype = V.canonical_dtype("o_data_type", out_dtype)
    if out_dtype not in _FP8:
        V.check_out_dtype("o_data_type", out_dtype, q.device.type)
    else:
        V.check_interpreter("o_data_type", out_dtype, q.device.type)
    if out is not None:
        _check_tensor("out", out, 3)
        if tuple(out.shape) != (nq, hq, dvo) or out.dtype != out_dtype or out.device != q.device:
            _fail("out", f"is {tuple(out.shape)} {out.dtype} on {out.device}",
                  f"pass a [{nq}, {hq}, {dvo}] {out_dtype} tensor on {q.device}")
        V.check_writable(f"{_NAME}: out", out)
    return out_dtype


def _packed_offsets(q, k_cache, v_cache, out, offsets: dict, batch_offsets_stats, units: str,
                    qo_indptr, kv_indptr, paged: bool, graph_mode: int):
    """Checks that the q / o / k / v offsets describe packed requests; returns the LSE
    offsets in elements (None without batch_offsets_stats)."""
    bsz, hq, dvo = qo_indptr.shape[0] - 1, q.shape[1], v_cache.shape[-1]
    checks = [("batch_offsets_q", offsets["q"], qo_indptr, q.stride(0)),
              ("batch_offsets_o", offsets["o"], qo_indptr,
               out.stride(0) if out is not None else hq * dvo)]
    if not paged:
        checks += [("batch_offsets_k", offsets["k"], kv_indptr, k_cache.stride(0)),
                   ("batch_offsets_v", offsets["v"], kv_indptr, v_cache.stride(0))]
    for arg, raw, ind, row in checks:
        if raw is not None:
            tok = _offsets_in_tokens(arg, raw, bsz, units, row, q.device)
            _check_packed(arg, tok, ind, units, row, raw, graph_mode)
    offs_stats = None if batch_offsets_stats is None else _offsets_in_tokens(
        "batch_offsets_stats", batch_offsets_stats, bsz, "tokens", 1, q.device)
    if offs_stats is not None and units == "tokens":
        offs_stats = offs_stats * hq  # token units -> LSE elements
    return offs_stats


def _work_list(q, k_cache, v_cache, block_tables, qo_lens, kv_lens, qo_indptr, kv_indptr,
               max_token_per_sequence: int, max_sequence_kv: int, causal: bool,
               graph_mode: int):
    """(tile height, work list). graph_mode: the uniform list over max_token_per_sequence,
    the lengths and page table checked on the device (no host read: capturable); else the
    lengths' own list, checked on the host."""
    paged = block_tables is not None
    nq, hq, dqk = q.shape
    bsz = qo_lens.shape[0]
    group = hq // k_cache.shape[1]
    page = k_cache.shape[2] if paged else 0  # paged caches are [P, Hkv, page, D]

    def tile(qo_rows):
        return schedule.block_m_for(dqk, v_cache.shape[-1], group, max_sequence_kv, causal,
                                    paged, page_size=page, qo_lens=qo_rows,
                                    kv_dtype=k_cache.dtype)

    if paged:
        _check_tensor("block_tables", block_tables, 2)
        V.check_readable(f"{_NAME}: block_tables", block_tables)
        if block_tables.dtype not in (torch.int32, torch.int64):
            _fail("block_tables", f"must be int32, got {block_tables.dtype}",
                  "pass int32 page indices")
        if block_tables.shape[0] != bsz:
            _fail("block_tables", f"has {block_tables.shape[0]} rows for {bsz} requests",
                  "pass one row of page indices per request")
    if graph_mode:  # every request gets max_token_per_sequence rows of tiles
        # the checks below on the host, here on the device (no host read: capturable)
        V.device_check((qo_lens >= 0) & (qo_lens <= max_token_per_sequence),
                       f"{_NAME}: actual_seq_lens_q must be in [0, max_token_per_sequence]")
        V.device_check((kv_lens >= 0) & (kv_lens <= max_sequence_kv),
                       f"{_NAME}: actual_seq_lens_kv must be in [0, max_sequence_kv]")
        V.device_check(qo_indptr[-1:] <= nq, f"{_NAME}: q has fewer tokens than "
                                             "sum(actual_seq_lens_q)")
        if paged:
            npages, used = _pages_used(kv_lens, page, block_tables.shape[1])
            V.device_check(npages <= block_tables.shape[1], f"{_NAME}: block_tables has too "
                           "few columns for actual_seq_lens_kv")
            bt = block_tables.to(q.device)
            # (no size in the message: a traced one would be a guard, a graph per page count)
            V.device_check(~used | ((bt >= 0) & (bt < k_cache.shape[0])),
                           f"{_NAME}: block_tables holds page indices outside the cache's "
                           "pages for pages the KV lengths use")
        else:
            V.device_check(kv_indptr[-1:] <= k_cache.shape[0], f"{_NAME}: k_cache has fewer "
                           "tokens than sum(actual_seq_lens_kv)")
        bm = tile([max_token_per_sequence])
        return bm, schedule.uniform_work(bsz, max_token_per_sequence, group, bm, q.device)
    ql = [int(x) for x in qo_lens.tolist()]
    kl = [int(x) for x in kv_lens.tolist()]
    if any(n < 0 for n in ql + kl):
        _fail("actual_seq_lens_q/kv", f"hold negative lengths {ql} / {kl}",
              "pass lengths >= 0")
    if ql and max(ql) > max_token_per_sequence:
        _fail("max_token_per_sequence", f"= {max_token_per_sequence} < the longest query "
              f"{max(ql)}", "pass max(actual_seq_lens_q) or more")
    if kl and max(kl) > max_sequence_kv:
        _fail("max_sequence_kv", f"= {max_sequence_kv} < the longest KV {max(kl)}",
              "pass max(actual_seq_lens_kv) or more")
    if sum(ql) > nq:
        _fail("q", f"has {nq} tokens, the lengths need {sum(ql)}",
              "pass all query tokens, packed")
    if paged:
        need = max([-(-n // page) for n in kl], default=0)
        if need > block_tables.shape[1]:
            _fail("block_tables", f"has {block_tables.shape[1]} columns, a request needs "
                  f"{need} pages of {page}", "widen the table")
        used = torch.cat([block_tables[b, : -(-n // page)].reshape(-1).cpu()
                          for b, n in enumerate(kl)] + [torch.zeros(0, dtype=torch.int64)])
        if used.numel() and (int(used.min()) < 0 or int(used.max()) >= k_cache.shape[0]):
            _fail("block_tables", f"holds page indices outside [0, {k_cache.shape[0]})",
                  "index pages of k_cache/v_cache")
    elif sum(kl) > k_cache.shape[0]:
        _fail("k_cache", f"has {k_cache.shape[0]} tokens, the lengths need {sum(kl)}",
              "pass all KV tokens, packed")
    bm = tile(ql)
    return bm, schedule.build_work(ql, group, bm, q.device, kv_lens=kl)


def _check_lse_buffer(q, lse, qo_lens, offs_stats, max_token_per_sequence: int,
                      graph_mode: int) -> None:
    """The LSE buffer and where each request's rows go in it, checked before anything is
    written."""
    bsz, hq = qo_lens.shape[0], q.shape[1]
    if lse is not None:
        _check_tensor("lse", lse, 3)
        V.check_writable(f"{_NAME}: lse", lse)
        if tuple(lse.shape) != (bsz, max_token_per_sequence, hq) or \
                lse.dtype != torch.float32 or lse.device != q.device:
            _fail("lse", f"is {tuple(lse.shape)} {lse.dtype} on {lse.device}",
                  f"pass float32 [{bsz}, {max_token_per_sequence}, {hq}] (B, "
                  f"max_token_per_sequence, Hq) on {q.device}")
    if offs_stats is not None:
        rows = qo_lens.clamp(max=max_token_per_sequence)
        _check_stats_offsets(offs_stats[:-1], rows * hq, bsz * max_token_per_sequence * hq,
                             graph_mode)


def _call(q, k_cache, v_cache, block_tables, qo_indptr, kv_indptr, kv_lens, work, bm: int,
          params: tuple):
    """The op on the batch: paged (block tables compacted on the device) or ragged; fp8 q is
    upcast to bf16. params: the op's trailing scalars. Returns (out, lse [tokens, Hq])."""
    qx = q.to(torch.bfloat16) if q.dtype in _FP8 else q
    qo_i32, kv_i32 = qo_indptr.to(torch.int32), kv_indptr.to(torch.int32)
    if block_tables is not None:
        page_indptr, page_indices, last = _compact_block_tables(block_tables.to(q.device),
                                                                kv_lens, k_cache.shape[2])
        return call_op(
            "batch_paged_prefill",
            qx, k_cache.transpose(1, 2), v_cache.transpose(1, 2), qo_i32, page_indptr,
            page_indices, last, work, None, None, None, None, bm, *params)
    return call_op(
        "batch_ragged_prefill",
        qx, k_cache, v_cache, qo_i32, kv_i32, work, None, None, None, None, bm, *params)


def _token_requests(indptr: torch.Tensor, rows: int):
    """For each of ``rows`` tokens of requests packed back to back by indptr (int64 [B+1]
    from 0, on the device): (its request [rows], clamped into the batch (0 without requests),
    its row in that request, whether a request holds it (token < indptr[-1])). No host read."""
    tok = torch.arange(rows, device=indptr.device, dtype=torch.int64)
    req = torch.bucketize(tok, indptr[1:], right=True).clamp(max=max(indptr.shape[0] - 2, 0))
    return req, tok - indptr[req], tok < indptr[-1]


def _lse_in_cudnn_layout(lse_tok, qo_indptr, offs_stats, bsz: int, max_token_per_sequence: int,
                         lse_base: str) -> torch.Tensor:
    """The op's LSE [tokens, Hq] as cuDNN's float32 [B, max_token_per_sequence, Hq]: padded
    by request, or at batch_offsets_stats; -inf where no row lands."""
    nq, hq = lse_tok.shape
    dev = lse_tok.device
    size = bsz * max_token_per_sequence * hq
    req, row, inside = _token_requests(qo_indptr, nq)
    inside = inside & (row < max_token_per_sequence)
    if offs_stats is None:
        base = req * (max_token_per_sequence * hq) + row * hq
    else:
        base = offs_stats[req] + row * hq
        inside = inside & (base >= 0) & (base + hq <= size)
    flat = torch.full((size + hq,), float("-inf"), device=dev, dtype=torch.float32)
    dest = torch.where(inside, base, torch.full_like(base, size))[:, None] \
        + torch.arange(hq, device=dev)[None, :]
    if lse_base == "ln":
        lse_tok = lse_tok * LN2
    flat.index_put_((dest.reshape(-1),), lse_tok.reshape(-1))
    return flat[:size].reshape(bsz, max_token_per_sequence, hq)
