"""compiled_attn.trtllm_fmha_v2_prefill against a dense float64 oracle (CPU).

All five input layouts, the four mask modes (padding, causal, sliding_window, chunked),
bmm1/bmm2 scales, ALiBi, soft cap, sinks, fp8 paged KV, out/out_dtype, and bad inputs with the
messages that say how to fix them. Output buffers are poisoned with NaN before each call.
"""

from __future__ import annotations

import pytest
import torch

import compiled_attn
from tests.helpers import alibi_slopes_spec, dense_request, visibility
from tests.helpers import (_build, _call, _cum, _seqs, check_skip, check_stats, fn,
                           peaked_seqs)

WS = torch.empty(16, dtype=torch.uint8)
QO, KV = [5, 0, 3, 8], [9, 4, 3, 8]












def _oracle(qs, ks, vs, **kw):
    return torch.cat([dense_request(q, k, v, **kw)[0] for q, k, v in zip(qs, ks, vs)])


LAYOUTS = ["PACKED_QKV", "CONTIGUOUS_Q_KV", "SEPARATE_Q_K_V", "Q_PAGED_KV_NHD",
           "Q_PAGED_KV_HND"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mask_mode", ["causal", "padding"])
def test_layouts(layout, mask_mode):
    torch.manual_seed(LAYOUTS.index(layout) * 2 + (mask_mode == "causal"))
    qo, kv = (QO, QO) if layout == "PACKED_QKV" else (QO, KV)
    hq, hkv = (4, 4) if layout == "PACKED_QKV" else (6, 2)
    dvo = 8 if layout == "SEPARATE_Q_K_V" else 16
    qs, ks, vs = _seqs(qo, kv, hq, hkv, 16, dvo)
    qkv, table = _build(layout, qs, ks, vs, seed=3)
    out = torch.full((sum(qo), hq, dvo), float("nan"), dtype=torch.float64)
    got = _call(qkv, layout, table, qo, kv, out=out, mask_mode=mask_mode, bmm2_scale=0.7)
    assert got is out
    ref = _oracle(qs, ks, vs, sm_scale=0.3, causal=mask_mode == "causal", v_scale=0.7)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("layout", ["SEPARATE_Q_K_V", "Q_PAGED_KV_HND"])
@pytest.mark.parametrize("feature", ["sliding_window", "chunked", "alibi", "soft_cap", "sinks",
                                     "sinks_list_window"])
def test_features(layout, feature):
    torch.manual_seed(len(feature) * 31 + len(layout))
    qo, kv, hq, hkv, d = [6, 4, 9], [13, 4, 9], 6, 3, 16
    qs, ks, vs = _seqs(qo, kv, hq, hkv, d, d)
    qkv, table = _build(layout, qs, ks, vs, seed=5, page=5)
    kw, ref_kw = {}, dict(causal=True)
    if feature == "sliding_window":
        kw = dict(mask_mode="sliding_window", window_left=3)
        ref_kw.update(window_left=3)
    elif feature == "chunked":
        kw = dict(mask_mode="chunked", chunked_attention_size=4)
        ref_kw.update(chunk=4)
    elif feature == "alibi":
        kw = dict(pos_encoding_mode="alibi")
        ref_kw.update(alibi_slopes=alibi_slopes_spec(hq))
    elif feature == "soft_cap":
        kw = dict(logits_soft_cap_scale=1.5)
        ref_kw.update(soft_cap=1.5)
    elif feature == "sinks":
        s = (torch.randn(hq) * 2).float()
        kw = dict(sinks=s)
        ref_kw.update(sinks=s)
    else:
        s = (torch.randn(hq) * 2).float()
        kw = dict(sinks=[s], mask_mode="SLIDING_WINDOW", window_left=0)
        ref_kw.update(sinks=s, window_left=0)
    got = _call(qkv, layout, table, qo, kv, **kw)
    ref = _oracle(qs, ks, vs, sm_scale=0.3, **ref_kw)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, ref)


# (mask_mode, window_left, chunked_attention_size) -> the oracle's window and chunk: FlashInfer's
# kernel (fmha_v2_run.cu) makes "sliding_window" and "chunked" one causal mode narrowed by
# whichever is set, and "causal" that mode where 0 < window_left < max_kv_len or a chunk is set
@pytest.mark.parametrize("mask_mode,window_left,chunk,ref", [
    ("causal", 3, 0, dict(window_left=3)), ("causal", 0, 0, dict()),
    ("causal", 13, 0, dict()), ("causal", -1, 4, dict(chunk=4)),
    ("chunked", -1, 0, dict()), ("chunked", 2, 0, dict(window_left=2)),
    ("sliding_window", -1, 4, dict(chunk=4)), ("sliding_window", -1, 0, dict()),
    ("sliding_window", 0, 0, dict(window_left=0)),
    # a chunk of 1 key (log2 0) or a negative one chunks nothing in FlashInfer's kernel
    ("causal", -1, 1, dict()), ("chunked", -1, 1, dict()), ("causal", -1, -4, dict()),
    ("sliding_window", 2, 1, dict(window_left=2)),
    # ...but a size of 1 still makes "causal" the narrowed mode: window_left 0 then keeps the
    # diagonal alone (FlashInfer's sliding window of window_left + 1 keys)
    ("causal", 0, 1, dict(window_left=0))])
def test_causal_modes_narrowed_as_flashinfer(mask_mode, window_left, chunk, ref):
    torch.manual_seed(window_left * 7 + chunk + len(mask_mode))
    qo, kv = [6, 4, 9], [13, 4, 9]
    qs, ks, vs = _seqs(qo, kv, 4, 2, 16, 16)
    qkv, table = _build("Q_PAGED_KV_NHD", qs, ks, vs, seed=2, page=4)
    got = _call(qkv, "Q_PAGED_KV_NHD", table, qo, kv, mask_mode=mask_mode,
                window_left=window_left, chunked_attention_size=chunk)
    torch.testing.assert_close(got, _oracle(qs, ks, vs, sm_scale=0.3, causal=True, **ref))


def test_alibi_makes_padding_causal_as_flashinfer():
    """FlashInfer's kernel turns a padding mask causal with ALiBi (fmha_v2_run.cu: ALiBi is
    defined for causal masks)."""
    torch.manual_seed(12)
    qo, kv = [5, 3], [9, 3]
    qs, ks, vs = _seqs(qo, kv, 4, 2, 16, 16)
    qkv, table = _build("SEPARATE_Q_K_V", qs, ks, vs)
    got = _call(qkv, "SEPARATE_Q_K_V", table, qo, kv, mask_mode="padding",
                pos_encoding_mode="alibi")
    ref = _oracle(qs, ks, vs, sm_scale=0.3, causal=True, alibi_slopes=alibi_slopes_spec(4))
    torch.testing.assert_close(got, ref)
    assert not torch.allclose(got, _oracle(qs, ks, vs, sm_scale=0.3, causal=False,
                                           alibi_slopes=alibi_slopes_spec(4)))


@pytest.mark.parametrize("bmm1,bmm2", [(0.0, 1.0), (0.3, 0.0), (0.3, -0.5), (-0.2, 1.0)])
def test_scales_as_flashinfer(bmm1, bmm2):
    """bmm1_scale 0 is the default 1 / sqrt(D_qk) (fmha_v2_run.cu); bmm2_scale any float."""
    torch.manual_seed(13)
    qo, kv = [5, 3], [9, 3]
    qs, ks, vs = _seqs(qo, kv, 4, 2, 16, 16)
    qkv, table = _build("CONTIGUOUS_Q_KV", qs, ks, vs)
    got = _call(qkv, "CONTIGUOUS_Q_KV", table, qo, kv, bmm1_scale=bmm1, bmm2_scale=bmm2)
    ref = _oracle(qs, ks, vs, sm_scale=bmm1 or 16 ** -0.5, causal=True, v_scale=bmm2)
    torch.testing.assert_close(got, ref)


@pytest.mark.parametrize("layout", ["SEPARATE_Q_K_V", "Q_PAGED_KV_HND"])
def test_out_rows_past_requests_keep_their_values(layout):
    """out= with more rows than cum_seq_lens_q[-1]: FlashInfer's kernel writes the requests'
    rows only, the rest keep the caller's values."""
    torch.manual_seed(14)
    qo, kv = [3, 2], [4, 5]
    qs, ks, vs = _seqs(qo, kv, 4, 2, 8, 8)
    (q, *rest), table = _build(layout, qs, ks, vs)
    q = torch.cat([q, torch.randn(3, 4, 8, dtype=q.dtype)])  # 3 rows of no request
    kv_part = tuple(rest) if layout == "SEPARATE_Q_K_V" else rest[0]
    qkv = (q, *kv_part) if layout == "SEPARATE_Q_K_V" else (q, kv_part)
    out = torch.full((8, 4, 8), 7.0, dtype=torch.float64)
    got = _call(qkv, layout, table, qo, kv, out=out)
    assert got is out
    torch.testing.assert_close(out[:5], _oracle(qs, ks, vs, sm_scale=0.3, causal=True))
    assert (out[5:] == 7.0).all()


def test_chunked_differs_from_causal():
    """The chunked case above is not trivially causal: the chunk boundary hides keys."""
    torch.manual_seed(1)
    qs, ks, vs = _seqs([6], [13], 2, 1, 8, 8)
    a = _oracle(qs, ks, vs, sm_scale=0.3, causal=True, chunk=4)
    b = _oracle(qs, ks, vs, sm_scale=0.3, causal=True)
    assert not torch.allclose(a, b)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_paged_kv_fp16_q_and_out_dtype(fp8):
    torch.manual_seed(7)
    qo, kv, hq, hkv, d = [4, 6], [11, 6], 4, 2, 16
    qs, ks, vs = _seqs(qo, kv, hq, hkv, d, d)
    ks8, vs8 = [k.to(fp8) for k in ks], [v.to(fp8) for v in vs]
    qs16 = [q.half() for q in qs]
    qkv, table = _build("Q_PAGED_KV_NHD", qs16, ks8, vs8, seed=2, kv_dtype=fp8)
    assert qkv[1].dtype == fp8
    got = _call(qkv, "Q_PAGED_KV_NHD", table, qo, kv, bmm1_scale=0.25 * 0.8, bmm2_scale=1.3,
                out_dtype="float32")
    assert got.dtype == torch.float32
    ref = _oracle(qs16, [k.double() * 0.8 for k in ks8], vs8, sm_scale=0.25, causal=True,
                  v_scale=1.3)
    torch.testing.assert_close(got.double(), ref, rtol=2e-3, atol=2e-3)


def test_qo_gt_kv_rows_see_nothing():
    torch.manual_seed(8)
    qs, ks, vs = _seqs([5], [2], 2, 2, 8, 8)
    got = _call(_build("SEPARATE_Q_K_V", qs, ks, vs)[0], "SEPARATE_Q_K_V", None, [5], [2])
    assert torch.equal(got[:3], torch.zeros_like(got[:3]))
    torch.testing.assert_close(got, _oracle(qs, ks, vs, sm_scale=0.3, causal=True))


# ------------------------------------------------------------------------------------------
# bad inputs
# ------------------------------------------------------------------------------------------
def _bad(layout="SEPARATE_Q_K_V", **kw):
    torch.manual_seed(9)
    qs, ks, vs = _seqs([3, 2], [4, 5], 4, 2, 8, 8)
    qkv, table = _build(layout, qs, ks, vs)
    if "qkv" in kw:
        qkv = kw.pop("qkv")
    args = dict(qo_lens=[3, 2], kv_lens=[4, 5])
    args.update({k: kw.pop(k) for k in ("qo_lens", "kv_lens") if k in kw})
    return _call(qkv, layout, kw.pop("table", table), args["qo_lens"], args["kv_lens"], **kw)


def test_bad_base_runs():
    assert not torch.isnan(_bad()).any()
    assert not torch.isnan(_bad("Q_PAGED_KV_NHD")).any()


@pytest.mark.parametrize("layout,kw,exc,match", [
    ("SEPARATE_Q_K_V", dict(skip_softmax_threshold_scale_factor=float("inf")), ValueError,
     "skip_softmax_threshold_scale_factor.*finite"),
    ("SEPARATE_Q_K_V", dict(skip_softmax_threshold_scale_factor="0.5"), ValueError,
     "skip_softmax_threshold_scale_factor"),
    ("SEPARATE_Q_K_V", dict(mask_mode="padding", window_left=2), ValueError,
     "window_left.*mask_mode='padding'"),
    ("SEPARATE_Q_K_V", dict(mask_mode="padding", chunked_attention_size=8), ValueError,
     "chunked_attention_size.*mask_mode='padding'"),
    ("SEPARATE_Q_K_V", dict(mask_mode="padding", chunked_attention_size=1), ValueError,
     "chunked_attention_size = 1 with mask_mode='padding'"),
    ("SEPARATE_Q_K_V", dict(mask_mode="chunked", chunked_attention_size=6), ValueError,
     "power of two"),
    ("SEPARATE_Q_K_V", dict(chunked_attention_size=6), ValueError, "power of two"),
    ("SEPARATE_Q_K_V", dict(mask_mode="sliding_window", window_left=2, chunked_attention_size=4),
     ValueError, "window_left.*chunked_attention_size.*pass one"),
    ("SEPARATE_Q_K_V", dict(bmm2_scale=float("nan")), ValueError, "bmm2_scale.*finite"),
    ("SEPARATE_Q_K_V", dict(mask_mode="bidirectional"), ValueError, "mask_mode.*use one of"),
    ("PACKED_KV", dict(), ValueError, "input_layout.*use one of"),
    ("SEPARATE_Q_K_V", dict(pos_encoding_mode="rope"), NotImplementedError, "pos_encoding_mode"),
    ("SEPARATE_Q_K_V", dict(bmm1_scale=torch.tensor(0.3)), NotImplementedError, "bmm1_scale"),
    ("SEPARATE_Q_K_V", dict(sinks=torch.zeros(3)), ValueError, "sinks"),
    ("SEPARATE_Q_K_V", dict(out=torch.empty(5, 4, 7, dtype=torch.float64)), ValueError, "out"),
    ("SEPARATE_Q_K_V", dict(out=torch.empty(5, 4, 8, dtype=torch.float64), out_dtype="float32"),
     ValueError, "out_dtype.*out is"),
    ("SEPARATE_Q_K_V", dict(table=torch.zeros(2, 2, dtype=torch.int32)), ValueError,
     "block_tables.*drop it"),
    ("Q_PAGED_KV_NHD", dict(table=None), ValueError, "block_tables.*required"),
    ("Q_PAGED_KV_NHD", dict(table=torch.zeros(3, 2, dtype=torch.int32)), ValueError,
     "block_tables.*one row per request"),
    ("CONTIGUOUS_Q_KV", dict(qkv=torch.zeros(5, 4, 8)), ValueError, "qkv.*tuple"),
    ("SEPARATE_Q_K_V", dict(qkv=(torch.zeros(5, 4, 8), torch.zeros(9, 2, 8, dtype=torch.float64),
                                 torch.zeros(9, 2, 8, dtype=torch.float64))), TypeError,
     "k: dtype torch.float64 differs from q's torch.float32"),
    ("SEPARATE_Q_K_V", dict(qkv=(torch.zeros(5, 4, 8), torch.zeros(9, 2, 8),
                                 torch.zeros(9, 2, 8, dtype=torch.float64))), TypeError,
     "k / v: dtypes torch.float32 and torch.float64 differ"),
])
def test_bad_inputs(layout, kw, exc, match):
    with pytest.raises(exc, match=match):
        _bad(layout, **kw)


def separate_pools(cache: torch.Tensor, table: torch.Tensor):
    """FlashInfer's non-interleaved form of a stacked [P, 2, ...] cache and its [B, M] table:
    K and V as the two halves of one [2, P, ...] allocation, and [B, 2, M] tables whose V
    offsets count from k_cache's start (page + P), as its test_fmha_v2_prefill builds them."""
    fused = torch.stack([cache[:, 0], cache[:, 1]])
    pages = cache.shape[0]
    return (fused[0], fused[1]), torch.stack([table, table + pages], 1).to(torch.int32)


@pytest.mark.parametrize("layout", ["Q_PAGED_KV_NHD", "Q_PAGED_KV_HND"])
def test_paged_separate_k_v_pools(layout):
    """(q, (k_cache, v_cache)) with [B, 2, M] block tables gives the stacked cache's output
    (FlashInfer's test_trtllm_fmha_v2_prefill_non_interleaved_kv), against the oracle."""
    torch.manual_seed(13)
    qo, kv, hq, hkv, d = [6, 4, 9], [13, 4, 9], 6, 3, 16
    qs, ks, vs = _seqs(qo, kv, hq, hkv, d, d)
    (q, cache), table = _build(layout, qs, ks, vs, seed=7, page=4)
    pools, tables = separate_pools(cache, table)
    out = torch.full((sum(qo), hq, d), float("nan"), dtype=torch.float64)
    got = _call((q, pools), layout, tables, qo, kv, out=out, logits_soft_cap_scale=2.0)
    torch.testing.assert_close(got, _oracle(qs, ks, vs, sm_scale=0.3, causal=True, soft_cap=2.0))
    assert torch.equal(got, _call((q, cache), layout, table, qo, kv, logits_soft_cap_scale=2.0))


def test_paged_separate_k_v_pools_bad_inputs():
    torch.manual_seed(14)
    qs, ks, vs = _seqs([3, 2], [4, 5], 4, 2, 8, 8)
    (q, cache), table = _build("Q_PAGED_KV_NHD", qs, ks, vs)
    (kc, vc), tables = separate_pools(cache, table)
    cases = [
        (dict(qkv=(q, (kc, vc))), ValueError, r"block_tables: expected a 3-D tensor"),
        (dict(qkv=(q, (kc, vc)), table=tables[:, :1]), ValueError,
         r"block_tables has shape \(2, 1, 2\)"),
        (dict(qkv=(q, cache), table=tables), ValueError, "block_tables: expected a 2-D tensor"),
        (dict(qkv=(q, (kc, vc.clone())), table=tables), ValueError,
         "two allocations.*positive whole number of pages after k_cache"),
        (dict(qkv=(q, (vc, kc)), table=tables), ValueError, "bytes apart"),
        (dict(qkv=(q, (kc, vc[:, :, :1])), table=tables), ValueError, "one shape and dtype"),
        (dict(qkv=(q, (kc, vc, vc)), table=tables), ValueError, "sequence of 3 tensors"),
        (dict(qkv=(q, (kc, vc.transpose(1, 2))), table=tables), ValueError,
         "one shape and dtype"),
    ]
    for kw, exc, match in cases:
        with pytest.raises(exc, match=match):
            _bad("Q_PAGED_KV_NHD", **kw)
    # V pages that do not follow their K pages by v_cache's offset: a device-side check
    shuffled = tables.clone()
    shuffled[0, 1, 0] = tables[1, 1, 0]
    with pytest.raises(RuntimeError, match=r"block_tables\[:, 1\] must be block_tables\[:, 0\]"):
        _bad("Q_PAGED_KV_NHD", qkv=(q, (kc, vc)), table=shuffled)
    # entries past a request's pages are not read (a wide, poisoned table)
    wide = torch.cat([tables, torch.full((2, 2, 3), -7, dtype=torch.int32)], 2)
    assert torch.equal(_bad("Q_PAGED_KV_NHD", qkv=(q, (kc, vc)), table=wide),
                       _bad("Q_PAGED_KV_NHD", qkv=(q, cache), table=table))


@pytest.mark.parametrize("layout", ["Q_PAGED_KV_NHD", "Q_PAGED_KV_HND"])
def test_block_tables_wider_than_needed(layout):
    """Columns past each request's pages are never read, whatever they hold (FlashInfer's
    tables are sized for the longest request the engine serves)."""
    torch.manual_seed(15)
    qo, kv = [5, 3], [9, 2]
    qs, ks, vs = _seqs(qo, kv, 4, 2, 8, 8)
    (q, cache), table = _build(layout, qs, ks, vs, seed=8, page=4)
    tail = torch.tensor([[-1, cache.shape[0], 2 ** 31 - 1]] * 2, dtype=torch.int32)
    got = _call((q, cache), layout, torch.cat([table, tail], 1), qo, kv)
    torch.testing.assert_close(got, _oracle(qs, ks, vs, sm_scale=0.3, causal=True))


@pytest.mark.parametrize("layout", ["SEPARATE_Q_K_V", "Q_PAGED_KV_NHD"])
def test_inconsistent_lengths_caught_on_device(layout):
    """seq_lens against cum_seq_lens_kv, whose differences FlashInfer's kernel reads as the KV
    lengths (paged layouts too)."""
    torch.manual_seed(10)
    qs, ks, vs = _seqs([3, 2], [4, 5], 4, 2, 8, 8)
    qkv, table = _build(layout, qs, ks, vs)
    with pytest.raises(RuntimeError, match="cum_seq_lens_kv must be the cumulative sum of "
                                           "seq_lens"):
        fn(qkv, layout, WS, torch.tensor([4, 4], dtype=torch.int32), 3, 5, 0.3, 1.0,
           2, _cum([3, 2]), _cum([4, 5]), block_tables=table)


def test_max_q_len_too_small_caught_on_device():
    torch.manual_seed(11)
    qs, ks, vs = _seqs([3, 2], [4, 5], 4, 2, 8, 8)
    qkv = (torch.cat(qs), torch.cat(ks), torch.cat(vs))
    with pytest.raises(RuntimeError, match="max_q_len"):
        fn(qkv, "SEPARATE_Q_K_V", WS, torch.tensor([4, 5], dtype=torch.int32), 2, 5, 0.3, 1.0,
           2, _cum([3, 2]), _cum([4, 5]))


# ---- save_softmax_stats and skip-softmax ---------------------------------------------------





def test_values_flashinfer_reads_as_off_or_even():
    """FlashInfer's kernel caps the logits for a soft cap != 0 (c * tanh(s / c) is even in c:
    -1.5 caps as 1.5; it was taken as no cap) and skips softmax tiles for a factor > 0 only (a
    negative one raised)."""
    torch.manual_seed(31)
    qo, kv = [5, 3], [9, 3]
    qs, ks, vs = _seqs(qo, kv, 4, 2, 16, 16)
    qkv, table = _build("Q_PAGED_KV_NHD", qs, ks, vs, seed=4)
    capped = _call(qkv, "Q_PAGED_KV_NHD", table, qo, kv, logits_soft_cap_scale=1.5)
    torch.testing.assert_close(
        _call(qkv, "Q_PAGED_KV_NHD", table, qo, kv, logits_soft_cap_scale=-1.5), capped,
        rtol=0, atol=0)
    torch.testing.assert_close(capped, _oracle(qs, ks, vs, sm_scale=0.3, causal=True,
                                               soft_cap=1.5))
    torch.testing.assert_close(
        _call(qkv, "Q_PAGED_KV_NHD", table, qo, kv, skip_softmax_threshold_scale_factor=-0.5),
        _call(qkv, "Q_PAGED_KV_NHD", table, qo, kv), rtol=0, atol=0)


def test_alibi_with_sinks_is_not_implemented():
    """FlashInfer biases key j by slope * j: beside a sink the per-row constant the ops' bias
    leaves out (slope * p_i) no longer cancels, so the two together raise."""
    with pytest.raises(NotImplementedError, match="sinks with pos_encoding_mode='alibi'"):
        _bad(pos_encoding_mode="alibi", sinks=torch.zeros(4))


@pytest.mark.parametrize("layout", ["SEPARATE_Q_K_V", "Q_PAGED_KV_HND"])
def test_save_softmax_stats_with_alibi_as_flashinfer(layout):
    """With ALiBi FlashInfer's stored max is of its own logits, bmm1 * q.k + slope * j, over
    sqrt(D) alone (its ALiBi kernels scale the logits before the max); the sum is relative to
    it (it was over sqrt(D) * bmm1 and without the slope * p_i the ops' bias leaves out)."""
    torch.manual_seed(33)
    qo, kv = [5, 0, 3], [9, 4, 3]
    hq, hkv, d = 4, 2, 16
    qs, ks, vs = _seqs(qo, kv, hq, hkv, d, d)
    qkv, table = _build(layout, qs, ks, vs, seed=5)
    _, stats = _call(qkv, layout, table, qo, kv, pos_encoding_mode="alibi",
                     save_softmax_stats=True)
    slopes = alibi_slopes_spec(hq).double()
    want = []
    for q, k in zip(qs, ks):
        s = torch.einsum("qhd,khd->hqk", q.double(), k.double().repeat_interleave(2, 1)) * 0.3
        s = s + slopes[:, None, None] * torch.arange(k.shape[0], dtype=torch.float64)
        vis = visibility(q.shape[0], k.shape[0], causal=True)
        s = s.masked_fill(~vis[None], float("-inf"))
        m = s.amax(-1)
        want.append(torch.stack([m / d ** 0.5, torch.exp(s - m[..., None]).sum(-1)], -1)
                    .transpose(0, 1))
    torch.testing.assert_close(stats.double(), torch.cat(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("soft_cap", [0.0, 1.5])
def test_save_softmax_stats(layout, soft_cap):
    """(out, stats) on every layout, soft cap or not; out as without stats."""
    torch.manual_seed(LAYOUTS.index(layout) + 7 * (soft_cap > 0))
    qo, kv = (QO, QO) if layout == "PACKED_QKV" else (QO, KV)
    hq, hkv = (4, 4) if layout == "PACKED_QKV" else (6, 2)
    qs, ks, vs = _seqs(qo, kv, hq, hkv, 16, 16)
    qkv, table = _build(layout, qs, ks, vs, seed=3)
    cap = dict(logits_soft_cap_scale=soft_cap) if soft_cap else {}
    out = torch.full((sum(qo), hq, 16), float("nan"), dtype=torch.float64)
    got, stats = _call(qkv, layout, table, qo, kv, out=out, save_softmax_stats=True, **cap)
    assert got is out
    torch.testing.assert_close(got, _call(qkv, layout, table, qo, kv, **cap), rtol=0, atol=0)
    check_stats(stats, qs, ks, bmm1_scale=0.3, soft_cap=soft_cap)


def test_save_softmax_stats_rows_without_keys():
    """A request with no keys: its rows' stats are (-inf, 0), FlashInfer's max + ln(sum) then
    -inf (the LSE of an empty row), never NaN."""
    torch.manual_seed(2)
    qs, ks, vs = _seqs([3, 2], [0, 4], 2, 1, 8, 8)
    qkv, _ = _build("SEPARATE_Q_K_V", qs, ks, vs)
    out, stats = _call(qkv, "SEPARATE_Q_K_V", None, [3, 2], [0, 4], save_softmax_stats=True)
    assert torch.equal(stats[:3, :, 0], torch.full((3, 2), float("-inf")))
    assert torch.equal(stats[:3, :, 1], torch.zeros(3, 2))
    assert torch.equal(out[:3], torch.zeros(3, 2, 8, dtype=out.dtype))
    check_stats(stats[3:], qs[1:], ks[1:], bmm1_scale=0.3)








@pytest.mark.parametrize("layout", ["SEPARATE_Q_K_V", "Q_PAGED_KV_NHD"])
@pytest.mark.parametrize("mask_mode", ["causal", "padding"])
def test_skip_softmax(layout, mask_mode):
    """The CPU reference's tiles are reference.SKIP_TILE keys."""
    from compiled_attn.ops.reference import SKIP_TILE

    qo, kv = [40, 3], [200, 150]
    qs, ks, vs = peaked_seqs(qo, kv, 4, 2, 16, SKIP_TILE, seed=len(layout) + len(mask_mode))
    qkv, table = _build(layout, qs, ks, vs, seed=1, page=16)
    got = _call(qkv, layout, table, qo, kv, mask_mode=mask_mode, bmm1_scale=0.25,
                skip_softmax_threshold_scale_factor=4.0)
    check_skip(got, qs, ks, vs, sm_scale=0.25, factor=4.0, tile=SKIP_TILE,
               causal=mask_mode == "causal")


def test_skip_softmax_zero_is_exact():
    """A factor of 0 (or None) is the exact path, bit for bit."""
    qs, ks, vs = peaked_seqs([40, 3], [200, 150], 4, 2, 16, 64, seed=4)
    qkv, _ = _build("SEPARATE_Q_K_V", qs, ks, vs)
    base = _call(qkv, "SEPARATE_Q_K_V", None, [40, 3], [200, 150])
    for f in (0, 0.0, None):
        got = _call(qkv, "SEPARATE_Q_K_V", None, [40, 3], [200, 150],
                    skip_softmax_threshold_scale_factor=f)
        assert torch.equal(got, base)
    skipped = _call(qkv, "SEPARATE_Q_K_V", None, [40, 3], [200, 150],
                    skip_softmax_threshold_scale_factor=4.0)
    assert not torch.equal(skipped, base)


def test_int64_block_table_entry_past_int32_is_caught():
    """An int64 page index of 2^32 + 6 was compacted to int32 before the range check and read
    as page 6; it is checked first now (a device-side check, as the other page checks)."""
    torch.manual_seed(35)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q = torch.randn(7, 4, 16, dtype=torch.float64)
    cache = torch.randn(8, 2, 4, 2, 16, dtype=torch.float64)

    def call(table):
        return compiled_attn.trtllm_fmha_v2_prefill(
            (q, cache), "Q_PAGED_KV_NHD", torch.empty(1), i32(5, 9), 4, 9, 0.25, 1.0, 2,
            i32(0, 3, 7), i32(0, 5, 14), block_tables=table)

    assert not torch.isnan(call(torch.tensor([[3, 0, 0], [1, 5, 6]]))).any()
    with pytest.raises(RuntimeError, match="block_tables holds page indices outside the cache"):
        call(torch.tensor([[3, 0, 0], [1, 5, 2 ** 32 + 6]]))


def test_compiled_over_batch_sizes():
    """torch.compile(fullgraph=True) over batch sizes 2, 3, 4 (Dynamo makes batch_size
    symbolic at the first recompile): the eager numbers each time, at most two graphs (a
    message formatted from the traced batch_size failed the trace at the recompile)."""
    from torch._dynamo.utils import counters

    g = torch.Generator().manual_seed(5)
    ws = torch.empty(16, dtype=torch.uint8)

    def attend(q, k, v, sl, cq, ck, mq, mk, b):
        return compiled_attn.trtllm_fmha_v2_prefill((q, k, v), "SEPARATE_Q_K_V", ws, sl, mq, mk,
                                                    0.25, 1.0, b, cq, ck)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(attend, fullgraph=True, backend="eager")
    for ql, kl in (([3, 5], [7, 11]), ([3, 5, 2], [7, 11, 4]), ([4, 1, 2, 6], [9, 3, 4, 6])):
        q = torch.randn(sum(ql), 4, 16, generator=g)
        k, v = (torch.randn(sum(kl), 2, 16, generator=g) for _ in range(2))
        args = (q, k, v, torch.tensor(kl, dtype=torch.int32), _cum(ql), _cum(kl), 6, 11,
                len(ql))  # (max_q_len / max_kv_len kept: each changing int is a recompile)
        torch.testing.assert_close(compiled(*args), attend(*args))
    assert counters["stats"]["unique_graphs"] <= 2
