"""FlashInfer's prefill entry points on compiled_attn's ops: single-request prefill and the
ragged / paged batch wrappers.

``single_prefill_with_kv_cache`` checks and normalises its arguments and calls
``torch.ops.compiled_attn.single_prefill`` once. The two batch wrappers follow FlashInfer's
plan/run split: ``plan()`` reads the index arrays on the host (they may live on CPU or GPU),
validates them (with messages that say how to fix the input), packs custom masks per request,
builds the int32 work list (``compiled_attn.ops.schedule.build_work``) and stores every tensor
the op needs on the wrapper's device; ``run()`` checks only shapes, dtypes and devices against
the plan and calls ``torch.ops.compiled_attn.batch_{paged,ragged}_prefill``, so it never reads a
device value on the host: it can be captured in a CUDA graph and traced by torch.compile.
Both wrappers share one base class for plan bookkeeping and run plumbing; they differ only in
how the KV side is described (offsets vs. page table). Semantics are those of docs/spec.md:
bottom-right aligned positions, LSE in base 2 over the final logits, rows that see no key give
output 0 and LSE -inf. Every accepted FlashInfer argument takes effect, or raises
NotImplementedError naming what is missing. Dtypes: fp16 / bf16 (K/V also fp8 with scales);
float32 is accepted too, and is computed in float32 on CPU, while on a GPU the kernel's two
matrix products (Q K^T and P V) take TF32 inputs (Triton's default for float32 dots; ~1e-3
relative error) with float32 accumulation and softmax.
"""

from __future__ import annotations

import functools
import operator

import torch

from . import _validate as V
from ._host import copy_to, gather_host, to_device
from ._plan_options import (BATCH_OPTION_ARGS, LastOptions, PlanOptions, options_key,
                            scalar_options)
from .op_call import bound_run, call_op, graph_leaf, write_rows
from .ops import decode_chunks as _chunks
from .ops.choose import RESIDENT_PER_SM, decode_chunk_sms, device_of, page_table_capacity
from .ops.launch import (LaunchCache, Memo, adopt_scratch, kernel_device, plain_tensors,
                         untraced)
from .ops.policy import POLICY
from .ops import MASK_CAUSAL, MASK_CUSTOM, MASK_NONE, POS_ALIBI
from .ops.device import sm_count
from .ops.schedule import (MAX_CHUNKS, block_m_for, build_decode_chunks, build_split_work,
                            build_work, chunks_wanted, decode_chunk_capacity, int32_host,
                            planned_chunk_count, split_capacity)
from .utils import (LN2, _byte_offsets, _pack_from_sources, _paged_kv_views,
                    _segment_bit_sources, get_alibi_slopes, packbits)

__all__ = [
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
]

_LSE_DOC = ("LSE: float32, base 2 (natural logsumexp / ln 2) over the final logits (scale, "
            "soft cap and ALiBi included); -inf for a row that sees no key (its output is 0).")


# --------------------------------------------------------------------------------------------
# shared argument handling
# --------------------------------------------------------------------------------------------
def _split_v_scale(v_scale) -> tuple[float, torch.Tensor | None]:
    """v_scale as (float the op applies, device tensor to multiply the output by afterwards).
    A device tensor is applied on the device (no host read); it never touches the LSE."""
    if torch.is_tensor(v_scale) and v_scale.device.type != "cpu":
        if v_scale.numel() != 1:
            V.unsupported("v_scale", f"got a tensor of shape {tuple(v_scale.shape)}; only a "
                          "scalar scale is supported (per-head scales are not)")
        V.check_readable("v_scale", v_scale)
        if v_scale.dtype.is_complex or v_scale.dtype == torch.bool:
            raise TypeError(f"v_scale: got a {v_scale.dtype} tensor; pass a real scale")
        return 1.0, v_scale.reshape(())
    return V.host_scale("v_scale", v_scale), None


def _apply_v_scale_tensor(out: torch.Tensor, vt: torch.Tensor | None) -> torch.Tensor:
    if vt is None:
        return out
    ct = torch.float64 if out.dtype == torch.float64 else torch.float32
    return (out.to(ct) * vt.to(ct)).to(out.dtype)


def _check_out_lse(out, lse, rows: int, hq: int, dvo: int, o_dtype, device,
                   lse_layout: str = "NH"):
    if out is not None:
        V.check_tensor("out", out, shape=(rows, hq, dvo), dtypes=(o_dtype,), device=device,
                       what="[tokens, Hq, D_vo] in the plan's output dtype")
        V.check_writable("out", out)
    if lse is not None:
        if lse_layout == "NH":
            V.check_tensor("lse", lse, shape=(rows, hq), dtypes=(torch.float32,), device=device,
                           what="[tokens, Hq] float32 (lse_layout='NH')")
        else:
            V.check_tensor("lse", lse, shape=(hq, rows), dtypes=(torch.float32,), device=device,
                           what="[Hq, tokens] float32 (lse_layout='HN')")
            if not lse.is_contiguous():
                raise ValueError("lse: with lse_layout='HN' it must be contiguous (a [Hq, tokens] "
                                 "buffer, not a transposed view of [tokens, Hq]); pass "
                                 "lse.contiguous() or let run() allocate it")
        V.check_writable("lse", lse)


def _deliver(res_out, res_lse, out, lse, return_lse, lse_base: str = "log2",
             lse_layout: str = "NH", end: torch.Tensor | None = None):
    """Copy the op's results into caller buffers (out=, lse=) and shape the return value.
    res_lse is the op's base-2 ``[tokens, Hq]``; lse_base "ln" scales it by ln 2, lse_layout
    "HN" returns its contiguous transpose ``[Hq, tokens]`` (FlashInfer's run() options).
    end: op_call.write_rows' (the plan's rows end where a CUDA-graph run's q has more rows:
    the caller's buffers keep theirs past it)."""
    if lse_base == "ln":
        res_lse = res_lse * LN2
    if out is not None:
        res_out = write_rows(out, res_out, end)
    if lse is not None:
        write_rows(lse.t() if lse_layout == "HN" else lse, res_lse, end)
        res_lse = lse
    elif lse_layout == "HN":
        res_lse = res_lse.t().contiguous()
    return (res_out, res_lse) if return_lse else res_out


# --------------------------------------------------------------------------------------------
# single request
# --------------------------------------------------------------------------------------------
def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_q: torch.Tensor | None = None,
    scale_k: torch.Tensor | None = None,
    scale_v: torch.Tensor | None = None,
    o_dtype: torch.dtype | None = None,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    kv_cache_sf=None,
    k_scale=None,
    v_scale=None,
):
    """Prefill attention of one request: q against its whole KV.

    q: ``[qo_len, Hq, D_qk]``. k: ``[kv_len, Hkv, D_qk]`` (NHD) or ``[Hkv, kv_len, D_qk]``
    (HND); v: ``[kv_len, Hkv, D_vo]`` / ``[Hkv, kv_len, D_vo]``; any strides. Hq % Hkv == 0
    (query head h reads KV head h // (Hq / Hkv)). k/v may be fp8 (e4m3/e5m2) with k_scale
    (multiplies sm_scale) and v_scale (multiplies the output, not the LSE); a float, a
    one-element CPU tensor, or (v_scale only) a one-element device tensor.
    custom_mask: bool ``[qo_len, kv_len]`` (True = attend; an integer type: nonzero; any shape
    with qo_len * kv_len entries, read row-major) or packed_custom_mask: uint8
    ``[ceil(qo_len * kv_len / 8)]``, little-endian bits (``packbits(mask, bitorder="little")``);
    a mask replaces ``causal``, the window still applies. causal: key j visible to row i when
    ``j <= kv_len - qo_len + i`` (bottom-right aligned); raises when kv_len < qo_len (as
    FlashInfer's single prefill).
    window_left >= 0: also ``j >= kv_len - qo_len + i - window_left``. logits_soft_cap > 0:
    ``s = c * tanh(s / c)``. pos_encoding_mode: "NONE", "ROPE_LLAMA" (in-kernel rotary of q and
    k, rope_scale / rope_theta) or "ALIBI" (slopes of get_alibi_slopes(Hq), bias
    ``slope * (j - p_i)`` with absolute positions: FlashInfer's kernel uses the row index
    without the kv_len - qo_len offset, which gives the same output but an LSE larger by
    ``slope * (kv_len - qo_len) / ln 2``). With both, the ALiBi bias is added to the capped
    logits; FlashInfer's fa2 kernel adds it inside the tanh (and applies sm_scale twice there),
    so the two differ for that combination. o_dtype: output dtype (default q's); float32
    inputs run TF32 matrix products on a GPU (module docstring). backend:
    "auto" / "fa2" / "fa3" all run compiled_attn's kernel. use_fp16_qk_reduction: a permission
    (we always reduce in fp32). scale_q / scale_k / scale_v (per-head fp8-q scales) and
    kv_cache_sf (NVFP4) raise NotImplementedError.

    Returns out ``[qo_len, Hq, D_vo]``, and with return_lse also lse float32 ``[qo_len, Hq]``.
    """
    args = (q, k, v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout,
            pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left, logits_soft_cap,
            rope_scale, rope_theta, backend, k_scale, v_scale)
    if (scale_q is None and scale_k is None and scale_v is None and kv_cache_sf is None
            and not torch.is_tensor(k_scale) and not torch.is_tensor(v_scale)):
        # a bound launch (op_call.bound_run): a repeated call replays what the first launched
        out, lse = bound_run(_SINGLE_MEMO, (q, k, v, custom_mask, packed_custom_mask),
                             args[3:4] + args[6:], lambda: _single_prefill(*args, True),
                             discard=() if return_lse else (1,))
        return (out, lse) if return_lse else out
    for name, val in (("scale_q", scale_q), ("scale_k", scale_k), ("scale_v", scale_v)):
        V.reject_if_set(name, val, "per-head fp8-q quantisation scales are not supported; "
                        "keep q in fp16/bf16 and pass scalar k_scale / v_scale for fp8 K/V")
    V.reject_if_set("kv_cache_sf", kv_cache_sf, "NVFP4 KV caches are not supported")
    return _single_prefill(*args, return_lse)


def _single_prefill(q, k, v, o_dtype, custom_mask, packed_custom_mask, causal, kv_layout,
                    pos_encoding_mode, use_fp16_qk_reduction, sm_scale, window_left,
                    logits_soft_cap, rope_scale, rope_theta, backend, k_scale, v_scale,
                    return_lse):
    """single_prefill_with_kv_cache's whole path (checks, views, the op), its arguments in
    this order (per-head q scales and NVFP4 already refused)."""
    V.check_backend(backend)
    layout = V.check_kv_layout(kv_layout)
    V.check_tensor("q", q, ndim=3, what="[qo_len, Hq, D_qk]")
    kv_what = "[kv_len, Hkv, D]" if layout == "NHD" else "[Hkv, kv_len, D]"
    V.check_tensor("k", k, ndim=3, device=q.device, what=kv_what)
    V.check_tensor("v", v, ndim=3, device=q.device, what=kv_what)
    kn, vn = (k, v) if layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
    qo_len, hq, dqk = q.shape
    kv_len, hkv, _ = kn.shape
    dvo = vn.shape[2]
    if kn.shape[2] != dqk:
        raise ValueError(f"k: head dim {kn.shape[2]} differs from q's {dqk}; q and k share "
                         "D_qk (only v may have another head dim)")
    if tuple(vn.shape[:2]) != (kv_len, hkv):
        raise ValueError(f"v: shape {tuple(v.shape)} does not match k's {tuple(k.shape)} in "
                         "tokens and heads")
    dev = q.device.type
    V.check_q_dtype("q.dtype", q.dtype, dev)
    V.check_kv_dtype("k.dtype", k.dtype, dev)
    if v.dtype != k.dtype:
        raise TypeError(f"v.dtype {v.dtype} differs from k.dtype {k.dtype}; store k and v in "
                        "one dtype")
    if k.dtype not in V.FP8_DTYPES and k.dtype != q.dtype:
        raise TypeError(f"k.dtype {k.dtype} differs from q.dtype {q.dtype}; use one dtype "
                        "(only fp8 K/V may differ from q)")
    V.check_heads(hq, hkv, names=("q's head count (q.shape[1])", "k's KV head count"))
    V.check_head_dims(dqk, dvo, dev, names=("D_qk", "D_vo"))
    opts = scalar_options(head_dim_qk=dqk, pos_encoding_mode=pos_encoding_mode,
                           sm_scale=sm_scale, window_left=window_left,
                           logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                           rope_theta=rope_theta, use_fp16_qk_reduction=use_fp16_qk_reduction)
    out_dtype = q.dtype if o_dtype is None else V.canonical_dtype("o_dtype", o_dtype)
    V.check_out_dtype("o_dtype", out_dtype, dev)

    nbits = qo_len * kv_len
    if packed_custom_mask is not None:
        packed_custom_mask = V.mask_packed_length(
            "packed_custom_mask", packed_custom_mask, (nbits + 7) // 8,
            lambda: f"ceil(qo_len * kv_len / 8) with qo_len={qo_len}, kv_len={kv_len}")
        V.check_tensor("packed_custom_mask", packed_custom_mask, device=q.device)
        packed, mask_mode = packed_custom_mask, MASK_CUSTOM
    elif custom_mask is not None:
        V.mask_bool_length("custom_mask", custom_mask, nbits,
                           lambda: f"qo_len * kv_len = {qo_len} * {kv_len}")
        V.check_tensor("custom_mask", custom_mask, device=q.device)
        packed, mask_mode = packbits(custom_mask, bitorder="little"), MASK_CUSTOM
    else:
        packed = None
        mask_mode = MASK_CAUSAL if causal else MASK_NONE
        if causal and kv_len < qo_len:
            raise ValueError(f"causal=True needs kv_len >= qo_len; got kv_len={kv_len} < "
                             f"qo_len={qo_len} (the first rows would see no key). Pass a "
                             "custom_mask, or use a batch wrapper, which allows it")

    sm = V.fits_float32("sm_scale * k_scale",
                        opts["sm_scale"] * V.host_scale("k_scale", k_scale))
    v_scale_f, v_scale_t = _split_v_scale(v_scale)
    alibi = get_alibi_slopes(hq, q.device) if opts["pos_encoding_mode"] == POS_ALIBI else None
    out, lse = call_op(
        "single_prefill",
        q.unsqueeze(0), kn.unsqueeze(0), vn.unsqueeze(0), packed, alibi, None,
        mask_mode, opts["window_left"], 0, sm, opts["logits_soft_cap"],
        opts["pos_encoding_mode"], opts["rope_scale"], opts["rope_theta"], v_scale_f, out_dtype)
    out = _apply_v_scale_tensor(out[0], v_scale_t)
    return (out, lse[0]) if return_lse else out


_SINGLE_MEMO = Memo()
single_prefill_with_kv_cache.__doc__ += "\n    " + _LSE_DOC + "\n"
single_prefill_with_kv_cache = graph_leaf(
    single_prefill_with_kv_cache, scalars=("sm_scale", "window_left", "logits_soft_cap",
                                           "rope_scale", "rope_theta"))


def single_prefill_with_kv_cache_return_lse(*args, **kwargs):
    """:func:`single_prefill_with_kv_cache` with ``return_lse=True`` by default: returns (out
    ``[qo_len, Hq, D_vo]``, lse float32 ``[qo_len, Hq]``); a ``return_lse=False`` keyword
    wins, as over FlashInfer's ``functools.partial`` (out only). """
    kwargs.setdefault("return_lse", True)
    return single_prefill_with_kv_cache(*args, **kwargs)


single_prefill_with_kv_cache_return_lse.__doc__ += _LSE_DOC


# --------------------------------------------------------------------------------------------
# batch wrappers: shared plan / run machinery
# --------------------------------------------------------------------------------------------
def _check_fixed_split_size(fixed_split_size) -> int | None:
    """FlashInfer's fixed_split_size: a positive int (pages per KV chunk; ragged: keys), or
    None, 0 or a negative int (off: FlashInfer plans ``fixed_split_size or -1`` and splits for
    a value > 0 only)."""
    if fixed_split_size is None:
        return None
    if isinstance(fixed_split_size, bool) or not isinstance(fixed_split_size, int):
        raise ValueError(f"fixed_split_size: got {fixed_split_size!r}; pass a positive int "
                         "(pages per KV chunk; ragged: keys), or None / -1 for the default plan")
    return fixed_split_size if fixed_split_size > 0 else None


def _check_uniform_q_len(uniform_q_len, qo_h: torch.Tensor) -> None:
    """FlashInfer's uniform_q_len: None, or a promise that every request has that many query
    rows (0 or less: no promise). A promise that qo_indptr (a host copy) breaks is a ValueError."""
    if uniform_q_len is None:
        return
    if isinstance(uniform_q_len, bool) or not isinstance(uniform_q_len, int):
        raise TypeError(f"uniform_q_len: got {uniform_q_len!r}; pass an int or None")
    lens = qo_h[1:] - qo_h[:-1]
    if uniform_q_len > 0 and lens.numel() and not bool((lens == uniform_q_len).all()):
        raise ValueError(f"uniform_q_len={uniform_q_len} does not describe this batch (query "
                         f"lengths {int(lens.min())}..{int(lens.max())}); pass None, or the "
                         "length every request has")


def _check_plan_args(args: dict, qo_h: torch.Tensor) -> None:
    """The batch plan arguments compiled_attn refuses or only checks: multi-item scoring
    (NotImplementedError), disable_split_kv's type, uniform_q_len's promise (fixed_split_size:
    _check_fixed_split_size)."""
    multi = "multi-item scoring (prefix_len_ptr / token_pos_in_items_* / max_item_len_ptr)"
    for name in ("prefix_len_ptr", "token_pos_in_items_ptr", "max_item_len_ptr"):
        V.reject_if_set(name, args[name], f"{multi} is not supported")
    if args["token_pos_in_items_len"] != 0:
        V.unsupported("token_pos_in_items_len", f"{multi} is not supported; leave it 0")
    disable_split_kv = args["disable_split_kv"]
    try:  # a bool, or an integer taken as one (FlashInfer hands it to its C++ plan as a bool)
        args["disable_split_kv"] = bool(operator.index(disable_split_kv))
    except TypeError:
        raise TypeError(f"disable_split_kv: got {disable_split_kv!r}; pass a bool") from None
    _check_uniform_q_len(args["uniform_q_len"], qo_h)


def _check_length_hints(args: dict, qo_lens: list, kv_lens: list) -> None:
    """Optional lengths given for other backends (seq_lens, seq_lens_q) must agree with the
    index arrays' (qo_lens, kv_lens: lists [B]), and the bounds (max_token_per_sequence,
    max_sequence_kv) must hold."""
    for name, have in (("seq_lens", kv_lens), ("seq_lens_q", qo_lens)):
        if args[name] is not None:
            g = V.host_copy(name, args[name]).reshape(-1).tolist()
            if g != have:
                raise ValueError(f"{name}: {g} disagrees with the lengths the index arrays "
                                 f"give, {have}; pass None or the same lengths")
    for name, have in (("max_token_per_sequence", qo_lens), ("max_sequence_kv", kv_lens)):
        bound = args[name]
        if bound is not None and have and int(bound) < max(have):
            raise ValueError(f"{name} = {bound} is below the longest request's "
                             f"{max(have)}; pass None or an upper bound")


def _plan_mask(args: dict, qo_lens: list, kv_lens: list):
    """(mask_mode, packed mask bytes or None, int32 byte offsets [B+1] or None) of a batch
    plan (qo_lens, kv_lens: lists [B]): custom masks packed per request, each request's
    segment padded to whole bytes."""
    custom_mask, packed_custom_mask = args["custom_mask"], args["packed_custom_mask"]
    if packed_custom_mask is None and custom_mask is None:
        return (MASK_CAUSAL if args["causal"] else MASK_NONE), None, None
    mask_bits = list(map(operator.mul, qo_lens, kv_lens))
    if packed_custom_mask is not None:
        byte_ptr = _byte_offsets(mask_bits)
        packed = V.mask_packed_length(
            "packed_custom_mask", packed_custom_mask, byte_ptr[-1],
            "sum over requests of ceil(qo_len * kv_len / 8): each request's bits start "
            "on a new byte")
    else:
        V.mask_bool_length("custom_mask", custom_mask, sum(mask_bits),
                           "sum over requests of qo_len * kv_len, each request's "
                           "[qo_len, kv_len] mask flattened row-major")
        src, byte_ptr = _segment_bit_sources(mask_bits, custom_mask.device)
        packed = _pack_from_sources(custom_mask, src, "little")
    return MASK_CUSTOM, packed, int32_host(byte_ptr)


class _Plan:
    """What plan() fixed: host numbers (never device values) and device tensors for the op."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


# A paged plan's decode key chunks (BatchPrefillWithPagedKVCacheWrapper._plan_chunks): the
# chunk requests' index arrays and work list, each chunk row's query row (the op's row map),
# the merge rows.
_CHUNK_FIELDS = ("chunk_qo_indptr", "chunk_kv_indptr", "chunk_last_page_len", "chunk_work",
                 "chunk_src", "chunk_merge")


# Plan fields that run() never reads for a launch: the requests' lengths (the plan's work lists
# and index arrays hold them on the device) and the largest page index, which run() checks
# against the cache before any replay (BatchPrefillWithPagedKVCacheWrapper.run)
_PLAN_ONLY = frozenset({"qo_lens", "kv_lens", "max_page"})


def same_launches(a: dict, b: dict, plan_only: frozenset,
                  same_object: tuple = (torch.Tensor,)) -> bool:
    """Whether run() launches for a plan of fields b as for one of fields a, so that calls
    bound for a replay for b: every field but plan_only's the same, values of the
    same_object types as the same objects (tensors: their contents the device's business),
    other values equal and of one type."""
    if a.keys() != b.keys():
        return False
    for k, x in a.items():
        y = b[k]
        if x is y or k in plan_only:  # (most fields: a reused option, a kept tensor, None)
            continue
        if (isinstance(x, same_object) or isinstance(y, same_object)
                or type(x) is not type(y) or x != y):
            return False
    return True


def table_with_room(idx_h: torch.Tensor, have: int | None, b: int,
                    page_size: int) -> torch.Tensor:
    """A re-plan's page table idx_h ``[n]`` (host; b requests), padded with page 0 to the
    length ``have`` of the last plan's table where that holds it, is not over twice as long,
    and launches as a table of n entries (choose.page_table_capacity); else, once the table
    outgrows it, to about n + n / 2 (at least 64 more): requests grow a page now and then,
    and a table of the same length is written into the last one's tensor (to_device's into),
    keeping the calls bound to it; growing by half, a table that grows k-fold takes about
    log(k) / log(1.5) new tensors (each costs the step's first run() a recording). The first
    plan's table (have None), and an empty one, are exact. The kernels read only the
    requests' entries; the tail is a valid page for the traced checks of the whole table."""
    n = idx_h.numel()
    if have is None or n == 0:
        return idx_h
    if not (n <= have <= 2 * n + 64
            and page_table_capacity(n, have, page_size, b) == have):
        have = page_table_capacity(n, n + max(n // 2, 64), page_size, b)
    return idx_h if have == n else torch.cat([idx_h, idx_h.new_zeros(have - n)])


def _cache_pages(paged_kv_cache) -> int | None:
    """The pages of a paged cache argument (a tensor or a (k, v) pair: dim 0 in either
    layout), or None for anything else (the full path names what is wrong)."""
    c = paged_kv_cache[0] if isinstance(paged_kv_cache, (tuple, list)) and paged_kv_cache \
        else paged_kv_cache
    return c.shape[0] if isinstance(c, torch.Tensor) and c.dim() else None


def pages_fit(max_page: V.LargestPage | None, paged_kv_cache) -> bool:
    """Whether a plan's largest page index (V.check_page_table's, None without pages) is
    inside the cache argument, or nothing says it is not (a cache argument the full path will
    name as wrong): a replay skips run()'s checks, and its key does not hold the plan's page
    indices."""
    pages = _cache_pages(paged_kv_cache)
    return pages is None or max_page is None or max_page.value < pages


def _chunks_exact(p: _Plan, window_left: int, sinks) -> bool:
    """Whether a decode batch cut into key chunks computes plan p's attention exactly, on the
    Gluon kernel where it reads the pages (ops.decode_chunks.exact)."""
    return _chunks.exact(custom_mask=p.mask_mode == MASK_CUSTOM, window_left=window_left,
                         pos_encoding_mode=p.pos_encoding_mode,
                         logits_soft_cap=p.logits_soft_cap, sinks=sinks,
                         dtypes=(p.q_dtype, p.kv_dtype, p.o_dtype))


class _WrapperBase:
    """What every FlashInfer-style wrapper has: the workspace buffers (which only fix the
    device) and the CUDA-graph flag."""

    @property
    def is_cuda_graph_enabled(self) -> bool:
        """Whether the wrapper was built with use_cuda_graph=True (fixed batch size, plan()
        copies into the caller's buffers, run() capturable)."""
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer: torch.Tensor,
                               int_workspace_buffer: torch.Tensor | None = None) -> None:
        """Replace the workspace buffers: float_workspace_buffer and int_workspace_buffer,
        uint8 ``[bytes]`` tensors (any size) on the wrapper's device. compiled_attn keeps its
        plan in its own tensors and allocates split-KV partials per run, so the buffers only fix
        the device; they must stay on it."""
        for name, buf in (("float_workspace_buffer", float_workspace_buffer),
                          ("int_workspace_buffer", int_workspace_buffer)):
            if buf is not None:
                V.check_tensor(name, buf, device=self.device)
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = int_workspace_buffer

    def end_forward(self) -> None:
        """Deprecated in FlashInfer; nothing to release."""

    # the host arrays the wrapper's plans last sent to the device, by name (_send)
    _sent: dict | None = None

    def _send(self, arrays: dict, non_blocking: bool, into: dict | None) -> dict:
        """_host.to_device of a plan's host arrays ({name: host array or None}), into the
        last plan's tensors ``into`` by name where shapes match; an array holding the values
        the wrapper last sent under its name is not copied again (to_device's sent; e.g. a
        decode step's page table until a request takes a new page). The record is by name
        over every call, so a plan may send its arrays in several calls of distinct names."""
        sent = self._sent
        self._sent = {**(sent or {}), **arrays}
        return to_device(arrays, self.device, non_blocking, into, sent)


def _copy_padded(buf: torch.Tensor, src: torch.Tensor, fill, non_blocking: bool):
    """buf's first len(src) entries (rows) become src and every later one ``fill`` (a number
    for a 1-D buf, a row for a 2-D one): a CUDA-graph buffer re-planned in place, by fills on
    its device (no host copy to wait for). Returns buf."""
    n = src.shape[0]
    buf[:n].copy_(src.reshape(n, *buf.shape[1:]).to(buf.dtype), non_blocking=non_blocking)
    if n < buf.shape[0]:
        tail = buf[n:]
        if buf.dim() == 1:
            tail.fill_(fill)
        else:
            for j, v in enumerate(fill):
                tail[:, j].fill_(v)
    return buf


class _BatchPrefillBase(_WrapperBase):
    """Plan bookkeeping and run plumbing shared by the paged and ragged wrappers.

    Subclasses describe the KV side: ``_KV_BUFS`` names the index buffers their CUDA-graph
    constructor takes (besides qo_indptr_buf and the mask buffers)."""

    _KV_BUFS: tuple[str, ...] = ()

    def _init_common(self, float_workspace_buffer, kv_layout, use_cuda_graph, index_bufs: dict,
                     custom_mask_buf, mask_indptr_buf, backend, jit_args, jit_kwargs,
                     variant_owns_mask):
        V.check_tensor("float_workspace_buffer", float_workspace_buffer)
        V.check_backend(backend)
        V.reject_if_set("jit_args", jit_args, "custom JIT attention variants are not supported")
        V.reject_if_set("jit_kwargs", jit_kwargs, "custom JIT attention variants are not "
                        "supported")
        V.reject_if_set("variant_owns_mask", variant_owns_mask, "a mask computed by a custom "
                        "JIT attention variant needs jit_args, which are not supported; pass "
                        "False and a custom_mask / packed_custom_mask to plan()", default=False)
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = None
        self.device = float_workspace_buffer.device
        self._kv_layout = V.check_kv_layout(kv_layout)
        self._backend = backend
        self._use_cuda_graph = bool(use_cuda_graph)
        self._plan: _Plan | None = None
        # the plan a plan() in progress retired when it began writing into its tensors
        # (_to_device); _set_plan compares the new plan with it
        self._retired: _Plan | None = None
        # the last plan's (PlanOptions, its fields): _plan_common reuses them
        self._options = LastOptions()
        self._bufs: dict[str, torch.Tensor] = {}
        self._work_buf: torch.Tensor | None = None
        # CUDA-graph mode with split KV (the first plan's tiles leave SMs idle): the merge
        # rows' buffer (_graph_tensors)
        self._merge_buf: torch.Tensor | None = None
        self._max_total_rows: int | None = None
        # CUDA-graph mode: ((group, D_qk, D_vo), tile height) of the first plan, which fixed
        # the work buffer (_graph_tensors)
        self._graph_tile: tuple | None = None
        # CUDA-graph mode, paged: the decode key chunks' buffers (a dict), or False where the
        # first plan was not cut; None before it (BatchPrefillWithPagedKVCacheWrapper._plan_chunks)
        self._chunk_bufs = None
        if not self._use_cuda_graph:
            return
        # CUDA-graph mode: plan() copies into these fixed buffers; run() passes them to the op.
        for name, buf in index_bufs.items():
            if not torch.is_tensor(buf):
                raise ValueError(f"{name}: use_cuda_graph=True needs this buffer as an int32 "
                                 "tensor on the workspace's device (plan() copies into it)")
            V.check_tensor(name, buf, ndim=1, dtypes=(torch.int32,), device=self.device)
        self._fixed_batch_size = index_bufs["qo_indptr_buf"].numel() - 1
        b = self._fixed_batch_size
        for name, buf in index_bufs.items():
            want = {"indptr": b + 1, "last_page_len": b}.get(
                "indptr" if name.endswith("indptr_buf") else
                "last_page_len" if "last_page_len" in name else "", None)
            if want is not None and buf.numel() != want:
                raise ValueError(f"{name}: has {buf.numel()} entries; with qo_indptr_buf of "
                                 f"{b + 1} entries (batch size {b}) it needs {want}")
        if custom_mask_buf is not None:
            V.check_tensor("custom_mask_buf", custom_mask_buf, ndim=1, dtypes=(torch.uint8,),
                           device=self.device)
        if mask_indptr_buf is not None:
            V.check_tensor("mask_indptr_buf", mask_indptr_buf, shape=(b + 1,),
                           dtypes=(torch.int32,), device=self.device)
        self._bufs = dict(index_bufs, custom_mask_buf=custom_mask_buf,
                          mask_indptr_buf=mask_indptr_buf)

    # ---- plan ---------------------------------------------------------------------------
    def _into_buf(self, name: str, src: torch.Tensor, non_blocking: bool, fill: int = 0):
        """Copy src into the caller's CUDA-graph buffer `name` (size checked); the tail past
        src is filled with `fill` (a valid value: page 0, no mask bit) so nothing reads junk."""
        self._check_bufs({name: src.numel()})
        return _copy_padded(self._bufs[name], src, fill, non_blocking)

    def _check_batch(self, b: int) -> None:
        """A CUDA-graph plan's batch size is the buffers' (checked before any buffer's size:
        the indptr buffers hold exactly that many entries, so no larger buffer would do)."""
        if b != self._fixed_batch_size:
            raise ValueError(f"qo_indptr: batch size {b} differs from the {self._fixed_batch_size} "
                             "the CUDA-graph buffers were made for; the batch size is fixed "
                             "with use_cuda_graph=True (pad with empty requests)")

    def _check_bufs(self, needs: dict) -> None:
        """Each CUDA-graph buffer of ``needs`` ({name: entries}) exists and holds that many.
        A plan checks them all before it writes any buffer: a plan that fails leaves the
        wrapper's last plan (whose tensors are these buffers) as it was."""
        for name, n in needs.items():
            buf = self._bufs[name]
            if buf is None:
                raise ValueError(f"{name}: the plan uses a custom mask, so use_cuda_graph=True "
                                 f"needs {name} passed to the constructor")
            if n > buf.numel():
                raise ValueError(f"{name}: holds {buf.numel()} entries but this plan needs "
                                 f"{n}; allocate a larger buffer when constructing the wrapper")

    def _plan_common(self, args: dict, qo_h: torch.Tensor, kv_list: list, *,
                     paged: bool, page_size: int = 0, kv_arrays: dict) -> _Plan:
        """Everything plan() does that does not depend on how KV is addressed. args: the
        plan()'s arguments by FlashInfer name; qo_h: host qo_indptr (checked, int32 or int64);
        kv_list: the requests' keys, a list [B]; page_size: the paged cache's (0: ragged);
        kv_arrays: the subclass's checked host index arrays ({plan field: tensor}), which
        outside CUDA-graph mode go to the device with the plan's own (in CUDA-graph mode the
        subclass copies them into its buffers)."""
        _check_plan_args(args, qo_h)
        def make():
            o = PlanOptions.of_batch(args, self.device.type)
            return o, o.fields()

        # (a serving step re-plans with the same options: the previous plan's are reused)
        opts, fields = self._options.get(
            options_key(args, BATCH_OPTION_ARGS, self.device.type), make)
        # (the lengths as lists: each torch op on a small host tensor costs microseconds)
        qo_v = qo_h.tolist()
        total_rows = qo_v[-1]
        qo_list = V.lengths(qo_v)
        if total_rows * opts.group >= 2 ** 31:  # (the work list's rows are int32)
            raise ValueError(f"qo_indptr: {total_rows} query rows of {opts.group} heads a "
                             "KV head exceed the int32 row range of the kernels' work list; "
                             "split the batch")
        split_size = _check_fixed_split_size(args["fixed_split_size"])
        # FlashInfer: disable_split_kv=True wins over a fixed split size.
        fixed = split_size is not None and not args["disable_split_kv"]
        if fixed and self._use_cuda_graph:
            V.unsupported("fixed_split_size", "with use_cuda_graph=True: CUDA-graph plans size "
                          "their KV splits once, at the first plan (few long requests split "
                          "over the SMs), not in fixed-size chunks; pass None (such plans take "
                          "one tile height for every batch) or plan without CUDA graphs")
        _check_length_hints(args, qo_list, kv_list)
        mask_mode, packed, mask_indptr = _plan_mask(args, qo_list, kv_list)
        # CUDA-graph plans keep the first plan's tile height for every re-plan (the captured
        # launch is fixed): the one for any key length, or (POLICY.graph_decode_tile) decode
        # rows' where the first plan's requests are decode rows. Fixed-split plans take the
        # tile for any batch: a request's tiles must not depend on the rest of the batch.
        b = len(qo_list)
        max_kv = None if self._use_cuda_graph or fixed or b == 0 else max(kv_list)
        shape_key = (opts.group, opts.head_dim_qk, opts.head_dim_vo, opts.num_kv_heads)
        if self._use_cuda_graph and self._graph_tile and self._graph_tile[0] == shape_key:
            block_m = self._graph_tile[1]
        else:
            rows = not fixed and (POLICY.graph_decode_tile or not self._use_cuda_graph)
            block_m = block_m_for(opts.head_dim_qk, opts.head_dim_vo, opts.group, max_kv,
                                  mask_mode != MASK_NONE, paged, page_size=page_size,
                                  qo_lens=qo_list if rows else None, kv_dtype=opts.kv_dtype)
        work = build_work(qo_list, opts.group, block_m, "cpu", kv_lens=kv_list)
        non_blocking = args["non_blocking"]
        if self._use_cuda_graph:
            tensors = self._graph_tensors(qo_h, shape_key, block_m, work, packed, mask_indptr,
                                          non_blocking, kv_lens=kv_list,
                                          num_kv_heads=opts.num_kv_heads,
                                          disable_split_kv=args["disable_split_kv"])
        else:
            chunk_keys = split_size * max(page_size, 1) if fixed else None
            tensors = self._plan_tensors(qo_h, qo_list, kv_list, opts, block_m, work, packed,
                                         mask_indptr, args["disable_split_kv"], non_blocking,
                                         chunk_keys, mask_mode == MASK_CAUSAL, kv_arrays)
        old = self._last_plan()
        if opts.pos_encoding_mode != POS_ALIBI:
            alibi = None
        elif old is not None and old.alibi is not None and old.num_qo_heads == opts.num_qo_heads:
            alibi = old.alibi  # (the slopes depend on the head count alone)
        else:
            alibi = get_alibi_slopes(opts.num_qo_heads, self.device)
        return _Plan(batch_size=b, total_rows=total_rows, qo_lens=qo_list, kv_lens=kv_list,
                     block_m=block_m, mask_mode=mask_mode, alibi=alibi, **tensors, **fields)

    def _graph_split_sms(self) -> int | None:
        """The SM count plans size their KV splits for (None: this device never splits: plans
        split on CUDA devices only)."""
        return sm_count(self.device.index) if self.device.type == "cuda" else None

    def _graph_tensors(self, qo_h, shape_key: tuple, block_m: int, work, packed, mask_indptr,
                       non_blocking: bool, *, kv_lens: list, num_kv_heads: int,
                       disable_split_kv: bool) -> dict:
        """The plan's device tensors in CUDA-graph mode: copies into the constructor's buffers
        and into a work buffer sized at the first plan (padding rows are request -1).
        shape_key: (group, D_qk, D_vo, Hkv). Where the first plan's tiles (at most, for its rows)
        leave most SMs idle (schedule.chunks_wanted) and it does not pass disable_split_kv,
        every plan of the wrapper splits KV as an eager plan would (build_split_work) into
        buffers sized for any plan within that capacity (schedule.split_capacity), its merge
        rows padded with request -1: a captured decode of few long requests then runs on
        every SM."""
        group = shape_key[0]
        b, total_rows = qo_h.numel() - 1, int(qo_h[-1])
        self._check_batch(b)
        needs = {"qo_indptr_buf": qo_h.numel()}
        if packed is not None:
            needs.update(custom_mask_buf=packed.numel(), mask_indptr_buf=mask_indptr.numel())
        self._check_bufs(needs)
        if self._max_total_rows is not None and total_rows > self._max_total_rows:
            raise ValueError(f"qo_indptr: {total_rows} query rows exceed the "
                             f"{self._max_total_rows} of the first plan, which fixed the "
                             "CUDA-graph capacity; make the first plan() the largest batch")
        if self._graph_tile is not None and (shape_key, block_m) != self._graph_tile:
            raise ValueError("num_qo_heads / num_kv_heads / head dims changed since the first "
                             "plan in CUDA-graph mode; create a new wrapper for new shapes")
        if self._max_total_rows is None:
            # The first plan fixes the row capacity (as in FlashInfer); the work buffer is
            # sized for any plan within it: sum_b ceil(x_b / m) <= (X + B (m - 1)) // m.
            self._max_total_rows = total_rows
            cap = (total_rows * group + b * (block_m - 1)) // block_m
            sms = None if disable_split_kv else self._graph_split_sms()
            if sms is not None and chunks_wanted(cap * num_kv_heads, sms) > 1:
                self._merge_buf = torch.empty((max(cap, 1), 4), dtype=torch.int32,
                                              device=self.device)
                rows = split_capacity(cap, num_kv_heads, sms)
            else:
                rows = cap
            self._work_buf = torch.empty((max(rows, 1), 2 if self._merge_buf is None else 4),
                                         dtype=torch.int32, device=self.device)
            self._graph_tile = (shape_key, block_m)
        mb, wb = self._merge_buf, self._work_buf
        if mb is not None:
            # (disable_split_kv: one chunk a tile, chunk columns kept for the captured launch)
            work, merge = build_split_work(
                (qo_h[1:] - qo_h[:-1]).tolist(), kv_lens, group, block_m, num_kv_heads, "cpu",
                num_sms=self._graph_split_sms(), max_chunks=1 if disable_split_kv else MAX_CHUNKS,
                tiles=work)
            if merge is None:
                merge = torch.empty((0, 4), dtype=torch.int32)
            if merge.shape[0] > mb.shape[0]:  # cannot happen: a merge row per split tile
                raise AssertionError("merge rows exceed their computed capacity")
            _copy_padded(mb, merge, (-1, 0, 0, 0), non_blocking)
        if work.shape[0] > wb.shape[0]:  # cannot happen by the bounds above
            raise AssertionError("work list exceeds its computed capacity")
        # Padding rows (request -1; a chunk 0 of 1) are skipped by the kernel.
        _copy_padded(wb, work, (-1, 0) if wb.shape[1] == 2 else (-1, 0, 0, 1), non_blocking)
        qo_dev = self._into_buf("qo_indptr_buf", qo_h, non_blocking)
        if packed is not None:
            packed_dev = self._into_buf("custom_mask_buf", packed.reshape(-1), non_blocking)
            mask_indptr_dev = self._into_buf("mask_indptr_buf", mask_indptr, non_blocking)
        else:
            packed_dev = mask_indptr_dev = None
        return dict(qo_indptr=qo_dev, work=wb, merge=mb, packed_mask=packed_dev,
                    mask_indptr=mask_indptr_dev)

    def _plan_tensors(self, qo_h, qo_lens: list, kv_lens: list, opts: PlanOptions,
                      block_m: int, work, packed, mask_indptr, disable_split_kv: bool,
                      non_blocking: bool, chunk_keys: int | None, causal: bool,
                      kv_arrays: dict) -> dict:
        """The plan's device tensors outside CUDA-graph mode, kv_arrays' (_plan_common's) among
        them (_host.to_device); qo_lens / kv_lens: the requests' lengths. chunk_keys
        (fixed_split_size): batch-invariant KV chunks of that many keys (build_split_work's
        chunk_keys; the work list keeps its chunk columns even where no tile splits, so every
        such plan runs the same kernel: the Gluon kernel takes no split plan). Else
        disable_split_kv=True is honoured: the plan then never splits KV; otherwise a CUDA plan
        splits long key ranges where the tiles would leave SMs idle (few query rows, long
        keys)."""
        merge = None
        if chunk_keys is not None:
            work, merge = build_split_work(qo_lens, kv_lens, opts.group, block_m,
                                           opts.num_kv_heads, "cpu", chunk_keys=chunk_keys,
                                           causal=causal, tiles=work)
        elif (self.device.type == "cuda" and not disable_split_kv
              and chunks_wanted(work.shape[0] * opts.num_kv_heads, self._graph_split_sms())
              > 1):  # (else build_split_work would cut no tile: the work list stays as it is)
            work, merge = build_split_work(qo_lens, kv_lens, opts.group, block_m,
                                           opts.num_kv_heads, "cpu",
                                           num_sms=self._graph_split_sms(), tiles=work)
            if merge is None:
                work = work[:, :2].contiguous()
        dev = self._to_device(dict(qo_indptr=qo_h, work=work, merge=merge,
                                   mask_indptr=mask_indptr, **kv_arrays), non_blocking)
        old = self._retired  # (set by _to_device where there was a plan)
        dev["packed_mask"] = None if packed is None else copy_to(
            packed, self.device, packed.dtype, non_blocking, old and old.packed_mask)
        return dev

    def _last_plan(self) -> _Plan | None:
        """The wrapper's last plan: the current one, or the one a plan() in progress (or one
        that raised) retired (_to_device; at most one of the two is set)."""
        return self._plan if self._plan is not None else self._retired

    def _to_device(self, arrays: dict, non_blocking: bool) -> dict:
        """_host.to_device of a plan's host arrays, into the current plan's tensors where
        shapes match (outside CUDA-graph mode, whose buffers are fixed anyway): a re-plan of
        the same shapes keeps its tensors and so (_set_plan) its bound launches. The current
        plan is retired first: its tensors now hold the new plan's values, so if this plan()
        raised later, run() would say there is no plan rather than compute the old one on
        them. The copies are ordered on the current stream after the runs queued there, as
        FlashInfer's plan() writes its workspace."""
        if self._plan is not None:
            self._retired, self._plan = self._plan, None
        return self._send(arrays, non_blocking,
                          None if self._retired is None else self._retired.__dict__)

    def _forward_options(self, *, causal, pos_encoding_mode, use_fp16_qk_reduction,
                         window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta) -> None:
        """FlashInfer's deprecated forward(): its options replace the plan's, for that call and
        every later run() (as FlashInfer sets them on the wrapper). They are run-time scalars of
        the op, so the plan's work list and tiles stay (they hold for any mask); a planned
        custom mask still replaces causal."""
        p = self._plan
        if p is None:
            raise RuntimeError("forward() before plan(): call plan(...) with the batch's index "
                               "arrays first")
        opts = scalar_options(head_dim_qk=p.head_dim_qk, pos_encoding_mode=pos_encoding_mode,
                               sm_scale=sm_scale, window_left=window_left,
                               logits_soft_cap=logits_soft_cap, rope_scale=rope_scale,
                               rope_theta=rope_theta,
                               use_fp16_qk_reduction=use_fp16_qk_reduction)
        mask_mode = (p.mask_mode if p.mask_mode == MASK_CUSTOM else
                     MASK_CAUSAL if causal else MASK_NONE)
        alibi = (get_alibi_slopes(p.num_qo_heads, self.device)
                 if opts["pos_encoding_mode"] == POS_ALIBI else None)
        self._set_plan(_Plan(**{**p.__dict__, **opts, "mask_mode": mask_mode, "alibi": alibi}))

    def _set_plan(self, p: _Plan) -> None:
        """Take plan p; run() replays launches bound for it (its tensors keyed by identity).
        Where p launches as the plan before it (same_launches: the same tensors, written
        anew, and the same values but the lengths), the launches bound for that plan are
        kept: a serving step's first run() after plan() then replays too."""
        old, self._retired = self._last_plan(), None
        if old is None or not same_launches(old.__dict__, p.__dict__, _PLAN_ONLY):
            self._memo = LaunchCache(static=p.__dict__.values())
        self._plan = p

    def _bound(self, inputs: tuple, return_lse: bool, full):
        """run() with default options as a bound launch (op_call.bound_run): full() returns
        (out, lse)."""
        if self._plan is None:
            return full()[0]  # (raises: run() before plan())
        out, lse = bound_run(self._memo, inputs, (), full, discard=() if return_lse else (1,))
        return (out, lse) if return_lse else out

    # ---- run -----------------------------------------------------------------------------
    def _rows_ok(self, what: str, n: int, indptr: str, total: str,
                 at_least: bool = False) -> bool:
        """Whether the n rows of argument ``what`` hold the plan's ``indptr``[-1] (its host
        count ``total``): exactly, or at least with use_cuda_graph=True or ``at_least``
        (V.rows_match: traced, a device assert)."""
        p = self._plan  # (traced, the host count is not read: it would be a guard)
        return V.rows_match(what, n, indptr, getattr(p, indptr),
                            None if V.traced() else getattr(p, total),
                            at_least=at_least or self._use_cuda_graph)

    def _rows_end(self) -> torch.Tensor | None:
        """_deliver's end: the plan's qo_indptr[-1] with use_cuda_graph=True (q may have more
        rows than the plan, which the kernel leaves unwritten), else None (q has exactly its
        rows)."""
        return self._plan.qo_indptr[-1:] if self._use_cuda_graph else None

    def _check_q(self, q: torch.Tensor) -> _Plan:
        p = self._plan
        if p is None:
            raise RuntimeError("run() before plan(): call plan(...) with the batch's index "
                               "arrays first")
        V.check_tensor("q", q, ndim=3, device=self.device, what="[qo_indptr[-1], Hq, D_qk]")
        rows_ok = self._rows_ok("q", q.shape[0], "qo_indptr", "total_rows")
        if tuple(q.shape[1:]) != (p.num_qo_heads, p.head_dim_qk) or not rows_ok:
            need = ("qo_indptr[-1]" if V.traced() else f">= {p.total_rows}"
                    if self._use_cuda_graph else str(p.total_rows))
            raise ValueError(f"q: shape {tuple(q.shape)} does not match the plan: "
                             f"[{need}, {p.num_qo_heads}, {p.head_dim_qk}] "
                             "(qo_indptr[-1], num_qo_heads, head_dim_qk); re-plan for new shapes")
        if q.dtype != p.q_dtype:
            raise TypeError(f"q: dtype {q.dtype} but the plan has q_data_type={p.q_dtype}; pass "
                            f"q_data_type={q.dtype} to plan()")
        return p

    def _check_kv_dtype(self, name: str, t: torch.Tensor, p: _Plan) -> None:
        if t.dtype != p.kv_dtype:
            raise TypeError(f"{name}: dtype {t.dtype} but the plan has kv_data_type="
                            f"{p.kv_dtype}; pass kv_data_type={t.dtype} to plan()")
        V.check_tensor(name, t, device=self.device)

    def _run_scalars(self, p: _Plan, *, args, q_scale, k_scale, v_scale, o_scale, enable_pdl,
                     kv_cache_sf, window_left):
        if args:
            V.unsupported("*args", "extra positional arguments (custom-kernel tensors / per-head "
                          "fp8 scales) are not supported")
        V.reject_if_set("kv_cache_sf", kv_cache_sf, "NVFP4 KV caches are not supported")
        V.check_enable_pdl(enable_pdl)
        if o_scale is not None and V.host_scale("o_scale", o_scale) != 1.0:
            V.unsupported("o_scale", "fp8 output quantisation is not supported; leave o_scale "
                          "None (or 1.0)")
        sm = V.fits_float32("sm_scale * q_scale * k_scale", p.sm_scale * V.host_scale(
            "q_scale", q_scale) * V.host_scale("k_scale", k_scale))
        v_f, v_t = _split_v_scale(v_scale)
        w = p.window_left if window_left is None else V.check_window_left(window_left)
        return sm, v_f, v_t, w


_RUN_DOC = """
        Returns out ``[qo_indptr[-1], Hq, D_vo]`` in the plan's o_data_type, and with
        return_lse=True also lse float32 ``[qo_indptr[-1], Hq]`` (lse_layout "NH", the
        default) or its contiguous transpose ``[Hq, qo_indptr[-1]]`` ("HN"), in base 2
        (lse_base "log2", the default) or natural log ("ln"). out / lse: optional
        preallocated outputs of those shapes (written and returned). q_scale and k_scale (float
        or one-element CPU tensor) multiply sm_scale; v_scale multiplies the output, not the
        LSE (a one-element device tensor is applied on the device). enable_pdl: None/False
        (True raises). run() reads no device value, so it is CUDA-graph capturable.
        """ + _LSE_DOC


_PLAN_COMMON_DOC = """
        num_qo_heads, num_kv_heads: Hq % Hkv == 0 (GQA groups of any size). head_dim_qk,
        head_dim_vo (default head_dim_qk): on CUDA each a multiple of 8 from 16 to 256, or 512
        (any pair of them), on CPU any. custom_mask: bool (an integer type: nonzero attends),
        each request's ``[qo_len, kv_len]`` mask flattened row-major and concatenated
        (``sum(qo_len * kv_len)`` entries); or
        packed_custom_mask: uint8, the same bits packed per request with
        ``segment_packbits(mask, indptr, bitorder="little")`` (each request starts on a new
        byte; ``sum(ceil(qo_len * kv_len / 8))`` bytes). A mask replaces causal; the window
        still applies; a mask of the wrong length is a ValueError.
        causal: bottom-right aligned (row i of a request sits at ``kv_len - qo_len + i``);
        kv_len < qo_len is allowed (rows that see no key give 0 / LSE -inf).
        pos_encoding_mode "NONE"/"ROPE_LLAMA"/"ALIBI" (ALiBi with absolute positions; see
        single_prefill_with_kv_cache for the LSE difference to FlashInfer). window_left >= -1,
        logits_soft_cap >= 0 (None = 0), sm_scale (default 1/sqrt(head_dim_qk)), rope_scale (1),
        rope_theta (1e4); a window of 2^31 - 1 keys or more is no window (-1), and sm_scale,
        logits_soft_cap, rope_scale, rope_theta beyond float32's range raise (the kernel
        computes them in float32). q_data_type / kv_data_type / o_data_type: dtypes run()
        must get (kv may be fp8). use_fp16_qk_reduction: a permission (we reduce in fp32).
        non_blocking: asynchronous host-to-device copies. seq_lens / seq_lens_q, if given, must
        equal the lengths of the index arrays; max_token_per_sequence / max_sequence_kv, if
        given, must bound them; so must uniform_q_len (FlashInfer's promise that every request
        has that many query rows, a tile-sizing hint for its CUDA-graph planner: ours sizes tiles
        from the lengths themselves, so a hint that holds changes nothing, and one that does not is
        a ValueError, where FlashInfer warns and drops it). disable_split_kv: True keeps every
        tile's keys in one program (on CUDA outside CUDA-graph mode the plan otherwise splits long
        key ranges when the tiles would leave SMs idle, a choice that depends on the whole batch; a
        paged decode batch, one query row a request, on a Hopper GPU is then cut into key chunks
        that run() launches as one-row requests and merges by LSE; with use_cuda_graph=True the
        first plan decides whether every plan of the wrapper is).
        fixed_split_size (FlashInfer's batch-invariant mode; pages, ragged: keys; ignored with
        disable_split_kv=True, as in FlashInfer): each tile's key range is cut into
        ceil(keys / (fixed_split_size * page_size)) chunks of whole key blocks, and the tile
        height no longer depends on the batch's longest request, so a request's output and LSE
        do not depend on the rest of the batch (bit for bit); with use_cuda_graph=True it
        raises NotImplementedError. The multi-item-scoring arguments raise
        NotImplementedError.
        With use_cuda_graph=True the index arrays are copied into the constructor's buffers
        (sizes checked) and the work list into a fixed buffer sized at the first plan, whose
        total query rows become the capacity (as in FlashInfer); padding work rows are
        (request -1, row 0). run() then takes q (and ragged k / v) with more rows than the plan
        uses (a captured buffer): output and LSE rows past qo_indptr[-1] belong to no request
        and the kernel does not write them, as in FlashInfer (the CPU reference writes 0 /
        -inf); slice them off. Without it, a re-plan whose index arrays keep their shapes
        writes them into the last plan's device tensors, on the current stream (as FlashInfer's
        plan() writes its workspace): a run() of the last plan queued on another stream must be
        ordered before it.
        """


class BatchPrefillWithPagedKVCacheWrapper(_BatchPrefillBase):
    """Batch prefill/append attention of ragged queries against a paged KV cache.

    Page table: kv_indptr ``[B+1]`` in pages, kv_indices ``[kv_indptr[-1]]``, last_page_len
    ``[B]`` in [1, page_size] (0 allowed for a request without pages); request b holds
    ``kv_len = (pages - 1) * page_size + last_page_len`` tokens, token t in page
    ``kv_indices[kv_indptr[b] + t // page_size]``, slot ``t % page_size``.
    """

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indptr_buf: torch.Tensor | None = None,
                 paged_kv_indices_buf: torch.Tensor | None = None,
                 paged_kv_last_page_len_buf: torch.Tensor | None = None,
                 custom_mask_buf: torch.Tensor | None = None,
                 mask_indptr_buf: torch.Tensor | None = None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None, variant_owns_mask: bool = False) -> None:
        """float_workspace_buffer: any tensor on the device the wrapper runs on (compiled_attn
        needs no scratch; it fixes the device). kv_layout: "NHD" or "HND". use_cuda_graph:
        fixed batch size B; then qo_indptr_buf int32 ``[B+1]``, paged_kv_indptr_buf int32
        ``[B+1]``, paged_kv_indices_buf int32 ``[max pages]``, paged_kv_last_page_len_buf int32
        ``[B]`` are required, custom_mask_buf uint8 ``[max mask bytes]`` and mask_indptr_buf
        int32 ``[B+1]`` when a custom mask will be planned. backend: "auto"/"fa2"/"fa3" (all
        run compiled_attn's kernel). jit_args / jit_kwargs / variant_owns_mask=True (custom
        JIT attention variants) raise NotImplementedError."""
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph,
                          dict(qo_indptr_buf=qo_indptr_buf, paged_kv_indptr_buf=paged_kv_indptr_buf,
                               paged_kv_indices_buf=paged_kv_indices_buf,
                               paged_kv_last_page_len_buf=paged_kv_last_page_len_buf),
                          custom_mask_buf, mask_indptr_buf, backend, jit_args, jit_kwargs,
                          variant_owns_mask)

    def plan(self, qo_indptr: torch.Tensor, paged_kv_indptr: torch.Tensor,
             paged_kv_indices: torch.Tensor, paged_kv_last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim_qk: int, page_size: int,
             head_dim_vo: int | None = None, custom_mask: torch.Tensor | None = None,
             packed_custom_mask: torch.Tensor | None = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             sm_scale: float | None = None, window_left: int = -1,
             logits_soft_cap: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking: bool = True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0,
             max_item_len_ptr=None, seq_lens=None, seq_lens_q=None, block_tables=None,
             max_token_per_sequence=None, max_sequence_kv=None, fixed_split_size=None,
             disable_split_kv: bool = False, uniform_q_len: int | None = None) -> None:
        """Plan a batch: qo_indptr ``[B+1]`` (query rows per request), paged_kv_indptr ``[B+1]``
        (pages per request; it may start past 0), paged_kv_indices ``[>= paged_kv_indptr[-1]]``
        (a pre-allocated buffer may be longer, as in FlashInfer: only entries
        paged_kv_indptr[0] to paged_kv_indptr[-1] are read and checked, so a sub-batch can be
        planned with the whole batch's buffer), paged_kv_last_page_len ``[B]``, all integer,
        on CPU or GPU (read on the host here). page_size >= 1. block_tables (cuDNN layout)
        raises NotImplementedError. With use_cuda_graph=True the entries used are copied to
        the start of paged_kv_indices_buf, which needs room for those only (FlashInfer's
        needs room for the whole argument).
        """
        args = dict(locals())  # the arguments by FlashInfer name, for _plan_common
        V.reject_if_set("block_tables", block_tables, "block tables are a cuDNN-backend input; "
                        "pass the page table (paged_kv_indptr / paged_kv_indices)")
        hosts = gather_host(qo_indptr, paged_kv_indptr, paged_kv_indices,
                            paged_kv_last_page_len)
        qo_h = V.host_indptr("qo_indptr", qo_indptr, hosts=hosts)
        b = qo_h.numel() - 1
        kv_h, idx_h, last_h, kv_lens, max_page = V.page_table(
            ("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"), paged_kv_indptr,
            paged_kv_indices, paged_kv_last_page_len, page_size, length=b + 1,
            length_from="qo_indptr", hosts=hosts)
        if not self._use_cuda_graph:
            idx_h = self._table_with_room(idx_h, b, page_size)
        if self._use_cuda_graph:  # (before _plan_common writes any buffer)
            self._check_batch(b)
            self._check_bufs({"paged_kv_indptr_buf": kv_h.numel(),
                              "paged_kv_indices_buf": idx_h.numel(),
                              "paged_kv_last_page_len_buf": last_h.numel()})
        p = self._plan_common(args, qo_h, kv_lens, paged=True, page_size=page_size,
                              kv_arrays=dict(kv_indptr=kv_h, kv_indices=idx_h,
                                             last_page_len=last_h))
        if self._use_cuda_graph:
            p.kv_indptr = self._into_buf("paged_kv_indptr_buf", kv_h, non_blocking)
            p.kv_indices = self._into_buf("paged_kv_indices_buf", idx_h, non_blocking)
            p.last_page_len = self._into_buf("paged_kv_last_page_len_buf", last_h, non_blocking)
        p.page_size = page_size
        p.max_page = max_page
        p.__dict__.update(self._plan_chunks(p, args, qo_h, kv_h, last_h))
        self._set_plan(p)

    def _table_with_room(self, idx_h: torch.Tensor, b: int, page_size: int) -> torch.Tensor:
        """table_with_room of a re-plan's page table against the last plan's."""
        old = self._last_plan()
        return table_with_room(idx_h, None if old is None else old.kv_indices.numel(), b,
                               page_size)

    def _plan_chunks(self, p: _Plan, args: dict, qo_h, kv_h, last_h) -> dict:
        """Plan p's decode key chunks (_CHUNK_FIELDS; all None where the batch is not cut).
        A plan of decode rows that a split plan would split (neither disable_split_kv nor
        fixed_split_size), with options the chunks compute exactly (_chunks_exact), on a device
        and tile the launch policy cuts for (choose.decode_chunk_sms), cuts each request's pages
        into chunk requests (schedule.build_decode_chunks) that run() launches instead of the
        split plan: one paged launch whose chunk rows read their query rows of q in place (the
        op's row map, chunk_src), then a merge (ops/decode_chunks.py). In CUDA-graph mode the
        first plan decides for the wrapper: if it is cut, every re-plan is (into buffers sized
        at the first plan, padded; one chunk a request where the batch would not be cut), so
        that a captured run() serves it."""
        none = dict.fromkeys(_CHUNK_FIELDS)
        graph = self._use_cuda_graph
        if graph and self._chunk_bufs is False:
            return none
        n = sms = 0
        if not (args["disable_split_kv"]
                or _check_fixed_split_size(args["fixed_split_size"]) is not None
                or not kernel_device(self.device)):
            sms = decode_chunk_sms(p.page_size, p.head_dim_qk, p.head_dim_vo, p.block_m,
                                   p.kv_dtype, plain=_chunks_exact(p, p.window_left, None),
                                   device=device_of(self.device))
            n = sms and planned_chunk_count(p.qo_lens, p.kv_lens, p.num_kv_heads, sms)
        if graph and self._chunk_bufs is None:  # the first plan
            self._chunk_bufs = self._chunk_buffers(p, sms) if n else False
        if not (n or graph and self._chunk_bufs):
            return none
        c = build_decode_chunks(qo_h.tolist(), kv_h.tolist(), last_h.tolist(), p.page_size,
                                n or 1)
        work = build_work((c["qo_indptr"][1:] - c["qo_indptr"][:-1]).tolist(), p.group,
                          p.block_m, "cpu", kv_lens=c["kv_lens"])
        nb = args["non_blocking"]
        fields = dict(chunk_qo_indptr=c["qo_indptr"], chunk_kv_indptr=c["kv_indptr"],
                      chunk_last_page_len=c["last_page_len"], chunk_work=work,
                      chunk_src=c["src"], chunk_merge=c["merge"])
        if not graph:
            return self._to_device(fields, nb)
        # padding: chunk requests without rows or pages, work rows of request -1, row-map
        # entries of q's row 0 (rows of no request: never read), merge rows of out row -1 (no
        # store)
        fill = dict(chunk_qo_indptr=int(c["qo_indptr"][-1]),
                    chunk_kv_indptr=int(c["kv_indptr"][-1]), chunk_last_page_len=0,
                    chunk_work=(-1, 0), chunk_src=0, chunk_merge=(-1, 0, 0))
        out = {}
        for k, t in fields.items():
            buf = self._chunk_bufs[k]
            if t.shape[0] > buf.shape[0]:  # cannot happen: decode_chunk_capacity bounds them
                raise AssertionError(f"{k}: {t.shape[0]} rows exceed the capacity "
                                     f"{buf.shape[0]}")
            out[k] = _copy_padded(buf, t, fill[k], nb)
        return out

    def _chunk_buffers(self, p: _Plan, sms: int) -> dict:
        """CUDA-graph mode: the chunk fields' buffers, sized at the first plan (cut for ``sms``
        SMs) for any plan of the wrapper's batch size and row capacity
        (schedule.decode_chunk_capacity)."""
        cap = decode_chunk_capacity(self._fixed_batch_size, self._max_total_rows, p.group,
                                    p.block_m, p.num_kv_heads, RESIDENT_PER_SM[64] * sms)
        shapes = dict(chunk_qo_indptr=(cap["requests"] + 1,),
                      chunk_kv_indptr=(cap["requests"] + 1,),
                      chunk_last_page_len=(cap["requests"],), chunk_work=(cap["work"], 2),
                      chunk_src=(cap["rows"],), chunk_merge=(cap["merge"], 3))
        return {k: torch.empty(s, dtype=torch.int32, device=self.device)
                for k, s in shapes.items()}

    plan.__doc__ += _PLAN_COMMON_DOC
    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache, *args, q_scale=None, k_scale=None,
            v_scale=None, out: torch.Tensor | None = None, lse: torch.Tensor | None = None,
            return_lse: bool = False, lse_base: str = "log2", lse_layout: str = "NH",
            enable_pdl: bool | None = None,
            window_left: int | None = None, sinks: torch.Tensor | None = None,
            kv_cache_sf=None, skip_softmax_threshold_scale_factor: float | None = None,
            use_fp16_softmax: bool | None = None, uses_spcompress: bool | None = None):
        """Attention of q ``[qo_indptr[-1], Hq, D_qk]`` against paged_kv_cache: a 5-D tensor
        ``[P, 2, page, Hkv, D]`` (NHD) / ``[P, 2, Hkv, page, D]`` (HND), or a (k, v) tuple of
        4-D ``[P, page, Hkv, D]`` / ``[P, Hkv, page, D]`` tensors (any strides; page size 1
        may drop the page axis). window_left: overrides the plan's for this call. sinks:
        float32 ``[Hq]`` attention-sink logits (added to each row's softmax denominator).
        skip_softmax_threshold_scale_factor, use_fp16_softmax / uses_spcompress (True),
        kv_cache_sf and extra positional args raise NotImplementedError.
        """
        if (not args and q_scale is None and k_scale is None and v_scale is None and out is None
                and lse is None and lse_base == "log2" and lse_layout == "NH" and not enable_pdl
                and window_left is None and sinks is None and kv_cache_sf is None
                and skip_softmax_threshold_scale_factor is None and not use_fp16_softmax
                and not uses_spcompress):
            # (a replay skips run()'s checks: the largest page index, which the key does not
            # hold, against the cache's pages here, where a replay may follow; the full path
            # raises where it fails)
            if torch.compiler.is_compiling() or self._pages_fit(paged_kv_cache):
                return self._bound((q, paged_kv_cache), return_lse,
                                   lambda: self._run(q, paged_kv_cache, return_lse=True))
        return self._run(q, paged_kv_cache, *args, q_scale=q_scale, k_scale=k_scale,
                         v_scale=v_scale, out=out, lse=lse, return_lse=return_lse,
                         lse_base=lse_base, lse_layout=lse_layout, enable_pdl=enable_pdl,
                         window_left=window_left, sinks=sinks, kv_cache_sf=kv_cache_sf,
                         skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
                         use_fp16_softmax=use_fp16_softmax, uses_spcompress=uses_spcompress)

    def _pages_fit(self, paged_kv_cache) -> bool:
        """Whether the plan's largest page index is inside the cache (pages_fit), or there is
        no plan."""
        return self._plan is None or pages_fit(self._plan.max_page, paged_kv_cache)

    def _run(self, q, paged_kv_cache, *args, q_scale=None, k_scale=None, v_scale=None, out=None,
             lse=None, return_lse=False, lse_base="log2", lse_layout="NH", enable_pdl=None,
             window_left=None, sinks=None, kv_cache_sf=None,
             skip_softmax_threshold_scale_factor=None, use_fp16_softmax=None,
             uses_spcompress=None):
        p = self._check_q(q)
        lse_base, lse_layout = V.check_lse_base(lse_base), V.check_lse_layout(lse_layout)
        V.reject_if_set("skip_softmax_threshold_scale_factor", skip_softmax_threshold_scale_factor,
                        "skip-softmax sparsity is only in compiled_attn.trtllm_fmha_v2_prefill")
        for name, val in (("use_fp16_softmax", use_fp16_softmax),
                          ("uses_spcompress", uses_spcompress)):
            if val:
                V.unsupported(name, "a trtllm-gen cubin variant; compiled_attn has none")
        sm, v_f, v_t, w = self._run_scalars(p, args=args, q_scale=q_scale, k_scale=k_scale,
                                            v_scale=v_scale, o_scale=None,
                                            enable_pdl=enable_pdl, kv_cache_sf=kv_cache_sf,
                                            window_left=window_left)
        k_cache, v_cache = _paged_kv_views(paged_kv_cache, self._kv_layout, "paged_kv_cache")
        self._check_kv_dtype("paged_kv_cache (k)", k_cache, p)
        self._check_kv_dtype("paged_kv_cache (v)", v_cache, p)
        want_k = (p.page_size, p.num_kv_heads, p.head_dim_qk)
        want_v = (p.page_size, p.num_kv_heads, p.head_dim_vo)
        if tuple(k_cache.shape[1:]) != want_k or tuple(v_cache.shape[1:]) != want_v or \
                v_cache.shape[0] != k_cache.shape[0]:
            raise ValueError(
                f"paged_kv_cache: k/v caches of logical NHD shapes {tuple(k_cache.shape)} / "
                f"{tuple(v_cache.shape)} do not match the plan: [P, {p.page_size}, "
                f"{p.num_kv_heads}, {p.head_dim_qk}] / [P, {p.page_size}, {p.num_kv_heads}, "
                f"{p.head_dim_vo}] (page_size, num_kv_heads, head dims; kv_layout="
                f"{self._kv_layout!r})")
        V.check_pages_in_cache("paged_kv_indices", p.max_page, k_cache.shape[0],
                               "paged_kv_cache", p.kv_indices)
        if sinks is not None:
            V.check_tensor("sinks", sinks, shape=(p.num_qo_heads,), dtypes=(torch.float32,),
                           device=self.device, what="[Hq] float32")
        _check_out_lse(out, lse, q.shape[0], p.num_qo_heads, p.head_dim_vo, p.o_dtype,
                       self.device, lse_layout)
        # (the chunks' direct launches need an eager call on plain tensors; a q that requires
        # grad takes the op, whose autograd kernel refuses the backward)
        if (p.chunk_work is not None and _chunks_exact(p, w, sinks) and untraced()
                and plain_tensors((q, k_cache, v_cache))):
            # decode key chunks (_plan_chunks): one paged launch of the chunk requests, each
            # chunk row reading its request's row of q in place (the op's row map), then
            # their outputs merged per request
            o_c, lse_c = call_op(
                "batch_paged_prefill", q, k_cache, v_cache, p.chunk_qo_indptr,
                p.chunk_kv_indptr, p.kv_indices, p.chunk_last_page_len, p.chunk_work, None,
                None, None, None, p.block_m, p.mask_mode, w, 0, sm, p.logits_soft_cap,
                p.pos_encoding_mode, p.rope_scale, p.rope_theta, v_f, p.o_dtype,
                q_rows=p.chunk_src, launches=self._memo)
            adopt_scratch(o_c)
            adopt_scratch(lse_c)
            res_out, res_lse = _chunks.merge_chunks(o_c, lse_c, p.chunk_merge, q.shape[0])
            return _deliver(_apply_v_scale_tensor(res_out, v_t), res_lse, out, lse,
                            return_lse, lse_base, lse_layout, self._rows_end())
        res_out, res_lse = call_op(
            "batch_paged_prefill",
            q, k_cache, v_cache, p.qo_indptr, p.kv_indptr, p.kv_indices, p.last_page_len,
            p.work, p.packed_mask, p.mask_indptr, p.alibi, sinks, p.block_m, p.mask_mode, w, 0,
            sm, p.logits_soft_cap, p.pos_encoding_mode, p.rope_scale, p.rope_theta, v_f,
            p.o_dtype, merge=p.merge, launches=self._memo)
        return _deliver(_apply_v_scale_tensor(res_out, v_t), res_lse, out, lse, return_lse,
                        lse_base, lse_layout, self._rows_end())

    run.__doc__ += _RUN_DOC
    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q: torch.Tensor, paged_kv_cache, causal: bool = False,
                pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                k_scale=None, v_scale=None, window_left: int = -1,
                logits_soft_cap: float | None = None, sm_scale: float | None = None,
                rope_scale: float | None = None, rope_theta: float | None = None,
                *, _return_lse: bool = False):
        """Deprecated in FlashInfer (use run()). The options replace the plan's, for this call
        and later run()s, FlashInfer's defaults included (causal=False unless passed); then
        run(q, paged_kv_cache, k_scale=, v_scale=)."""
        self._forward_options(causal=causal, pos_encoding_mode=pos_encoding_mode,
                              use_fp16_qk_reduction=use_fp16_qk_reduction,
                              window_left=window_left, logits_soft_cap=logits_soft_cap,
                              sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale,
                        return_lse=_return_lse)

    forward_return_lse = functools.partialmethod(forward, _return_lse=True)


class BatchPrefillWithRaggedKVCacheWrapper(_BatchPrefillBase):
    """Batch prefill attention of ragged queries against ragged (contiguous per request) K/V:
    request b's keys are rows ``kv_indptr[b]:kv_indptr[b+1]`` of k and v."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False, qo_indptr_buf: torch.Tensor | None = None,
                 kv_indptr_buf: torch.Tensor | None = None,
                 custom_mask_buf: torch.Tensor | None = None,
                 mask_indptr_buf: torch.Tensor | None = None, backend: str = "auto",
                 jit_args=None, jit_kwargs=None, variant_owns_mask: bool = False) -> None:
        """float_workspace_buffer, kv_layout, backend, jit_args, jit_kwargs, variant_owns_mask:
        as BatchPrefillWithPagedKVCacheWrapper; with use_cuda_graph=True, qo_indptr_buf and
        kv_indptr_buf (int32 ``[B+1]``) are required, custom_mask_buf / mask_indptr_buf when a
        custom mask will be planned."""
        self._init_common(float_workspace_buffer, kv_layout, use_cuda_graph,
                          dict(qo_indptr_buf=qo_indptr_buf, kv_indptr_buf=kv_indptr_buf),
                          custom_mask_buf, mask_indptr_buf, backend, jit_args, jit_kwargs,
                          variant_owns_mask)

    def plan(self, qo_indptr: torch.Tensor, kv_indptr: torch.Tensor, num_qo_heads: int,
             num_kv_heads: int, head_dim_qk: int, head_dim_vo: int | None = None,
             custom_mask: torch.Tensor | None = None,
             packed_custom_mask: torch.Tensor | None = None, causal: bool = False,
             pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
             window_left: int = -1, logits_soft_cap: float | None = None,
             sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, q_data_type="float16", kv_data_type=None,
             o_data_type=None, non_blocking: bool = True, prefix_len_ptr=None,
             token_pos_in_items_ptr=None, token_pos_in_items_len: int = 0,
             max_item_len_ptr=None, fixed_split_size=None, disable_split_kv: bool = False,
             seq_lens=None, seq_lens_q=None, max_token_per_sequence=None,
             max_sequence_kv=None, v_indptr=None, o_indptr=None,
             uniform_q_len: int | None = None) -> None:
        """Plan a batch: qo_indptr ``[B+1]`` and kv_indptr ``[B+1]`` (rows of q and of k/v per
        request; kv_indptr may start past 0, an offset into k / v as in FlashInfer), integer,
        on CPU or GPU (read on the host here). Note FlashInfer's ragged
        plan orders window_left, logits_soft_cap, sm_scale differently from the paged one; so
        does this. v_indptr / o_indptr (cuDNN inputs), if given, must equal kv_indptr /
        qo_indptr (separate value / output offsets raise NotImplementedError).
        """
        args = dict(locals())  # the arguments by FlashInfer name, for _plan_common
        hosts = gather_host(qo_indptr, kv_indptr)
        qo_h = V.host_indptr("qo_indptr", qo_indptr, hosts=hosts)
        b = qo_h.numel() - 1
        kv_h = V.host_indptr("kv_indptr", kv_indptr, length=b + 1, length_from="qo_indptr",
                             start_zero=False, hosts=hosts)  # (offsets into k / v, as FlashInfer's)
        for name, given, same in (("v_indptr", v_indptr, kv_h), ("o_indptr", o_indptr, qo_h)):
            if given is not None:
                V.check_int(name, V.check_tensor(name, given, what="[batch_size + 1]"))
            if given is not None and not torch.equal(V.host_copy(name, given).reshape(-1), same):
                V.unsupported(name, "separate value / output offsets are not supported; pass "
                              "None (k and v share kv_indptr, out follows qo_indptr)")
        if self._use_cuda_graph:  # (before _plan_common writes any buffer)
            self._check_batch(b)
            self._check_bufs({"kv_indptr_buf": kv_h.numel()})
        p = self._plan_common(args, qo_h, V.lengths(kv_h.tolist()), paged=False,
                              kv_arrays=dict(kv_indptr=kv_h))
        if self._use_cuda_graph:
            p.kv_indptr = self._into_buf("kv_indptr_buf", kv_h, non_blocking)
        p.total_kv = int(kv_h[-1])
        self._set_plan(p)

    plan.__doc__ += _PLAN_COMMON_DOC
    begin_forward = plan

    def run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args, q_scale=None,
            k_scale=None, v_scale=None, o_scale=None, out: torch.Tensor | None = None,
            lse: torch.Tensor | None = None, return_lse: bool = False, lse_base: str = "log2",
            lse_layout: str = "NH", enable_pdl: bool | None = None, kv_cache_sf=None):
        """Attention of q ``[qo_indptr[-1], Hq, D_qk]`` against k ``[>= kv_indptr[-1], Hkv,
        D_qk]`` and v ``[>= kv_indptr[-1], Hkv, D_vo]`` (HND: ``[Hkv, >= kv_indptr[-1], D]``;
        any strides; rows kv_indptr[0] to kv_indptr[-1] are read, as in FlashInfer).
        o_scale other than None/1.0, kv_cache_sf and extra positional args raise
        NotImplementedError. fp8 k/v scales take effect here too (FlashInfer ignores them on
        this path).
        """
        if (not args and q_scale is None and k_scale is None and v_scale is None
                and o_scale is None and out is None and lse is None and lse_base == "log2"
                and lse_layout == "NH" and not enable_pdl and kv_cache_sf is None):
            return self._bound((q, k, v), return_lse, lambda: self._run(q, k, v, return_lse=True))
        return self._run(q, k, v, *args, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
                         o_scale=o_scale, out=out, lse=lse, return_lse=return_lse,
                         lse_base=lse_base, lse_layout=lse_layout, enable_pdl=enable_pdl,
                         kv_cache_sf=kv_cache_sf)

    def _run(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, o_scale=None,
             out=None, lse=None, return_lse=False, lse_base="log2", lse_layout="NH",
             enable_pdl=None, kv_cache_sf=None):
        p = self._check_q(q)
        lse_base, lse_layout = V.check_lse_base(lse_base), V.check_lse_layout(lse_layout)
        sm, v_f, v_t, w = self._run_scalars(p, args=args, q_scale=q_scale, k_scale=k_scale,
                                            v_scale=v_scale, o_scale=o_scale,
                                            enable_pdl=enable_pdl, kv_cache_sf=kv_cache_sf,
                                            window_left=None)
        kv_what = ("[kv_indptr[-1], Hkv, D]" if self._kv_layout == "NHD"
                   else "[Hkv, kv_indptr[-1], D]")
        V.check_tensor("k", k, ndim=3, what=kv_what)
        V.check_tensor("v", v, ndim=3, what=kv_what)
        self._check_kv_dtype("k", k, p)
        self._check_kv_dtype("v", v, p)
        kn, vn = (k, v) if self._kv_layout == "NHD" else (k.transpose(0, 1), v.transpose(0, 1))
        # (at least: the kernel reads rows kv_indptr[0] to kv_indptr[-1], as FlashInfer's)
        rows_ok = self._rows_ok("k / v", kn.shape[0], "kv_indptr", "total_kv", at_least=True)
        if not rows_ok or tuple(kn.shape[1:]) != (p.num_kv_heads, p.head_dim_qk) or \
                tuple(vn.shape) != (kn.shape[0], p.num_kv_heads, p.head_dim_vo):
            raise ValueError(
                f"k / v: shapes {tuple(k.shape)} / {tuple(v.shape)} do not match the plan: "
                f">= {'kv_indptr[-1]' if V.traced() else p.total_kv} rows (kv_indptr[-1]), "
                f"{p.num_kv_heads} KV heads, head dims "
                f"{p.head_dim_qk} / {p.head_dim_vo} (kv_layout={self._kv_layout!r})")
        _check_out_lse(out, lse, q.shape[0], p.num_qo_heads, p.head_dim_vo, p.o_dtype,
                       self.device, lse_layout)
        res_out, res_lse = call_op(
            "batch_ragged_prefill",
            q, kn, vn, p.qo_indptr, p.kv_indptr, p.work, p.packed_mask, p.mask_indptr,
            p.alibi, None, p.block_m, p.mask_mode, w, 0, sm, p.logits_soft_cap,
            p.pos_encoding_mode, p.rope_scale, p.rope_theta, v_f, p.o_dtype, merge=p.merge,
            launches=self._memo)
        return _deliver(_apply_v_scale_tensor(res_out, v_t), res_lse, out, lse, return_lse,
                        lse_base, lse_layout, self._rows_end())

    run.__doc__ += _RUN_DOC
    run_return_lse = functools.partialmethod(run, return_lse=True)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False,
                pos_encoding_mode: str = "NONE", use_fp16_qk_reduction: bool = False,
                window_left: int = -1, logits_soft_cap: float | None = None,
                sm_scale: float | None = None, rope_scale: float | None = None,
                rope_theta: float | None = None, *, _return_lse: bool = False):
        """Deprecated in FlashInfer (use run()). The options replace the plan's, for this call
        and later run()s, FlashInfer's defaults included (causal=False unless passed); then
        run(q, k, v)."""
        self._forward_options(causal=causal, pos_encoding_mode=pos_encoding_mode,
                              use_fp16_qk_reduction=use_fp16_qk_reduction,
                              window_left=window_left, logits_soft_cap=logits_soft_cap,
                              sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta)
        return self.run(q, k, v, return_lse=_return_lse)

    forward_return_lse = functools.partialmethod(forward, _return_lse=True)
