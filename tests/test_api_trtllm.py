"""compiled_attn.trtllm_fmha_v2_prefill against a dense float64 oracle (CPU).

All five input layouts, the four mask modes (padding, causal, sliding_window, chunked),
bmm1/bmm2 scales, ALiBi, soft cap, sinks, fp8 paged KV, out/out_dtype, and bad inputs with the
messages that say how to fix them. Output buffers are poisoned with NaN before each call.
"""

from __future__ import annotations

import pytest
import torch

import compiled_attn
from tests.helpers import alibi_slopes_spec, dense_request, shuffled_block_table

fn = compiled_attn.trtllm_fmha_v2_prefill
WS = torch.empty(16, dtype=torch.uint8)
QO, KV = [5, 0, 3, 8], [9, 4, 3, 8]


def _cum(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _seqs(qo_lens, kv_lens, hq, hkv, dqk, dvo, dtype=torch.float64):
    qs = [torch.randn(n, hq, dqk, dtype=torch.float64).to(dtype) for n in qo_lens]
    ks = [torch.randn(n, hkv, dqk, dtype=torch.float64).to(dtype) for n in kv_lens]
    vs = [torch.randn(n, hkv, dvo, dtype=torch.float64).to(dtype) for n in kv_lens]
    return qs, ks, vs


def _paged(ks, vs, page, layout, seed, dtype=None):
    """[P, 2, page, Hkv, D] (NHD) or [P, 2, Hkv, page, D] (HND) and a shuffled block table
    (-1 where unused)."""
    g = torch.Generator().manual_seed(seed)
    bsz, hkv, d = len(ks), ks[0].shape[1], ks[0].shape[2]
    max_pages = max(-(-k.shape[0] // page) for k in ks)
    total = bsz * max_pages + 1
    cache = torch.randn(total, 2, page, hkv, d, dtype=torch.float64)
    table = shuffled_block_table([k.shape[0] for k in ks], page, max_pages, total, g)
    for b, (k, v) in enumerate(zip(ks, vs)):
        for t in range(k.shape[0]):
            pg = int(table[b, t // page])
            cache[pg, 0, t % page] = k[t].double()
            cache[pg, 1, t % page] = v[t].double()
    if dtype is not None:
        cache = cache.to(dtype)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    return cache, table


def _build(layout, qs, ks, vs, seed=0, page=4, kv_dtype=None):
    q = torch.cat(qs)
    if layout == "PACKED_QKV":
        return torch.stack([q, torch.cat(ks), torch.cat(vs)], 1), None
    if layout == "CONTIGUOUS_Q_KV":
        return (q, torch.stack([torch.cat(ks), torch.cat(vs)], 1)), None
    if layout == "SEPARATE_Q_K_V":
        return (q, torch.cat(ks), torch.cat(vs)), None
    cache, table = _paged(ks, vs, page, layout[-3:], seed, kv_dtype)
    return (q, cache), table


def _call(qkv, layout, table, qo_lens, kv_lens, out=None, **kw):
    kw.setdefault("bmm1_scale", 0.3)
    kw.setdefault("bmm2_scale", 1.0)
    return fn(qkv, layout, WS, torch.tensor(kv_lens, dtype=torch.int32),
              max_q_len=max(qo_lens), max_kv_len=max(kv_lens), batch_size=len(qo_lens),
              cum_seq_lens_q=_cum(qo_lens), cum_seq_lens_kv=_cum(kv_lens), block_tables=table,
              out=out, **kw)


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
    ("SEPARATE_Q_K_V", dict(save_softmax_stats=True), NotImplementedError,
     "save_softmax_stats.*row max"),
    ("SEPARATE_Q_K_V", dict(skip_softmax_threshold_scale_factor=0.5), NotImplementedError,
     "skip_softmax"),
    ("SEPARATE_Q_K_V", dict(window_left=4), ValueError, "window_left.*sliding_window"),
    ("SEPARATE_Q_K_V", dict(mask_mode="padding", window_left=2), ValueError,
     "window_left.*sliding_window"),
    ("SEPARATE_Q_K_V", dict(chunked_attention_size=8), ValueError,
     "chunked_attention_size.*mask_mode='chunked'"),
    ("SEPARATE_Q_K_V", dict(mask_mode="chunked", chunked_attention_size=6), ValueError,
     "power of two"),
    ("SEPARATE_Q_K_V", dict(mask_mode="bidirectional"), ValueError, "mask_mode.*use one of"),
    ("PACKED_KV", dict(), ValueError, "input_layout.*use one of"),
    ("SEPARATE_Q_K_V", dict(pos_encoding_mode="rope"), NotImplementedError, "pos_encoding_mode"),
    ("SEPARATE_Q_K_V", dict(logits_soft_cap_scale=-1.0), ValueError, "logits_soft_cap_scale"),
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


def test_paged_tuple_caches_not_implemented():
    q = torch.randn(5, 4, 8, dtype=torch.float64)
    kc = torch.randn(4, 4, 2, 8, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match="stacked"):
        _bad("Q_PAGED_KV_NHD", qkv=(q, (kc, kc.clone())))


@pytest.mark.parametrize("kw,match", [
    (dict(kv_lens=[4, 4]), "cum_seq_lens_kv must be the cumulative sum of seq_lens"),
])
def test_inconsistent_lengths_caught_on_device(kw, match):
    torch.manual_seed(10)
    qs, ks, vs = _seqs([3, 2], [4, 5], 4, 2, 8, 8)
    qkv = (torch.cat(qs), torch.cat(ks), torch.cat(vs))
    with pytest.raises(RuntimeError, match=match):
        fn(qkv, "SEPARATE_Q_K_V", WS, torch.tensor([4, 4], dtype=torch.int32), 3, 5, 0.3, 1.0,
           2, _cum([3, 2]), _cum([4, 5]))


def test_max_q_len_too_small_caught_on_device():
    torch.manual_seed(11)
    qs, ks, vs = _seqs([3, 2], [4, 5], 4, 2, 8, 8)
    qkv = (torch.cat(qs), torch.cat(ks), torch.cat(vs))
    with pytest.raises(RuntimeError, match="max_q_len"):
        fn(qkv, "SEPARATE_Q_K_V", WS, torch.tensor([4, 5], dtype=torch.int32), 2, 5, 0.3, 1.0,
           2, _cum([3, 2]), _cum([4, 5]))
