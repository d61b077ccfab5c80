"""Public prefill API (single prefill, paged and ragged batch wrappers) on CPU against the
dense float64 oracle of tests/helpers.py (a per-request, per-head loop with
torch.softmax, never ops.reference). Outputs are poisoned with NaN before runs that write into
caller buffers; NaN never passes (assert_close with equal_nan=False)."""

from __future__ import annotations

import math

import pytest
import torch

import compiled_attn as fi

from .helpers import (D64, WS, check, counted_copies, dense, dense_batch, indptr, make_paged,
                      paged_graph_bufs, rand)
from tests.helpers import batch_invariance, check_fixed_split_plan, poisoned_tail, ragged_kv  # noqa: F401

# --------------------------------------------------------------------------------------------
# single prefill
# --------------------------------------------------------------------------------------------
SINGLE_CASES = [
    # qo, kv, hq, hkv, dqk, dvo, causal, layout
    (1, 1, 2, 2, 8, 8, True, "NHD"),
    (5, 17, 4, 2, 16, 16, True, "NHD"),
    (17, 17, 7, 1, 8, 8, True, "HND"),
    (13, 40, 4, 4, 24, 16, False, "NHD"),
    (9, 3, 2, 1, 8, 8, False, "HND"),
]


@pytest.mark.parametrize("qo,kv,hq,hkv,dqk,dvo,causal,layout", SINGLE_CASES)
def test_single_prefill_grid(qo, kv, hq, hkv, dqk, dvo, causal, layout):
    q, k, v = rand(qo, hq, dqk, seed=1), rand(kv, hkv, dqk, seed=2), rand(kv, hkv, dvo, seed=3)
    kk, vv = (k, v) if layout == "NHD" else (k.transpose(0, 1).contiguous(),
                                             v.transpose(0, 1).contiguous())
    out, lse = fi.single_prefill_with_kv_cache(q, kk, vv, causal=causal, kv_layout=layout,
                                               return_lse=True)
    assert out.shape == (qo, hq, dvo) and lse.dtype == torch.float32
    check(out, lse, *dense(q, k, v, causal=causal))
    out2, lse2 = fi.single_prefill_with_kv_cache_return_lse(q, kk, vv, causal=causal,
                                                            kv_layout=layout)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)
    # return_lse=False wins over the default, as over FlashInfer's functools.partial
    out3 = fi.single_prefill_with_kv_cache_return_lse(q, kk, vv, causal=causal,
                                                      kv_layout=layout, return_lse=False)
    assert torch.is_tensor(out3) and torch.equal(out, out3)


@pytest.mark.parametrize("feature", ["window", "window_noncausal", "soft_cap", "alibi", "rope",
                                     "mask_bool", "mask_packed", "sm_scale"])
def test_single_prefill_features(feature):
    qo, kv, hq, hkv, d = 11, 19, 4, 2, 16
    q, k, v = rand(qo, hq, d, seed=4), rand(kv, hkv, d, seed=5), rand(kv, hkv, d, seed=6)
    mask = torch.rand(qo, kv, generator=torch.Generator().manual_seed(7)) > 0.4
    mask[3] = False  # a row that sees nothing: output 0, LSE -inf
    api, ref = {}, {}
    if feature == "window":
        api = ref = dict(causal=True, window_left=4)
    elif feature == "window_noncausal":
        api = ref = dict(window_left=3)
    elif feature == "soft_cap":
        api, ref = dict(causal=True, logits_soft_cap=2.5), dict(causal=True, soft_cap=2.5)
    elif feature == "alibi":
        api, ref = dict(causal=True, pos_encoding_mode="ALIBI"), dict(causal=True, alibi=True)
    elif feature == "rope":
        api = dict(causal=True, pos_encoding_mode="ROPE_LLAMA", rope_scale=2.0, rope_theta=500.0)
        ref = dict(causal=True, rope=True, rope_scale=2.0, rope_theta=500.0)
    elif feature == "mask_bool":
        api, ref = dict(custom_mask=mask, causal=True, window_left=6), dict(mask=mask,
                                                                            window_left=6)
    elif feature == "mask_packed":
        api = dict(packed_custom_mask=fi.packbits(mask.reshape(-1), bitorder="little"))
        ref = dict(mask=mask)
    elif feature == "sm_scale":
        api = ref = dict(sm_scale=0.37, causal=True)
    out, lse = fi.single_prefill_with_kv_cache(q, k, v, return_lse=True, **api)
    r_out, r_lse = dense(q, k, v, **ref)
    check(out, lse, r_out, r_lse)
    if "mask" in feature:
        assert torch.all(out[3] == 0) and torch.all(lse[3] == -math.inf)


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_single_prefill_fp8_kv_scales_and_out_dtype(fp8):
    q = rand(6, 4, 16, seed=8, dtype=torch.float32)
    k8, v8 = rand(9, 2, 16, seed=9).to(fp8), rand(9, 2, 16, seed=10).to(fp8)
    out, lse = fi.single_prefill_with_kv_cache(q, k8, v8, causal=True, k_scale=0.5,
                                               v_scale=torch.tensor(3.0), return_lse=True,
                                               o_dtype=torch.float64)
    assert out.dtype == torch.float64
    r_out, r_lse = dense(q, k8.to(D64) * 0.5, v8.to(D64) * 3.0, causal=True)
    check(out, lse, r_out, r_lse, tol=dict(atol=1e-5, rtol=1e-5))


def test_single_prefill_causal_needs_kv_ge_qo():
    q, k = rand(5, 2, 8), rand(3, 2, 8)
    with pytest.raises(ValueError, match="kv_len >= qo_len"):
        fi.single_prefill_with_kv_cache(q, k, k, causal=True)
    # A custom mask replaces causal, so the rule does not apply.
    fi.single_prefill_with_kv_cache(q, k, k, causal=True,
                                    custom_mask=torch.ones(5, 3, dtype=torch.bool))


def test_single_prefill_unsupported_args_raise():
    q, k = rand(3, 2, 8), rand(3, 2, 8)
    with pytest.raises(NotImplementedError, match="scale_q"):
        fi.single_prefill_with_kv_cache(q, k, k, scale_q=torch.ones(2))
    with pytest.raises(NotImplementedError, match="kv_cache_sf"):
        fi.single_prefill_with_kv_cache(q, k, k, kv_cache_sf=(k, k))
    with pytest.raises(NotImplementedError, match="cudnn"):
        fi.single_prefill_with_kv_cache(q, k, k, backend="cudnn")


# --------------------------------------------------------------------------------------------
# paged wrapper
# --------------------------------------------------------------------------------------------
# qo > kv (request 2), an empty query (request 1), kv 0 (request 4), odd lengths.
QO, KV = [5, 0, 9, 1, 3], [13, 7, 4, 16, 0]


@pytest.mark.parametrize("page,layout,fmt,hq,hkv", [
    (1, "NHD", "5d", 4, 2),
    (5, "HND", "tuple", 7, 1),
    (16, "NHD", "tuple", 4, 4),
    (5, "HND", "5d", 6, 3),
])
def test_paged_grid(page, layout, fmt, hq, hkv):
    d = 8
    cache, kvi, idx, last, ks, vs = make_paged(KV, hkv, d, d, page, layout=layout, fmt=fmt)
    q = rand(sum(QO), hq, d, seed=11)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, layout)
    w.plan(indptr(QO), kvi, idx, last, hq, hkv, d, page, causal=True, q_data_type=D64)
    out, lse = w.run(q, cache, return_lse=True)
    check(out, lse, *dense_batch(q, QO, ks, vs, causal=True))
    out2, lse2 = w.run_return_lse(q, cache)
    assert torch.equal(out, out2) and torch.equal(lse, lse2)


@pytest.mark.parametrize("feature", ["window", "soft_cap", "alibi", "rope", "sinks",
                                     "noncausal", "run_window"])
def test_paged_features(feature):
    page, hq, hkv, d = 5, 4, 2, 8
    cache, kvi, idx, last, ks, vs = make_paged(KV, hkv, d, d, page, fmt="tuple", seed=12)
    q = rand(sum(QO), hq, d, seed=13)
    plan_kw, run_kw, ref = dict(causal=True), {}, dict(causal=True)
    if feature == "window":
        plan_kw["window_left"] = ref["window_left"] = 3
    elif feature == "soft_cap":
        plan_kw["logits_soft_cap"] = ref["soft_cap"] = 1.5
    elif feature == "alibi":
        plan_kw["pos_encoding_mode"], ref["alibi"] = "ALIBI", True
    elif feature == "rope":
        plan_kw.update(pos_encoding_mode="ROPE_LLAMA", rope_theta=1000.0)
        ref.update(rope=True, rope_theta=1000.0)
    elif feature == "sinks":
        run_kw["sinks"] = ref["sinks"] = torch.tensor([0.5, -1.0, 2.0, 0.0])
    elif feature == "noncausal":
        plan_kw, ref = {}, {}
    elif feature == "run_window":
        run_kw["window_left"] = ref["window_left"] = 2  # a run-time override takes effect
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(indptr(QO), kvi, idx, last, hq, hkv, d, page, q_data_type=D64, **plan_kw)
    out, lse = w.run(q, cache, return_lse=True, **run_kw)
    check(out, lse, *dense_batch(q, QO, ks, vs, **ref))


@pytest.mark.parametrize("packed", [False, True])
def test_paged_custom_mask_batch(packed):
    page, hq, hkv, d = 4, 4, 1, 8
    cache, kvi, idx, last, ks, vs = make_paged(KV, hkv, d, d, page, seed=14)
    q = rand(sum(QO), hq, d, seed=15)
    g = torch.Generator().manual_seed(16)
    masks = [torch.rand(a, b, generator=g) > 0.3 for a, b in zip(QO, KV)]
    flat = torch.cat([m.reshape(-1) for m in masks])
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    if packed:
        mask_ind = indptr([a * b for a, b in zip(QO, KV)])
        pk, new_ind = fi.segment_packbits(flat, mask_ind, bitorder="little")
        # Per-request byte offsets (FlashInfer's plan uses bit offsets for B > 1).
        assert new_ind.tolist() == indptr([(a * b + 7) // 8 for a, b in zip(QO, KV)]).tolist()
        mask_kw = dict(packed_custom_mask=pk)
    else:
        mask_kw = dict(custom_mask=flat)
    w.plan(indptr(QO), kvi, idx, last, hq, hkv, d, page, causal=True, window_left=5,
           q_data_type=D64, **mask_kw)
    out, lse = w.run(q, cache, return_lse=True)
    check(out, lse, *dense_batch(q, QO, ks, vs, masks=masks, window_left=5))


def test_paged_fp8_scales_dqk_ne_dvo_out_lse_buffers():
    page, hq, hkv, dqk, dvo = 5, 4, 2, 12, 8
    cache, kvi, idx, last, ks, vs = make_paged(KV, hkv, dqk, dvo, page, fmt="tuple",
                                               dtype=torch.float8_e4m3fn, seed=17)
    q = rand(sum(QO), hq, dqk, seed=18, dtype=torch.float32)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(indptr(QO), kvi, idx, last, hq, hkv, dqk, page, head_dim_vo=dvo, causal=True,
           q_data_type=torch.float32, kv_data_type=torch.float8_e4m3fn,
           o_data_type=torch.float64)
    out = torch.full((sum(QO), hq, dvo), math.nan, dtype=D64)
    lse = torch.full((sum(QO), hq), math.nan, dtype=torch.float32)
    res = w.run(q, cache, k_scale=0.25, v_scale=2.0, q_scale=2.0, out=out, lse=lse,
                return_lse=True)
    assert res[0] is out and res[1] is lse
    ref = dense_batch(q, QO, [k * 0.5 for k in ks], [v * 2.0 for v in vs], causal=True)
    check(out, lse, *ref, tol=dict(atol=1e-5, rtol=1e-5))


def test_paged_replan_new_lengths_and_no_stale_mask():
    page, hq, hkv, d = 3, 2, 1, 8
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    cache, kvi, idx, last, ks, vs = make_paged(KV, hkv, d, d, page, seed=19)
    q = rand(sum(QO), hq, d, seed=20)
    flat = torch.zeros(sum(a * b for a, b in zip(QO, KV)), dtype=torch.bool)
    w.plan(indptr(QO), kvi, idx, last, hq, hkv, d, page, custom_mask=flat, q_data_type=D64)
    out = w.run(q, cache)
    assert torch.all(out == 0)
    qo2, kv2 = [2, 7], [9, 3]
    cache2, kvi2, idx2, last2, ks2, vs2 = make_paged(kv2, hkv, d, d, page, seed=21)
    q2 = rand(9, hq, d, seed=22)
    w.plan(indptr(qo2), kvi2, idx2, last2, hq, hkv, d, page, causal=True, q_data_type=D64)
    out2, lse2 = w.run(q2, cache2, return_lse=True)
    check(out2, lse2, *dense_batch(q2, qo2, ks2, vs2, causal=True))


def test_paged_replan_into_the_last_plans_tensors(monkeypatch):
    """A re-plan of the same shapes writes into the last plan's tensors, and the run() after it
    computes the new plan's attention; a re-plan whose checks fail leaves the last plan as it
    was; one that fails after its first write leaves no plan (its tensors hold part of the new
    one), and run() says so."""
    page, hq, hkv, d, qo = 3, 2, 1, 8, [2, 5]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    q = rand(sum(qo), hq, d, seed=24)
    tables = [make_paged(kv, hkv, d, d, page, seed=s) for kv, s in (([7, 9], 25), ([8, 9], 26))]
    for cache, kvi, idx, last, ks, vs in tables:  # (6 pages each: the same shapes)
        w.plan(indptr(qo), kvi, idx, last, hq, hkv, d, page, causal=True, q_data_type=D64)
        if cache is tables[0][0]:
            kept = [t for t in w._plan.__dict__.values() if torch.is_tensor(t)]
        check(w.run(q, cache), None, *dense_batch(q, qo, ks, vs, causal=True)[:1], None)
    assert [t for t in w._plan.__dict__.values() if torch.is_tensor(t)] == kept
    cache, kvi, idx, last, ks, vs = tables[1]
    with pytest.raises(ValueError, match="paged_kv_last_page_len: entry 0 is 0"):
        w.plan(indptr(qo), kvi, idx, last * 0, hq, hkv, d, page, causal=True, q_data_type=D64)
    check(w.run(q, cache), None, *dense_batch(q, qo, ks, vs, causal=True)[:1], None)

    def fail(*a, **kw):
        raise RuntimeError("planning failed")

    monkeypatch.setattr(w, "_plan_chunks", fail)
    with pytest.raises(RuntimeError, match="planning failed"):
        w.plan(indptr(qo), *tables[0][1:4], hq, hkv, d, page, causal=True, q_data_type=D64)
    with pytest.raises(RuntimeError, match=r"run\(\) before plan\(\)"):
        w.run(q, cache)
    monkeypatch.undo()
    w.plan(indptr(qo), kvi, idx, last, hq, hkv, d, page, causal=True, q_data_type=D64)
    check(w.run(q, cache), None, *dense_batch(q, qo, ks, vs, causal=True)[:1], None)


def test_paged_cuda_graph_buffers_path():
    """use_cuda_graph=True on CPU: plan copies into the caller's buffers and a fixed work
    buffer; re-plans within capacity reuse the same tensors (what a captured graph replays)."""
    page, hq, hkv, d, b = 4, 4, 2, 8, 3
    bufs = dict(paged_graph_bufs(b, 32), custom_mask_buf=torch.zeros(64, dtype=torch.uint8),
                mask_indptr_buf=torch.zeros(b + 1, dtype=torch.int32))
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **bufs)
    assert w.is_cuda_graph_enabled
    ids = None
    for seed, (qo, kv) in enumerate([([6, 3, 5], [9, 3, 20]), ([2, 0, 4], [5, 1, 4])]):
        cache, kvi, idx, last, ks, vs = make_paged(kv, hkv, d, d, page, seed=30 + seed)
        w.plan(indptr(qo), kvi, idx, last, hq, hkv, d, page, causal=True, q_data_type=D64)
        p = w._plan
        assert p.qo_indptr is bufs["qo_indptr_buf"] and p.kv_indices is bufs["paged_kv_indices_buf"]
        work_ids = p.work.data_ptr()
        ids = ids or work_ids
        assert work_ids == ids  # the work list lives in one fixed buffer
        n_items = sum(-(-(n * (hq // hkv)) // p.block_m) for n in qo)
        assert torch.all(p.work[n_items:, 0] == -1)  # padding rows: request -1, skipped
        q = rand(sum(qo), hq, d, seed=40 + seed)
        out, lse = w.run(q, cache, return_lse=True)
        check(out, lse, *dense_batch(q, qo, ks, vs, causal=True))
    # Over capacity: more rows than the first plan, more pages than the buffer.
    cache, kvi, idx, last, _, _ = make_paged([9, 3, 20], hkv, d, d, page)
    with pytest.raises(ValueError, match="exceed the 14 of the first plan"):
        w.plan(indptr([6, 3, 6]), kvi, idx, last, hq, hkv, d, page, q_data_type=D64)
    with pytest.raises(ValueError, match="batch size 2 differs"):
        w.plan(indptr([1, 1]), kvi[:3], idx[:int(kvi[2])], last[:2], hq, hkv, d, page,
               q_data_type=D64)
    # a larger batch: the batch size named, not the indptr buffers (which hold exactly B + 1)
    more = make_paged([9, 3, 4, 2], hkv, d, d, page)
    with pytest.raises(ValueError, match="batch size 4 differs"):
        w.plan(indptr([1, 1, 1, 1]), *more[1:4], hq, hkv, d, page, q_data_type=D64)
    with pytest.raises(ValueError, match="paged_kv_indices_buf: holds 32 entries"):
        big = make_paged([40, 40, 60], hkv, d, d, page)
        w.plan(indptr([1, 1, 1]), big[1], big[2], big[3], hq, hkv, d, page, q_data_type=D64)




def test_cuda_graph_plans_keep_the_first_plans_tile(monkeypatch):
    """A CUDA-graph plan's tile height is its first plan's: with the policy's
    graph_decode_tile, decode rows (at most ops.tiles.DECODE_ROWS packed rows a request) on
    pages the Gluon kernel reads by boxes take the 64-row tile, other first plans the 128-row
    tile for any key length, and later plans keep it whatever their rows (the captured launch
    cannot change its tile)."""
    from compiled_attn.ops import choose

    from compiled_attn.ops.policy import POLICY

    monkeypatch.setattr(choose, "INTERPRET", False)
    monkeypatch.setattr(choose, "_plan_device", lambda: choose.H100)
    page, hq, hkv, d = 16, 8, 2, 128

    def plans(*qos):
        w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(3, 64))
        tiles = []
        for qo in qos:
            _, kvi, idx, last, _, _ = make_paged([300, 40, 17], hkv, d, d, page)
            w.plan(indptr(qo), kvi, idx, last, hq, hkv, d, page, causal=True,
                   q_data_type=torch.bfloat16)
            tiles.append(w._plan.block_m)
        return tiles

    assert plans([16, 1, 1], [18, 0, 0], [1, 1, 1]) == [64, 64, 64]  # (the default)
    assert plans([18, 0, 0], [1, 1, 1]) == [128, 128]
    monkeypatch.setattr(POLICY, "graph_decode_tile", False)
    assert plans([16, 1, 1], [1, 1, 1]) == [128, 128]
    # eager plans choose per plan; fixed-split ones (batch-invariant) for any batch
    _, kvi, idx, last, _, _ = make_paged([300, 40, 17], hkv, d, d, page)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
    tiles = []
    for split in (None, 4):
        w.plan(indptr([1, 1, 1]), kvi, idx, last, hq, hkv, d, page, causal=True,
               q_data_type=torch.bfloat16, fixed_split_size=split)
        tiles.append(w._plan.block_m)
    assert tiles == [64, 128]


def test_paged_indices_buffer_longer_than_indptr():
    """FlashInfer reads paged_kv_indices[:paged_kv_indptr[-1]] only, and its batch-invariance
    test re-plans a sub-batch with the whole buffer (as serving engines do with buffers sized
    for the largest batch): the entries past indptr[-1] are neither read nor checked, in eager
    and CUDA-graph plans (the graph buffer needs room for indptr[-1] entries only)."""
    qo, kv, page, hq, hkv, d = [3, 5, 2], [9, 4, 11], 4, 4, 2, 8
    cache, kvi, idx, last, ks, vs = make_paged(kv, hkv, d, d, page, seed=50)
    buf = poisoned_tail(idx, cache.shape[0])
    q = rand(sum(qo), hq, d, seed=51)
    bufs = paged_graph_bufs(3, idx.numel() + 1)
    for w in (fi.BatchPrefillWithPagedKVCacheWrapper(WS),
              fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **bufs)):
        w.plan(indptr(qo), kvi, buf, last, hq, hkv, d, page, causal=True, q_data_type=D64)
        out, lse = w.run(q, cache, return_lse=True)
        check(out, lse, *dense_batch(q, qo, ks, vs, causal=True))
    # the sub-batch of the first two requests, planned with the same buffer
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(indptr(qo[:2]), kvi[:3], buf, last[:2], hq, hkv, d, page, causal=True,
           q_data_type=D64)
    n = sum(qo[:2])
    out, lse = w.run(q[:n], cache, return_lse=True)
    check(out, lse, *dense_batch(q[:n], qo[:2], ks[:2], vs[:2], causal=True))
    # a buffer shorter than indptr[-1] still raises; a negative page in use still does
    with pytest.raises(ValueError, match="paged_kv_indices holds only"):
        w.plan(indptr(qo), kvi, idx[:-1], last, hq, hkv, d, page, q_data_type=D64)
    bad = buf.clone()
    bad[0] = -1
    with pytest.raises(ValueError, match="paged_kv_indices: entry 0 is -1"):
        w.plan(indptr(qo), kvi, bad, last, hq, hkv, d, page, q_data_type=D64)


# --------------------------------------------------------------------------------------------
# ragged wrapper
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("layout,hq,hkv,dqk,dvo,feature", [
    ("NHD", 7, 1, 8, 8, "causal"),
    ("HND", 4, 2, 12, 8, "causal"),
    ("NHD", 4, 4, 8, 8, "mask"),
    ("HND", 6, 2, 8, 8, "window_softcap"),
    ("NHD", 4, 2, 8, 8, "alibi_rope_noncausal"),
])
def test_ragged(layout, hq, hkv, dqk, dvo, feature):
    k, v, ks, vs = ragged_kv(KV, hkv, dqk, dvo, seed=50, layout=layout)
    q = rand(sum(QO), hq, dqk, seed=52)
    plan_kw, ref, masks = dict(causal=True), dict(causal=True), None
    if feature == "mask":
        g = torch.Generator().manual_seed(53)
        masks = [torch.rand(a, b, generator=g) > 0.5 for a, b in zip(QO, KV)]
        plan_kw = dict(custom_mask=torch.cat([m.reshape(-1) for m in masks]), causal=True)
        ref = {}
    elif feature == "window_softcap":
        plan_kw.update(window_left=2, logits_soft_cap=3.0)
        ref.update(window_left=2, soft_cap=3.0)
    elif feature == "alibi_rope_noncausal":
        plan_kw, ref = dict(pos_encoding_mode="ROPE_LLAMA"), dict(rope=True)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, layout)
    w.plan(indptr(QO), indptr(KV), hq, hkv, dqk, dvo, q_data_type=D64, **plan_kw)
    out, lse = w.run(q, k, v, return_lse=True)
    check(out, lse, *dense_batch(q, QO, ks, vs, masks=masks, **ref))
    if feature == "alibi_rope_noncausal":
        w.plan(indptr(QO), indptr(KV), hq, hkv, dqk, dvo, pos_encoding_mode="ALIBI",
               q_data_type=D64)
        out, lse = w.run(q, k, v, return_lse=True)
        check(out, lse, *dense_batch(q, QO, ks, vs, alibi=True))


def test_ragged_fp8_scales_take_effect_and_replan_drops_mask():
    hq, hkv, d = 4, 2, 8
    k, v, ks, vs = ragged_kv(KV, hkv, d, d, seed=60)
    k8, v8 = k.to(torch.float8_e5m2), v.to(torch.float8_e5m2)
    q = rand(sum(QO), hq, d, seed=61, dtype=torch.float32)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    mask = torch.zeros(sum(a * b for a, b in zip(QO, KV)), dtype=torch.bool)
    w.plan(indptr(QO), indptr(KV), hq, hkv, d, custom_mask=mask, q_data_type=torch.float32,
           kv_data_type=torch.float8_e5m2)
    assert torch.all(w.run(q, k8, v8) == 0)
    w.plan(indptr(QO), indptr(KV), hq, hkv, d, causal=True, q_data_type=torch.float32,
           kv_data_type=torch.float8_e5m2)  # the re-plan has no mask: none may survive
    out, lse = w.run(q, k8, v8, k_scale=2.0, v_scale=0.5, return_lse=True)
    ref = dense_batch(q, QO, [x.to(torch.float8_e5m2).to(D64) * 2.0 for x in ks],
                      [x.to(torch.float8_e5m2).to(D64) * 0.5 for x in vs], causal=True)
    check(out, lse, *ref, tol=dict(atol=1e-5, rtol=1e-5))


@pytest.mark.parametrize("lse_layout", ["NH", "HN"])
def test_cuda_graph_run_keeps_caller_rows_past_the_plan(lse_layout):
    """use_cuda_graph=True and q with more rows than the plan (a captured buffer): out= and
    lse= take the plan's rows, and their rows past qo_indptr[-1] keep the caller's values, as
    FlashInfer's kernel leaves them."""
    page, hq, hkv, d, b = 4, 4, 2, 8, 3
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(b, 32))
    qo, kv = [2, 0, 4], [5, 1, 4]
    cache, kvi, idx, last, ks, vs = make_paged(kv, hkv, d, d, page, seed=33)
    w.plan(indptr(qo), kvi, idx, last, hq, hkv, d, page, causal=True, q_data_type=D64)
    q = rand(10, hq, d, seed=34)
    out = torch.full((10, hq, d), 7.0, dtype=D64)
    lse = torch.full((10, hq) if lse_layout == "NH" else (hq, 10), 7.0, dtype=torch.float32)
    got, got_lse = w.run(q, cache, out=out, lse=lse, return_lse=True, lse_layout=lse_layout)
    assert got is out and got_lse is lse
    rows = lse if lse_layout == "NH" else lse.t()
    check(out[:6], rows[:6], *dense_batch(q[:6], qo, ks, vs, causal=True))
    assert (out[6:] == 7.0).all() and (rows[6:] == 7.0).all()


def test_integer_custom_masks_read_as_bool():
    """An integer custom mask (nonzero attends, as FlashInfer packs mask.to(torch.bool)) gives
    the bool mask's result: single prefill and a ragged plan; a qo_indptr and kv_indptr of
    different lengths name both."""
    hq, hkv, d = 2, 1, 8
    qo, kv = [4, 3], [6, 11]
    k, v, ks, vs = ragged_kv(kv, hkv, d, d, seed=80)
    g = torch.Generator().manual_seed(81)
    masks = [torch.rand(a, c, generator=g) > 0.5 for a, c in zip(qo, kv)]
    flat = torch.cat([m.reshape(-1) for m in masks])
    q = rand(7, hq, d, seed=82)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, "NHD")
    outs = []
    for mask in (flat, flat.to(torch.uint8) * 3, flat.to(torch.int8) * -1,
                 flat.to(torch.int32) * 7, flat.to(torch.int64) * -2):
        w.plan(indptr(qo), indptr(kv), hq, hkv, d, custom_mask=mask, q_data_type=D64)
        outs.append(w.run(q, k, v))
    check(outs[0], None, *dense_batch(q, qo, ks, vs, masks=masks))
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    one = fi.single_prefill_with_kv_cache(q[:4], ks[0], vs[0], custom_mask=masks[0])
    assert torch.equal(one, fi.single_prefill_with_kv_cache(
        q[:4], ks[0], vs[0], custom_mask=masks[0].to(torch.uint8)))
    with pytest.raises(ValueError, match=r"kv_indptr: has 3 entries but batch_size \+ 1 = 2 "
                                         r"are needed \(the batch size of qo_indptr\)"):
        w.plan(indptr([4]), indptr(kv), hq, hkv, d, q_data_type=D64)


def test_ragged_kv_offsets_into_a_larger_buffer():
    """As FlashInfer's ragged kernel: kv_indptr may start past 0 and k / v may hold rows past
    kv_indptr[-1] (a slice of a larger buffer); only rows kv_indptr[0] to kv_indptr[-1] are
    read. Fewer rows than kv_indptr[-1] still raise."""
    hq, hkv, d = 2, 1, 8
    qo, kv = [4, 3], [6, 11]
    k, v, ks, vs = ragged_kv(kv, hkv, d, d, seed=90)
    q = rand(7, hq, d, seed=91)
    pad = lambda t, a, b: torch.cat([rand(a, hkv, d, seed=92), t, rand(b, hkv, d, seed=93)])  # noqa: E731
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, "NHD")
    w.plan(indptr(qo), indptr(kv) + 5, hq, hkv, d, causal=True, q_data_type=D64)
    out, lse = w.run(q, pad(k, 5, 4), pad(v, 5, 4), return_lse=True)
    check(out, lse, *dense_batch(q, qo, ks, vs, causal=True))
    with pytest.raises(ValueError, match=r"k / v: shapes \(21, 1, 8\) / \(21, 1, 8\) do not "
                                         r"match the plan: >= 22 rows"):
        w.run(q, pad(k, 4, 0), pad(v, 4, 0))


def test_cuda_graph_replan_refuses_new_head_counts_and_dims():
    """A CUDA-graph wrapper's re-plan with other head counts (the same group: it was let
    through) or head dims raises, naming what changed; the same shapes re-plan."""
    page, qo, kv = 4, [3, 4], [5, 9]
    _, kvi, idx, last, _, _ = make_paged(kv, 2, 8, 8, page, seed=100)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(2, 16))

    def plan(hq, hkv, d):
        w.plan(indptr(qo), kvi, idx, last, hq, hkv, d, page, causal=True, q_data_type=D64)

    plan(4, 2, 8)
    plan(4, 2, 8)
    for shapes in ((8, 4, 8), (2, 1, 8), (4, 2, 16)):
        with pytest.raises(ValueError, match="num_qo_heads / num_kv_heads / head dims changed "
                                             "since the first plan in CUDA-graph mode"):
            plan(*shapes)


def test_cuda_graph_plan_that_fails_writes_no_buffer():
    """A CUDA-graph plan checks every buffer before it writes any: a re-plan that fails (its
    page table or mask does not fit the buffers) leaves the last plan's run() as it was (its
    qo_indptr, kv_indptr and work buffers were already overwritten: wrong numbers), and a
    first plan that fails fixes no capacity."""
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cache = rand(7, 2, 4, 2, 16, seed=110)
    q = rand(7, 4, 16, seed=111)
    idx, ind, last = i32(3, 0, 5, 1, 6), i32(0, 2, 5), i32(1, 1)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(2, 5))
    w.plan(i32(0, 3, 7), ind, idx, last, 4, 2, 16, 4, causal=True, q_data_type=D64)
    good = w.run(q, cache)
    with pytest.raises(ValueError, match="paged_kv_indices_buf: holds 5 entries but this plan "
                                         "needs 6"):
        w.plan(i32(0, 1, 7), i32(0, 2, 6), torch.cat([idx, i32(2)]), last, 4, 2, 16, 4,
               causal=True, q_data_type=D64)
    with pytest.raises(ValueError, match="custom_mask_buf: the plan uses a custom mask"):
        w.plan(i32(0, 1, 7), ind, idx, last, 4, 2, 16, 4,
               custom_mask=torch.ones(5 + 6 * 9, dtype=torch.bool), q_data_type=D64)
    assert torch.equal(w.run(q, cache), good)
    fresh = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(2, 3))
    with pytest.raises(ValueError, match="paged_kv_indices_buf: holds 3"):
        fresh.plan(i32(0, 1, 2), ind, idx, last, 4, 2, 16, 4, q_data_type=D64)
    fresh.plan(i32(0, 3, 7), i32(0, 1, 2), idx[:2], i32(3, 4), 8, 4, 16, 4, q_data_type=D64)


def test_paged_kv_indptr_may_start_past_zero():
    """As FlashInfer's kernels (pages at indices[indptr[b] + j]): a page table whose indptr
    starts past 0 over a longer indices buffer, the entries before it poisoned; the numbers of
    the same table from 0, for the paged wrapper and both POD wrappers (they raised). A bad
    entry is named at its position in the caller's buffer."""
    hq, hkv, d, page, qo, kv = 4, 2, 8, 4, [3, 4], [5, 9]
    cache, kvi, idx, last, _, _ = make_paged(kv, hkv, d, d, page, seed=95)
    head = torch.tensor([-1, 2 ** 30, -7], dtype=torch.int32)
    shifted = (kvi + 3, torch.cat([head, idx]), last)
    q = rand(sum(qo), hq, d, seed=96)
    outs = []
    for table in ((kvi, idx, last), shifted):
        w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
        w.plan(indptr(qo), *table, hq, hkv, d, page, causal=True, q_data_type=D64)
        outs.append(w.run(q, cache, return_lse=True))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    q_d = rand(len(kv), hq, d, seed=97)
    k_p, v_p = rand(6, hkv, d, seed=98), rand(6, hkv, d, seed=99)
    pods = []
    for table in ((kvi, idx, last), shifted):
        pod = fi.PODWithPagedKVCacheWrapper(WS, "NHD")
        pod.plan(*table, hq, hkv, d, page, q_data_type=D64)
        batch = fi.BatchPODWithPagedKVCacheWrapper(WS, "NHD")
        batch.plan(indptr(qo), *table, indptr([1] * len(kv)), *table, hq, hkv, d, page,
                   q_data_type=D64)
        pods.append((pod.run(q[:6], k_p, v_p, q_d, cache, causal_p=True),
                     batch.run(q, cache, q_d, cache, causal_p=True)))
    for a, b in zip(*pods):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    bad = torch.cat([head, idx.clone()])
    bad[3 + 2] = -4
    with pytest.raises(ValueError, match="paged_kv_indices: entry 5 is -4"):
        fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD").plan(
            indptr(qo), kvi + 3, bad, last, hq, hkv, d, page, q_data_type=D64)


def test_ragged_cuda_graph_buffers_path_with_mask():
    hq, hkv, d, b = 2, 1, 8, 2
    bufs = dict(qo_indptr_buf=torch.zeros(b + 1, dtype=torch.int32),
                kv_indptr_buf=torch.zeros(b + 1, dtype=torch.int32),
                custom_mask_buf=torch.zeros(40, dtype=torch.uint8),
                mask_indptr_buf=torch.zeros(b + 1, dtype=torch.int32))
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, "NHD", True, **bufs)
    qo, kv = [4, 3], [6, 11]
    k, v, ks, vs = ragged_kv(kv, hkv, d, d, seed=70)
    g = torch.Generator().manual_seed(71)
    masks = [torch.rand(a, c, generator=g) > 0.5 for a, c in zip(qo, kv)]
    w.plan(indptr(qo), indptr(kv), hq, hkv, d,
           custom_mask=torch.cat([m.reshape(-1) for m in masks]), q_data_type=D64)
    assert w._plan.packed_mask is bufs["custom_mask_buf"]
    assert bufs["mask_indptr_buf"].tolist() == [0, 3, 3 + 5]
    q = rand(7, hq, d, seed=72)
    out, lse = w.run(q, k, v, return_lse=True)
    check(out, lse, *dense_batch(q, qo, ks, vs, masks=masks))
    with pytest.raises(ValueError, match="custom_mask_buf: holds 40 entries but this plan needs"):
        w.plan(indptr([4, 3]), indptr([60, 60]), hq, hkv, d,
               custom_mask=torch.ones(420, dtype=torch.bool), q_data_type=D64)
    with pytest.raises(ValueError, match="batch size 3 differs"):  # (not kv_indptr_buf)
        w.plan(indptr([1, 1, 1]), indptr([2, 2, 2]), hq, hkv, d, q_data_type=D64)


def test_run_traces_fullgraph_without_host_reads():
    """run() reads no device value: dynamo traces it as one graph (eager backend: tracing only)."""
    cache, kvi, idx, last, ks, vs = make_paged([5, 9], 2, 8, 8, 4, seed=80)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(indptr([3, 4]), kvi, idx, last, 4, 2, 8, 4, causal=True, q_data_type=D64)
    q = rand(7, 4, 8, seed=81)
    f = torch.compile(lambda q, c: w.run(q, c, return_lse=True, v_scale=2.0, k_scale=0.5),
                      fullgraph=True, backend="eager")
    out, lse = f(q, cache)
    check(out, lse, *dense_batch(q, [3, 4], [k * 0.5 for k in ks], [v * 2 for v in vs],
                                 causal=True))
    r = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    r.plan(indptr([3, 4]), indptr([5, 9]), 4, 2, 8,
           custom_mask=torch.ones(3 * 5 + 4 * 9, dtype=torch.bool), q_data_type=D64)
    k = rand(14, 2, 8, seed=82)
    g = torch.compile(lambda q, k: r.run(q, k, k), fullgraph=True, backend="eager")
    check(g(q, k), None, *dense_batch(q, [3, 4], list(k.split([5, 9])), list(k.split([5, 9]))))


def test_cuda_graph_replans_keep_one_traced_graph():
    """use_cuda_graph=True wrappers with plan() outside and run() inside
    torch.compile(fullgraph=True): re-plans within the buffers' capacity (new lengths, new
    page tables) reuse one graph and give each plan's numbers. plan()'s row counts and largest
    page index once became guards: a recompile per re-plan, a failure past the limit. Under
    tracing they are device checks: a plan needing more rows than k holds fails there."""
    from torch._dynamo.utils import counters

    i32 = torch.int32
    hq, hkv, d, b, page, n_pages = 4, 2, 8, 2, 4, 16
    q, k, v = rand(12, hq, d, seed=1), rand(30, hkv, d, seed=2), rand(30, hkv, d, seed=3)
    cache = rand(n_pages, 2, page, hkv, d, seed=4)
    r = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, "NHD", True, qo_indptr_buf=torch.zeros(
        b + 1, dtype=i32), kv_indptr_buf=torch.zeros(b + 1, dtype=i32))
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(b, n_pages))
    torch._dynamo.reset()
    counters.clear()
    ragged = torch.compile(lambda q, k, v: r.run(q, k, v), fullgraph=True, backend="eager")
    paged = torch.compile(lambda q, c: w.run(q, c), fullgraph=True, backend="eager")
    g = torch.Generator().manual_seed(5)
    for qo, kv in (([6, 6], [15, 15]), ([1, 1], [3, 9]), ([2, 3], [7, 20]), ([0, 4], [0, 11])):
        rows = sum(qo)
        r.plan(indptr(qo), indptr(kv), hq, hkv, d, causal=True, q_data_type=D64)
        ks, vs = list(k[:sum(kv)].split(kv)), list(v[:sum(kv)].split(kv))
        check(ragged(q, k, v)[:rows], None, *dense_batch(q[:rows], qo, ks, vs, causal=True)[:1],
              None)
        pages = [-(-n // page) for n in kv]
        idx = torch.randperm(n_pages, generator=g)[:sum(pages)].to(i32)
        last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv], dtype=i32)
        w.plan(indptr(qo), indptr(pages), idx, last, hq, hkv, d, page, causal=True,
               q_data_type=D64)
        own = [cache[idx[a:a + n].long()] for a, n in zip(indptr(pages)[:-1].tolist(), pages)]
        ks = [x[:, 0].reshape(-1, hkv, d)[:n] for x, n in zip(own, kv)]
        vs = [x[:, 1].reshape(-1, hkv, d)[:n] for x, n in zip(own, kv)]
        check(paged(q, cache)[:rows], None, *dense_batch(q[:rows], qo, ks, vs, causal=True)[:1],
              None)
    assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    r.plan(indptr([2, 2]), indptr([20, 20]), hq, hkv, d, q_data_type=D64)  # 40 rows > 30
    with pytest.raises(RuntimeError, match=r"the plan's kv_indptr\[-1\]"):
        ragged(q, k, v)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_paged_page_size_one_without_page_axis(layout):
    """Page size 1 caches may drop the page axis: [P, 2, H, D] or a tuple of [P, H, D]."""
    hq, hkv, d = 4, 2, 8
    cache, kvi, idx, last, ks, vs = make_paged(KV, hkv, d, d, 1, layout=layout, seed=95)
    squeezed = cache.squeeze(3 if layout == "HND" else 2)
    q = rand(sum(QO), hq, d, seed=96)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, layout)
    w.plan(indptr(QO), kvi, idx, last, hq, hkv, d, 1, causal=True, q_data_type=D64)
    ref = dense_batch(q, QO, ks, vs, causal=True)
    for c in (squeezed, (squeezed[:, 0], squeezed[:, 1])):
        out, lse = w.run(q, c, return_lse=True)
        check(out, lse, *ref)


# --------------------------------------------------------------------------------------------
# FlashInfer 0.7.2's newer wrapper options: the LSE's base and layout, uniform_q_len,
# variant_owns_mask, and the deprecated forward() / forward_return_lse()
# --------------------------------------------------------------------------------------------
def _planned(kind, plan_kw=None, hq=4, hkv=2, d=8, seed=120):
    """A planned wrapper of `kind` over QO / KV, its run(q) closure and the oracle's inputs."""
    plan_kw = dict(q_data_type=D64, **(plan_kw or {}))
    q = rand(sum(QO), hq, d, seed=seed)
    if kind == "paged":
        cache, kvi, idx, last, ks, vs = make_paged(KV, hkv, d, d, 3, seed=seed + 1)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
        w.plan(indptr(QO), kvi, idx, last, hq, hkv, d, 3, **plan_kw)
        kv_args = (cache,)
    else:
        k, v, ks, vs = ragged_kv(KV, hkv, d, d, seed=seed + 1)
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
        w.plan(indptr(QO), indptr(KV), hq, hkv, d, **plan_kw)
        kv_args = (k, v)
    return w, q, kv_args, ks, vs


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_run_lse_base_and_layout(kind):
    """lse_base="ln" gives the natural-log LSE (base 2 times ln 2), lse_layout="HN" its
    contiguous [Hq, tokens] transpose, into a caller's buffer of that layout too; rows that
    see no key (request 4 has no keys) stay -inf in every form."""
    w, q, kv, ks, vs = _planned(kind, dict(causal=True))
    ref_out, ref_lse = dense_batch(q, QO, ks, vs, causal=True)
    assert torch.isneginf(ref_lse).any()
    ln2 = math.log(2.0)
    out, lse = w.run(q, *kv, return_lse=True, lse_base="ln")
    check(out, lse, ref_out, ref_lse * ln2)
    out, lse = w.run_return_lse(q, *kv, lse_layout="HN")
    assert lse.shape == (4, sum(QO)) and lse.is_contiguous()
    check(out, lse.t(), ref_out, ref_lse)
    buf = torch.full((4, sum(QO)), math.nan, dtype=torch.float32)
    out, lse = w.run(q, *kv, return_lse=True, lse=buf, lse_base="ln", lse_layout="HN")
    assert lse is buf
    check(out, lse.t(), ref_out, ref_lse * ln2)
    assert torch.equal(w.run(q, *kv, lse_base="ln"), out)  # no LSE asked: the output alone


def test_plan_uniform_q_len_is_checked():
    """uniform_q_len promises every request's query length: a promise that holds plans as
    without it, one that does not is a ValueError (FlashInfer drops it with a warning)."""
    hq, hkv, d = 4, 2, 8
    k, v, ks, vs = ragged_kv([6, 9], hkv, d, d, seed=130)
    q = rand(6, hq, d, seed=131)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    for hint in (3, 0, -1, None):
        w.plan(indptr([3, 3]), indptr([6, 9]), hq, hkv, d, causal=True, q_data_type=D64,
               uniform_q_len=hint)
        check(*w.run(q, k, v, return_lse=True), *dense_batch(q, [3, 3], ks, vs, causal=True))
    with pytest.raises(ValueError, match=r"uniform_q_len=4 does not describe this batch "
                                         r"\(query lengths 3..3\)"):
        w.plan(indptr([3, 3]), indptr([6, 9]), hq, hkv, d, uniform_q_len=4)
    cache, kvi, idx, last, _, _ = make_paged([6, 9], hkv, d, d, 4, seed=132)
    wp = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    with pytest.raises(ValueError, match="uniform_q_len=2 does not describe"):
        wp.plan(indptr([2, 3]), kvi, idx, last, hq, hkv, d, 4, uniform_q_len=2)
    with pytest.raises(TypeError, match="uniform_q_len: got True; pass an int or None"):
        wp.plan(indptr([2, 3]), kvi, idx, last, hq, hkv, d, 4, uniform_q_len=True)


@pytest.mark.parametrize("cls", [fi.BatchPrefillWithPagedKVCacheWrapper,
                                 fi.BatchPrefillWithRaggedKVCacheWrapper])
def test_variant_owns_mask_needs_jit_variants(cls):
    cls(WS, variant_owns_mask=False)
    with pytest.raises(NotImplementedError, match="variant_owns_mask: a mask computed by a "
                                                  "custom JIT attention variant"):
        cls(WS, variant_owns_mask=True)


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_deprecated_forward_replaces_the_plan_options(kind):
    """forward() as FlashInfer's: its options (defaults included) replace the plan's, for that
    call and later run()s; a planned custom mask still replaces causal."""
    w, q, kv, ks, vs = _planned(kind)  # planned non-causal
    out = w.forward(q, *kv, causal=True, window_left=2, logits_soft_cap=2.0, sm_scale=0.3)
    ref = dense_batch(q, QO, ks, vs, causal=True, window_left=2, soft_cap=2.0, sm_scale=0.3)
    check(out, None, *ref)
    check(*w.run(q, *kv, return_lse=True), *ref)  # the options stay
    out, lse = w.forward_return_lse(q, *kv, pos_encoding_mode="ALIBI")  # causal=False again
    check(out, lse, *dense_batch(q, QO, ks, vs, alibi=True))
    if kind == "paged":  # FlashInfer's paged forward() takes the fp8 scales too
        out = w.forward(q, *kv, causal=True, k_scale=0.5, v_scale=2.0)
        check(out, None, *dense_batch(q, QO, [k * 0.5 for k in ks], [v * 2.0 for v in vs],
                                      causal=True))
    g = torch.Generator().manual_seed(140)
    masks = [torch.rand(a, b, generator=g) > 0.4 for a, b in zip(QO, KV)]
    w, q, kv, ks, vs = _planned(kind, dict(custom_mask=torch.cat([m.reshape(-1)
                                                                 for m in masks])))
    check(*w.forward_return_lse(q, *kv, causal=True), *dense_batch(q, QO, ks, vs, masks=masks))
    fresh = type(w)(WS)
    with pytest.raises(RuntimeError, match=r"forward\(\) before plan\(\)"):
        fresh.forward(q, *kv)


# --------------------------------------------------------------------------------------------
# empty edges: a mask without bits, no query rows, a cache without pages
# --------------------------------------------------------------------------------------------
def _assert_no_key(out, lse):
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_custom_mask_without_bits_beside_keys():
    """Every request's qo_len * kv_len is 0 but the batch has keys: the mask has no bits (0
    bytes), and every query row sees no key."""
    hq, hkv, d = 2, 1, 8
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    w.plan(indptr([0, 2]), indptr([3, 0]), hq, hkv, d, custom_mask=torch.zeros(0, dtype=torch.bool),
           q_data_type=D64)
    k = rand(3, hkv, d, seed=150)
    _assert_no_key(*w.run(rand(2, hq, d, seed=151), k, k, return_lse=True))
    cache, kvi, idx, last, _, _ = make_paged([3, 0], hkv, d, d, 2, seed=152)
    wp = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    wp.plan(indptr([0, 2]), kvi, idx, last, hq, hkv, d, 2,
            packed_custom_mask=torch.zeros(0, dtype=torch.uint8), q_data_type=D64)
    _assert_no_key(*wp.run(rand(2, hq, d, seed=153), cache, return_lse=True))


def test_single_prefill_without_query_rows():
    k = rand(4, 1, 8, seed=154)
    for kw in (dict(), dict(causal=True), dict(custom_mask=torch.zeros(0, 4, dtype=torch.bool))):
        out, lse = fi.single_prefill_with_kv_cache(rand(0, 2, 8), k, k[..., :6], return_lse=True,
                                                   **kw)
        assert out.shape == (0, 2, 6) and lse.shape == (0, 2)


def test_cuda_graph_paged_plan_on_a_cache_without_pages():
    """The index buffers' tail past the plan is padding (page 0); a cache with no pages at all
    reads none of it."""
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(1, 4))
    w.plan(indptr([3]), indptr([0]), torch.zeros(0, dtype=torch.int32),
           torch.zeros(1, dtype=torch.int32), 2, 1, 4, 16, causal=True, q_data_type=D64)
    _assert_no_key(*w.run(rand(3, 2, 4, seed=155), torch.zeros(0, 2, 16, 1, 4, dtype=D64),
                          return_lse=True))


# --------------------------------------------------------------------------------------------
# fixed_split_size: batch invariance (FlashInfer's tests/attention/test_batch_invariant_fa2.py)
# --------------------------------------------------------------------------------------------




@pytest.mark.parametrize("kind,layout,page", [("paged", "NHD", 4), ("paged", "HND", 1),
                                              ("ragged", "NHD", 1)])
def test_fixed_split_size_batch_invariant(kind, layout, page):
    """fixed_split_size takes effect (every tile in ceil(keys / (size * page)) chunks) and a
    sub-batch re-planned with the same buffers gives the shared requests' bits, while the
    request left out is the longest (it no longer sets the tile height)."""
    qo, kv = [6, 3, 9], [40, 25, 90]
    plan, out, lse, ks, vs, q = batch_invariance(
        kind, qo_lens=qo, kv_lens=kv, inv=2, page=page, fixed_split_size=4, layout=layout,
        seed=60)
    check_fixed_split_plan(plan, qo, kv, 4 * page, 2)
    check(out, lse, *dense_batch(q, qo, ks, vs, causal=True))


def test_fixed_split_size_with_disable_split_kv_or_cuda_graph():
    """disable_split_kv=True wins over fixed_split_size (as in FlashInfer); a CUDA-graph plan,
    which never splits, refuses it."""
    plan, *_ = batch_invariance("paged", qo_lens=[4, 2], kv_lens=[30, 12], inv=1, page=4,
                                fixed_split_size=2, disable_split_kv=True, seed=61)
    assert plan.work.shape[1] == 2
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(2, 16))
    with pytest.raises(NotImplementedError, match="fixed_split_size.*use_cuda_graph"):
        w.plan(indptr([4, 2]), indptr([8, 3]), torch.arange(11, dtype=torch.int32),
               torch.tensor([2, 4], dtype=torch.int32), 4, 2, 16, 4, fixed_split_size=2)


@pytest.mark.parametrize("paged", [False, True])
def test_replan_reuses_the_options_only_while_they_are_the_same(paged, monkeypatch):
    # A serving step re-plans with the same options: a batch plan takes them from the
    # wrapper's previous plan. Any option changing (its type too: True is no window) makes
    # them anew, a bad one still raises, and a plan on reused options runs as a fresh one.
    from compiled_attn._plan_options import PlanOptions

    made = []
    of_batch = PlanOptions.of_batch.__func__
    monkeypatch.setattr(PlanOptions, "of_batch",
                        classmethod(lambda cls, *a: made.append(1) or of_batch(cls, *a)))
    qo_lens, kv_lens = [3, 5], [7, 5]
    cache, kvi, idx, last, ks, vs = make_paged(kv_lens, 2, 32, 32, 4, dtype=torch.float32,
                                               seed=3)
    q = rand(sum(qo_lens), 4, 32, dtype=torch.float32, seed=4)

    def wrapper_and_call():
        if paged:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
            return w, lambda **kw: w.plan(indptr(qo_lens), kvi, idx, last, 4, 2, 32, 4,
                                          q_data_type=torch.float32, **kw), \
                lambda: w.run(q, cache)
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
        k, v = torch.cat(ks).float(), torch.cat(vs).float()
        return w, lambda **kw: w.plan(indptr(qo_lens), indptr(kv_lens), 4, 2, 32,
                                      q_data_type=torch.float32, **kw), lambda: w.run(q, k, v)

    w, plan, run = wrapper_and_call()
    plan(window_left=3)
    plan(window_left=3)
    assert len(made) == 1 and w._plan.window_left == 3
    plan(window_left=1)
    assert len(made) == 2 and w._plan.window_left == 1
    with pytest.raises(ValueError, match="window_left"):
        plan(window_left=True)
    plan(window_left=1, sm_scale=0.5)
    assert len(made) == 4 and w._plan.sm_scale == 0.5
    plan(window_left=1, sm_scale=0.5, causal=True)  # (not an option of PlanOptions)
    assert len(made) == 4
    got = run()
    _, fresh_plan, fresh_run = wrapper_and_call()
    fresh_plan(window_left=1, sm_scale=0.5, causal=True)
    assert torch.equal(got, fresh_run())
    plan(window_left=1, sm_scale=0.5, kv_data_type="float32")  # (q's dtype, named)
    assert len(made) == 6 and w._plan.kv_dtype == torch.float32  # (5: the fresh wrapper)


def test_paged_replans_copy_only_the_arrays_that_changed(monkeypatch):
    # A decode step re-plans with the page table it had until a request takes a new page:
    # arrays holding the last plan's values are not copied again (_host.to_device's sent),
    # and every plan computes its own table's answer. Plans: a table; the same values in new
    # tensors; the same lengths on other pages; a table one entry longer.
    copies = counted_copies(monkeypatch)
    page, hq, hkv, d = 3, 4, 2, 8
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    counts = []
    for seed, kv in ((20, [5, 9, 1]), (20, [5, 9, 1]), (21, [5, 9, 1]), (22, [5, 10, 1])):
        cache, kvi, idx, last, ks, vs = make_paged(kv, hkv, d, d, page, seed=seed)
        q = rand(len(kv), hq, d, seed=seed + 1)
        copies.clear()
        w.plan(indptr([1] * len(kv)), kvi.clone(), idx.clone(), last.clone(), hq, hkv, d, page,
               q_data_type=D64)
        counts.append(len(copies))
        out, lse = w.run(q, cache, return_lse=True)
        check(out, lse, *dense_batch(q, [1] * len(kv), ks, vs))
    # nothing new on the second plan; the page indices alone on the third; the fourth's table,
    # one entry longer, and its lengths
    assert counts[1] == 0 and counts[2] == 1 and counts[3] >= 3 and counts[0] >= 4, counts


def test_growing_page_table_keeps_its_tensor_within_its_room():
    # A decode step's table grows a page now and then: a re-plan's table is written into the
    # last plan's tensor while it fits (its tail page 0, never read), and an outgrown one gets
    # half again its length (at least 64 more entries), so that a table growing from 100 to
    # 375 pages takes the first plan's exact tensor and three more (101 -> 165, 166 -> 249,
    # 250 -> 375), not one a page (further on, choose.page_table_capacity may cap a room
    # where a longer table would launch otherwise). Every plan computes its own table's answer.
    page, hq, hkv, d = 1, 2, 1, 8
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    cache = rand(400, 2, page, hkv, d, seed=30)
    perm = torch.randperm(400, generator=torch.Generator().manual_seed(31)).to(torch.int32)
    tensors, lengths = [], []
    for n in range(100, 376):
        w.plan(indptr([1]), torch.tensor([0, n], dtype=torch.int32), perm[:n].clone(),
               torch.ones(1, dtype=torch.int32), hq, hkv, d, page, q_data_type=D64)
        t = w._plan.kv_indices
        assert t[:n].tolist() == perm[:n].tolist() and not t[n:].any()
        if not tensors or t is not tensors[-1]:
            tensors.append(t)
            lengths.append(t.numel())
        if n % 60 == 0:  # (a few runs against the oracle: the tail is not read)
            q = rand(1, hq, d, seed=n)
            k, v = cache[perm[:n].long(), 0, 0], cache[perm[:n].long(), 1, 0]
            out, lse = w.run(q, cache, return_lse=True)
            check(out, lse, *dense(q, k, v, causal=False))
    assert lengths == [100, 165, 249, 375], lengths
