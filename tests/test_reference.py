"""ops.reference, through the public ops on CPU, against an independent dense float64 oracle.

The oracle (``dense_request`` in tests/helpers.py) is written from the spec alone and shares no
code with ops/reference.py. The ops are called through
``torch.ops.compiled_attn.*`` with CPU tensors, which dispatches to the reference.
"""

from __future__ import annotations

import math
import zlib

import pytest
import torch

import compiled_attn  # noqa: F401  (registers torch.ops.compiled_attn.*)
from compiled_attn.ops import schedule
from compiled_attn.ops import (
    MASK_CAUSAL,
    MASK_CUSTOM,
    MASK_NONE,
    POS_ALIBI,
    POS_NONE,
    POS_ROPE_LLAMA,
)

from .helpers import (LN2, alibi_slopes_spec, assert_lse, dense_request, indptr, oracle_batch,
                      pack_segments)

OPS = torch.ops.compiled_attn
F64_TOL = dict(rtol=1e-9, atol=1e-9)


def assert_close_f64(actual, expected, tol=F64_TOL):
    assert not torch.isnan(actual).any(), "NaN in the op's output"
    torch.testing.assert_close(actual.double(), expected.double(), **tol)


def rand(*shape, dtype=torch.float64, scale=1.0):
    return (torch.randn(*shape, dtype=torch.float64) * scale).to(dtype)


# ------------------------------------------------------------------------------------------
# Op call helpers (positional arguments, in schema order)
# ------------------------------------------------------------------------------------------
def call_single(q, k, v, *, packed=None, slopes=None, sinks=None, mask_mode=MASK_NONE,
                window_left=-1, chunk=0, sm_scale=None, cap=0.0, pos=POS_NONE,
                rope_scale=1.0, rope_theta=1e4, v_scale=1.0, out_dtype=None):
    sm_scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    return OPS.single_prefill(q, k, v, packed, slopes, sinks, mask_mode, window_left, chunk,
                              sm_scale, cap, pos, rope_scale, rope_theta, v_scale, out_dtype)


def common_args(q, k_last_dims, *, qo_lens, packed=None, mask_indptr=None, slopes=None,
                sinks=None, mask_mode=MASK_NONE, window_left=-1, chunk=0, sm_scale=None,
                cap=0.0, pos=POS_NONE, rope_scale=1.0, rope_theta=1e4, v_scale=1.0,
                out_dtype=None):
    hq, dqk = q.shape[1], q.shape[2]
    hkv, dvo = k_last_dims
    g = hq // hkv
    bm = schedule.block_m_for(dqk, dvo, g)
    work = schedule.build_work(qo_lens, g, bm)
    sm_scale = sm_scale if sm_scale is not None else dqk ** -0.5
    head = (work, packed, mask_indptr, slopes, sinks, bm)
    tail = (mask_mode, window_left, chunk, sm_scale, cap, pos, rope_scale, rope_theta, v_scale,
            out_dtype)
    return head, tail


def call_ragged(q, k, v, qo_lens, kv_lens, **kw):
    head, tail = common_args(q, (k.shape[1], v.shape[2]), qo_lens=qo_lens, **kw)
    return OPS.batch_ragged_prefill(q, k, v, indptr(qo_lens), indptr(kv_lens), *head, *tail)


def call_paged(q, k_cache, v_cache, qo_lens, page_indptr, page_indices, last_len, **kw):
    head, tail = common_args(q, (k_cache.shape[2], v_cache.shape[3]), qo_lens=qo_lens, **kw)
    return OPS.batch_paged_prefill(q, k_cache, v_cache, indptr(qo_lens), page_indptr,
                                   page_indices, last_len, *head, *tail)


# ------------------------------------------------------------------------------------------
# Sanity of the oracle itself (so that a wrong oracle cannot make the suite pass)
# ------------------------------------------------------------------------------------------
def test_oracle_matches_sdpa_and_alibi_table():
    torch.manual_seed(0)
    q, k, v = rand(5, 2, 8), rand(9, 2, 8), rand(9, 2, 8)
    out, lse = dense_request(q, k, v, sm_scale=0.3, causal=True)
    # SDPA with an explicit bottom-right causal mask
    vis = torch.ones(5, 9, dtype=torch.bool).tril(diagonal=9 - 5)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=vis, scale=0.3)
    torch.testing.assert_close(out, ref.transpose(0, 1))
    s = torch.einsum("qhd,khd->hqk", q, k) * 0.3
    nat = torch.logsumexp(s.masked_fill(~vis, float("-inf")), -1).T
    torch.testing.assert_close(lse * LN2, nat)
    # FlashInfer's published slopes for 8 heads and for 6 heads (n = 4: 1/4.. then 2^-1, 2^-3)
    torch.testing.assert_close(alibi_slopes_spec(8), torch.tensor([2.0 ** -(i + 1) for i in range(8)]))
    torch.testing.assert_close(alibi_slopes_spec(6),
                               torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8,
                                             2.0 ** -1, 2.0 ** -3]))


# ------------------------------------------------------------------------------------------
# single_prefill: every visibility rule and logit transform
# ------------------------------------------------------------------------------------------
SINGLE_CASES = [
    # id, qo, kv, hq, hkv, dqk, dvo, extra kwargs for op / oracle
    ("noncausal", 7, 11, 4, 4, 16, 16, {}),
    ("causal_bottom_right", 6, 13, 4, 2, 16, 16, dict(causal=True)),
    ("causal_square", 9, 9, 3, 1, 8, 8, dict(causal=True)),
    ("window_causal", 10, 17, 4, 2, 16, 16, dict(causal=True, window_left=3)),
    ("window_noncausal", 8, 12, 2, 2, 16, 16, dict(window_left=2)),
    ("window_zero", 5, 9, 2, 1, 8, 8, dict(causal=True, window_left=0)),
    ("soft_cap", 6, 10, 4, 4, 16, 16, dict(causal=True, cap=2.5)),
    ("alibi_6_heads", 7, 12, 6, 3, 16, 16, dict(causal=True, alibi=True)),
    ("alibi_noncausal_window", 5, 9, 8, 8, 8, 8, dict(window_left=4, alibi=True)),
    ("rope_llama", 6, 10, 4, 2, 16, 16, dict(causal=True, rope=(1.0, 1e4))),
    ("rope_scaled", 5, 8, 2, 2, 32, 32, dict(rope=(2.5, 5e5))),
    ("gqa_7_to_1", 6, 9, 7, 1, 16, 16, dict(causal=True)),
    ("dqk_ne_dvo", 6, 10, 4, 2, 24, 16, dict(causal=True)),
    ("dqk192_dvo128", 4, 6, 2, 1, 192, 128, dict(causal=True)),
    ("v_scale", 5, 7, 2, 2, 8, 8, dict(v_scale=0.37)),
    ("cap_alibi_window", 6, 11, 4, 2, 16, 16,
     dict(causal=True, cap=3.0, alibi=True, window_left=5)),
    ("cap_rope_window", 6, 11, 4, 2, 16, 16,
     dict(causal=True, cap=3.0, rope=(1.0, 1e4), window_left=5)),
]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("case", SINGLE_CASES, ids=[c[0] for c in SINGLE_CASES])
def test_single_prefill_rules(case, layout):
    _, qo, kv, hq, hkv, dqk, dvo, extra = case
    torch.manual_seed(zlib.crc32(repr((case[0], layout)).encode()))
    bsz = 2
    q = rand(bsz, qo, hq, dqk)
    if layout == "NHD":
        k, v = rand(bsz, kv, hkv, dqk), rand(bsz, kv, hkv, dvo)
    else:  # HND storage [B, Hkv, S, D], handed to the op as a permuted view
        k = rand(bsz, hkv, kv, dqk).transpose(1, 2)
        v = rand(bsz, hkv, kv, dvo).transpose(1, 2)
        assert hkv == 1 or not k.is_contiguous()
    sm_scale = 0.9 / math.sqrt(dqk)
    slopes = alibi_slopes_spec(hq) if extra.get("alibi") else None
    rope = extra.get("rope")
    out, lse = call_single(
        q, k, v, slopes=slopes, mask_mode=MASK_CAUSAL if extra.get("causal") else MASK_NONE,
        window_left=extra.get("window_left", -1), sm_scale=sm_scale, cap=extra.get("cap", 0.0),
        pos=POS_ALIBI if slopes is not None else (POS_ROPE_LLAMA if rope else POS_NONE),
        rope_scale=rope[0] if rope else 1.0, rope_theta=rope[1] if rope else 1e4,
        v_scale=extra.get("v_scale", 1.0))
    assert out.shape == (bsz, qo, hq, dvo) and out.dtype == torch.float64
    assert lse.shape == (bsz, qo, hq)
    for b in range(bsz):
        ro, rl = dense_request(q[b], k[b], v[b], sm_scale=sm_scale,
                               causal=extra.get("causal", False),
                               window_left=extra.get("window_left", -1),
                               soft_cap=extra.get("cap", 0.0), alibi_slopes=slopes, rope=rope,
                               v_scale=extra.get("v_scale", 1.0))
        assert_close_f64(out[b], ro)
        assert_lse(lse[b], rl, tol=dict(rtol=1e-6, atol=1e-6))


def test_single_prefill_custom_mask_per_batch_entry():
    """A custom mask replaces causal; the window still applies; bits of [B, Sq, Skv]."""
    torch.manual_seed(1)
    bsz, qo, kv, hq, hkv, d = 2, 5, 7, 4, 2, 16
    q, k, v = rand(bsz, qo, hq, d), rand(bsz, kv, hkv, d), rand(bsz, kv, hkv, d)
    masks = torch.rand(bsz, qo, kv) < 0.6
    masks[0, 2] = False  # a row that sees nothing
    packed, _ = pack_segments([masks.reshape(-1)])  # one bit string, no per-entry padding
    for window in (-1, 2):
        out, lse = call_single(q, k, v, packed=packed, mask_mode=MASK_CUSTOM,
                               window_left=window, sm_scale=0.4)
        for b in range(bsz):
            ro, rl = dense_request(q[b], k[b], v[b], sm_scale=0.4, mask=masks[b],
                                   window_left=window)
            assert_close_f64(out[b], ro)
            assert_lse(lse[b], rl)
        assert torch.equal(out[0, 2], torch.zeros_like(out[0, 2]))


def test_single_prefill_lse_is_base_2():
    torch.manual_seed(2)
    q, k, v = rand(1, 4, 2, 8), rand(1, 6, 2, 8), rand(1, 6, 2, 8)
    _, lse = call_single(q, k, v, sm_scale=0.5)
    s = torch.einsum("qhd,khd->qhk", q[0], k[0]) * 0.5
    torch.testing.assert_close(lse[0].double() * LN2, torch.logsumexp(s, -1))
    torch.testing.assert_close(lse[0].double(), torch.log2(torch.exp2(s * math.log2(math.e)).sum(-1)))


@pytest.mark.parametrize("in_dtype,out_dtype", [
    (torch.float16, None), (torch.float16, torch.float32), (torch.float32, torch.bfloat16),
    (torch.bfloat16, torch.float16),
])
def test_single_prefill_dtypes(in_dtype, out_dtype):
    torch.manual_seed(3)
    q, k, v = rand(1, 6, 4, 16, dtype=in_dtype), rand(1, 9, 2, 16, dtype=in_dtype), \
        rand(1, 9, 2, 16, dtype=in_dtype)
    out, lse = call_single(q, k, v, mask_mode=MASK_CAUSAL, sm_scale=0.25, out_dtype=out_dtype)
    assert out.dtype == (out_dtype or in_dtype)
    assert lse.dtype == torch.float32
    ro, rl = dense_request(q[0], k[0], v[0], sm_scale=0.25, causal=True)
    tol = dict(rtol=2e-2, atol=2e-2)
    assert_close_f64(out[0], ro, tol)
    assert_lse(lse[0], rl, dict(rtol=1e-3, atol=1e-3))


# ------------------------------------------------------------------------------------------
# batch_ragged_prefill
# ------------------------------------------------------------------------------------------
def _ragged_inputs(qo_lens, kv_lens, hq, hkv, dqk, dvo, dtype=torch.float64):
    q = rand(sum(qo_lens), hq, dqk, dtype=dtype)
    k = rand(sum(kv_lens), hkv, dqk, dtype=dtype)
    v = rand(sum(kv_lens), hkv, dvo, dtype=dtype)
    kp = indptr(kv_lens).tolist()
    ks = [k[kp[b]:kp[b + 1]] for b in range(len(kv_lens))]
    vs = [v[kp[b]:kp[b + 1]] for b in range(len(kv_lens))]
    return q, k, v, ks, vs


RAGGED_CASES = [
    # id, qo_lens, kv_lens, hq, hkv, kwargs
    ("causal_mixed_empty", [3, 0, 7, 5], [9, 4, 7, 0], 4, 2, dict(causal=True)),
    ("qo_gt_kv_causal", [6, 2], [3, 8], 2, 1, dict(causal=True)),
    ("window_noncausal", [4, 6], [10, 6], 4, 4, dict(window_left=2)),
    ("window_causal_gqa7", [5, 3], [8, 11], 7, 1, dict(causal=True, window_left=4)),
    ("sinks", [4, 5, 1], [6, 5, 9], 4, 2, dict(causal=True, sinks=True)),
    ("sinks_window_cap", [5, 4], [9, 4], 2, 2, dict(causal=True, sinks=True, window_left=1,
                                                    cap=1.5)),
    ("chunked", [8, 5], [21, 13], 2, 1, dict(chunk=4)),
    ("alibi_cap", [4, 6], [7, 6], 6, 2, dict(causal=True, alibi=True, cap=4.0)),
    ("rope", [3, 5], [10, 5], 4, 2, dict(causal=True, rope=(1.0, 1e4))),
    ("v_scale", [3, 2], [4, 5], 2, 2, dict(v_scale=1.7)),
]


@pytest.mark.parametrize("case", RAGGED_CASES, ids=[c[0] for c in RAGGED_CASES])
def test_ragged_rules(case):
    name, qo_lens, kv_lens, hq, hkv, extra = case
    torch.manual_seed(zlib.crc32(repr(name).encode()))
    d = 16
    q, k, v, ks, vs = _ragged_inputs(qo_lens, kv_lens, hq, hkv, d, d)
    sinks = (torch.randn(hq) * 1.5).float() if extra.get("sinks") else None
    slopes = alibi_slopes_spec(hq) if extra.get("alibi") else None
    rope = extra.get("rope")
    sm = 0.8 / math.sqrt(d)
    out, lse = call_ragged(
        q, k, v, qo_lens, kv_lens, slopes=slopes, sinks=sinks,
        mask_mode=MASK_CAUSAL if extra.get("causal") else MASK_NONE,
        window_left=extra.get("window_left", -1), chunk=extra.get("chunk", 0), sm_scale=sm,
        cap=extra.get("cap", 0.0),
        pos=POS_ALIBI if slopes is not None else (POS_ROPE_LLAMA if rope else POS_NONE),
        rope_scale=rope[0] if rope else 1.0, rope_theta=rope[1] if rope else 1e4,
        v_scale=extra.get("v_scale", 1.0))
    ro, rl = oracle_batch(q, ks, vs, qo_lens, sm_scale=sm, causal=extra.get("causal", False),
                          window_left=extra.get("window_left", -1), chunk=extra.get("chunk", 0),
                          soft_cap=extra.get("cap", 0.0), alibi_slopes=slopes, rope=rope,
                          sinks=sinks, v_scale=extra.get("v_scale", 1.0))
    assert out.shape == (sum(qo_lens), hq, d)
    assert_close_f64(out, ro)
    assert_lse(lse, rl, tol=dict(rtol=1e-6, atol=1e-6))
    # rows that see nothing: output exactly 0
    dead = torch.isinf(rl)
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))


def test_ragged_qo_gt_kv_has_dead_rows():
    """The case above really has rows that see nothing (qo_len > kv_len, causal)."""
    _, lse = oracle_batch(rand(8, 2, 4), [rand(3, 1, 4), rand(8, 1, 4)],
                          [rand(3, 1, 4), rand(8, 1, 4)], [6, 2], sm_scale=1.0, causal=True)
    assert torch.isinf(lse[:3]).all() and torch.isfinite(lse[3:]).all()


def test_ragged_custom_mask_byte_padded_segments():
    """B = 3 packed masks whose bit lengths are not multiples of 8 (segments byte-padded), with
    and without a window; one request has a row that sees nothing, one is empty."""
    torch.manual_seed(4)
    qo_lens, kv_lens, hq, hkv, d = [3, 0, 5, 2], [5, 3, 7, 3], 4, 2, 8
    q, k, v, ks, vs = _ragged_inputs(qo_lens, kv_lens, hq, hkv, d, d)
    masks = [torch.rand(n, m) < 0.55 for n, m in zip(qo_lens, kv_lens)]
    masks[2][1] = False
    masks[0][0, 0] = True  # at least something visible
    packed, moff = pack_segments(masks)
    assert any(n * m % 8 for n, m in zip(qo_lens, kv_lens))
    for window in (-1, 1):
        out, lse = call_ragged(q, k, v, qo_lens, kv_lens, packed=packed, mask_indptr=moff,
                               mask_mode=MASK_CUSTOM, window_left=window, sm_scale=0.5)
        ro, rl = oracle_batch(q, ks, vs, qo_lens, sm_scale=0.5, masks=masks, window_left=window)
        assert_close_f64(out, ro)
        assert_lse(lse, rl)


def test_ragged_custom_mask_unpadded_offsets_would_differ():
    """The byte padding matters: a bit string without per-request padding gives another
    answer (guards against a reference that ignores mask_indptr)."""
    torch.manual_seed(5)
    qo_lens, kv_lens = [3, 4], [3, 5]
    q, k, v, ks, vs = _ragged_inputs(qo_lens, kv_lens, 2, 2, 8, 8)
    masks = [torch.rand(3, 3) < 0.5, torch.rand(4, 5) < 0.5]
    masks[0][:, 0] = True
    masks[1][:, 0] = True
    packed, moff = pack_segments(masks)
    out, _ = call_ragged(q, k, v, qo_lens, kv_lens, packed=packed, mask_indptr=moff,
                         mask_mode=MASK_CUSTOM, sm_scale=0.5)
    ro, _ = oracle_batch(q, ks, vs, qo_lens, sm_scale=0.5, masks=masks)
    assert_close_f64(out, ro)
    wrong_off = torch.tensor([0, 1, moff[-1]], dtype=torch.int32)  # 9 bits start at byte 1
    out_wrong, _ = call_ragged(q, k, v, qo_lens, kv_lens, packed=packed, mask_indptr=wrong_off,
                               mask_mode=MASK_CUSTOM, sm_scale=0.5)
    assert not torch.allclose(out_wrong[3:], ro[3:])


def test_ragged_fully_masked_rows_zero_and_neg_inf():
    """Fully masked rows (custom mask row of zeros; kv_len 0; window before any key) with soft
    cap, sinks and ALiBi on: output exactly 0, LSE -inf, never NaN."""
    torch.manual_seed(6)
    qo_lens, kv_lens, hq, hkv, d = [3, 2, 2], [4, 0, 3], 4, 2, 8
    q, k, v, ks, vs = _ragged_inputs(qo_lens, kv_lens, hq, hkv, d, d)
    masks = [torch.ones(3, 4, dtype=torch.bool), torch.ones(2, 0, dtype=torch.bool),
             torch.ones(2, 3, dtype=torch.bool)]
    masks[0][1] = False
    masks[2][:] = False
    packed, moff = pack_segments(masks)
    sinks = torch.randn(hq).float()
    out, lse = call_ragged(q, k, v, qo_lens, kv_lens, packed=packed, mask_indptr=moff,
                           mask_mode=MASK_CUSTOM, sinks=sinks, slopes=alibi_slopes_spec(hq),
                           pos=POS_ALIBI, cap=2.0, sm_scale=0.5)
    dead = torch.tensor([False, True, False, True, True, True, True])
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert torch.equal(out[dead], torch.zeros_like(out[dead]))
    assert torch.isneginf(lse[dead]).all()
    assert torch.isfinite(lse[~dead]).all()
    ro, rl = oracle_batch(q, ks, vs, qo_lens, sm_scale=0.5, masks=masks, sinks=sinks,
                          alibi_slopes=alibi_slopes_spec(hq), soft_cap=2.0)
    assert_close_f64(out, ro)
    assert_lse(lse, rl, tol=dict(rtol=1e-6, atol=1e-6))


def test_ragged_dtypes_and_out_dtype():
    torch.manual_seed(7)
    qo_lens, kv_lens = [4, 6], [9, 6]
    q, k, v, ks, vs = _ragged_inputs(qo_lens, kv_lens, 4, 2, 16, 8, dtype=torch.float16)
    for out_dtype in (None, torch.float32, torch.bfloat16):
        out, lse = call_ragged(q, k, v, qo_lens, kv_lens, mask_mode=MASK_CAUSAL, sm_scale=0.3,
                               out_dtype=out_dtype)
        assert out.dtype == (out_dtype or torch.float16) and lse.dtype == torch.float32
        ro, rl = oracle_batch(q, ks, vs, qo_lens, sm_scale=0.3, causal=True)
        assert_close_f64(out, ro, dict(rtol=2e-2, atol=2e-2))
        assert_lse(lse, rl, dict(rtol=1e-3, atol=1e-3))


# ------------------------------------------------------------------------------------------
# batch_paged_prefill
# ------------------------------------------------------------------------------------------
def make_paged(kv_lens, page, hkv, dqk, dvo, *, layout="NHD", form="5d", dtype=torch.float64,
               seed=0):
    """A shuffled page table over a cache with spare pages. Returns the op's logical NHD caches
    (views), the page table and per-request contiguous k/v read back token by token."""
    g = torch.Generator().manual_seed(seed)
    npages = [-(-n // page) for n in kv_lens]
    total = sum(npages) + 3
    perm = torch.randperm(total, generator=g)[: sum(npages)].to(torch.int32)
    if form == "5d":
        if layout == "NHD":
            cache = rand(total, 2, page, hkv, dqk, dtype=dtype)
            kc, vc = cache[:, 0], cache[:, 1]
        else:
            cache = rand(total, 2, hkv, page, dqk, dtype=dtype)
            kc, vc = cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)
    else:  # (k, v) tuple of 4-D tensors, v with its own head dim
        if layout == "NHD":
            kc, vc = rand(total, page, hkv, dqk, dtype=dtype), rand(total, page, hkv, dvo, dtype=dtype)
        else:
            kc = rand(total, hkv, page, dqk, dtype=dtype).transpose(1, 2)
            vc = rand(total, hkv, page, dvo, dtype=dtype).transpose(1, 2)
    page_indptr = indptr(npages)
    last = torch.tensor([n - (p - 1) * page if p else page for n, p in zip(kv_lens, npages)],
                        dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(kv_lens):
        rows_k, rows_v = [], []
        for t in range(n):
            pg = int(perm[int(page_indptr[b]) + t // page])
            rows_k.append(kc[pg, t % page])
            rows_v.append(vc[pg, t % page])
        ks.append(torch.stack(rows_k) if rows_k else kc.new_zeros(0, hkv, kc.shape[-1]))
        vs.append(torch.stack(rows_v) if rows_v else vc.new_zeros(0, hkv, vc.shape[-1]))
    return kc, vc, page_indptr, perm, last, ks, vs


PAGED_CASES = [
    # id, page, layout, form, qo_lens, kv_lens, hq, hkv, kwargs
    ("p1_nhd_5d", 1, "NHD", "5d", [3, 4], [5, 7], 4, 2, dict(causal=True)),
    ("p5_hnd_5d", 5, "HND", "5d", [4, 0, 6], [12, 3, 6], 4, 1, dict(causal=True)),
    ("p16_nhd_tuple", 16, "NHD", "tuple", [5, 3], [21, 16], 7, 1, dict(causal=True)),
    ("p16_hnd_tuple_window", 16, "HND", "tuple", [6, 2], [33, 2], 4, 2,
     dict(causal=True, window_left=7)),
    ("p5_qo_gt_kv_sinks", 5, "NHD", "5d", [7, 3], [4, 11], 2, 2, dict(causal=True, sinks=True)),
    ("p5_alibi_rope", 5, "HND", "tuple", [4, 5], [9, 5], 4, 2, dict(alibi=True, window_left=3)),
    ("p1_rope", 1, "HND", "5d", [3, 2], [6, 4], 2, 1, dict(causal=True, rope=(1.0, 1e4))),
]


@pytest.mark.parametrize("case", PAGED_CASES, ids=[c[0] for c in PAGED_CASES])
def test_paged_rules(case):
    name, page, layout, form, qo_lens, kv_lens, hq, hkv, extra = case
    torch.manual_seed(zlib.crc32(repr(name).encode()))
    dqk, dvo = 16, (8 if form == "tuple" else 16)
    kc, vc, pind, pidx, last, ks, vs = make_paged(kv_lens, page, hkv, dqk, dvo, layout=layout,
                                                  form=form, seed=len(name))
    q = rand(sum(qo_lens), hq, dqk)
    sinks = (torch.randn(hq) * 2).float() if extra.get("sinks") else None
    slopes = alibi_slopes_spec(hq) if extra.get("alibi") else None
    rope = extra.get("rope")
    sm = 1.1 / math.sqrt(dqk)
    out, lse = call_paged(
        q, kc, vc, qo_lens, pind, pidx, last, slopes=slopes, sinks=sinks,
        mask_mode=MASK_CAUSAL if extra.get("causal") else MASK_NONE,
        window_left=extra.get("window_left", -1), sm_scale=sm,
        pos=POS_ALIBI if slopes is not None else (POS_ROPE_LLAMA if rope else POS_NONE),
        rope_scale=rope[0] if rope else 1.0, rope_theta=rope[1] if rope else 1e4)
    ro, rl = oracle_batch(q, ks, vs, qo_lens, sm_scale=sm, causal=extra.get("causal", False),
                          window_left=extra.get("window_left", -1), alibi_slopes=slopes,
                          rope=rope, sinks=sinks)
    assert out.shape == (sum(qo_lens), hq, dvo)
    assert_close_f64(out, ro)
    assert_lse(lse, rl, tol=dict(rtol=1e-6, atol=1e-6))


def test_paged_custom_mask():
    torch.manual_seed(8)
    qo_lens, kv_lens, page = [3, 5], [7, 6], 5
    kc, vc, pind, pidx, last, ks, vs = make_paged(kv_lens, page, 2, 8, 8, seed=3)
    q = rand(sum(qo_lens), 4, 8)
    masks = [torch.rand(n, m) < 0.5 for n, m in zip(qo_lens, kv_lens)]
    packed, moff = pack_segments(masks)
    out, lse = call_paged(q, kc, vc, qo_lens, pind, pidx, last, packed=packed,
                          mask_indptr=moff, mask_mode=MASK_CUSTOM, sm_scale=0.5)
    ro, rl = oracle_batch(q, ks, vs, qo_lens, sm_scale=0.5, masks=masks)
    assert_close_f64(out, ro)
    assert_lse(lse, rl)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_fp8_kv_upcast_with_scales(fp8):
    """fp8 KV is upcast; k_scale folds into sm_scale (caller side), v_scale scales the output
    and leaves the LSE alone."""
    torch.manual_seed(9)
    qo_lens, kv_lens, page, hq, hkv, d = [4, 3], [9, 5], 5, 4, 2, 16
    kc, vc, pind, pidx, last, ks, vs = make_paged(kv_lens, page, hkv, d, d, dtype=fp8, seed=4)
    assert kc.dtype == fp8
    q = rand(sum(qo_lens), hq, d, dtype=torch.float16)
    k_scale, v_scale, sm = 0.8, 1.9, d ** -0.5
    out, lse = call_paged(q, kc, vc, qo_lens, pind, pidx, last, mask_mode=MASK_CAUSAL,
                          sm_scale=sm * k_scale, v_scale=v_scale)
    assert out.dtype == torch.float16
    ro, rl = oracle_batch(q, [x.double() * k_scale for x in ks], vs, qo_lens, sm_scale=sm,
                          causal=True, v_scale=v_scale)
    assert_close_f64(out, ro, dict(rtol=1e-2, atol=1e-2))
    assert_lse(lse, rl, dict(rtol=1e-4, atol=1e-4))


# ------------------------------------------------------------------------------------------
# pod_prefill_decode
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["plain", "alibi_window_cap"])
def test_pod_prefill_and_decode(variant):
    torch.manual_seed(10)
    hq, hkv, d = 4, 2, 16
    qo_p, kv_p, kv_d = [5, 3], [9, 3], [6, 11, 1]
    qo_d = [1, 1, 1]
    kcp, vcp, pind_p, pidx_p, last_p, ks_p, vs_p = make_paged(kv_p, 5, hkv, d, d, seed=1)
    kcd, vcd, pind_d, pidx_d, last_d, ks_d, vs_d = make_paged(kv_d, 4, hkv, d, d, layout="HND",
                                                              seed=2)
    q_p, q_d = rand(sum(qo_p), hq, d), rand(sum(qo_d), hq, d)
    slopes = alibi_slopes_spec(hq) if variant != "plain" else None
    win_p, cap_p, win_d, cap_d = (2, 3.0, 3, 1.5) if variant != "plain" else (-1, 0.0, -1, 0.0)
    g = hq // hkv
    bm = schedule.block_m_for(d, d, g)
    w_p = schedule.build_work(qo_p, g, bm)
    w_d = schedule.build_work(qo_d, g, bm)
    work = torch.cat([torch.cat([torch.zeros(len(w_p), 1, dtype=torch.int32), w_p], 1),
                      torch.cat([torch.ones(len(w_d), 1, dtype=torch.int32), w_d], 1)])
    out_p, lse_p, out_d, lse_d = OPS.pod_prefill_decode(
        q_p, kcp, vcp, indptr(qo_p), pind_p, pidx_p, last_p,
        q_d, kcd, vcd, indptr(qo_d), pind_d, pidx_d, last_d,
        work, None, None, slopes, bm,
        MASK_CAUSAL, win_p, 0.3, cap_p, MASK_NONE, win_d, 0.2, cap_d,
        POS_ALIBI if slopes is not None else POS_NONE, 1.0, 1e4, 1.0, None)
    rp, lp = oracle_batch(q_p, ks_p, vs_p, qo_p, sm_scale=0.3, causal=True, window_left=win_p,
                          soft_cap=cap_p, alibi_slopes=slopes)
    rd, ld = oracle_batch(q_d, ks_d, vs_d, qo_d, sm_scale=0.2, window_left=win_d,
                          soft_cap=cap_d, alibi_slopes=slopes)
    assert_close_f64(out_p, rp)
    assert_close_f64(out_d, rd)
    assert_lse(lse_p, lp, dict(rtol=1e-6, atol=1e-6))
    assert_lse(lse_d, ld, dict(rtol=1e-6, atol=1e-6))
