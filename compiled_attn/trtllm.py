"""FlashInfer's TRT-LLM FMHAv2 prefill entry point, ``trtllm_fmha_v2_prefill``, on our ops.

This module gives ``flashinfer.trtllm_fmha_v2_prefill`` (FlashInfer's current signature, every
argument accepted) on top of the ``compiled_attn`` torch.library ops. The five input layouts
reduce to two calls: PACKED_QKV, CONTIGUOUS_Q_KV and SEPARATE_Q_K_V give ragged K/V
(``torch.ops.compiled_attn.batch_ragged_prefill`` over views of the caller's tensors, no copy),
Q_PAGED_KV_NHD / Q_PAGED_KV_HND give a paged cache addressed by a rectangular block table
(``batch_paged_prefill``, the table compacted on the device), as one stacked cache or as
FlashInfer's separate (k_cache, v_cache) pools with [B, 2, M] tables. The mask modes (padding,
causal, sliding_window, chunked), bmm1/bmm2 scales, ALiBi, soft cap and attention sinks map
onto the op's arguments; save_softmax_stats takes the op's row max beside its LSE, and
skip-softmax is the op's skip_softmax rule. Nothing here reads a device value on the host: the
work list is the uniform one over ``max_q_len`` and the consistency of the length arrays is
asserted on the device, so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import math

import torch

from . import _validate as V
from .op_call import call_op, write_rows
from .cudnn import _compact_block_tables, _pages_used, _token_requests
from .ops import MASK_CAUSAL, MASK_NONE, POS_ALIBI, POS_NONE, schedule
from .utils import get_alibi_slopes

__all__ = ["trtllm_fmha_v2_prefill"]

_NAME = "trtllm_fmha_v2_prefill"
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
LAYOUTS = ("PACKED_QKV", "CONTIGUOUS_Q_KV", "Q_PAGED_KV_NHD", "Q_PAGED_KV_HND", "SEPARATE_Q_K_V")
MASK_MODES = ("padding", "causal", "sliding_window", "chunked")


def _fail(arg: str, problem: str, fix: str, exc=ValueError):
    raise exc(f"{_NAME}: {arg} {problem}; {fix}")


def _tuple_of(qkv, n: int, layout: str, what: str):
    if not isinstance(qkv, (tuple, list)) or len(qkv) != n:
        _fail("qkv", f"must be a tuple {what} for input_layout={layout!r}, got "
                     f"{type(qkv).__name__}", f"pass {what}")
    for i, t in enumerate(qkv):
        if not torch.is_tensor(t):
            _fail(f"qkv[{i}]", f"must be a tensor, got {type(t).__name__}", f"pass {what}")
    return qkv


def _separate_pools(pools, nhd: bool):
    """FlashInfer's non-interleaved paged cache: (k_cache, v_cache), 4-D of one shape and
    dtype, contiguous, V at a positive whole number of pages after K in one allocation (the
    [B, 2, M] block tables give page offsets from k_cache's start). Returns (k_cache, v_cache,
    that offset in pages)."""
    what = "[pages, page, Hkv, D]" if nhd else "[pages, Hkv, page, D]"
    if len(pools) != 2:
        _fail("qkv[1]", f"is a sequence of {len(pools)} tensors", f"pass (k_cache, v_cache), "
              f"each {what}")
    k, v = pools
    V.check_tensor("qkv[1][0] (k_cache)", k, ndim=4, what=what)
    V.check_tensor("qkv[1][1] (v_cache)", v, ndim=4, device=k.device,
                   device_of="qkv[1][0] (k_cache)", what=what)
    if k.shape != v.shape or k.dtype != v.dtype:
        _fail("qkv[1]", f"holds k_cache {tuple(k.shape)} {k.dtype} and v_cache "
              f"{tuple(v.shape)} {v.dtype}", "pass two caches of one shape and dtype")
    if not (k.is_contiguous() and v.is_contiguous()):
        _fail("qkv[1]", "holds a non-contiguous cache", "pass contiguous k_cache / v_cache "
              "(block offsets count whole pages from k_cache's start)")
    page_bytes = math.prod(k.shape[1:]) * k.element_size()
    delta = v.data_ptr() - k.data_ptr()
    same = k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    if not same or page_bytes == 0 or delta <= 0 or delta % page_bytes:
        _fail("qkv[1]", f"holds caches {delta} bytes apart ({'one' if same else 'two'} "
              f"allocation{'' if same else 's'}; a page is {page_bytes} bytes)",
              "place v_cache a positive whole number of pages after k_cache in one "
              "allocation (e.g. kv = torch.empty(2, pages, ...); kv[0], kv[1]), or pass a "
              "stacked [pages, 2, ...] cache")
    return k, v, delta // page_bytes


def _int_vector(arg: str, t, n: int, device) -> torch.Tensor:
    V.check_tensor(arg, t, what="[batch_size] integers")  # (n may be traced: no f-string)
    if t.dtype not in (torch.int32, torch.int64):
        _fail(arg, f"must be int32, got {t.dtype}", "pass int32 lengths/offsets")
    if t.numel() != n:
        _fail(arg, f"must hold {n} entries, got shape {tuple(t.shape)}",
              "check batch_size" if n else "")
    if t.device != device:
        _fail(arg, f"is on {t.device} but q is on {device}", "move it to q's device")
    return t.reshape(-1).to(torch.int64)


def _device_check(cond: torch.Tensor, msg: str):
    """A check on device values without a host read (a device-side assert under CUDA; raises
    at once on CPU)."""
    V.device_check(cond, f"{_NAME}: {msg}")


def trtllm_fmha_v2_prefill(
    qkv,
    input_layout: str,
    workspace_buffer: torch.Tensor,
    seq_lens: torch.Tensor,
    max_q_len: int,
    max_kv_len: int,
    bmm1_scale: float,
    bmm2_scale: float,
    batch_size: int,
    cum_seq_lens_q: torch.Tensor,
    cum_seq_lens_kv: torch.Tensor,
    block_tables: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | str | None = None,
    sinks=None,
    pos_encoding_mode: str | None = None,
    logits_soft_cap_scale: float | None = None,
    mask_mode: str = "causal",
    window_left: int = -1,
    chunked_attention_size: int = 0,
    save_softmax_stats: bool = False,
    skip_softmax_threshold_scale_factor: float | None = 0,
):
    """Ragged or paged prefill (FlashInfer's TRT-LLM FMHAv2 entry point).

    Args:
        qkv: by ``input_layout``:
            PACKED_QKV: one tensor [T, 3, H, D] (q, k, v of each token; Hq = Hkv = H).
            CONTIGUOUS_Q_KV: (q [T, Hq, D], kv [Tk, 2, Hkv, D]).
            SEPARATE_Q_K_V: (q [T, Hq, Dqk], k [Tk, Hkv, Dqk], v [Tk, Hkv, Dvo]).
            Q_PAGED_KV_NHD: (q [T, Hq, D], paged_kv [P, 2, page, Hkv, D]).
            Q_PAGED_KV_HND: (q [T, Hq, D], paged_kv [P, 2, Hkv, page, D]).
            Either paged layout also takes (q, (k_cache, v_cache)), each [P, page, Hkv, D]
            (NHD) / [P, Hkv, page, D] (HND), one shape and dtype, contiguous, v_cache a
            positive whole number of pages (delta) after k_cache in one allocation
            (FlashInfer's non-interleaved pools), with [B, 2, M] block tables.
            Any strides. q fp16/bf16/fp32 (fp8 is upcast exactly to bf16); K/V also fp8 (fold
            its scales into bmm1_scale / bmm2_scale).
        workspace_buffer: accepted for compatibility; our kernel needs no workspace.
        seq_lens: int32 [B], KV length of each request (must match cum_seq_lens_kv, whose
            differences FlashInfer's kernel reads; checked on the device).
        max_q_len: bound on each request's query length: the work list covers this many rows
            per request (rows past a request's length are skipped by the kernel).
        max_kv_len: bound on each KV length (asserted on the device).
        bmm1_scale: multiplies q.k (the softmax scale, with any fp8 q/k scales folded in); 0
            means 1 / sqrt(D_qk), as in FlashInfer.
        bmm2_scale: multiplies the output (e.g. the fp8 v scale; any finite float); not the
            LSE.
        batch_size: B.
        cum_seq_lens_q: int32 [B+1] query indptr into q's tokens.
        cum_seq_lens_kv: int32 [B+1] KV indptr: its differences must be seq_lens (every layout;
            ragged layouts: offsets into k/v's tokens).
        block_tables: int32 [B, max_pages] (paged layouts): request b's token t is in page
            ``block_tables[b, t // page]``, slot ``t % page``. With (k_cache, v_cache) pools:
            [B, 2, max_pages], K page offsets then V page offsets, both counted in pages from
            k_cache's start; a V offset must be its K offset + delta (V page i is v_cache[i],
            as FlashInfer's own test builds them; other V orders fail a device-side check).
            Columns past a request's ceil(seq_len / page) pages are never read (the table may
            be wider than needed, and hold anything there).
        out: optional [T, Hq, Dvo] output buffer (its rows of the requests written in place;
            rows past cum_seq_lens_q[-1] keep their values, as FlashInfer's kernel leaves them;
            returned).
        out_dtype: output dtype (torch dtype or name); default out's dtype, else q's.
        sinks: float32 [Hq] attention sink logits (natural units; a list/tuple holding one such
            tensor is accepted): out = sum_j e^(s_j) v_j / (sum_j e^(s_j) + e^(sink_h)).
        pos_encoding_mode: None or "alibi" (slopes of get_alibi_slopes(Hq), bias
            slope * (j - p_i)); with mask_mode="padding" ALiBi makes the mask causal, as
            FlashInfer's kernel does.
        logits_soft_cap_scale: c != 0: s = |c| tanh(s / |c|) on the scaled logits (c tanh(s /
            c) is even in c, and FlashInfer's kernel caps for c != 0); None or 0: no cap.
        mask_mode: "padding" (no mask), "causal" (bottom-right), "sliding_window" or "chunked";
            the last three are causal, narrowed as FlashInfer's kernel resolves them: by
            window_left (keys j >= p_i - window_left) where mask_mode is "sliding_window" or
            "chunked" and window_left >= 0, or it is "causal" and 0 < window_left < max_kv_len;
            by chunked_attention_size C > 0 (keys in [floor(p_i / C) * C, p_i]). "padding"
            takes neither (ValueError), nor do a window and a chunk together (FlashInfer
            asserts against them, in debug builds only). ALiBi with sinks raises
            NotImplementedError (FlashInfer biases key j by slope * j: next to a sink that
            differs from the ops' slope * (j - p_i) by more than a constant).
        window_left: -1 (no window) or >= 0 (above).
        chunked_attention_size: C, a power of two (above); 0, 1 or less: no chunks (FlashInfer's
            kernel chunks by log2(C)).
        save_softmax_stats: also return float32 [T, Hq, 2] softmax statistics (below).
        skip_softmax_threshold_scale_factor: None, 0 or less (exact attention) or f > 0:
            skip-softmax sparsity, FlashInfer's rule: a row leaves out a key tile whose
            largest logit m_t has exp(m_t - m) < f / kv_len, m the row's running max over the
            tiles before it (in key order) and kv_len the request's (tiles of the kernel's
            BLOCK_N keys, 64 or 128 on the GPU, 32 under the interpreter, 64 in the CPU
            reference); a tile every row of a work item leaves out skips its P.V. The left-out
            softmax mass of a row is below f, so the output moves by less than 2 f max|v|.
            Not in the Gluon kernel: such calls run the Triton kernel.

    Returns:
        out [T, Hq, Dvo]; with save_softmax_stats, (out, stats). Rows that see no key are 0.
        Rows past cum_seq_lens_q[-1] belong to no request: the kernel does not write them (as
        FlashInfer; the CPU reference writes 0; out= keeps its values there); slice them off.

    stats (FlashInfer's Hopper encoding, tests/attention/test_fmha_v2_prefill.py): per row,
    stats[..., 1] = sum_j exp(s_j - m) over the final logits s_j (natural units: scale, soft
    cap and ALiBi applied; m their max) and stats[..., 0] the max as Hopper's FMHAv2 stores
    it: m / (sqrt(D_qk) * bmm1_scale) (the raw q.k max over sqrt(D_qk)) without a soft cap,
    m / sqrt(D_qk) with one. So LSE = stats[..., 0] * sqrt(D_qk) * bmm1_scale +
    ln(stats[..., 1]) (soft cap: stats[..., 0] * sqrt(D_qk) + ln(stats[..., 1])). With ALiBi,
    as FlashInfer's ALiBi kernels store it: (m + slope * p_i) / sqrt(D_qk), the max of its own
    logits (bias slope * j) over sqrt(D_qk) alone, and the sum relative to m. A row that
    sees no key has (-inf, 0). Differences: FlashInfer writes stats for CONTIGUOUS_Q_KV only
    (and SEPARATE_Q_K_V in MLA shapes); here every layout has them. A sink is not part of
    the sum (as the ops' LSE); Blackwell's FMHAv2 stores m itself, not reproduced.
    """
    mode, window_left, chunk, cap, pos, sm_scale, out_scale, stats, skip = _options(
        input_layout, mask_mode, window_left, chunked_attention_size, logits_soft_cap_scale,
        pos_encoding_mode, save_softmax_stats, skip_softmax_threshold_scale_factor, bmm1_scale,
        bmm2_scale, batch_size, max_q_len, max_kv_len)
    V.check_tensor("workspace_buffer", workspace_buffer)
    paged = input_layout.startswith("Q_PAGED_KV")
    q, k, v, v_delta = _tensors(qkv, input_layout)
    dev, hq, dvo = q.device, q.shape[1], v.shape[-1]
    group = V.check_heads(hq, k.shape[-2], names=("query heads", "KV heads"))
    V.check_head_dims(q.shape[2], dvo, dev.type)
    if q.dtype not in _FP8:
        V.check_q_dtype("q", q.dtype, dev.type)
    else:  # computed as bfloat16
        V.check_interpreter("q", torch.bfloat16, dev.type)
    V.check_kv_dtype("k/v", k.dtype, dev.type)
    V.check_qkv_dtypes(q.dtype, k.dtype, v.dtype, names=("q", "k", "v"))
    o_dtype = _out_dtype(q, v, out, out_dtype)
    if sm_scale == 0.0:  # (FlashInfer: bmm1_scale 0 is the default scale)
        sm_scale = 1.0 / math.sqrt(q.shape[2])
    kv_lens, cq, ckv = _lengths(q, k, seq_lens, cum_seq_lens_q, cum_seq_lens_kv, batch_size,
                                max_q_len, max_kv_len, paged)

    # ---- the op
    page = k.shape[1] if paged else 0  # paged: k is the [P, page, Hkv, D] view of the cache
    # the work list gives every request max_q_len rows of tiles
    bm = schedule.block_m_for(q.shape[2], dvo, group, max_kv_len, mode != "padding", paged,
                              page_size=page, qo_lens=[max_q_len], kv_dtype=k.dtype)
    work = schedule.uniform_work(batch_size, max_q_len, group, bm, dev)
    slopes = get_alibi_slopes(hq, dev) if pos == POS_ALIBI else None
    sinks = _sinks(sinks, hq, dev)
    if slopes is not None and sinks is not None:
        _fail("sinks", "with pos_encoding_mode='alibi' are not supported: FlashInfer's kernel "
              "biases key j by slope * j, against which a sink's weight changes with the "
              "row's position (the ops' bias, slope * (j - p_i), gives other numbers)",
              "drop the sinks or ALiBi", NotImplementedError)
    qx = q.to(torch.bfloat16) if q.dtype in _FP8 else q
    mask_code = MASK_NONE if mode == "padding" else MASK_CAUSAL
    params = (mask_code, window_left, chunk, sm_scale, cap, pos, 1.0, 1e4, out_scale, o_dtype)
    cq32 = cq.to(torch.int32)
    if paged:
        pind, pidx, last = _page_table(block_tables, input_layout, kv_lens, k, v_delta,
                                       batch_size)
        o, lse = call_op(
            "batch_paged_prefill",
            qx, k, v, cq32, pind, pidx, last, work, None, None, slopes, sinks, bm, *params,
            row_max=stats, skip_softmax=skip)
    else:
        if block_tables is not None:
            _fail("block_tables", f"was given with input_layout={input_layout!r}",
                  "drop it (only the Q_PAGED_KV layouts use a page table)")
        o, lse = call_op(
            "batch_ragged_prefill",
            qx, k, v, cq32, ckv.to(torch.int32), work, None, None, slopes, sinks, bm, *params,
            row_max=stats, skip_softmax=skip)
    if out is not None:
        o = write_rows(out, o, cq[-1:])
    if not stats:
        return o
    offset = None if slopes is None else _alibi_offsets(slopes, cq, kv_lens, lse.shape[0])
    return o, _softmax_stats(lse, q.shape[2], sm_scale, cap, offset)


# ---- the sections of trtllm_fmha_v2_prefill, in call order
def _options(input_layout, mask_mode, window_left, chunked_attention_size,
             logits_soft_cap_scale, pos_encoding_mode, save_softmax_stats,
             skip_softmax_threshold_scale_factor, bmm1_scale, bmm2_scale, batch_size,
             max_q_len, max_kv_len):
    """The call's options, checked: (mask mode ("padding" or a causal one), window_left and
    chunk size as they take effect, soft cap, position encoding code, sm_scale (bmm1_scale; 0:
    1 / sqrt(D_qk), which the caller fills in), output scale, save_softmax_stats,
    skip-softmax factor)."""
    if input_layout not in LAYOUTS:
        _fail("input_layout", f"= {input_layout!r} is not a layout", f"use one of {LAYOUTS}")
    for arg, val in (("batch_size", batch_size), ("max_q_len", max_q_len),
                     ("max_kv_len", max_kv_len)):
        if isinstance(val, bool) or not isinstance(val, int) or val < 0:
            _fail(arg, f"must be a non-negative int, got {val!r}", "pass an int")
    mode = mask_mode.lower() if isinstance(mask_mode, str) else mask_mode
    if mode not in MASK_MODES:
        _fail("mask_mode", f"= {mask_mode!r} is not a mask mode", f"use one of {MASK_MODES}")
    window_left = V.check_window_left(-1 if window_left is None else window_left)
    chunk = 0 if chunked_attention_size is None else chunked_attention_size
    if isinstance(chunk, bool) or not isinstance(chunk, int):
        _fail("chunked_attention_size", f"= {chunk!r}", "use 0 or a power of two")
    # a size > 0 selects FlashInfer's narrowed causal mode even where it then chunks nothing
    chunked = chunk > 0
    if chunk <= 1:  # FlashInfer's kernel chunks by log2(size): 0 (a size of 1) or less is none
        chunk = 0
    if chunk & (chunk - 1):
        _fail("chunked_attention_size", f"= {chunk}", "pass 0 or a power of two")
    if mode == "padding" and (window_left >= 0 or chunked):
        arg, val = ("window_left", window_left) if window_left >= 0 else (
            "chunked_attention_size", chunked_attention_size)
        _fail(arg, f"= {val} with mask_mode='padding' (no mask to narrow)",
              "pass mask_mode='sliding_window', 'chunked' or 'causal', or drop it")
    # FlashInfer's kernel (fmha_v2_run.cu): "sliding_window" and "chunked" are one causal mode
    # narrowed by whichever of window_left / chunked_attention_size is set; "causal" becomes
    # it where 0 < window_left < max_kv_len (a wider window hides no key) or a chunk size > 0
    # is given (a size of 1 too: then window_left = 0 keeps the diagonal alone).
    narrowed = mode in ("sliding_window", "chunked") or 0 < window_left < max_kv_len or chunked
    window_left = window_left if narrowed else -1
    if window_left >= 0 and chunk:
        _fail("window_left", f"= {window_left} with chunked_attention_size = {chunk}",
              "pass one of them (-1 or 0 for the other)")
    cap = logits_soft_cap_scale
    if V.is_number(cap):  # FlashInfer's kernel caps for c != 0, and c * tanh(s / c) is even in c
        cap = abs(float(cap))
    cap = V.check_soft_cap(cap, "logits_soft_cap_scale")
    if pos_encoding_mode is None or str(pos_encoding_mode).lower() == "none":
        pos = POS_NONE
    elif str(pos_encoding_mode).lower() == "alibi":
        pos = POS_ALIBI
        if mode == "padding":  # (FlashInfer's kernel: ALiBi is defined for causal masks)
            mode = "causal"
    else:
        _fail("pos_encoding_mode", f"= {pos_encoding_mode!r} is not supported",
              "use None or 'alibi' (apply RoPE to q/k before the call)", NotImplementedError)
    stats = bool(save_softmax_stats)
    skip = skip_softmax_threshold_scale_factor
    if skip is None:
        skip = 0.0
    elif not V.is_number(skip) or not float(skip) < math.inf:
        _fail("skip_softmax_threshold_scale_factor", f"= {skip!r}",
              "pass a finite number (0, a negative one or None: exact attention)")
    # (FlashInfer's kernel skips for a factor > 0 only)
    skip = V.fits_float32("skip_softmax_threshold_scale_factor", max(float(skip), 0.0))
    for arg, val in (("bmm1_scale", bmm1_scale), ("bmm2_scale", bmm2_scale)):
        if torch.is_tensor(val):
            _fail(arg, "is a tensor", "pass a Python float (the kernel takes it as a scalar)",
                  NotImplementedError)
    sm_scale = V.check_scale("bmm1_scale", bmm1_scale, 1.0, positive=False)
    out_scale = V.check_scale("bmm2_scale", bmm2_scale, 1.0, positive=False)
    return mode, window_left, chunk, cap, pos, sm_scale, out_scale, stats, skip


def _tensors(qkv, input_layout: str):
    """(q [T, Hq, Dqk], k [Tk, Hkv, Dqk] or [P, page, Hkv, Dqk], v likewise with Dvo, v_delta)
    from qkv by layout, checked for devices and matching shapes; v_delta: separate
    (k_cache, v_cache) pools' offset of v_cache from k_cache in pages, else None."""
    v_delta = None
    if input_layout == "PACKED_QKV":
        V.check_tensor("qkv", qkv, ndim=4, what="[tokens, 3, H, D]")
        if qkv.shape[1] != 3:
            _fail("qkv", f"has shape {tuple(qkv.shape)}", "PACKED_QKV takes [tokens, 3, H, D]")
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]
    elif input_layout == "CONTIGUOUS_Q_KV":
        q, kv = _tuple_of(qkv, 2, input_layout, "(q [T, Hq, D], kv [Tk, 2, Hkv, D])")
        V.check_tensor("qkv[1]", kv, ndim=4, what="[tokens, 2, Hkv, D]")
        if kv.shape[1] != 2:
            _fail("qkv[1]", f"has shape {tuple(kv.shape)}", "pass kv as [tokens, 2, Hkv, D]")
        k, v = kv[:, 0], kv[:, 1]
    elif input_layout == "SEPARATE_Q_K_V":
        q, k, v = _tuple_of(qkv, 3, input_layout, "(q [T, Hq, Dqk], k [Tk, Hkv, Dqk], "
                                                  "v [Tk, Hkv, Dvo])")
        V.check_tensor("qkv[1]", k, ndim=3, what="[tokens, Hkv, D_qk]")
        V.check_tensor("qkv[2]", v, ndim=3, what="[tokens, Hkv, D_vo]")
    else:
        nhd = input_layout.endswith("NHD")
        if isinstance(qkv, (tuple, list)) and len(qkv) == 2 and isinstance(qkv[1], (tuple, list)):
            q = _tuple_of(qkv[:1], 1, input_layout, "(q [T, Hq, D], (k_cache, v_cache))")[0]
            k, v, v_delta = _separate_pools(qkv[1], nhd)
        else:
            q, kv = _tuple_of(qkv, 2, input_layout, "(q [T, Hq, D], paged_kv [pages, 2, ...])")
            V.check_tensor("qkv[1]", kv, ndim=5, what="[pages, 2, page, Hkv, D]" if nhd
                           else "[pages, 2, Hkv, page, D]")
            if kv.shape[1] != 2:
                _fail("qkv[1]", f"has shape {tuple(kv.shape)}", "the second dim must be 2 (K, V)")
            k, v = kv[:, 0], kv[:, 1]
        if not nhd:
            k, v = k.transpose(1, 2), v.transpose(1, 2)  # -> [P, page, Hkv, D] views
    V.check_tensor("q", q, ndim=3, what="[tokens, Hq, D_qk]")
    dev = q.device
    for name, t in (("k", k), ("v", v)):
        if t.device != dev:
            _fail(name, f"is on {t.device} but q is on {dev}", "move it to q's device")
    dqk = q.shape[2]
    if k.shape[-1] != dqk:
        _fail("qkv", f"has head dim {k.shape[-1]} for K but {dqk} for Q", "use the same D_qk")
    if v.shape[:-1] != k.shape[:-1]:
        _fail("qkv", f"has K {tuple(k.shape)} and V {tuple(v.shape)}",
              "K and V must match except in the head dim")
    return q, k, v, v_delta


def _out_dtype(q, v, out, out_dtype) -> torch.dtype:
    """The output dtype (out's, else out_dtype, else q's), with out checked [T, Hq, Dvo]."""
    dev = q.device
    if out is not None:
        V.check_tensor("out", out, shape=(q.shape[0], q.shape[1], v.shape[-1]), device=dev,
                       what="[tokens, Hq, D_vo]")
        V.check_writable("out", out)
        if out_dtype is not None and V.canonical_dtype("out_dtype", out_dtype) != out.dtype:
            _fail("out_dtype", f"= {out_dtype} but out is {out.dtype}", "pass one of them")
        o_dtype = out.dtype
    else:
        o_dtype = q.dtype if out_dtype is None else V.canonical_dtype("out_dtype", out_dtype)
    if o_dtype not in _FP8:
        V.check_out_dtype("out_dtype", o_dtype, dev.type)
    else:
        V.check_interpreter("out_dtype", o_dtype, dev.type)
    return o_dtype


def _lengths(q, k, seq_lens, cum_seq_lens_q, cum_seq_lens_kv, bsz: int, max_q_len: int,
             max_kv_len: int, paged: bool):
    """(kv_lens [B], cum_seq_lens_q [B+1], cum_seq_lens_kv [B+1]) on q's device, checked on
    the device (no host reads)."""
    dev = q.device
    kv_lens = _int_vector("seq_lens", seq_lens, bsz, dev)
    cq = _int_vector("cum_seq_lens_q", cum_seq_lens_q, bsz + 1, dev)
    ckv = _int_vector("cum_seq_lens_kv", cum_seq_lens_kv, bsz + 1, dev)
    qo_lens = cq[1:] - cq[:-1]
    _device_check((cq[:1] == 0) & (qo_lens >= 0).all() & (cq[-1:] <= q.shape[0]),
                  "cum_seq_lens_q must start at 0, be non-decreasing and end at most at "
                  "q's token count")
    _device_check(qo_lens <= max_q_len, "a query length exceeds max_q_len")
    _device_check((kv_lens >= 0) & (kv_lens <= max_kv_len),
                  "seq_lens must be in [0, max_kv_len]")
    # (FlashInfer's kernel reads each request's KV length from cum_seq_lens_kv, every layout)
    ok = (ckv[:1] == 0) & (ckv[1:] - ckv[:-1] == kv_lens).all()
    if not paged:
        ok = ok & (ckv[-1:] <= k.shape[0])
    _device_check(ok, "cum_seq_lens_kv must be the cumulative sum of seq_lens (starting at 0)"
                  + ("" if paged else " and end at most at K/V's token count"))
    return kv_lens, cq, ckv


def _sinks(sinks, hq: int, dev):
    """sinks as a float32 [Hq] tensor (a list / tuple of one accepted), or None."""
    if sinks is None:
        return None
    if isinstance(sinks, (list, tuple)):
        if len(sinks) != 1:
            _fail("sinks", f"is a sequence of {len(sinks)} tensors",
                  "pass one float32 [Hq] tensor")
        sinks = sinks[0]
    V.check_tensor("sinks", sinks, shape=(hq,), device=dev, what="[Hq] float32")
    return sinks.to(torch.float32)


def _page_table(block_tables, input_layout: str, kv_lens, k, v_delta, bsz: int):
    """The block table checked (its page indices on the device) and compacted into
    (page indptr, page indices, last page length). k: the [P, page, Hkv, D] cache view;
    v_delta: as _tensors gives it (a [B, 2, M] table with separate pools)."""
    dev, page = k.device, k.shape[1]
    if block_tables is None:
        _fail("block_tables", f"is required for input_layout={input_layout!r}",
              "pass int32 [batch_size, max_pages] page indices")
    if v_delta is None:
        V.check_tensor("block_tables", block_tables, ndim=2, device=dev,
                       what="[batch_size, max_pages] (a stacked [pages, 2, ...] cache; "
                       "[B, 2, M] tables go with a (k_cache, v_cache) tuple)")
    else:
        V.check_tensor("block_tables", block_tables, ndim=3, device=dev,
                       what="[batch_size, 2, max_pages] (K and V page offsets from "
                       "k_cache's start, for a (k_cache, v_cache) tuple)")
        if block_tables.shape[1] != 2:
            _fail("block_tables", f"has shape {tuple(block_tables.shape)}",
                  "pass [batch_size, 2, max_pages]: K offsets, then V offsets")
    if block_tables.shape[0] != bsz:
        _fail("block_tables", f"has {block_tables.shape[0]} rows for batch_size {bsz}",
              "pass one row per request")
    if block_tables.dtype not in (torch.int32, torch.int64):
        _fail("block_tables", f"must be int32, got {block_tables.dtype}", "pass int32")
    _device_check(kv_lens <= block_tables.shape[-1] * page,
                  "block_tables has too few columns for seq_lens")
    k_table = block_tables if v_delta is None else block_tables[:, 0]
    _, used = _pages_used(kv_lens, page, block_tables.shape[-1])
    if v_delta is not None:
        _device_check(~used | (block_tables[:, 1] == k_table + v_delta),
                      f"block_tables[:, 1] must be block_tables[:, 0] + {v_delta} (v_cache "
                      "starts that many pages after k_cache) for every page in use: V "
                      "pages ordered apart from their K pages are not supported")
    # (checked before the int32 compaction, where an int64 index past 2^31 would wrap)
    _device_check(~used | ((k_table >= 0) & (k_table < k.shape[0])),
                  "block_tables holds page indices outside the cache")
    return _compact_block_tables(k_table, kv_lens, page)


def _softmax_stats(lse: torch.Tensor, dqk: int, bmm1_scale: float, cap: float,
                   alibi_offset: torch.Tensor | None = None) -> torch.Tensor:
    """FlashInfer's (max, sum) stats float32 [T, Hq, 2] from the op's float32 [T, Hq, 2] =
    (LSE, row max), both base 2 (the encoding: trtllm_fmha_v2_prefill's docstring). With
    ALiBi (alibi_offset [T, Hq], _alibi_offsets) FlashInfer's max is of its own biased logits,
    over sqrt(D) alone."""
    lse2, m2 = lse[..., 0], lse[..., 1]
    seen = m2 > float("-inf")
    total = torch.where(seen, torch.exp2(lse2 - torch.where(seen, m2, 0.0)), 0.0)
    if alibi_offset is not None:
        stored = (m2 * math.log(2.0) + alibi_offset) / math.sqrt(dqk)
    else:
        stored = m2 * (math.log(2.0) / (math.sqrt(dqk) * (1.0 if cap > 0 else bmm1_scale)))
    return torch.stack([stored, total], dim=-1)


def _alibi_offsets(slopes: torch.Tensor, cq: torch.Tensor, kv_lens: torch.Tensor,
                   rows: int) -> torch.Tensor:
    """slope_h * p_i, float32 [rows, Hq]: FlashInfer's ALiBi logits (bias slope * j) less the
    ops' (slope * (j - p_i), p_i = kv_len - qo_len + i the row's position). slopes [Hq];
    cq: the requests' cumulative query rows [B + 1] (int64, device); kv_lens [B]. Rows past
    cq[-1] belong to no request (0)."""
    if kv_lens.shape[0] == 0:
        return torch.zeros(rows, slopes.shape[0], device=cq.device)
    req, row, inside = _token_requests(cq, rows)
    pos = kv_lens.to(torch.int64)[req] - (cq[req + 1] - cq[req]) + row
    pos = torch.where(inside, pos, torch.zeros_like(pos))
    return pos.to(torch.float32)[:, None] * slopes[None, :]
