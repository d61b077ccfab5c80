"""GPU tier of the decode key chunks (ops/decode_chunks.py; pytest -m gpu on a Hopper GPU): a
paged wrapper's decode batch of few requests over long keys, planned with the launch policy's
defaults, is cut into chunk requests whose one paged launch the Gluon kernel runs; its output
and LSE against a float64 reference on fresh random inputs, bounded by PyTorch's own error in
bf16 (SDPA on the same GPU); its CUDA-graph replay bit for bit against the eager call. Cases:
one request at 32k keys, odd lengths with a row without keys and a request without rows,
page 1 with GQA 7:1, and one query head a KV head."""

import pytest
import torch
import torch.nn.functional as F

import compiled_attn as ca
from compiled_attn.ops import prefill_kernel
from tests.helpers import indptr
from tests.kernel_cases import capture_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"),
]

D = 128
CASES = {  # name: (qo_lens, kv_lens, page, Hq, Hkv)
    "1x32k": ([1], [32768], 16, 32, 8),
    "odd": ([1, 1, 0, 1, 1, 1], [4096, 4001, 300, 0, 9999, 4097], 16, 32, 8),
    "page1-gqa7": ([1, 1, 1], [9000, 20001, 777], 1, 7, 1),
    "mha": ([1, 1], [10000, 3000], 16, 8, 8),
}


def _case(qo, kv, page, hq, hkv, seed):
    g = torch.Generator().manual_seed(seed)
    npg = [-(-n // page) for n in kv]
    total = sum(npg) + 5
    cache = torch.randn(total, 2, page, hkv, D, generator=g).to("cuda", torch.bfloat16)
    idx = torch.randperm(total, generator=g)[:sum(npg)].to(torch.int32)
    last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv], dtype=torch.int32)
    q = torch.randn(sum(qo), hq, D, generator=g).to("cuda", torch.bfloat16)
    return q, cache, indptr(npg), idx, last


def _dense_kv(cache, kvi, idx, last, page, b):
    pages = idx[int(kvi[b]):int(kvi[b + 1])].long().cuda()
    n = (pages.numel() - 1) * page + int(last[b]) if pages.numel() else 0
    return (cache[pages, i].reshape(-1, *cache.shape[-2:])[:n] for i in (0, 1))


def _reference(q, cache, qo, kvi, idx, last, page, dt):
    """Per request with rows: causal (bottom-right) SDPA in dt (float64: the math backend) over
    its K/V gathered from the pages -> (out [rows, Hq, D], base-2 LSE [rows, Hq]) in float64."""
    outs, lses, r = [], [], 0
    for b, n in enumerate(qo):
        if not n:
            continue
        k, v = (t.to(dt) for t in _dense_kv(cache, kvi, idx, last, page, b))
        qb = q[r:r + n].to(dt).transpose(0, 1)  # [Hq, n, D]
        r += n
        kv = k.shape[0]
        see = (torch.arange(kv, device=q.device)[None, :]
               <= torch.arange(n, device=q.device)[:, None] + kv - n)  # [n, kv]
        if kv == 0 or not see.any():
            outs.append(torch.zeros(n, q.shape[1], D, dtype=torch.float64, device=q.device))
            lses.append(torch.full((n, q.shape[1]), float("-inf"), dtype=torch.float64,
                                   device=q.device))
            continue
        g = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(g, 1).transpose(0, 1) for t in (k, v))  # [Hq, kv, D]
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=see)
        s = (qb.double() @ k.double().transpose(1, 2)) * D ** -0.5
        s = s.masked_fill(~see, float("-inf"))
        outs.append(o.transpose(0, 1).double())
        lses.append((torch.logsumexp(s, -1) / torch.log(torch.tensor(2.0))).transpose(0, 1))
    return torch.cat(outs), torch.cat(lses).to(q.device)


@pytest.mark.parametrize("name", sorted(CASES))
def test_decode_chunks_on_the_gluon_kernel(name, monkeypatch):
    qo, kv, page, hq, hkv = CASES[name]
    q, cache, kvi, idx, last = _case(qo, kv, page, hq, hkv, seed=len(name))
    seen = []
    orig = prefill_kernel._gluon.launch

    def spy(*a, **kw):
        seen.append((kw["block_m"], kw["paged"] is not None))
        return orig(*a, **kw)

    monkeypatch.setattr(prefill_kernel._gluon, "launch", spy)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device="cuda"), "NHD")
    w.plan(indptr(qo), kvi, idx, last, hq, hkv, D, page, causal=True,
           q_data_type=torch.bfloat16)
    p = w._plan
    assert p.chunk_work is not None and int(p.chunk_merge[:, 2].max()) > 1
    out = torch.full((sum(qo), hq, D), float("nan"), dtype=torch.bfloat16, device="cuda")
    lse = torch.full((sum(qo), hq), float("nan"), device="cuda")
    w.run(q, cache, out=out, lse=lse, return_lse=True)
    torch.cuda.synchronize()
    assert seen == [(64, True)]  # one paged launch, on the Gluon kernel's decode tile
    ref, ref_lse = _reference(q, cache, qo, kvi, idx, last, page, torch.float64)
    own, _ = _reference(q, cache, qo, kvi, idx, last, page, torch.bfloat16)
    assert not out.isnan().any() and not lse.isnan().any()
    err = (out.double() - ref).abs().max().item()
    own_err = (own - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= 2 * own_err + torch.finfo(torch.bfloat16).eps * scale, (err, own_err)
    inf = ref_lse.isinf()
    assert torch.equal(lse.isinf(), inf)
    assert (lse.double()[~inf] - ref_lse[~inf]).abs().max().item() <= 1e-3
    # CUDA-graph capture of the two launches (paged, merge) replays the eager call's bits
    graph, g_out = capture_graph(lambda: w.run(q, cache))
    g_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(g_out, w.run(q, cache)) and torch.equal(g_out, out)


def test_cuda_graph_replay_after_replan():
    """use_cuda_graph=True, first planned with few long decodes (cut): run() captured once,
    then re-planned into the same buffers with other lengths, a request without rows, a
    two-row request (kept whole) and disable_split_kv (one chunk a request), and replayed;
    each replay against the float64 reference within PyTorch's own bf16 error."""
    from tests.helpers import paged_graph_bufs

    hq, hkv, page, b = 32, 8, 16, 4
    plans = [([1, 1, 1, 1], [30000, 4096, 17, 9000], {}),
             ([1, 0, 1, 1], [5000, 300, 20000, 1], {}),
             ([2, 1, 1, 0], [7000, 12000, 64, 5], {}),
             ([1, 1, 1, 1], [3000, 3000, 3000, 3000], dict(disable_split_kv=True))]
    pages = sum(-(-n // page) for n in plans[0][1]) + 2048
    bufs = paged_graph_bufs(b, pages, "cuda")
    w = ca.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device="cuda"), "NHD",
                                               use_cuda_graph=True, **bufs)
    graph = q_buf = cache = None
    for seed, (qo, kv, extra) in enumerate(plans):
        q, c, kvi, idx, last = _case(qo, kv, page, hq, hkv, seed=40 + seed)
        w.plan(indptr(qo), kvi, idx, last, hq, hkv, D, page, causal=True,
               q_data_type=torch.bfloat16, **extra)
        assert w._plan.chunk_work is not None
        if graph is None:
            q_buf = torch.zeros(4, hq, D, dtype=torch.bfloat16, device="cuda")
            cache = torch.zeros(pages, 2, page, hkv, D, dtype=torch.bfloat16, device="cuda")
            graph, out = capture_graph(lambda: w.run(q_buf, cache))
        q_buf[:q.shape[0]].copy_(q)
        cache[:c.shape[0]].copy_(c)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = sum(qo)
        ref, _ = _reference(q, c, qo, kvi, idx, last, page, torch.float64)
        own, _ = _reference(q, c, qo, kvi, idx, last, page, torch.bfloat16)
        got = out[:n]
        assert not got.isnan().any()
        err = (got.double() - ref).abs().max().item()
        own_err = (own - ref).abs().max().item()
        assert err <= 2 * own_err + torch.finfo(torch.bfloat16).eps * ref.abs().max().item(), \
            (seed, err, own_err)


@pytest.mark.parametrize("name", ["odd", "page1-gqa7", "mha"])
def test_chunk_launches_read_q_in_place_and_merge_after_the_paged_launch(name, monkeypatch):
    """A chunked run() is two launches: the paged one, whose chunk rows read q's rows in place
    through the plan's row map (no gathered copy), and the merge, a programmatic dependent of
    it (decode_chunks.MERGE_PDL, Hopper) that reads what the paged launch wrote only after it
    completes: the output equals the plain merge launch's bit for bit, in the recording call,
    its bound replay and a CUDA graph's replay. Q by registers (GQA), gathered pages (page 1)
    and one query head a KV head (Q through the row map there too, not the load warp's TMA)."""
    from compiled_attn.ops import decode_chunks, launch

    assert decode_chunks._pdl(torch.device("cuda")) == dict(PDL=True, launch_pdl=True)
    qo, kv, page, hq, hkv = CASES[name]
    q, cache, kvi, idx, last = _case(qo, kv, page, hq, hkv, seed=7)
    got, seen = {}, []
    orig = launch.run_direct

    def spy(fn, grid, *a, **kw):  # (kernel, launched as a dependent, PDL / Q_ROWS constexpr)
        sched = kw.get("SCHEDULE")
        seen.append((fn.fn.__name__, kw.get("launch_pdl", False),
                     bool(sched.Q_ROWS) if sched is not None else kw.get("PDL", False)))
        return orig(fn, grid, *a, **kw)

    monkeypatch.setattr(launch, "run_direct", spy)
    for pdl in (True, False):
        monkeypatch.setattr(decode_chunks, "MERGE_PDL", pdl)
        seen.clear()
        w = ca.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device="cuda"), "NHD")
        w.plan(indptr(qo), kvi, idx, last, hq, hkv, D, page, causal=True,
               q_data_type=torch.bfloat16)
        assert w._plan.chunk_work is not None
        recorded = w.run(q, cache, return_lse=True)
        assert seen == [("_gluon_fwd", False, True), ("_merge_chunks", pdl, pdl)]
        replayed = w.run(q, cache, return_lse=True)  # (the bound call: no new launch path)
        assert len(seen) == 2 and all(torch.equal(a, b) for a, b in zip(replayed, recorded))
        graph, g_out = capture_graph(lambda: w.run(q, cache, return_lse=True))
        for t in g_out:
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(g_out, recorded))
        got[pdl] = recorded
    assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))


@pytest.mark.parametrize("name", ["odd", "page1-gqa7", "mha"])
def test_row_map_equals_the_gathered_rows(name, monkeypatch):
    """batch_paged_prefill's row map (q_rows) on the Gluon kernel: the launch's rows read q's
    rows q_rows in place and give the bits of the same launch on q[q_rows] gathered (rows in
    any order, repeated, some of q's never read; a request without keys among them). POD's
    (q_rows_d) runs in test_pod_gluon_gpu's decode-chunk cases."""
    from compiled_attn.ops import MASK_CAUSAL, POS_NONE, launch, schedule

    seen = []
    orig = launch.run_direct

    def spy(fn, grid, *a, **kw):
        seen.append((fn.fn.__name__, kw["SCHEDULE"].Q_ROWS if "SCHEDULE" in kw else None))
        return orig(fn, grid, *a, **kw)

    monkeypatch.setattr(launch, "run_direct", spy)

    qo, kv, page, hq, hkv = CASES[name]
    q, cache, kvi, idx, last = _case(qo, kv, page, hq, hkv, seed=11)
    n = q.shape[0]
    g = torch.Generator().manual_seed(3)
    rows = torch.randint(0, n, (len(qo) * 3,), generator=g).to(torch.int32)
    # three one-row requests over each request's pages, each reading a random row of q
    pages = [idx[int(kvi[b]):int(kvi[b + 1])] for b in range(len(qo)) for _ in range(3)]
    idx_c = torch.cat(pages).to(torch.int32)
    kvi_c = indptr([p.numel() for p in pages])
    last_c = last.repeat_interleave(3)
    qo_c = indptr([1] * rows.numel())
    kv_c = [kv[b] for b in range(len(qo)) for _ in range(3)]
    group = hq // hkv
    block_m = 64
    work = schedule.build_work([1] * rows.numel(), group, block_m, "cpu", kv_lens=kv_c)
    k, v = cache[:, 0], cache[:, 1]
    dev = dict(device="cuda")
    args = (k, v, qo_c.to(**dev), kvi_c.to(**dev), idx_c.to(**dev), last_c.to(**dev),
            work.to(**dev), None, None, None, None, block_m, MASK_CAUSAL, -1, 0, D ** -0.5, 0.0,
            POS_NONE, 1.0, 1e4, 1.0, torch.bfloat16)
    op = torch.ops.compiled_attn.batch_paged_prefill
    mapped = op(q, *args, q_rows=rows.cuda())
    gathered = op(q[rows.long().cuda()], *args)
    assert seen == [("_gluon_fwd", True), ("_gluon_fwd", False)]
    assert mapped[0].shape == (rows.numel(), hq, D)
    assert not mapped[0].isnan().any() and not mapped[1].isnan().any()
    assert torch.equal(mapped[0], gathered[0]) and torch.equal(mapped[1], gathered[1])
