"""POD wrappers on CPU against the independent dense float64 oracle of test_api_prefill."""

from __future__ import annotations

import math

import pytest
import torch

import compiled_attn as fi

from .helpers import (D64, WS, check, check_pod_launch, counted_copies, dense, dense_batch,
                      indptr, make_paged, pack_segments, poisoned_tail, rand)

KV_D = [13, 1, 8, 0]  # decode KV lengths, an empty one included


@pytest.mark.parametrize("layout,fmt,hq,hkv,page", [("NHD", "5d", 4, 2, 5),
                                                    ("HND", "tuple", 7, 1, 1)])
def test_pod_single_prefill_plus_decode(layout, fmt, hq, hkv, page, pod_launch):
    d, qo, kv = 8, 9, 14
    cache, kvi, idx, last, ks, vs = make_paged(KV_D, hkv, d, d, page, layout=layout, fmt=fmt)
    w = fi.PODWithPagedKVCacheWrapper(WS, layout)
    w.plan(kvi, idx, last, hq, hkv, d, page, window_left=6, q_data_type=D64, sm_scale=0.3)
    q_p, k_p, v_p = rand(qo, hq, d, seed=1), rand(kv, hkv, d, seed=2), rand(kv, hkv, d, seed=3)
    q_d = rand(len(KV_D), hq, d, seed=4)
    kk, vv = (k_p, v_p) if layout == "NHD" else (k_p.transpose(0, 1), v_p.transpose(0, 1))
    (o_p, o_d), (l_p, l_d) = w.run(q_p, kk, vv, q_d, cache, causal_p=True, kv_layout_p=layout,
                                   window_left_p=4, return_lse_p=True, return_lse_d=True,
                                   v_scale=2.0, k_scale=0.5)
    check_pod_launch(pod_launch, True)
    check(o_p, l_p, *dense(q_p, k_p, v_p, causal=True, window_left=4))
    check(o_d, l_d, *dense_batch(q_d, [1] * len(KV_D), ks, vs, window_left=6, sm_scale=0.15,
                                 v_scale=2.0))
    # Without return_lse: the plain pair; with only one LSE asked, the other is None.
    o_p2, o_d2 = w.run(q_p, kk, vv, q_d, cache, causal_p=True, kv_layout_p=layout,
                       window_left_p=4, v_scale=2.0, k_scale=0.5)
    assert torch.equal(o_p2, o_p) and torch.equal(o_d2, o_d)
    (_, _), (lp, ld) = w.run(q_p, kk, vv, q_d, cache, kv_layout_p=layout, return_lse_d=True)
    assert lp is None and ld is not None


@pytest.mark.parametrize("feature", ["mask", "packed_mask", "alibi", "rope", "decode_overrides"])
def test_pod_features(feature, pod_launch):
    hq, hkv, d, page, qo, kv = 4, 2, 8, 4, 6, 10
    cache, kvi, idx, last, ks, vs = make_paged(KV_D, hkv, d, d, page, seed=5)
    q_p, k_p, v_p = rand(qo, hq, d, seed=6), rand(kv, hkv, d, seed=7), rand(kv, hkv, d, seed=8)
    q_d = rand(len(KV_D), hq, d, seed=9)
    mask = torch.rand(qo, kv, generator=torch.Generator().manual_seed(10)) > 0.5
    plan_kw, run_kw, ref_p, ref_d = {}, {}, {}, {}
    if feature == "mask":
        run_kw, ref_p = dict(custom_mask_p=mask), dict(mask=mask)
    elif feature == "packed_mask":
        run_kw = dict(packed_custom_mask_p=fi.packbits(mask, bitorder="little"))
        ref_p = dict(mask=mask)
    elif feature == "alibi":
        plan_kw, run_kw = dict(pos_encoding_mode="ALIBI"), dict(pos_encoding_mode_p="ALIBI")
        ref_p = ref_d = dict(alibi=True)
    elif feature == "rope":
        plan_kw = dict(pos_encoding_mode="ROPE_LLAMA", rope_theta=100.0)
        run_kw = dict(pos_encoding_mode_p="ROPE_LLAMA", rope_theta_p=100.0, causal_p=True)
        ref_p, ref_d = dict(rope=True, rope_theta=100.0, causal=True), dict(rope=True,
                                                                            rope_theta=100.0)
    elif feature == "decode_overrides":  # FlashInfer ignores these; here they take effect
        run_kw = dict(sm_scale_d=0.2, window_left_d=3, causal_d=True, sm_scale_p=0.7)
        ref_p, ref_d = dict(sm_scale=0.7), dict(sm_scale=0.2, window_left=3)
    w = fi.PODWithPagedKVCacheWrapper(WS)
    w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=D64, **plan_kw)
    (o_p, o_d), (l_p, l_d) = w.run(q_p, k_p, v_p, q_d, cache, return_lse_p=True,
                                   return_lse_d=True, **run_kw)
    check_pod_launch(pod_launch, True)
    check(o_p, l_p, *dense(q_p, k_p, v_p, **ref_p))
    check(o_d, l_d, *dense_batch(q_d, [1] * len(KV_D), ks, vs, **ref_d))


def test_pod_cuda_graph_buffers_and_errors():
    hq, hkv, d, page = 2, 1, 8, 3
    b = len(KV_D)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(16, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32))
    w = fi.PODWithPagedKVCacheWrapper(WS, "NHD", True, **bufs)
    cache, kvi, idx, last, ks, vs = make_paged(KV_D, hkv, d, d, page, seed=11)
    w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=D64)
    assert bufs["paged_kv_indices_buffer"][:idx.numel()].tolist() == idx.tolist()
    q_p, k_p = rand(3, hq, d, seed=12), rand(5, hkv, d, seed=13)
    q_d = rand(b, hq, d, seed=14)
    o_p, o_d = w.run(q_p, k_p, k_p, q_d, cache)
    check(o_p, None, *dense(q_p, k_p, k_p))
    check(o_d, None, *dense_batch(q_d, [1] * b, ks, vs))
    with pytest.raises(ValueError, match="kv_len >= qo_len"):
        w.run(rand(6, hq, d), k_p, k_p, q_d, cache, causal_p=True)
    with pytest.raises(NotImplementedError, match="pos_encoding_mode_p"):
        w.run(q_p, k_p, k_p, q_d, cache, pos_encoding_mode_p="ALIBI")
    with pytest.raises(NotImplementedError, match="custom_mask_d"):
        w.run(q_p, k_p, k_p, q_d, cache, custom_mask_d=torch.ones(b, 1, dtype=torch.bool))
    with pytest.raises(ValueError, match="kv_layout_d"):
        w.run(q_p, k_p, k_p, q_d, cache, kv_layout_d="HND")
    with pytest.raises(ValueError, match="q_d: shape"):
        w.run(q_p, k_p, k_p, q_d[:2], cache)
    with pytest.raises(ValueError, match="custom_mask_p: has 14 entries but the plan needs 15"):
        w.run(q_p, k_p, k_p, q_d, cache, custom_mask_p=torch.ones(14, dtype=torch.bool))
    # RoPE asked in run() on a plan without it: the head dim is checked there too (an odd one
    # failed inside the reference's rotation)
    odd = fi.PODWithPagedKVCacheWrapper(WS, "NHD")
    cache3, kvi3, idx3, last3, _, _ = make_paged(KV_D, hkv, 3, 3, page, seed=16)
    odd.plan(kvi3, idx3, last3, hq, hkv, 3, page, q_data_type=D64)
    with pytest.raises(ValueError, match="ROPE_LLAMA' needs an even head_dim_qk; got 3"):
        odd.run(rand(3, hq, 3), rand(5, hkv, 3), rand(5, hkv, 3), rand(b, hq, 3), cache3,
                pos_encoding_mode_p="ROPE_LLAMA", pos_encoding_mode_d="ROPE_LLAMA")
    # a CUDA-graph re-plan with other head counts (the same group) or head dim raises, as the
    # batch wrappers' (it went through; a cut plan's decodes then came out wrong)
    w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=D64)
    cache2, kvi2, idx2, last2, _, _ = make_paged(KV_D, 2 * hkv, d, d, page, seed=17)
    for shapes in ((2 * hq, 2 * hkv, d), (hq, hkv, 2 * d)):
        with pytest.raises(ValueError, match="num_qo_heads / num_kv_heads / head_dim changed "
                                             "since the first plan in CUDA-graph mode"):
            w.plan(kvi2, idx2, last2, *shapes, page, q_data_type=D64)


def test_batch_pod(pod_launch):
    hq, hkv, d, page = 6, 2, 8, 4
    qo_p, kv_p = [5, 0, 7], [9, 3, 5]  # qo > kv in request 2
    cache_p, kvi_p, idx_p, last_p, ks_p, vs_p = make_paged(kv_p, hkv, d, d, page, seed=20)
    cache_d, kvi_d, idx_d, last_d, ks_d, vs_d = make_paged(KV_D, hkv, d, d, page, seed=21,
                                                           fmt="tuple")
    q_p, q_d = rand(sum(qo_p), hq, d, seed=22), rand(len(KV_D), hq, d, seed=23)
    w = fi.BatchPODWithPagedKVCacheWrapper(WS)
    w.plan(indptr(qo_p), kvi_p, idx_p, last_p, indptr([1] * len(KV_D)), kvi_d, idx_d, last_d,
           hq, hkv, d, page, window_left=5, data_type=D64)
    (o_p, o_d), (l_p, l_d) = w.run(q_p, cache_p, q_d, cache_d, causal_p=True, return_lse=True,
                                   q_scale=2.0, v_scale=torch.tensor(0.5))
    check_pod_launch(pod_launch, True)
    check(o_p, l_p, *dense_batch(q_p, qo_p, ks_p, vs_p, causal=True, window_left=5))
    check(o_d, l_d, *dense_batch(q_d, [1] * len(KV_D), ks_d, vs_d, window_left=5,
                                 sm_scale=2.0 / math.sqrt(d), v_scale=0.5))
    # Per-request custom masks (bool and segment-packed) for B > 1.
    g = torch.Generator().manual_seed(24)
    masks = [torch.rand(a, b, generator=g) > 0.4 for a, b in zip(qo_p, kv_p)]
    flat = torch.cat([m.reshape(-1) for m in masks])
    packed, _ = fi.segment_packbits(flat, indptr([a * b for a, b in zip(qo_p, kv_p)]),
                                    bitorder="little")
    ref = dense_batch(q_p, qo_p, ks_p, vs_p, masks=masks, window_left=5)
    for kw in (dict(custom_mask_p=flat), dict(packed_custom_mask_p=packed)):
        (o_p, _), (l_p, _) = w.run(q_p, cache_p, q_d, cache_d, return_lse=True, **kw)
        check(o_p, l_p, *ref)
    with pytest.raises(ValueError, match="packed_custom_mask_p: has 10 bytes but the plan needs"):
        w.run(q_p, cache_p, q_d, cache_d, packed_custom_mask_p=fi.packbits(flat, "little"))
    # a prefill part whose masks have no bits (no request has both rows and keys)
    w.plan(indptr([0, 1]), *make_paged([11, 0], hkv, d, d, page, seed=25)[1:4],
           indptr([1] * len(KV_D)), kvi_d, idx_d, last_d, hq, hkv, d, page, data_type=D64)
    cache_e = make_paged([11, 0], hkv, d, d, page, seed=25)[0]
    for kw in (dict(custom_mask_p=torch.zeros(0, dtype=torch.bool)),
               dict(packed_custom_mask_p=torch.zeros(0, dtype=torch.uint8))):
        (o_p, _), (l_p, _) = w.run(q_p[:1], cache_e, q_d, cache_d, return_lse=True, **kw)
        assert torch.equal(o_p, torch.zeros_like(o_p)) and torch.isneginf(l_p).all()


def test_pod_run_traces_fullgraph(pod_launch):
    """The one-page prefill cache, its page table and the work list are built with device ops
    from shapes: dynamo traces run() as one graph, one fused launch or (where the fused launch
    would not be the Gluon kernel's, as on this CPU, and the policy lets calls go apart) the
    parts' two launches, as an eager call of the plan would."""
    hq, hkv, d, page = 4, 2, 8, 4
    cache, kvi, idx, last, ks, vs = make_paged(KV_D, hkv, d, d, page, seed=90)
    w = fi.PODWithPagedKVCacheWrapper(WS)
    w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=D64)
    f = torch.compile(lambda qp, kp, qd, c: w.run(qp, kp, kp, qd, c, causal_p=True,
                                                  return_lse_p=True),
                      fullgraph=True, backend="eager")
    q_p, k_p, q_d = rand(3, hq, d, seed=91), rand(5, hkv, d, seed=92), rand(len(KV_D), hq, d)
    (o_p, o_d), (l_p, l_d) = f(q_p, k_p, q_d, cache)
    check(o_p, l_p, *dense(q_p, k_p, k_p, causal=True))
    assert l_d is None
    check(o_d, None, *dense_batch(q_d, [1] * len(KV_D), ks, vs))
    check_pod_launch(pod_launch, True)


def test_exporting_reads_torch_exports_flag():
    """_validate.exporting(): False under a torch.compile trace, True under torch.export's.
    (torch.compiler.is_exporting() answers True under every torch.compile trace on torch 2.11,
    which sent compiled POD calls to the fused launch where eager calls run apart.)"""
    from compiled_attn import _validate as V

    def f(x):
        return x + (1.0 if V.exporting() else 2.0)

    class M(torch.nn.Module):
        def forward(self, x):
            return f(x)

    x = torch.zeros(2)
    assert not V.exporting()
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x), x + 2.0)
    assert torch.equal(torch.export.export(M(), (x,)).module()(x), x + 1.0)


def test_pod_export_keeps_one_op():
    """torch.export of a POD wrapper's run() keeps one pod_prefill_decode node (what an
    AOTInductor package compiles) even where torch.compile and eager calls run the parts
    apart (here: the fused launch would not be the Gluon kernel's, as on any CPU)."""
    from compiled_attn.pod import _traced_apart

    hq, hkv, d, page = 4, 2, 8, 4
    cache, kvi, idx, last, ks, vs = make_paged(KV_D, hkv, d, d, page, seed=93)
    w = fi.PODWithPagedKVCacheWrapper(WS)
    w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=D64)
    assert _traced_apart(w._plan)

    class Step(torch.nn.Module):
        def forward(self, qp, kp, qd, c):
            return w.run(qp, kp, kp, qd, c, causal_p=True)

    q_p, k_p, q_d = rand(3, hq, d, seed=94), rand(5, hkv, d, seed=95), rand(len(KV_D), hq, d)
    ep = torch.export.export(Step(), (q_p, k_p, q_d, cache))
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    ours = [t for t in targets if "compiled_attn" in str(t)]
    assert ours == [torch.ops.compiled_attn.pod_prefill_decode.default], ours
    o_p, o_d = ep.module()(q_p, k_p, q_d, cache)
    check(o_p, None, *dense(q_p, k_p, k_p, causal=True))
    check(o_d, None, *dense_batch(q_d, [1] * len(KV_D), ks, vs))


def test_pod_cuda_graph_replans_keep_one_traced_graph():
    """A CUDA-graph-mode POD wrapper under torch.compile(fullgraph=True), re-planned each decode
    step (the decode requests grow; the page table, and its largest index, change): one graph,
    each step's numbers. The plan's largest page index was a guard (a recompile per re-plan)."""
    from torch._dynamo.utils import counters

    i32 = torch.int32
    hq, hkv, d, page, n_pages = 2, 1, 8, 3, 16
    b = len(KV_D)
    cache = rand(n_pages, 2, page, hkv, d, seed=15)
    w = fi.PODWithPagedKVCacheWrapper(
        WS, "NHD", True, paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=i32),
        paged_kv_indices_buffer=torch.zeros(n_pages, dtype=i32),
        paged_kv_last_page_len_buffer=torch.zeros(b, dtype=i32))
    q_p, k_p, q_d = rand(3, hq, d, seed=16), rand(5, hkv, d, seed=17), rand(b, hq, d, seed=18)
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda qp, kp, qd, c: w.run(qp, kp, kp, qd, c, causal_p=True),
                      fullgraph=True, backend="eager")
    g = torch.Generator().manual_seed(19)
    for step in range(4):
        kv = [n + step for n in KV_D]
        pages = [-(-n // page) for n in kv]
        # a permutation of pages 0..P-1: the largest index grows with the page count
        idx = torch.randperm(sum(pages), generator=g).to(i32)
        last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv], dtype=i32)
        w.plan(indptr(pages), idx, last, hq, hkv, d, page, q_data_type=D64)
        o_p, o_d = f(q_p, k_p, q_d, cache)
        check(o_p, None, *dense(q_p, k_p, k_p, causal=True))
        own = [cache[idx[a:a + n].long()] for a, n in zip(indptr(pages)[:-1].tolist(), pages)]
        ks = [x[:, 0].reshape(-1, hkv, d)[:n] for x, n in zip(own, kv)]
        vs = [x[:, 1].reshape(-1, hkv, d)[:n] for x, n in zip(own, kv)]
        check(o_d, None, *dense_batch(q_d, [1] * b, ks, vs))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dynamic", [True, None])
def test_batch_pod_replans_keep_one_traced_graph(dynamic, masked):
    """BatchPOD under torch.compile(dynamic=True, fullgraph=True) on two fixed caches (as a
    serving engine allocates them), re-planned with new prefill and decode lengths (row
    counts, page tables and their largest index change): one graph, each plan's numbers; a q
    whose rows miss the plan trips the traced row check. run() read the plan's row counts
    (guards: a recompile per re-plan). Duck sizing is off: sizes that happen to match in one
    plan (dynamo's guess that they always do) are not what is tested. masked: the prefill
    part takes a packed custom mask, whose length run() checks against the plan's byte count
    (a host count there would be a guard)."""
    from torch._dynamo.utils import counters
    from torch.fx.experimental import _config as shape_config

    i32 = torch.int32
    hq, hkv, d, page, n_pages = 4, 2, 8, 4, 24
    caches = rand(n_pages, 2, page, hkv, d, seed=30), rand(n_pages, 2, page, hkv, d, seed=31)
    w = fi.BatchPODWithPagedKVCacheWrapper(WS)
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda qp, cp, qd, cd, m=None: w.run(
        qp, cp, qd, cd, packed_custom_mask_p=m, causal_p=m is None),
        fullgraph=True, dynamic=dynamic, backend="eager")
    g = torch.Generator().manual_seed(32)

    def table(kv, cache):
        """A page table over a random subset of the cache's pages, and each request's K / V."""
        pages = [-(-n // page) for n in kv]
        idx = torch.randperm(n_pages, generator=g)[:sum(pages)].to(i32)
        last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv], dtype=i32)
        own = [cache[idx[a:a + n].long()] for a, n in zip(indptr(pages)[:-1].tolist(), pages)]
        ks = [x[:, 0].reshape(-1, hkv, d)[:n] for x, n in zip(own, kv)]
        vs = [x[:, 1].reshape(-1, hkv, d)[:n] for x, n in zip(own, kv)]
        return (indptr(pages), idx, last), ks, vs

    for step in range(4):
        qo_p, kv_p = [3 + step, 2], [5 + 2 * step, 4 + step]
        kv_d = [n + step for n in KV_D]
        t_p, ks_p, vs_p = table(kv_p, caches[0])
        t_d, ks_d, vs_d = table(kv_d, caches[1])
        q_p, q_d = rand(sum(qo_p), hq, d, seed=50 + step), rand(len(kv_d), hq, d, seed=60)
        w.plan(indptr(qo_p), *t_p, indptr([1] * len(kv_d)), *t_d, hq, hkv, d, page,
               data_type=D64)
        masks = packed = None
        if masked:
            masks = [torch.rand(m, n, generator=g) < 0.7 for m, n in zip(qo_p, kv_p)]
            packed, _ = pack_segments(masks)
        with shape_config.patch(use_duck_shape=False):
            o_p, o_d = f(q_p, caches[0], q_d, caches[1], packed)
        check(o_p, None, *dense_batch(q_p, qo_p, ks_p, vs_p, masks=masks, causal=not masked))
        check(o_d, None, *dense_batch(q_d, [1] * len(kv_d), ks_d, vs_d))
    # dynamic=None: the first plan's static graph, then one with the changing sizes dynamic
    assert counters["stats"]["unique_graphs"] == (1 if dynamic else 2), dict(counters["stats"])
    with pytest.raises(RuntimeError, match="q_p: rows do not match the plan's qo_indptr_p"), \
            shape_config.patch(use_duck_shape=False):
        f(q_p[1:], caches[0], q_d, caches[1], packed)
    if masked:
        with pytest.raises(RuntimeError, match="packed_custom_mask_p: its bytes are not the "
                                               "plan's"), shape_config.patch(use_duck_shape=False):
            f(q_p, caches[0], q_d, caches[1], packed[1:])


def test_pod_page_indices_longer_than_indptr():
    """Both POD wrappers take page-index buffers longer than indptr[-1] (FlashInfer reads only
    the first indptr[-1] entries); the tails hold entries no kernel may read."""
    hq, hkv, d, page = 4, 2, 8, 4
    cache, kvi, idx, last, ks, vs = make_paged(KV_D, hkv, d, d, page, seed=60)
    q_p, k_p = rand(3, hq, d, seed=61), rand(5, hkv, d, seed=62)
    q_d = rand(len(KV_D), hq, d, seed=63)
    b = len(KV_D)
    graph_bufs = dict(paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32),
                      paged_kv_indices_buffer=torch.zeros(idx.numel(), dtype=torch.int32),
                      paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32))
    for w in (fi.PODWithPagedKVCacheWrapper(WS),
              fi.PODWithPagedKVCacheWrapper(WS, "NHD", True, **graph_bufs)):
        w.plan(kvi, poisoned_tail(idx, cache.shape[0]), last, hq, hkv, d, page,
               q_data_type=D64)
        o_p, o_d = w.run(q_p, k_p, k_p, q_d, cache)
        check(o_p, None, *dense(q_p, k_p, k_p))
        check(o_d, None, *dense_batch(q_d, [1] * b, ks, vs))
    qo_p, kv_p = [5, 2], [9, 6]
    cache_p, kvi_p, idx_p, last_p, ks_p, vs_p = make_paged(kv_p, hkv, d, d, page, seed=64)
    q_pb = rand(sum(qo_p), hq, d, seed=65)
    w = fi.BatchPODWithPagedKVCacheWrapper(WS)
    w.plan(indptr(qo_p), kvi_p, poisoned_tail(idx_p, cache_p.shape[0]), last_p,
           indptr([1] * b), kvi, poisoned_tail(idx, cache.shape[0]), last, hq, hkv, d, page,
           data_type=D64)
    (o_p, o_d), (l_p, l_d) = w.run(q_pb, cache_p, q_d, cache, causal_p=True, return_lse=True)
    check(o_p, l_p, *dense_batch(q_pb, qo_p, ks_p, vs_p, causal=True))
    check(o_d, l_d, *dense_batch(q_d, [1] * b, ks, vs))



def _check_part(out, lse, q, qo_lens, ks, vs, **kw):
    """A part's output and LSE against dense_batch; a part without rows: its empty shapes."""
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    if sum(qo_lens):
        check(out, lse, *dense_batch(q, qo_lens, ks, vs, **kw))


@pytest.mark.parametrize("qo,kv,kv_d", [(5, 8, []), (0, 6, KV_D), (0, 0, KV_D), (0, 0, [])])
@pytest.mark.parametrize("graph_bufs", [False, True])
def test_pod_empty_parts(qo, kv, kv_d, graph_bufs):
    """No decodes, no prefill rows (with keys or without), or neither; page 1, GQA 7:1; the
    CUDA-graph buffers sized for the plan's batch (0 included)."""
    hq, hkv, d, page, b = 7, 1, 8, 1, len(kv_d)
    cache, kvi, idx, last, ks, vs = make_paged(kv_d, hkv, d, d, page, seed=70)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(idx.numel() + 2, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32))
    w = fi.PODWithPagedKVCacheWrapper(WS, "NHD", graph_bufs, **(bufs if graph_bufs else {}))
    w.plan(kvi, idx, last, hq, hkv, d, page, window_left=4, q_data_type=D64)
    q_p, k_p, v_p = rand(qo, hq, d, seed=71), rand(kv, hkv, d, seed=72), rand(kv, hkv, d, seed=73)
    q_d = rand(b, hq, d, seed=74)
    (o_p, o_d), (l_p, l_d) = w.run(q_p, k_p, v_p, q_d, cache, causal_p=True, return_lse_p=True,
                                   return_lse_d=True)
    _check_part(o_p, l_p, q_p, [qo], [k_p], [v_p], causal=True)
    _check_part(o_d, l_d, q_d, [1] * b, ks, vs, window_left=4)


@pytest.mark.parametrize("qo_p,kv_p,kv_d", [([5, 0, 7], [9, 3, 5], KV_D), ([4, 1], [9, 3], []),
                                            ([], [], KV_D), ([0, 0], [5, 2], KV_D),
                                            ([], [], [])])
def test_batch_pod_empty_parts_page_1_gqa_7(qo_p, kv_p, kv_d):
    """Page 1 and GQA 7:1 with both parts, no decodes, no prefill requests, prefill requests
    without rows, and neither."""
    hq, hkv, d, page = 7, 1, 8, 1
    cache_p, kvi_p, idx_p, last_p, ks_p, vs_p = make_paged(kv_p, hkv, d, d, page, seed=80)
    cache_d, kvi_d, idx_d, last_d, ks_d, vs_d = make_paged(kv_d, hkv, d, d, page, seed=81)
    q_p, q_d = rand(sum(qo_p), hq, d, seed=82), rand(len(kv_d), hq, d, seed=83)
    w = fi.BatchPODWithPagedKVCacheWrapper(WS)
    w.plan(indptr(qo_p), kvi_p, idx_p, last_p, indptr([1] * len(kv_d)), kvi_d, idx_d, last_d,
           hq, hkv, d, page, window_left=3, data_type=D64)
    (o_p, o_d), (l_p, l_d) = w.run(q_p, cache_p, q_d, cache_d, causal_p=True, return_lse=True)
    _check_part(o_p, l_p, q_p, qo_p, ks_p, vs_p, causal=True, window_left=3)
    _check_part(o_d, l_d, q_d, [1] * len(kv_d), ks_d, vs_d, window_left=3)


def _hopper_pod(monkeypatch, n_dec: int, kv_d: int, hq: int, page: int):
    """(a POD wrapper, its plan()): n_dec decodes of kv_d keys on pages of ``page`` (bf16,
    Hkv 8, D 128: the pod suite's sizes) planned for a Hopper GPU (choose's plan device made
    the H100); plan() returns the plan dict."""
    from compiled_attn.ops import choose

    monkeypatch.setattr(choose, "_plan_device", lambda: choose.H100)
    pages = [-(-kv_d // page)] * n_dec
    last = kv_d - (pages[0] - 1) * page if n_dec else page
    w = fi.PODWithPagedKVCacheWrapper(WS)

    def plan():
        w.plan(indptr(pages), torch.arange(sum(pages), dtype=torch.int32),
               torch.full((n_dec,), last, dtype=torch.int32), hq, 8, 128, page,
               q_data_type=torch.bfloat16)
        return w._plan

    return w, plan


@pytest.mark.parametrize("n_dec,kv_d", [(16, 32768), (3, 100), (0, 16)])
def test_pod_prefill_part_from_the_host_matches_the_device_ops(n_dec, kv_d, monkeypatch):
    """An eager call's prefill part (its one-page table, mask offsets and the fused work lists
    with the plan's decodes, with and without key chunks) is built on the host in one copy
    (pod._host_part); a traced call's by device ops: the same int32 values and shapes, the
    views distinct, the eager one kept for the next call of those lengths."""
    w, plan = _hopper_pod(monkeypatch, n_dec, kv_d, 32, 16)
    p = plan()
    assert (p["chunks"] is not None) is (n_dec == 16)
    for qo, kv, mask in ((256, 256, None), (37, 1000, (37 * 1000 + 7) // 8), (1, 0, None),
                         (0, 5, None), (0, 0, 0)):
        host = w._prefill_part(qo, kv, mask, traced=False)
        dev = w._prefill_part(qo, kv, mask, traced=True)
        assert w._prefill_part(qo, kv, mask, traced=False) is host
        pairs = [*zip(host["table"], dev["table"]), (host["mask_indptr"], dev["mask_indptr"]),
                 (host["work"], dev["work"]), (host["work_cut"], dev["work_cut"])]
        for a, b in pairs:
            if b is None:
                assert a is None
                continue
            assert a.dtype == torch.int32 and a.shape == b.shape and torch.equal(a, b)
            assert a.is_contiguous()
        ptrs = [a.data_ptr() for a, _ in pairs if a is not None and a.numel()]
        assert len(set(ptrs)) == len(ptrs)


# (prefill tokens, decodes, keys each, Hq, page, apart): cases of the pod suite
# (benchmarks/NOTES.md, 2026-11-29). POD's prefill alone runs on contiguous k / v and its own
# tiles, so decodes under about its time go apart (page 16: p8192 + 16 x 4k ran fused at 0.86x
# of apart, + 128 x 4k 0.95x, + 256 x 4k 1.03x, + 128 x 32k 1.04x), and a small call stays
# fused whatever its balance (p2048 + 16 x 1k); a prefill under 2e11 FLOPs at a quarter of
# that balance (GQA 64/8 p2048 + 16 x 4k fused 1.04-1.12x apart, + 16 x 1k 0.98-1.05x,
# 2026-11-30). Page 1 takes the Gluon POD launch with both
# parts gathered, its prefill slower still, by the same rule at 1.7 times that balance
# (fused: p8192 + 256 x 4k 0.84x, p2048 + 16 x 4k 0.90x; p2048 + 256 x 1k 1.13x, p2048 + 128 x
# 1k and GQA 64/8 p2048 + 256 x 1k 1.04-1.06x), and apart whatever the balance for a prefill
# of more than 2e11 FLOPs (p8192: its fused rows + 128 / 256 x 32k lost, 0.955-0.994x); with
# pod_gather off it has no Gluon POD launch (the Triton fused launch ran 0.6x of apart,
# 2026-11-28) and goes apart. Few long decodes that alone take the few-programs K / V ring go
# apart beside a prefill under pod_ring_apart_share of their bytes on page 16 (p256 + 16 x 32k
# fused ran 0.96-0.975x of apart), not beside p2048 (1.02x), nor on page 1 (fused gathers,
# 1.00-1.02x).
@pytest.mark.parametrize("qo,n_dec,kv_d,hq,page,apart", [
    (8192, 16, 1024, 32, 16, True), (8192, 16, 4096, 64, 16, True),
    (8192, 16, 4096, 32, 16, True), (8192, 128, 4096, 32, 16, True),
    (8192, 256, 4096, 32, 16, False), (8192, 128, 32768, 32, 16, False),
    (2048, 128, 4096, 32, 16, False), (2048, 128, 4096, 64, 16, False),
    (256, 128, 32768, 32, 16, False), (2048, 16, 1024, 32, 16, False),
    (2048, 16, 4096, 32, 16, False), (2048, 16, 4096, 64, 16, False),
    (2048, 16, 1024, 64, 16, True), (64, 4, 64, 32, 16, False),
    (2048, 128, 4096, 32, 1, False), (64, 4, 64, 32, 1, False), (8192, 16, 1024, 32, 1, True),
    (8192, 128, 1024, 32, 1, True), (8192, 128, 1024, 32, 16, True),
    (2048, 128, 4096, 64, 1, False), (8192, 256, 4096, 32, 1, True),
    (2048, 16, 4096, 32, 1, True), (2048, 256, 1024, 32, 1, False),
    (2048, 128, 1024, 32, 1, False), (2048, 256, 1024, 64, 1, False),
    (2048, 64, 1024, 32, 1, True), (8192, 128, 32768, 64, 1, True),
    (8192, 128, 32768, 32, 1, True), (8192, 256, 32768, 32, 1, True),
    (8192, 256, 32768, 64, 1, True), (2048, 256, 32768, 64, 1, False),
    (256, 16, 4096, 64, 1, False), (256, 128, 4096, 32, 1, False),
    (256, 16, 32768, 32, 16, True), (256, 16, 32768, 64, 16, True),
    (2048, 16, 32768, 32, 16, False), (256, 16, 32768, 32, 1, False),
    (256, 16, 32768, 64, 1, False), (256, 32, 32768, 32, 16, False)])
def test_pod_apart_decision(qo, n_dec, kv_d, hq, page, apart, monkeypatch):
    """The launch choice (ops.choose.pod_apart) of PODWithPagedKVCacheWrapper at the suite's
    sizes (bf16, Hkv 8, D 128, causal prefill with kv = qo) planned for a Hopper GPU; the
    policy's balance 0 keeps every call fused."""
    from compiled_attn.ops.policy import POD_FUSED, override
    from compiled_attn.pod import _traced_apart

    w, plan = _hopper_pod(monkeypatch, n_dec, kv_d, hq, page)
    plan()
    assert w._launch_apart(qo, qo, True) is apart
    # the fused launch's tile and the decodes' own tile when apart: 64 rows, on boxes and on
    # gathered pages
    assert (w._plan["block_m"], w._plan["block_m_d"]) == (64, 64)
    # a call traced by torch.compile: apart only where that needs no sizes, never exported
    assert _traced_apart(w._plan) is False
    with override(**POD_FUSED):
        assert w._launch_apart(qo, qo, True) is False
        assert _traced_apart(w._plan) is False
    if page == 1:  # without the gathered Gluon POD launch: the Triton kernel's 128-row tile,
        with override(pod_gather=False):  # always apart
            plan()
            assert w._launch_apart(qo, qo, True) is True
            assert (w._plan["block_m"], w._plan["block_m_d"]) == (128, 64)
            assert _traced_apart(w._plan) is True
            with monkeypatch.context() as m:
                m.setattr(torch.compiler, "_is_exporting_flag", True)  # as torch.export sets it
                assert _traced_apart(w._plan) is False


# Under CUDA-graph capture, where a second launch costs the replays no host time: few long
# decodes that alone take the few-programs K / V ring go apart beside a prefill under
# pod_ring_graph_apart_share of their bytes where the fused launch's items exceed one wave of
# resident programs, counted before any decode key chunks (GQA 64/8 p256 + 16 x 4k, 384 items
# on 264 programs: fused ran 0.956-0.968x of apart on page 16 and 1; p256 + 16 x 32k page 1
# level), on any page and whatever the sizes; GQA 32/8 (256 items: fused 1.01-1.02x),
# p256 + 16 x 1k (1.04-1.11x) and the rows beside p2048 keep their eager launch
# (benchmarks/NOTES.md, 2026-11-29).
@pytest.mark.parametrize("qo,n_dec,kv_d,hq,page,eager,graph", [
    (256, 16, 4096, 64, 16, False, True), (256, 16, 4096, 64, 1, False, True),
    (256, 16, 32768, 64, 1, False, True), (256, 16, 32768, 64, 16, True, True),
    (256, 16, 4096, 32, 16, False, False), (256, 16, 4096, 32, 1, False, False),
    (256, 16, 1024, 64, 16, False, False), (256, 16, 1024, 64, 1, False, False),
    (256, 16, 32768, 32, 1, False, False), (2048, 16, 4096, 64, 16, False, False),
    (2048, 16, 32768, 64, 16, False, False), (256, 128, 4096, 64, 16, False, False)])
def test_pod_apart_decision_captured(qo, n_dec, kv_d, hq, page, eager, graph, monkeypatch):
    """The launch choice of a captured call (ops.choose.pod_apart's captured rules) beside the
    eager one, at the suite's sizes planned for a Hopper GPU; the rule's share 0 turns it off."""
    from compiled_attn.ops.policy import override

    w, plan = _hopper_pod(monkeypatch, n_dec, kv_d, hq, page)
    plan()
    assert w._launch_apart(qo, qo, True) is eager
    monkeypatch.setattr(type(w), "_capturing", lambda self: True)
    assert w._launch_apart(qo, qo, True) is graph
    with override(pod_ring_graph_apart_share=0.0):
        assert w._launch_apart(qo, qo, True) is eager


@pytest.mark.parametrize("hq,apart", [(64, True), (32, False)])
def test_batch_pod_apart_decision_captured(hq, apart, monkeypatch):
    """BatchPOD asks the captured rule too: a 256-token prefill request beside 16 x 4k decodes
    (page 16) goes apart under capture at GQA 64/8 (the fused launch's 384 items exceed a wave
    of 264 programs), not at GQA 32/8 (256 items), and never eagerly."""
    from compiled_attn.ops import choose

    monkeypatch.setattr(choose, "_plan_device", lambda: choose.H100)
    qo, n_dec, kv_d, page = 256, 16, 4096, 16
    dec = [kv_d // page] * n_dec
    w = fi.BatchPODWithPagedKVCacheWrapper(WS)
    w.plan(indptr([qo]), indptr([qo // page]), torch.arange(qo // page, dtype=torch.int32),
           torch.full((1,), page, dtype=torch.int32), indptr([1] * n_dec), indptr(dec),
           torch.arange(sum(dec), dtype=torch.int32), torch.full((n_dec,), page,
                                                                  dtype=torch.int32),
           hq, 8, 128, page, q_data_type=torch.bfloat16)
    assert w._launch_apart(True) is False
    monkeypatch.setattr(type(w), "_capturing", lambda self: True)
    assert w._launch_apart(True) is apart


# POD's decode key chunks at the pod suite's sizes (bf16, Hkv 8, D 128, causal prefill with
# kv = qo) planned for a Hopper GPU: (prefill rows, decodes, decode keys, Hq, page, chunks a
# request (0: none), whether a fused launch runs them). Few requests (at most one program a
# SM) are cut for two waves, in four chunks or more of 1k keys or more; beside a prefill of
# less than a wave of tiles (p256: 128, at GQA 64/8 256, of 264) a launch runs them only for
# decodes of 16k keys or more, whose chunks hold at most 4k keys. H200 replays of the fused
# launch, uncut / cut (benchmarks/NOTES.md, 2026-11-29): p2048 + 16 x 32k 636 / 547 us (in 4
# chunks; 8: 548 against 561 in a later run), p256 + 16 x 32k 535 / 497, p2048 + 16 x 4k 151 /
# 134, p256 + 16 x 4k 78 / 82 (not run), p256 + 8 x 32k 486 / 258, p2048 + 16 x 2k 110 / 115
# (2 chunks: not cut).
@pytest.mark.parametrize("qo,n_dec,kv_d,hq,page,chunks,cut", [
    (2048, 16, 32768, 32, 16, 8, True), (256, 16, 32768, 32, 16, 8, True),
    (2048, 16, 4096, 32, 16, 4, True), (256, 16, 4096, 32, 16, 4, False),
    (2048, 16, 2048, 32, 16, 0, False), (2048, 16, 3072, 32, 16, 0, False),
    (256, 16, 1024, 32, 16, 0, False), (256, 8, 32768, 32, 16, 8, True),
    (2048, 16, 8192, 32, 16, 4, True), (2048, 128, 4096, 32, 16, 0, False),
    (2048, 32, 4096, 32, 16, 0, False), (2048, 16, 32768, 64, 1, 8, True),
    (256, 16, 16384, 64, 16, 4, True), (2048, 2, 4096, 32, 16, 4, True),
    (256, 16, 4096, 64, 16, 4, False), (256, 16, 4096, 64, 1, 4, False),
    (2048, 4, 16384, 32, 16, 16, True), (2048, 16, 24576, 32, 16, 6, True)])
def test_pod_decode_chunk_decision(qo, n_dec, kv_d, hq, page, chunks, cut, monkeypatch):
    from compiled_attn.ops import choose
    from compiled_attn.ops.policy import override

    _, plan_dict = _hopper_pod(monkeypatch, n_dec, kv_d, hq, page)

    def plan():
        return plan_dict()["chunks"]

    c = plan()
    assert (0 if c is None else int(c["merge"][:, 2].max())) == chunks
    if c is not None:
        tiles = -(-qo * (hq // 8) // 64)
        assert choose.pod_cut(tiles * 8, c["longest"], c["sms"]) is cut
        assert c["work"].shape[0] == n_dec * chunks  # a one-row tile a chunk
    with override(pod_chunks="off"):
        assert plan() is None
    with override(pod_gluon=False):  # the Triton POD launch: no chunks under "gluon"
        assert plan() is None


@pytest.mark.parametrize("n_dec,kv_d,page", [(8, 32768, 16), (16, 32768, 16), (2, 4096, 1),
                                            (4, 1000, 16), (8, 600, 16)])
def test_pod_apart_decodes_cut_as_a_paged_call_of_them_alone(n_dec, kv_d, page, monkeypatch):
    """Where POD's parts run apart, its decodes take the key chunks a paged plan of them alone
    would (schedule.decode_chunk_count's own rule on a Hopper GPU: programs at most half the
    SMs, one wave, chunks of 512 keys or more), planned as p["chunks_apart"] on their own
    tile."""
    from compiled_attn.ops.schedule import decode_chunk_count

    w, plan = _hopper_pod(monkeypatch, n_dec, kv_d, 32, page)
    c = plan()["chunks_apart"]
    want = decode_chunk_count([1] * n_dec, [kv_d] * n_dec, 8, 132)
    assert (0 if c is None else int(c["merge"][:, 2].max())) == want
    if c is not None:
        assert w._plan["block_m_d"] == 64 and c["work"].shape[0] == c["src"].shape[0]


# (prefill tokens, decodes, keys each, Hq, page, apart eagerly, apart under capture): small
# calls (the two parts under pod_apart_min_bytes) stay fused eagerly, where a second launch's
# host time shows; under CUDA-graph capture a page-1 call, whose fused launch gathers its
# prefill, goes apart by the balance alone (p2048 + 16 x 1k replayed 120.5 us fused, 110.0
# apart), and a page-16 one keeps the floor (fused 2.6% faster there; benchmarks/NOTES.md,
# 2026-11-29). Larger calls decide alike.
@pytest.mark.parametrize("qo,n_dec,kv_d,hq,page,eager,captured", [
    (2048, 16, 1024, 32, 1, False, True), (2048, 16, 1024, 32, 16, False, False),
    (256, 16, 1024, 32, 1, False, False), (64, 4, 64, 32, 1, False, False),
    (8192, 16, 1024, 32, 1, True, True), (2048, 128, 4096, 32, 1, False, False)])
def test_pod_apart_under_capture(qo, n_dec, kv_d, hq, page, eager, captured, monkeypatch):
    from compiled_attn.ops.policy import override
    from compiled_attn.pod import _apart, _pairs

    from compiled_attn.pod import _prefill_tiles

    w, plan = _hopper_pod(monkeypatch, n_dec, kv_d, hq, page)
    p = plan()
    pairs = _pairs(qo, qo, True)
    kw = dict(fused_rows=_prefill_tiles(p, qo) + p["work_d"].shape[0])
    assert w._launch_apart(qo, qo, True) is eager  # (a CPU wrapper: never capturing)
    for c, want in ((False, eager), (True, captured)):
        assert _apart(p, pairs, p["decode_bytes"], dense_prefill=True, captured=c, **kw) is want
    # the setting is the floor under capture: the eager floor there keeps the eager choice
    with override(pod_gather_graph_min_bytes=4e8):
        assert _apart(p, pairs, p["decode_bytes"], dense_prefill=True, captured=True,
                      **kw) is eager
    # BatchPOD's prefill alone reads the fused launch's pages: no captured exception
    assert _apart(p, pairs, p["decode_bytes"], dense_prefill=False, captured=True,
                  **kw) is _apart(p, pairs, p["decode_bytes"], dense_prefill=False, **kw)


def test_gathered_penalty_only_where_the_prefill_alone_reads_dense_kv(monkeypatch):
    """On page 1 the fused launch gathers both parts: POD's prefill alone reads contiguous
    k / v (faster), so a large prefill with small decodes goes apart; BatchPOD's prefill alone
    reads the same gathered pages, so the same sizes stay fused (the usual balance)."""
    from compiled_attn.ops import choose
    from compiled_attn.pod import _apart, _pairs

    monkeypatch.setattr(choose, "_plan_device", lambda: choose.H100)
    qo, n_dec, kv_d, page = 8192, 128, 1024, 1
    dec = [kv_d // page] * n_dec
    w = fi.BatchPODWithPagedKVCacheWrapper(WS)
    w.plan(indptr([qo]), indptr([qo // page]), torch.arange(qo // page, dtype=torch.int32),
           torch.ones(1, dtype=torch.int32), indptr([1] * n_dec), indptr(dec),
           torch.arange(sum(dec), dtype=torch.int32), torch.ones(n_dec, dtype=torch.int32),
           32, 8, 128, page, q_data_type=torch.bfloat16)
    p = w._plan
    assert p["fused_gluon"] and p["fused_gathers"]
    pairs = _pairs(qo, qo, True)
    kw = dict(fused_rows=p["work"].shape[0])
    assert _apart(p, pairs, p["decode_bytes"], dense_prefill=True, **kw) is True  # as POD
    assert _apart(p, pairs, p["decode_bytes"], dense_prefill=False, **kw) is False  # BatchPOD


def test_pod_launch_choice_follows_a_later_policy_override(pod_calls):
    """The launch choice is the policy's at each call: a wrapper that ran a prefill length
    apart runs it fused under a later override (the prefill part it keeps for that length holds
    tensors, not the choice)."""
    from compiled_attn.ops.policy import override

    from .helpers import POD_LAUNCHES

    hq, hkv, d, page, qo = 4, 2, 8, 4, 6
    cache, kvi, idx, last, _, _ = make_paged(KV_D, hkv, d, d, page)
    w = fi.PODWithPagedKVCacheWrapper(WS)
    w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=D64)
    q_p, k_p, v_p = rand(qo, hq, d, seed=1), rand(qo, hkv, d, seed=2), rand(qo, hkv, d, seed=3)
    q_d = rand(len(KV_D), hq, d, seed=4)
    outs = {}
    for kind in ("apart", "fused"):
        pod_calls.clear()
        with override(**POD_LAUNCHES[kind]):
            outs[kind] = w.run(q_p, k_p, v_p, q_d, cache, causal_p=True)
        check_pod_launch((kind, pod_calls), True)
    for a, b in zip(outs["apart"], outs["fused"]):
        torch.testing.assert_close(a, b)


def test_pod_pairs_count_what_the_mask_keeps():
    """The query-key pairs choose.pod_apart is given: every pair, or the bottom-right causal
    mask's (kv < qo included), as counted row by row."""
    from compiled_attn.pod import _pairs

    for qo, kv in ((0, 5), (5, 0), (1, 1), (7, 3), (3, 7), (9, 9), (16, 40)):
        assert _pairs(qo, kv, False) == qo * kv
        assert _pairs(qo, kv, True) == sum(min(kv, max(0, kv - qo + 1 + i)) for i in range(qo))


def test_compiled_pod_run_keeps_one_graph_over_batch_and_cache_sizes():
    """torch.compile(dynamic=True, fullgraph=True) of POD run(): re-plans with new decode batch
    sizes and caches of new page counts reuse the graph (the batch size and the cache's page
    count were guards: a recompile each, a failure past the recompile limit), and each
    compiled call gives the eager call's numbers."""
    from torch._dynamo.utils import counters

    dt = torch.float64
    w = fi.PODWithPagedKVCacheWrapper(WS)
    g = torch.Generator().manual_seed(3)
    q_p, k_p, v_p = (torch.randn(n, h, 16, generator=g, dtype=dt)
                     for n, h in ((5, 4), (9, 2), (9, 2)))

    def attend(q_p, k_p, v_p, q_d, cache):
        return w.run(q_p, k_p, v_p, q_d, cache, causal_p=True)

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(attend, fullgraph=True, dynamic=True, backend="eager")
    for b, pages in ((2, 64), (3, 64), (5, 70), (7, 80), (4, 90)):
        w.plan(torch.arange(b + 1, dtype=torch.int32) * 2, torch.arange(2 * b, dtype=torch.int32),
               torch.full((b,), 3, dtype=torch.int32), 4, 2, 16, 4, q_data_type=dt,
               kv_data_type=dt)
        q_d = torch.randn(b, 4, 16, generator=g, dtype=dt)
        cache = tuple(torch.randn(pages, 4, 2, 16, generator=g, dtype=dt) for _ in range(2))
        for got, want in zip(f(q_p, k_p, v_p, q_d, cache), attend(q_p, k_p, v_p, q_d, cache)):
            torch.testing.assert_close(got, want)
    assert counters["stats"]["unique_graphs"] <= 2, dict(counters["stats"])


# POD's parts side by side (ops.choose.pod_side): where the prefill counted as bytes is at least
# pod_side_min_prefill_bytes (2e9) and the decodes' bytes at least pod_side_min_bytes (4e8), where
# the decodes' own launch is the Gluon kernel's persistent 64-row one (pages read by TMA boxes, or
# gathered: page 1), and the prefill's share of the decodes' bytes is at least pod_side_share
# (0.75): the decodes' grid capped at half the SMs (66 of 132); or, decode-heavy, at least
# pod_side_heavy_share (0.1): capped at their share of both parts' bytes, at most 0.8 (106).
# Measured (H200; benchmarks/NOTES.md, 2026-11-30): the p8192 cases below 0.99-1.09x the better
# of the fused launch and apart on page 16, 1.02-1.16x on page 1 (graph); the decode-heavy
# p8192 + 128 / 256 x 32k (shares 0.11-0.43) 1.04-1.19x; p4096 / p2048 + 128 x 4k and GQA 64/8
# p2048 + 128 x 1k (prefill under 2e9 bytes) lost 0.76-0.87x. Under that floor, where the fused
# launch would gather the prefill's contiguous k / v (page 1): side by side where the prefill is
# at least 2e8 bytes and 0.75 of the decodes' bytes, and the decodes read at least 6e7, on
# their share of both parts' bytes, at least a quarter of the SMs (2026-12-01: p2048 + 16 x 1k /
# 4k and GQA 64/8 p2048 + 128 x 1k 1.04-1.16x apart).
@pytest.mark.parametrize("qo,n_dec,kv_d,hq,page,programs", [
    (2048, 16, 1024, 32, 1, 33), (2048, 16, 4096, 32, 1, 71), (2048, 16, 1024, 64, 1, 33),
    (2048, 16, 4096, 64, 1, 49), (2048, 128, 1024, 64, 1, 71),
    (2048, 128, 1024, 32, 1, 0),  # (the prefill 0.43 of the decodes' bytes)
    (256, 16, 4096, 32, 1, 0), (1024, 16, 1024, 32, 1, 0),  # (prefills under 2e8 bytes)
    (2048, 16, 4096, 32, 16, 0),  # (page 16: the fused launch reads both parts by boxes)
    (2048, 8, 1024, 32, 1, 0),  # (decodes under 6e7 bytes)
    (8192, 256, 4096, 32, 16, 66), (8192, 128, 4096, 32, 16, 66),
    (8192, 256, 4096, 64, 16, 66), (8192, 128, 1024, 32, 16, 66),
    (8192, 16, 32768, 64, 16, 66), (2048, 128, 1024, 64, 16, 0),
    (4096, 128, 4096, 32, 16, 0), (2048, 128, 4096, 32, 16, 0),
    (8192, 16, 1024, 32, 16, 0), (8192, 16, 4096, 32, 16, 0),
    (8192, 256, 4096, 32, 1, 66), (8192, 16, 32768, 64, 1, 66),
    (2048, 128, 4096, 32, 1, 0), (64, 4, 64, 32, 16, 0),
    # decode-heavy: 17.2e9 / 34.4e9 decode bytes beside 3.7e9 (GQA 32/8) / 7.3e9 (64/8)
    (8192, 128, 32768, 32, 16, 106), (8192, 256, 32768, 32, 1, 106),
    (8192, 128, 32768, 64, 16, 93), (8192, 256, 32768, 64, 1, 106),
    (8192, 512, 32768, 32, 16, 0),  # (share 0.053: under pod_side_heavy_share)
    (2048, 256, 32768, 32, 16, 0)])  # (prefill under 2e9 bytes)
def test_pod_side_decision(qo, n_dec, kv_d, hq, page, programs, monkeypatch):
    """The side-by-side choice of PODWithPagedKVCacheWrapper at the suite's sizes planned for a
    Hopper GPU (132 SMs), never with a run's decode window or position encoding, and the
    launch-fixing settings: POD_FUSED (pod_apart_balance 0: one launch) and POD_APART never,
    POD_SIDE wherever the decodes' launch is the one the cap reaches (half the SMs)."""
    from compiled_attn.ops.policy import POD_APART, POD_FUSED, POD_SIDE, override

    from compiled_attn.ops import POS_NONE, POS_ROPE_LLAMA

    w, plan = _hopper_pod(monkeypatch, n_dec, kv_d, hq, page)
    plan()
    assert w._launch_side(qo, qo, True) == programs
    # a run's decode window or position encoding leaves the 64-row box launch the cap reaches
    assert w._launch_side(qo, qo, True, 127, POS_NONE) == 0
    assert w._launch_side(qo, qo, True, -1, POS_ROPE_LLAMA) == 0
    for fixed in (POD_FUSED, POD_APART):
        with override(**fixed):
            assert w._launch_side(qo, qo, True) == 0
    with override(**POD_SIDE):
        assert w._launch_side(qo, qo, True) == 66


@pytest.mark.parametrize("kind", ["pod", "batch_pod"])
def test_replan_reuses_the_options_only_while_they_are_the_same(kind, monkeypatch):
    # A serving step re-plans with the same options: plan() takes them from the previous plan
    # of the wrapper. Any option (its type too: True is no window), the launch policy or the
    # device plans are made for changing makes them anew, and a bad one still raises.
    from compiled_attn._plan_options import PlanOptions
    from compiled_attn.ops import choose, policy

    made = []
    of_pod = PlanOptions.of_pod.__func__
    monkeypatch.setattr(PlanOptions, "of_pod",
                        classmethod(lambda cls, *a: made.append(1) or of_pod(cls, *a)))
    _, kvi, idx, last, _, _ = make_paged(KV_D, 2, 32, 32, 4, dtype=torch.float32, seed=3)
    if kind == "pod":
        w = fi.PODWithPagedKVCacheWrapper(WS)

        def plan(**kw):
            w.plan(kvi, idx, last, 4, 2, 32, 4, q_data_type=torch.float32, **kw)
    else:
        w = fi.BatchPODWithPagedKVCacheWrapper(WS)
        qo = indptr([1] * len(KV_D))

        def plan(**kw):
            w.plan(qo, kvi, idx, last, qo, kvi, idx, last, 4, 2, 32, 4,
                   q_data_type=torch.float32, **kw)
    plan(window_left=3)
    plan(window_left=3)
    assert len(made) == 1 and w._plan["window_left"] == 3
    plan(window_left=1)
    assert len(made) == 2 and w._plan["window_left"] == 1
    with pytest.raises(ValueError, match="window_left: got True"):
        plan(window_left=True)
    plan(window_left=1, sm_scale=0.5)
    assert len(made) == 4 and w._plan["sm_scale"] == 0.5
    with policy.override(pod_apart_balance=0.0):
        plan(window_left=1, sm_scale=0.5)
    assert len(made) == 5
    monkeypatch.setattr(choose, "_plan_device", lambda: choose.H100)
    plan(window_left=1, sm_scale=0.5)
    assert len(made) == 6
    plan(window_left=1, sm_scale=0.5)
    assert len(made) == 6


def test_pod_replans_send_the_decodes_cached_lists_once(monkeypatch):
    # A serving step re-plans with the same decode batch size: the decodes' qo_indptr and work
    # lists are the same host objects (_decode_lists) and are not copied again; the page
    # table's arrays are. Batch sizes 4, 4, 3, 4, each plan's run() against the oracle.
    copies = counted_copies(monkeypatch)
    hq, hkv, d, page = 4, 2, 8, 3
    w = fi.PODWithPagedKVCacheWrapper(WS)
    counts = []
    for step, kv_d in enumerate([KV_D, [5, 0, 11, 2], [7, 1, 4], [3, 9, 0, 6]]):
        cache, kvi, idx, last, ks, vs = make_paged(kv_d, hkv, d, d, page, seed=90 + step)
        copies.clear()
        w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=D64)
        counts.append(len(copies))
        q_p, k_p, v_p = (rand(6, hq, d, seed=91), rand(9, hkv, d, seed=92),
                         rand(9, hkv, d, seed=93))
        q_d = rand(len(kv_d), hq, d, seed=94 + step)
        (o_p, o_d), (l_p, l_d) = w.run(q_p, k_p, v_p, q_d, cache, causal_p=True,
                                       return_lse_p=True, return_lse_d=True)
        _check_part(o_p, l_p, q_p, [6], [k_p], [v_p], causal=True)
        _check_part(o_d, l_d, q_d, [1] * len(kv_d), ks, vs)
        assert w._plan["qo_indptr"].tolist() == list(range(len(kv_d) + 1))
    # the page table's three arrays alone on the second plan; everything on the others
    assert counts[1] == 3 and counts[0] == counts[2] == counts[3] > 3, counts
