"""POD under the Triton interpreter: seeded random mixes of a prefill part and a decode part
through PODWithPagedKVCacheWrapper and BatchPODWithPagedKVCacheWrapper, and through the POD op
itself for the options the wrappers do not take (logits soft cap, as in FlashInfer's POD).

Each mix draws its lengths (odd ones, 1, qo_len != kv_len, requests without keys), the decode
batch size (0 included), empty prefill parts, page size 1 / 3 / 16, GQA 1:1 / 4:1 / 7:1, the
layouts, causal or not, window_left, sm_scale and which LSEs are asked for; every part is
checked against the float64 reference with the project's error bound (kernel_cases.check:
twice PyTorch's own error in the same dtype plus a rounding term; NaN never passes).
``test_mixes_cover_the_grid`` pins that the seeds reach every value listed. fp16 and fp32 only:
the interpreter computes bf16 dots wrongly (bf16 is tested on the GPU)."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

import compiled_attn as fi
from compiled_attn import ops
from compiled_attn.ops.tiles import ONE_PAGE_SIZE
from tests.helpers import POD_LAUNCHES, WS, check_pod_launch, indptr, make_paged
from tests.kernel_cases import Case, check_parts, check_pod, make_case, params

GQA = [(2, 2), (4, 1), (7, 1)]
PAGES = [1, 3, 16]
SEEDS = range(12)  # per wrapper: each (GQA, page size) pair at least once; empty parts
NO_DECODES, NO_PREFILL = (1, 5), (2, 5)  # seeds whose part is empty (5: both)


def _odd_or_one(r: random.Random, hi: int) -> int:
    return r.choice([1, r.randrange(3, hi, 2)])


def _mix(kind: str, seed: int) -> SimpleNamespace:
    """The random mix of ``seed`` for wrapper ``kind`` ("pod" / "batch_pod"): shapes, lengths
    and options (the CUDA-graph buffers and per-part overrides of POD only)."""
    r = random.Random(f"{kind}-{seed}")
    hq, hkv = GQA[seed % 3]
    m = SimpleNamespace(
        hq=hq, hkv=hkv, page=PAGES[(seed + seed // 3) % 3], d=r.choice([16, 32]),
        dtype=(torch.float16, torch.float32)[seed % 2], layout=r.choice(["NHD", "HND"]),
        causal=r.random() < 0.5, window=r.choice([-1, r.randint(0, 12)]),
        sm_scale=r.choice([None, 0.3]))
    n_dec = 0 if seed in NO_DECODES else r.randint(1, 5)
    m.kv_d = [0 if r.random() < 0.15 else r.randint(1, 50) for _ in range(n_dec)]
    if kind == "pod":
        if seed in NO_PREFILL:
            m.qo_p, m.kv_p = [0], [r.choice([0, r.randint(1, 12)])]
        else:
            qo = _odd_or_one(r, 40)
            kv = qo + r.randint(0, 20) if m.causal else r.randint(1, 45)  # causal: kv >= qo
            m.qo_p, m.kv_p = [qo], [kv]
        m.layout_p = r.choice(["NHD", "HND"])
        m.window_p = r.choice([-1, r.randint(0, 12)])
        m.sm_scale_p = r.choice([None, 0.7])
        m.lse = (r.random() < 0.5, r.random() < 0.5)
        m.graph_bufs = r.random() < 0.3
    else:
        if seed in NO_PREFILL:  # no requests, or requests without rows
            m.qo_p = [] if seed == NO_PREFILL[0] else [0, 0]
        else:
            m.qo_p = [0 if r.random() < 0.15 else _odd_or_one(r, 32)
                      for _ in range(r.randint(1, 3))]
        m.kv_p = [r.randint(0, 40) for _ in m.qo_p]  # causal: kv < qo allowed (bottom-right)
        m.lse = (r.random() < 0.5,) * 2
    return m


def _paged_case(q, cache, layout, qo_lens, kvi, idx, last) -> Case:
    """The reference's view of a paged part: q and the 5-D cache's K / V in NHD order."""
    k, v = cache[:, 0], cache[:, 1]
    if layout == "HND":
        k, v = k.transpose(1, 2), v.transpose(1, 2)
    return Case("paged", q=q, k=k, v=v, qo_indptr=indptr(qo_lens), kv_indptr=kvi,
                page_indices=idx, last_page_len=last)


def _parts(res, want_lse: tuple) -> tuple:
    """(out_p, lse_p, out_d, lse_d) of a POD run()'s result, its structure checked: the plain
    pair when no LSE is asked for, else the pair of pairs with None for an LSE not asked for."""
    if not any(want_lse):
        out_p, out_d = res
        assert torch.is_tensor(out_p) and torch.is_tensor(out_d)
        return out_p, None, out_d, None
    (out_p, out_d), (lse_p, lse_d) = res
    assert [lse is not None for lse in (lse_p, lse_d)] == list(want_lse)
    return out_p, lse_p, out_d, lse_d


def _randn(g, *shape, dtype):
    return torch.randn(*shape, generator=g).to(dtype)


@pytest.mark.parametrize("seed", SEEDS)
def test_pod_mix(seed, pod_launch):
    m = _mix("pod", seed)
    hq, hkv, d, dt, b = m.hq, m.hkv, m.d, m.dtype, len(m.kv_d)
    cache, kvi, idx, last, _, _ = make_paged(m.kv_d, hkv, d, d, m.page, layout=m.layout,
                                             dtype=dt, seed=seed)
    g = torch.Generator().manual_seed(1000 + seed)
    (qo,), (kv,) = m.qo_p, m.kv_p
    q_p, k_p, v_p = (_randn(g, qo, hq, d, dtype=dt), _randn(g, kv, hkv, d, dtype=dt),
                     _randn(g, kv, hkv, d, dtype=dt))
    q_d = _randn(g, b, hq, d, dtype=dt)
    bufs = {}
    if m.graph_bufs:  # buffers sized for more pages than this plan has
        bufs = dict(paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32),
                    paged_kv_indices_buffer=torch.zeros(idx.numel() + 7, dtype=torch.int32),
                    paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32))
    w = fi.PODWithPagedKVCacheWrapper(WS, m.layout, bool(bufs), **bufs)
    w.plan(kvi, idx, last, hq, hkv, d, m.page, window_left=m.window, q_data_type=dt,
           sm_scale=m.sm_scale)
    kk, vv = ((k_p, v_p) if m.layout_p == "NHD"
              else (k_p.transpose(0, 1).contiguous(), v_p.transpose(0, 1).contiguous()))
    pre = Case("ragged", q=q_p, k=k_p, v=v_p, qo_indptr=indptr([qo]), kv_indptr=indptr([kv]))
    dec = _paged_case(q_d, cache, m.layout, [1] * b, kvi, idx, last)
    p_pre = params(ops.MASK_CAUSAL if m.causal else ops.MASK_NONE, m.window_p,
                   sm_scale=m.sm_scale_p, head_dim=d)
    p_dec = params(ops.MASK_NONE, m.window, sm_scale=m.sm_scale, head_dim=d)
    check_parts(pre, dec, p_pre, p_dec, lambda: _parts(w.run(
        q_p, kk, vv, q_d, cache, causal_p=m.causal, kv_layout_p=m.layout_p,
        sm_scale_p=m.sm_scale_p, window_left_p=m.window_p, return_lse_p=m.lse[0],
        return_lse_d=m.lse[1]), m.lse))
    check_pod_launch(pod_launch, qo * kv > 0 and any(m.kv_d))


@pytest.mark.parametrize("seed", SEEDS)
def test_batch_pod_mix(seed, pod_launch):
    m = _mix("batch_pod", seed)
    hq, hkv, d, dt, b = m.hq, m.hkv, m.d, m.dtype, len(m.kv_d)
    cache_p, kvi_p, idx_p, last_p, _, _ = make_paged(m.kv_p, hkv, d, d, m.page,
                                                     layout=m.layout, dtype=dt, seed=seed)
    cache_d, kvi_d, idx_d, last_d, _, _ = make_paged(m.kv_d, hkv, d, d, m.page,
                                                     layout=m.layout, dtype=dt, seed=seed + 50)
    g = torch.Generator().manual_seed(2000 + seed)
    q_p, q_d = _randn(g, sum(m.qo_p), hq, d, dtype=dt), _randn(g, b, hq, d, dtype=dt)
    w = fi.BatchPODWithPagedKVCacheWrapper(WS, m.layout)
    w.plan(indptr(m.qo_p), kvi_p, idx_p, last_p, indptr([1] * b), kvi_d, idx_d, last_d, hq,
           hkv, d, m.page, window_left=m.window, q_data_type=dt, sm_scale=m.sm_scale)
    pre = _paged_case(q_p, cache_p, m.layout, m.qo_p, kvi_p, idx_p, last_p)
    dec = _paged_case(q_d, cache_d, m.layout, [1] * b, kvi_d, idx_d, last_d)
    p_pre = params(ops.MASK_CAUSAL if m.causal else ops.MASK_NONE, m.window,
                   sm_scale=m.sm_scale, head_dim=d)
    p_dec = params(ops.MASK_NONE, m.window, sm_scale=m.sm_scale, head_dim=d)
    check_parts(pre, dec, p_pre, p_dec, lambda: _parts(
        w.run(q_p, cache_p, q_d, cache_d, causal_p=m.causal, return_lse=m.lse[0]), m.lse))
    # (a request's last row sees all its keys, causal or not)
    check_pod_launch(pod_launch, any(q and k for q, k in zip(m.qo_p, m.kv_p)) and any(m.kv_d))


# (prefill, decode) soft caps of the op-level mixes: each part capped alone, then both
SOFT_CAPS = [(2.0, 0.0), (0.0, 3.0), (1.5, 4.0)]


@pytest.mark.parametrize("seed", range(len(SOFT_CAPS)))
def test_pod_op_soft_cap_mix(seed):
    # The wrappers take no soft cap (FlashInfer's POD fixes it at 0); the op takes one per
    # part, with a window and a custom mask for the prefill part.
    r = random.Random(f"op-{seed}")
    hq, hkv = GQA[seed % 3]
    d, dt = r.choice([16, 32]), (torch.float16, torch.float32)[seed % 2]
    qo_p = [_odd_or_one(r, 40) for _ in range(r.randint(1, 3))]
    kv_p = [n + r.randint(0, 20) for n in qo_p]
    kv_d = [0 if r.random() < 0.15 else r.randint(1, 50) for _ in range(r.randint(1, 5))]
    custom = r.random() < 0.5
    pre = make_case("paged", qo_p, kv_p, hq, hkv, d, dtype=dt, page_size=r.choice(PAGES),
                    custom_mask=custom, seed=seed)
    dec = make_case("paged", [1] * len(kv_d), kv_d, hq, hkv, d, dtype=dt,
                    page_size=r.choice(PAGES), seed=seed + 10)
    cap_p, cap_d = SOFT_CAPS[seed]
    check_pod(pre, dec,
              params(ops.MASK_CUSTOM if custom else ops.MASK_CAUSAL, r.choice([-1, 5]),
                     logits_soft_cap=cap_p, head_dim=d),
              params(ops.MASK_NONE, r.choice([-1, 9]), sm_scale=0.4, logits_soft_cap=cap_d,
                     head_dim=d))


def test_mixes_cover_the_grid():
    mixes = [(kind, _mix(kind, s)) for kind in ("pod", "batch_pod") for s in SEEDS]
    for kind in ("pod", "batch_pod"):
        ms = [m for k, m in mixes if k == kind]
        assert {(m.hq, m.hkv) for m in ms} == set(GQA)
        assert {m.page for m in ms} == set(PAGES)
        assert {m.dtype for m in ms} == {torch.float16, torch.float32}
        assert {m.causal for m in ms} == {True, False}
        assert {m.layout for m in ms} == {"NHD", "HND"}
        assert {m.sm_scale for m in ms} == {None, 0.3}
        assert any(m.window < 0 for m in ms)
        # a window that cuts keys of a decode request, and of a prefill row
        assert any(0 <= m.window < n - 1 for m in ms for n in m.kv_d)
        win_p = [(m.window_p if kind == "pod" else m.window, m) for m in ms]
        assert any(0 <= w < k - 1 for w, m in win_p for q, k in zip(m.qo_p, m.kv_p) if q)
        assert {m.lse for m in ms} >= {(True, True), (False, False)}
        assert any(not m.kv_d for m in ms) and any(sum(m.qo_p) == 0 for m in ms)
        assert any(not m.kv_d and sum(m.qo_p) == 0 for m in ms)
        assert any(0 in m.kv_d for m in ms)  # a decode request without keys
        lens = [(q, k) for m in ms for q, k in zip(m.qo_p, m.kv_p) if q]
        assert any(q == 1 for q, _ in lens) and any(q % 2 and q > 1 for q, _ in lens)
        assert any(q != k for q, k in lens)
    pods = [m for k, m in mixes if k == "pod"]
    assert {m.layout_p for m in pods} == {"NHD", "HND"}
    assert any(m.graph_bufs for m in pods) and {m.sm_scale_p for m in pods} == {None, 0.7}
    assert {m.lse for m in pods} >= {(True, False), (False, True)}
    batch = [m for k, m in mixes if k == "batch_pod"]
    assert any(q > k for m in batch for q, k in zip(m.qo_p, m.kv_p))


def test_one_page_prefill_constexpr_does_not_follow_its_length(monkeypatch):
    """PODWithPagedKVCacheWrapper's contiguous k_p / v_p (a one-page cache as long as the
    prefill's keys) reach the Triton POD launch with one fixed page-size constexpr for every
    prefill length, so the kernel is not compiled again per length; the results are checked
    against the reference by test_pod_mix."""
    from compiled_attn.ops import launch, policy, prefill_kernel as K

    hq, hkv, d, dt = 4, 1, 16, torch.float16
    cache, kvi, idx, last, _, _ = make_paged([5, 9], hkv, d, d, 4, dtype=dt, seed=3)
    w = fi.PODWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(kvi, idx, last, hq, hkv, d, 4, q_data_type=dt)
    seen = []
    real = launch.run

    def run(fn, grid, *args, **kw):
        if fn is K._pod_fwd:
            seen.append((kw["PAGE_SIZE_P"], kw["PAGE_SIZE_D"]))
        return real(fn, grid, *args, **kw)

    monkeypatch.setattr(launch, "run", run)
    g = torch.Generator().manual_seed(0)
    # every call takes the launch path, the fused one (tests/helpers.py POD_LAUNCHES)
    with policy.override(bound_launches=False, **POD_LAUNCHES["fused"]):
        for kv in (7, 33, 20):
            q_p, k_p, v_p = (_randn(g, n, h, d, dtype=dt)
                             for n, h in ((kv, hq), (kv, hkv), (kv, hkv)))
            w.run(q_p, k_p, v_p, _randn(g, 2, hq, d, dtype=dt), cache, causal_p=True)
    assert seen == [(ONE_PAGE_SIZE, 4)] * 3


def test_one_page_cache_listed_twice_keeps_page_arithmetic():
    """A one-page prefill cache whose page a request lists twice (legal in FlashInfer: the same
    page's keys twice over) is not read as rows (choose.one_page_cache): each part matches the
    float64 reference."""
    from compiled_attn.ops import choose

    hq, hkv, d, dt, page = 4, 2, 16, torch.float32, 5
    pre = make_case("paged", [3], [2 * page - 1], hq, hkv, d, dtype=dt, page_size=page, seed=7)
    one = pre.k[:1], pre.v[:1]  # keep page 0 only, listed twice
    pre = Case("paged", q=pre.q, k=one[0], v=one[1], qo_indptr=pre.qo_indptr,
               kv_indptr=torch.tensor([0, 2], dtype=torch.int32),
               page_indices=torch.zeros(2, dtype=torch.int32),
               last_page_len=torch.tensor([page - 1], dtype=torch.int32),
               work=pre.work, block_m=pre.block_m)
    assert not choose.one_page_cache(pre.k, pre.v, pre.page_indices)
    dec = make_case("paged", [1, 1], [6, 11], hq, hkv, d, dtype=dt, page_size=page, seed=8)
    check_pod(pre, dec, params(ops.MASK_CAUSAL, -1, head_dim=d),
              params(ops.MASK_NONE, -1, head_dim=d))


def test_decodes_apart_on_their_own_tile(monkeypatch, pod_calls):
    """A BatchPOD call run apart launches its decodes on the plan's block_m_d
    (choose.pod_decode_tile) with the work list built for that tile, not the fused launch's:
    here 16 rows (forced) against the plan's 64, with decode requests of up to 20 packed rows
    (two 16-row tiles). Each part matches the float64 reference; a list built for the other
    tile would leave rows unwritten."""
    from compiled_attn.ops import choose, policy

    monkeypatch.setattr(choose, "pod_decode_tile", lambda *a, **k: 16)
    hq, hkv, d, dt, page = 4, 1, 16, torch.float32, 3
    qo_p, kv_p, qo_d, kv_d = [9], [14], [5, 1, 3, 0], [21, 8, 40, 6]
    cache_p, kvi_p, idx_p, last_p, _, _ = make_paged(kv_p, hkv, d, d, page, dtype=dt, seed=11)
    cache_d, kvi_d, idx_d, last_d, _, _ = make_paged(kv_d, hkv, d, d, page, dtype=dt, seed=12)
    g = torch.Generator().manual_seed(13)
    q_p, q_d = _randn(g, sum(qo_p), hq, d, dtype=dt), _randn(g, sum(qo_d), hq, d, dtype=dt)
    w = fi.BatchPODWithPagedKVCacheWrapper(WS, "NHD")
    w.plan(indptr(qo_p), kvi_p, idx_p, last_p, indptr(qo_d), kvi_d, idx_d, last_d, hq, hkv, d,
           page, q_data_type=dt)
    assert (w._plan["block_m"], w._plan["block_m_d"]) == (64, 16)
    assert w._plan["work_d_apart"].shape[0] == 4  # 20, 4, 12, 0 packed rows: 2 + 1 + 1 tiles
    pre = _paged_case(q_p, cache_p, "NHD", qo_p, kvi_p, idx_p, last_p)
    dec = _paged_case(q_d, cache_d, "NHD", qo_d, kvi_d, idx_d, last_d)
    p_pre = params(ops.MASK_CAUSAL, -1, head_dim=d)
    p_dec = params(ops.MASK_NONE, -1, head_dim=d)  # (BatchPOD's multi-row decodes: no mask)
    with policy.override(**POD_LAUNCHES["apart"]):
        check_parts(pre, dec, p_pre, p_dec, lambda: _parts(
            w.run(q_p, cache_p, q_d, cache_d, causal_p=True, return_lse=True), (True, True)))
    check_pod_launch(("apart", pod_calls), True)


@pytest.mark.parametrize("kv_d,qo,kv", [([5, 9], 0, 3), ([5, 9], 0, 0), ([], 3, 5),
                                        ([0, 0], 3, 5)], ids=["no_prefill_rows",
                                                              "no_prefill", "no_decodes",
                                                              "no_decode_keys"])
def test_traced_apart_with_an_empty_part(kv_d, qo, kv):
    """A POD call traced by torch.compile runs apart whatever its sizes where the fused launch
    would not be the Gluon kernel's (pod._traced_apart: here the interpreter's), so an empty
    part reaches its own launch (an eager call keeps such a call fused): the outputs equal the
    eager call's, shapes included."""
    from compiled_attn.pod import _traced_apart

    hq, hkv, d, page, dt = 4, 2, 16, 4, torch.float32
    cache, kvi, idx, last, _, _ = make_paged(kv_d, hkv, d, d, page, dtype=dt, seed=21)
    w = fi.PODWithPagedKVCacheWrapper(WS)
    w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=dt)
    assert _traced_apart(w._plan)
    g = torch.Generator().manual_seed(22)
    q_p, k_p, q_d = (_randn(g, n, h, d, dtype=dt) for n, h in ((qo, hq), (kv, hkv),
                                                                (len(kv_d), hq)))
    eager = w.run(q_p, k_p, k_p, q_d, cache, causal_p=kv >= qo)
    torch._dynamo.reset()
    f = torch.compile(lambda a, b, c, e: w.run(a, b, b, c, e, causal_p=kv >= qo),
                      fullgraph=True, backend="eager")
    out = f(q_p, k_p, q_d, cache)
    for o, e in zip(out, eager):
        assert o.shape == e.shape and torch.equal(o, e)


# POD's decode key chunks (POLICY.pod_chunks for the fused launch, POLICY.decode_chunks for
# the decodes' own launch apart; compiled_attn/pod.py _plan_chunks): two chunks or more of at
# least 8 keys, and every fused launch asks for them (pod_chunk_long_keys 1), so that small
# mixes cut
CHUNKS = dict(pod_chunks="always", pod_chunk_min_keys=8, pod_chunk_min_chunks=2,
              pod_chunk_long_keys=1, decode_chunks="always", decode_chunk_min_keys=8)
CHUNK_SEEDS = [s for s in SEEDS if s not in NO_DECODES][:6]


@pytest.mark.parametrize("launch", ["fused", "apart"])
@pytest.mark.parametrize("kind", ["pod", "batch_pod"])
@pytest.mark.parametrize("seed", CHUNK_SEEDS)
def test_pod_decode_chunks_mix(kind, seed, launch, pod_merges):
    """The seeded mixes without a decode window, planned and run with decode key chunks: the
    fused launch, or the decodes' own launch where the parts run apart, runs the decodes as
    chunk requests (the recorded call merges them) and each part matches the float64
    reference; the bound replays of the same call give the same bits."""
    from compiled_attn.ops.policy import override

    m = _mix(kind, seed)
    m.window, m.graph_bufs = -1, False
    # at least two chunks of 8 keys (a request without keys kept where there is one)
    m.kv_d = [k + 17 if k else 0 for k in m.kv_d] + ([] if any(m.kv_d) else [33])
    hq, hkv, d, dt, b = m.hq, m.hkv, m.d, m.dtype, len(m.kv_d)
    cache_d, kvi_d, idx_d, last_d, _, _ = make_paged(m.kv_d, hkv, d, d, m.page,
                                                     layout=m.layout, dtype=dt, seed=seed)
    g = torch.Generator().manual_seed(3000 + seed)
    q_d = _randn(g, b, hq, d, dtype=dt)
    dec = _paged_case(q_d, cache_d, m.layout, [1] * b, kvi_d, idx_d, last_d)
    p_dec = params(ops.MASK_NONE, -1, sm_scale=m.sm_scale, head_dim=d)
    mask_p = ops.MASK_CAUSAL if m.causal else ops.MASK_NONE
    with override(**CHUNKS, **POD_LAUNCHES[launch]):
        if kind == "pod":
            (qo,), (kv,) = m.qo_p, m.kv_p
            q_p, k_p, v_p = (_randn(g, n, h, d, dtype=dt)
                             for n, h in ((qo, hq), (kv, hkv), (kv, hkv)))
            w = fi.PODWithPagedKVCacheWrapper(WS, m.layout)
            w.plan(kvi_d, idx_d, last_d, hq, hkv, d, m.page, q_data_type=dt,
                   sm_scale=m.sm_scale)
            pre = Case("ragged", q=q_p, k=k_p, v=v_p, qo_indptr=indptr([qo]),
                       kv_indptr=indptr([kv]))
            p_pre = params(mask_p, m.window_p, sm_scale=m.sm_scale_p, head_dim=d)

            def call():
                return w.run(q_p, k_p, v_p, q_d, cache_d, causal_p=m.causal,
                             sm_scale_p=m.sm_scale_p, window_left_p=m.window_p,
                             return_lse_p=True, return_lse_d=True)
        else:
            cache_p, kvi_p, idx_p, last_p, _, _ = make_paged(m.kv_p, hkv, d, d, m.page,
                                                             layout=m.layout, dtype=dt,
                                                             seed=seed + 50)
            q_p = _randn(g, sum(m.qo_p), hq, d, dtype=dt)
            w = fi.BatchPODWithPagedKVCacheWrapper(WS, m.layout)
            w.plan(indptr(m.qo_p), kvi_p, idx_p, last_p, indptr([1] * b), kvi_d, idx_d, last_d,
                   hq, hkv, d, m.page, q_data_type=dt, sm_scale=m.sm_scale)
            pre = _paged_case(q_p, cache_p, m.layout, m.qo_p, kvi_p, idx_p, last_p)
            p_pre = params(mask_p, -1, sm_scale=m.sm_scale, head_dim=d)

            def call():
                return w.run(q_p, cache_p, q_d, cache_d, causal_p=m.causal, return_lse=True)
        chunks = w._plan["chunks" if launch == "fused" else "chunks_apart"]
        assert chunks is not None and int(chunks["merge"][:, 2].max()) > 1
        check_parts(pre, dec, p_pre, p_dec, lambda: _parts(call(), (True, True)))
        first = [t.clone() for pair in call() for t in pair]
        again = [t for pair in call() for t in pair]
    # the first call cut and was recorded; the later ones replay its launches, merge included
    assert len(pod_merges) == 1
    for a, b_ in zip(first, again):
        assert torch.equal(a.nan_to_num(), b_.nan_to_num())


@pytest.mark.parametrize("launch", ["fused", "apart"])
def test_pod_decode_chunks_take_a_strided_q(launch, pod_merges):
    """q_d with a head-dim stride of 2 (sliced from a wider tensor) runs the decode key chunks
    too (their row gather takes q's strides; it ran uncut) and gives the contiguous q_d's
    bits."""
    from compiled_attn.ops.policy import override

    hq, hkv, d, dt, page = 4, 2, 16, torch.float32, 4
    kv_d = [40, 29, 0]
    cache_d, kvi_d, idx_d, last_d, _, _ = make_paged(kv_d, hkv, d, d, page, dtype=dt, seed=8)
    g = torch.Generator().manual_seed(9)
    q_p, k_p, v_p = (_randn(g, n, h, d, dtype=dt) for n, h in ((5, hq), (9, hkv), (9, hkv)))
    wide = _randn(g, len(kv_d), hq, 2 * d, dtype=dt)
    outs = []
    with override(**CHUNKS, **POD_LAUNCHES[launch]):
        w = fi.PODWithPagedKVCacheWrapper(WS)
        w.plan(kvi_d, idx_d, last_d, hq, hkv, d, page, q_data_type=dt)
        for q_d in (wide[..., ::2], wide[..., ::2].contiguous()):
            outs.append(w.run(q_p, k_p, v_p, q_d, cache_d, causal_p=True, return_lse_d=True))
    assert len(pod_merges) == 2  # both calls cut their decodes
    (o_p, o_d), (_, lse_d) = outs[0]
    (r_p, r_d), (_, r_lse) = outs[1]
    for x, y in ((o_p, r_p), (o_d, r_d), (lse_d, r_lse)):
        assert torch.equal(x.nan_to_num(), y.nan_to_num())


@pytest.mark.parametrize("kind,launch", [("pod", "fused"), ("batch_pod", "apart")])
def test_pod_decode_chunks_replans_keep_their_calls(kind, launch, pod_merges):
    """A decode step's re-plans of a POD / BatchPOD wrapper whose decodes are cut: while the
    chunk requests keep their shapes (each request's keys grow within its last page; then
    other pages), the plan writes them into the last plan's chunk tensors and keeps its chunk
    dict, so run() replays the calls recorded at the first step (no merge runs or is recorded
    again) and gives a fresh wrapper's bits each step; a request taking a new page (another
    chunk layout) records anew. (Each wrapper with one launch choice, CI time: the kept
    chunks are the fused launch's or the decodes' own, by one rule.)"""
    from compiled_attn.ops.policy import override

    hq, hkv, d, dt, page = 4, 2, 16, torch.float32, 4
    g = torch.Generator().manual_seed(21)
    q_p, k_p, v_p = (_randn(g, n, h, d, dtype=dt) for n, h in ((5, hq), (9, hkv), (9, hkv)))
    cache_p, kvi_p, idx_p, last_p, _, _ = make_paged([9], hkv, d, d, page, dtype=dt, seed=22)
    q_d = _randn(g, 3, hq, d, dtype=dt)
    key = "chunks" if launch == "fused" else "chunks_apart"
    steps = [([41, 30, 18], 0), ([42, 31, 19], 0), ([43, 32, 20], 0), ([43, 32, 20], 1),
             ([45, 33, 21], 1)]  # (keys, page-order seed); the last takes a new page

    def wrapper(table):
        if kind == "pod":
            w = fi.PODWithPagedKVCacheWrapper(WS)
            w.plan(*table, hq, hkv, d, page, q_data_type=dt)
            return w, lambda cache: w.run(q_p, k_p, v_p, q_d, cache, causal_p=True,
                                          return_lse_p=True, return_lse_d=True)
        w = fi.BatchPODWithPagedKVCacheWrapper(WS)
        w.plan(indptr([5]), kvi_p, idx_p, last_p, indptr([1, 1, 1]), *table, hq, hkv, d, page,
               q_data_type=dt)
        return w, lambda cache: w.run(q_p, cache_p, q_d, cache, causal_p=True, return_lse=True)

    with override(**CHUNKS, **POD_LAUNCHES[launch]):
        w = None
        memos, recorded = [], []
        for i, (kv_d, order) in enumerate(steps):
            cache_d, kvi_d, idx_d, last_d, _, _ = make_paged(kv_d, hkv, d, d, page, dtype=dt,
                                                             seed=30 + order)
            table = (kvi_d, idx_d, last_d)
            if w is None:
                w, run = wrapper(table)
            elif kind == "pod":
                w.plan(*table, hq, hkv, d, page, q_data_type=dt)
            else:
                w.plan(indptr([5]), kvi_p, idx_p, last_p, indptr([1, 1, 1]), *table, hq, hkv,
                       d, page, q_data_type=dt)
            assert w._plan[key] is not None
            memos.append(w._memo)
            before = len(pod_merges)
            got = run(cache_d)
            recorded.append(len(pod_merges) - before)
            want = wrapper(table)[1](cache_d)
            for a, b_ in zip((*got[0], *got[1]), (*want[0], *want[1])):
                assert torch.equal(a.nan_to_num(), b_.nan_to_num()), (i, kv_d)
    assert all(m is memos[0] for m in memos[:4]) and memos[4] is not memos[0]
    assert recorded == [1, 0, 0, 0, 1], recorded


@pytest.mark.parametrize("launch", ["fused", "apart"])
def test_pod_decode_chunks_in_cuda_graph_mode(launch, pod_merges):
    """use_cuda_graph=True: the first plan decides the chunk count; a re-plan with other
    lengths (a request now shorter than its chunks: trailing chunks without pages; one without
    keys, then with) writes the new chunks into the first plan's tensors, keeps every tensor
    but their kv_indptr and last_page_len as it was (what a captured run() reads), and both
    plans' runs match the float64 reference."""
    from compiled_attn.ops.policy import override

    hq, hkv, d, dt, page = 4, 2, 16, torch.float32, 4
    plans = ([40, 29, 0], [13, 57, 5])
    g = torch.Generator().manual_seed(11)
    q_p, k_p, v_p = (_randn(g, n, h, d, dtype=dt) for n, h in ((9, hq), (12, hkv), (12, hkv)))
    q_d = _randn(g, 3, hq, d, dtype=dt)
    pages = max(sum(-(-k // page) for k in kv) for kv in plans)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(pages + 3, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(3, dtype=torch.int32))
    key = "chunks" if launch == "fused" else "chunks_apart"
    with override(**CHUNKS, **POD_LAUNCHES[launch]):
        w = fi.PODWithPagedKVCacheWrapper(WS, "NHD", True, **bufs)
        seen = []
        for i, kv_d in enumerate(plans):
            cache, kvi, idx, last, _, _ = make_paged(kv_d, hkv, d, d, page, dtype=dt, seed=i)
            w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=dt)
            c = w._plan[key]
            assert c is not None
            seen.append({k: (t, t.clone()) for k, t in c.items() if torch.is_tensor(t)})
            pre = Case("ragged", q=q_p, k=k_p, v=v_p, qo_indptr=indptr([9]),
                       kv_indptr=indptr([12]))
            dec = _paged_case(q_d, cache, "NHD", [1] * 3, kvi, idx, last)
            merges = len(pod_merges)
            check_parts(pre, dec, params(ops.MASK_CAUSAL, head_dim=d),
                        params(ops.MASK_NONE, head_dim=d), lambda: _parts(w.run(
                            q_p, k_p, v_p, q_d, cache, causal_p=True, return_lse_p=True,
                            return_lse_d=True), (True, True)))
            assert len(pod_merges) == merges + 1  # the call cut its decodes
    (first, second) = seen
    n = int(first["merge"][1][0, 2])
    assert n > 1 and first["merge"][1][:, 2].tolist() == [n] * 3  # exactly n chunks a request
    for k, (t, before) in second.items():
        assert t is first[k][0]  # the first plan's tensors, written in place
        same = torch.equal(before, first[k][1])
        assert same == (k not in ("kv_indptr", "last_page_len")), k
    assert 0 in second["last_page_len"][1].tolist()  # trailing chunks without pages


@pytest.mark.parametrize("seed", range(4))
def test_pod_decode_chunks_graph_replans(seed, pod_merges):
    """CUDA-graph mode over three re-plans of random lengths (requests without keys, shorter
    than their chunks, longer than the first plan's longest) on random GQA, page size and
    layout, fused or apart: every plan's run matches the float64 reference, and the chunk
    tensors stay the first plan's."""
    from compiled_attn.ops.policy import override

    r = random.Random(f"graph-replans-{seed}")
    hq, hkv = GQA[seed % 3]
    page, layout = PAGES[seed % 3], r.choice(["NHD", "HND"])
    d, dt, b = 16, (torch.float16, torch.float32)[seed % 2], r.randint(1, 4)
    first = [r.randint(24, 60)] + [r.randint(0, 60) for _ in range(b - 1)]
    plans = [first] + [[0 if r.random() < 0.2 else r.randint(1, 90) for _ in range(b)]
                       for _ in range(2)]
    g = torch.Generator().manual_seed(7000 + seed)
    qo, kv = _odd_or_one(r, 30), r.randint(31, 45)
    q_p, k_p, v_p = (_randn(g, n, h, d, dtype=dt) for n, h in ((qo, hq), (kv, hkv), (kv, hkv)))
    q_d = _randn(g, b, hq, d, dtype=dt)
    pages = max(sum(-(-k // page) for k in lens) for lens in plans)
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(pages + 5, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32))
    launch = r.choice(["fused", "apart"])
    key = "chunks" if launch == "fused" else "chunks_apart"
    with override(**CHUNKS, **POD_LAUNCHES[launch]):
        w = fi.PODWithPagedKVCacheWrapper(WS, layout, True, **bufs)
        tensors = None
        for i, kv_d in enumerate(plans):
            cache, kvi, idx, last, _, _ = make_paged(kv_d, hkv, d, d, page, layout=layout,
                                                     dtype=dt, seed=100 * seed + i)
            w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=dt)
            c = w._plan[key]
            assert c is not None
            now = [c[k] for k in ("qo_indptr", "kv_indptr", "last_page_len", "src", "merge",
                                  "work")]
            assert tensors is None or all(a is b_ for a, b_ in zip(now, tensors))
            tensors = now
            pre = Case("ragged", q=q_p, k=k_p, v=v_p, qo_indptr=indptr([qo]),
                       kv_indptr=indptr([kv]))
            dec = _paged_case(q_d, cache, layout, [1] * b, kvi, idx, last)
            check_parts(pre, dec, params(ops.MASK_CAUSAL, head_dim=d),
                        params(ops.MASK_NONE, head_dim=d), lambda: _parts(w.run(
                            q_p, k_p, v_p, q_d, cache, causal_p=True, return_lse_p=True,
                            return_lse_d=True), (True, True)))
    assert len(pod_merges) == len(plans)  # every call cut its decodes


def test_pod_decode_chunks_follow_the_options(pod_merges):
    """Where the chunks would not compute the decodes exactly (a decode window passed to run(),
    a position encoding) or the policy has them off, run() launches the uncut decodes, and the
    plan keeps no chunks where it cannot use them; q_scale / k_scale / a v_scale tensor and a
    q_d of strided rows cut and give the uncut launch's numbers."""
    from compiled_attn.ops.policy import override

    hq, hkv, d, dt = 4, 2, 16, torch.float32
    kv_d = [40, 29, 0]
    cache, kvi, idx, last, _, _ = make_paged(kv_d, hkv, d, d, 4, dtype=dt, seed=1)
    g = torch.Generator().manual_seed(5)
    q_p, k_p, v_p = (_randn(g, n, h, d, dtype=dt) for n, h in ((9, hq), (12, hkv), (12, hkv)))
    q_d = _randn(g, len(kv_d), hq, d, dtype=dt)
    with override(**CHUNKS, **POD_LAUNCHES["fused"]):
        w = fi.PODWithPagedKVCacheWrapper(WS)
        w.plan(kvi, idx, last, hq, hkv, d, 4, q_data_type=dt)
        assert w._plan["chunks"] is not None
        cut_d = w.run(q_p, k_p, v_p, q_d, cache)[1]
        win_d = w.run(q_p, k_p, v_p, q_d, cache, window_left_d=5)[1]
        # scales (q_scale / k_scale into the logit scale, v_scale after the merge) and a q_d
        # whose rows are strided
        q_wide = torch.cat([q_d, q_d], dim=1)[:, :hq]
        merges_before = len(pod_merges)
        scaled = w.run(q_p, k_p, v_p, q_wide, cache, q_scale=0.5, k_scale=3.0,
                       v_scale=torch.tensor(2.0), return_lse_d=True)
        assert len(pod_merges) == merges_before + 1  # cut
        with override(pod_chunks="off"):
            w.plan(kvi, idx, last, hq, hkv, d, 4, q_data_type=dt)
            assert w._plan["chunks"] is None
            plain_d = w.run(q_p, k_p, v_p, q_d, cache)[1]
            plain_win = w.run(q_p, k_p, v_p, q_d, cache, window_left_d=5)[1]
            plain_scaled = w.run(q_p, k_p, v_p, q_wide, cache, q_scale=0.5, k_scale=3.0,
                                 v_scale=torch.tensor(2.0), return_lse_d=True)
        w.plan(kvi, idx, last, hq, hkv, d, 4, q_data_type=dt, pos_encoding_mode="ALIBI")
        assert w._plan["chunks"] is None
        w.plan(kvi, idx, last, hq, hkv, d, 4, q_data_type=dt, window_left=3)
        assert w._plan["chunks"] is None
        with pytest.raises(ValueError, match="pod_chunks"), override(pod_chunks="sometimes"):
            w.plan(kvi, idx, last, hq, hkv, d, 4, q_data_type=dt)
    # a decode window: the uncut launch, bit for bit; no window: the chunks' merged rows
    assert torch.equal(win_d, plain_win)
    assert (cut_d.double() - plain_d.double()).abs().max() < 1e-5
    (_, s_out), (_, s_lse) = scaled
    (_, p_out), (_, p_lse) = plain_scaled
    assert (s_out.double() - p_out.double()).abs().max() < 2e-5
    assert torch.allclose(s_lse.nan_to_num(), p_lse.nan_to_num(), atol=1e-5)


def test_pod_graph_replan_checks_fixed_chunk_arrays(monkeypatch):
    """A CUDA-graph re-plan whose chunk requests would differ from the first plan's in what the
    captured run() reads without a copy (rows, source rows, merge rows) raises instead of
    replaying stale arrays."""
    from compiled_attn import pod
    from compiled_attn.ops.policy import override

    hq, hkv, d, dt, page = 4, 2, 16, torch.float32, 4
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(4, dtype=torch.int32),
                paged_kv_indices_buffer=torch.zeros(40, dtype=torch.int32),
                paged_kv_last_page_len_buffer=torch.zeros(3, dtype=torch.int32))
    with override(**CHUNKS, **POD_LAUNCHES["fused"]):
        w = fi.PODWithPagedKVCacheWrapper(WS, "NHD", True, **bufs)
        for i, kv_d in enumerate(([40, 29, 0], [13, 57, 5])):
            _, kvi, idx, last, _, _ = make_paged(kv_d, hkv, d, d, page, dtype=dt, seed=i)
            w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=dt)
        assert w._plan["chunks"] is not None
        real = pod.build_decode_chunks

        def shifted(*args, **kwargs):
            c = real(*args, **kwargs)
            return dict(c, src=c["src"].flip(0))

        monkeypatch.setattr(pod, "build_decode_chunks", shifted)
        with pytest.raises(RuntimeError, match="decode chunks' src differs"):
            w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=dt)


@pytest.mark.parametrize("launch", ["fused", "apart"])
def test_pod_alibi_asked_at_run_on_a_plan_without_it(launch):
    """pos_encoding_mode_p / _d "ALIBI" at run() on a plan of "NONE" (FlashInfer's POD gives
    its prefill slopes whatever the plan): the slopes are made at the call, and both parts
    match the ALiBi reference, at the first call and at its replay."""
    from compiled_attn.ops.policy import override

    hq, hkv, d, dt, page = 4, 2, 16, torch.float32, 3
    cache, kvi, idx, last, _, _ = make_paged([7, 4], hkv, d, d, page, dtype=dt, seed=3)
    g = torch.Generator().manual_seed(5)
    q_p, k_p, v_p = (_randn(g, n, h, d, dtype=dt) for n, h in ((5, hq), (9, hkv), (9, hkv)))
    q_d = _randn(g, 2, hq, d, dtype=dt)
    slopes = fi.get_alibi_slopes(hq, torch.device("cpu"))
    pre = Case("ragged", q=q_p, k=k_p, v=v_p, qo_indptr=indptr([5]), kv_indptr=indptr([9]),
               alibi=slopes)
    dec = _paged_case(q_d, cache, "NHD", [1, 1], kvi, idx, last)
    dec.alibi = slopes
    p_pre = params(ops.MASK_CAUSAL, pos_encoding_mode=ops.POS_ALIBI, head_dim=d)
    p_dec = params(ops.MASK_NONE, pos_encoding_mode=ops.POS_ALIBI, head_dim=d)
    with override(**POD_LAUNCHES[launch]):
        w = fi.PODWithPagedKVCacheWrapper(WS)
        w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=dt, pos_encoding_mode="NONE")
        for _ in range(2):
            check_parts(pre, dec, p_pre, p_dec, lambda: _parts(w.run(
                q_p, k_p, v_p, q_d, cache, causal_p=True, pos_encoding_mode_p="ALIBI",
                pos_encoding_mode_d="ALIBI", return_lse_p=True, return_lse_d=True),
                (True, True)))


def test_alibi_mode_without_slopes_raises():
    """An op call whose position encoding is ALiBi but passes no slopes raises (the launch
    would read a stand-in tensor as slopes)."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (_randn(g, 1, n, 2, 16, dtype=torch.float32) for n in (3, 5, 5))
    with pytest.raises(ValueError, match="alibi_slopes: the position encoding is ALiBi"):
        ops.single_prefill(q, k, v, None, None, None, ops.MASK_NONE, -1, 0, 0.25, 0.0,
                           ops.POS_ALIBI, 1.0, 1e4, 1.0, None)


def test_strided_packed_masks_read_as_their_values():
    """A packed custom mask that is a strided view (here every other byte of a buffer) gives
    the contiguous mask's result, through POD's run() and single_prefill_with_kv_cache (the
    kernels read a mask by a bare pointer: the entry points pass a contiguous one)."""
    hq, hkv, d, dt, page = 4, 2, 16, torch.float32, 3
    cache, kvi, idx, last, _, _ = make_paged([7, 4], hkv, d, d, page, dtype=dt, seed=3)
    g = torch.Generator().manual_seed(8)
    q_p, k_p, v_p = (_randn(g, n, h, d, dtype=dt) for n, h in ((5, hq), (9, hkv), (9, hkv)))
    q_d = _randn(g, 2, hq, d, dtype=dt)
    packed = fi.packbits(torch.rand(5, 9, generator=g) > 0.5, bitorder="little")
    buf = torch.zeros(2 * packed.numel(), dtype=torch.uint8)
    buf[::2] = packed
    strided = buf[::2]
    w = fi.PODWithPagedKVCacheWrapper(WS)
    w.plan(kvi, idx, last, hq, hkv, d, page, q_data_type=dt)
    want = w.run(q_p, k_p, v_p, q_d, cache, packed_custom_mask_p=packed)
    got = w.run(q_p, k_p, v_p, q_d, cache, packed_custom_mask_p=strided)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert torch.equal(
        fi.single_prefill_with_kv_cache(q_p, k_p, v_p, packed_custom_mask=packed),
        fi.single_prefill_with_kv_cache(q_p, k_p, v_p, packed_custom_mask=strided))
