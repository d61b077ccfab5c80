"""GPU tier of the public API (pytest -m gpu): the FlashInfer-style wrappers on CUDA tensors run
our Triton kernels; each result is compared with the same call on CPU float64 copies (the
reference path, itself checked against an independent oracle in the CPU tier). Includes the
use_cuda_graph path: capture run(), re-plan with new lengths, replay."""

import pytest
import torch

import compiled_attn
from tests.helpers import paged_graph_bufs
from tests.kernel_cases import capture_graph

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
TOL = 3e-2  # bf16 outputs of O(1) values against float64


def _indptr(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _page_table(kv_lens, page, total_pages, gen):
    npages = [(n + page - 1) // page for n in kv_lens]
    indptr = _indptr(npages)
    indices = torch.randperm(total_pages, generator=gen)[: sum(npages)].to(torch.int32)
    last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv_lens], dtype=torch.int32)
    return indptr, indices, last


def _close(gpu, cpu):
    assert gpu.shape == cpu.shape, (gpu.shape, cpu.shape)
    assert not torch.isnan(gpu).any()
    err = (gpu.double().cpu() - cpu).abs().max().item()
    assert err < TOL, err


# (qo_lens, kv_lens) of each plan; the first fixes the tile: 128 rows, or 64 for decode rows
GRAPH_PLANS = {
    "prefill": [([300, 1, 500, 99], [400, 1, 700, 99]), ([250, 0, 17, 600], [900, 3, 17, 1000])],
    "decode": [([16, 1, 1, 1], [400, 1, 700, 99]), ([1, 0, 1, 17], [900, 3, 17, 1000]),
               ([2, 1, 1, 1], [3000, 1, 2, 1])],
    # few long decodes: every plan splits KV (its first plan's 4 tiles leave the SMs idle)
    "long decode": [([1, 1, 1, 1], [1000, 2500, 300, 20]), ([1, 1, 0, 1], [3900, 5, 0, 16]),
                    ([1, 1, 1, 1], [30, 40, 50, 60])],
}


@pytest.mark.parametrize("rows", sorted(GRAPH_PLANS))
def test_paged_wrapper_cuda_graph_replay_after_replan(rows):
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, page, b, pages = 16, 4, 128, 16, 4, 256
    cache = torch.randn(pages, 2, page, hkv, d, generator=g)
    cache_gpu = cache.to("cuda", torch.bfloat16)
    cap_rows, cap_pages = 900, pages
    bufs = paged_graph_bufs(b, cap_pages, "cuda")
    ws = torch.empty(1, device="cuda")
    w = compiled_attn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, **bufs)
    q_buf = torch.randn(cap_rows, hq, d, generator=g).to("cuda", torch.bfloat16)
    graph = None
    for qo, kv in GRAPH_PLANS[rows]:
        indptr, indices, last = _page_table(kv, page, pages, g)
        w.plan(_indptr(qo), indptr, indices, last, hq, hkv, d, page, causal=True,
               q_data_type=torch.bfloat16)
        hopper = torch.cuda.get_device_capability()[0] == 9  # (the Gluon kernel's pages)
        assert w._plan.block_m == (64 if rows != "prefill" and hopper else 128)
        # split KV where the first plan's tiles x KV heads fill at most half the SMs
        assert (w._plan.merge is not None) == (rows != "prefill")
        if graph is None:
            graph, out = capture_graph(lambda: w.run(q_buf, cache_gpu))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        n = sum(qo)
        ref_w = compiled_attn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD")
        ref_w.plan(_indptr(qo), indptr, indices, last, hq, hkv, d, page, causal=True,
                   q_data_type=torch.float64)
        ref = ref_w.run(q_buf[:n].double().cpu(), cache_gpu.double().cpu())
        _close(out[:n], ref)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_ragged_wrapper_custom_mask_and_single(layout):
    g = torch.Generator().manual_seed(1)
    hq, hkv, d = 8, 8, 64
    qo, kv = [33, 200, 1], [70, 200, 5]
    q = torch.randn(sum(qo), hq, d, generator=g)
    shape = (sum(kv), hkv, d) if layout == "NHD" else (hkv, sum(kv), d)
    k, v = torch.randn(*shape, generator=g), torch.randn(*shape, generator=g)
    mask = torch.cat([(torch.rand(a * b, generator=g) < 0.6) for a, b in zip(qo, kv)])
    outs = []
    for dev, dt in (("cuda", torch.bfloat16), ("cpu", torch.float64)):
        w = compiled_attn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1, device=dev), layout)
        w.plan(_indptr(qo), _indptr(kv), hq, hkv, d, custom_mask=mask, q_data_type=dt)
        outs.append(w.run(q.to(dev, dt), k.to(dev, dt), v.to(dev, dt), return_lse=True))
    _close(outs[0][0], outs[1][0])
    # single prefill, causal, same layout
    q1, k1 = q[:33], (k[:70] if layout == "NHD" else k[:, :70])
    v1 = v[:70] if layout == "NHD" else v[:, :70]
    got = compiled_attn.single_prefill_with_kv_cache(q1.cuda().bfloat16(), k1.cuda().bfloat16(),
                                                     v1.cuda().bfloat16(), causal=True,
                                                     kv_layout=layout)
    want = compiled_attn.single_prefill_with_kv_cache(q1.double(), k1.double(), v1.double(),
                                                      causal=True, kv_layout=layout)
    _close(got, want)


def test_batch_pod_wrapper_one_launch():
    g = torch.Generator().manual_seed(2)
    hq, hkv, d, page, pages = 16, 4, 128, 16, 128
    cache = torch.randn(pages, 2, page, hkv, d, generator=g)
    qo_p, kv_p = [100, 37], [300, 37]
    kv_d = [77, 1, 500, 33]
    ip, ii, il = _page_table(kv_p, page, pages, g)
    dp, di, dl = _page_table(kv_d, page, pages, g)
    q_p = torch.randn(sum(qo_p), hq, d, generator=g)
    q_d = torch.randn(len(kv_d), hq, d, generator=g)
    res = []
    for dev, dt in (("cuda", torch.bfloat16), ("cpu", torch.float64)):
        w = compiled_attn.BatchPODWithPagedKVCacheWrapper(torch.empty(1, device=dev), "NHD")
        w.plan(_indptr(qo_p), ip, ii, il, _indptr([1] * len(kv_d)), dp, di, dl, hq, hkv, d,
               page, q_data_type=dt, kv_data_type=dt)
        c = cache.to(dev, dt)
        res.append(w.run(q_p.to(dev, dt), c, q_d.to(dev, dt), c, causal_p=True))
    _close(res[0][0], res[1][0])
    _close(res[0][1], res[1][1])


def test_cudnn_graph_mode_captures_and_replays_new_lengths():
    """cuDNN's is_cuda_graph_compatible call reads no device value on the host (its value
    checks are device asserts): it captures in a CUDA graph and replays correctly after the
    captured length tensors change in place."""
    g = torch.Generator().manual_seed(3)
    hq, hkv, d, page, b, max_pages = 8, 2, 128, 16, 3, 8
    max_q, max_kv = 64, page * max_pages
    cache = torch.randn(b * max_pages, hkv, page, d, generator=g)
    kc, vc = cache.to("cuda", torch.bfloat16), cache.flip(0).to("cuda", torch.bfloat16)
    table = torch.randperm(b * max_pages, generator=g)[:b * max_pages].reshape(b, max_pages)
    table = table.to("cuda", torch.int32)
    q = torch.randn(b * max_q, hq, d, generator=g).to("cuda", torch.bfloat16)
    ws = torch.empty(1, device="cuda")
    qo_t = torch.zeros(b, dtype=torch.int32, device="cuda")
    kv_t = torch.zeros(b, dtype=torch.int32, device="cuda")

    def cudnn_call():
        return compiled_attn.cudnn_batch_prefill_with_kv_cache(
            q, kc, vc, 0.1, ws, max_token_per_sequence=max_q, max_sequence_kv=max_kv,
            actual_seq_lens_q=qo_t, actual_seq_lens_kv=kv_t, block_tables=table, causal=True,
            return_lse=False, is_cuda_graph_compatible=True)[0]

    graph = None
    for qo, kv in (([64, 1, 30], [100, 1, 128]), ([10, 64, 0], [10, 90, 5])):
        qo_t.copy_(torch.tensor(qo))
        kv_t.copy_(torch.tensor(kv))
        if graph is None:
            graph, out = capture_graph(cudnn_call)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        ref = compiled_attn.cudnn_batch_prefill_with_kv_cache(
            q.double().cpu(), kc.double().cpu(), vc.double().cpu(), 0.1, torch.empty(1),
            max_token_per_sequence=max_q, max_sequence_kv=max_kv,
            actual_seq_lens_q=torch.tensor(qo), actual_seq_lens_kv=torch.tensor(kv),
            block_tables=table.cpu(), causal=True, return_lse=False)[0]
        _close(out[:sum(qo)], ref[:sum(qo)])


@pytest.mark.parametrize("m", [1000, 4096])
@pytest.mark.parametrize("graph", [False, True])
def test_cudnn_ragged_padded_kv(m, graph):
    """Ragged K / V without batch_offsets_k / _v, read padded as FlashInfer's cuDNN graph
    reads them (request b from row b * max_sequence_kv: one page of m keys a request on the
    paged kernel), against the CPU float64 call."""
    g = torch.Generator().manual_seed(m + graph)
    hq, hkv, d = 8, 2, 128
    qo, kv = [64, 1, 200], [m, 0, m // 2 + 7]
    q = torch.randn(sum(qo), hq, d, generator=g)
    k, v = (torch.randn(3 * m, hkv, d, generator=g) for _ in range(2))
    qi = _indptr(qo)

    def call(q, k, v, dev):
        return compiled_attn.cudnn_batch_prefill_with_kv_cache(
            q, k, v, 0.1, torch.empty(1, device=dev), max_token_per_sequence=200,
            max_sequence_kv=m, actual_seq_lens_q=torch.tensor(qo, device=dev),
            actual_seq_lens_kv=torch.tensor(kv, device=dev), causal=True, return_lse=True,
            batch_offsets_q=(qi * hq * d).to(dev), batch_offsets_o=(qi * hq * d).to(dev),
            is_cuda_graph_compatible=graph and dev == "cuda")

    out, lse = call(*(x.to("cuda", torch.bfloat16) for x in (q, k, v)), "cuda")
    ref_out, ref_lse = call(q.double(), k.double(), v.double(), "cpu")
    _close(out, ref_out)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse.cpu()), fin)
    _close(lse.cpu()[fin], ref_lse[fin])


def _poisoned(indices, n_pages):
    """indices followed by entries no kernel may read (a buffer sized for a larger batch)."""
    tail = torch.tensor([-1, n_pages, 2 ** 31 - 1] * 5, dtype=torch.int32)
    return torch.cat([indices, tail])


@pytest.mark.parametrize("page", [1, 16])
def test_page_indices_longer_than_indptr(page):
    """Paged, CUDA-graph-mode and BatchPOD plans take page-index buffers longer than
    indptr[-1] (FlashInfer reads the first indptr[-1] entries only): the poisoned tail is never
    read, and the output is the exact-length plan's, bit for bit."""
    g = torch.Generator().manual_seed(4)
    hq, hkv, d = 16, 4, 128
    qo, kv = [300, 1, 500, 99], [400, 1, 700, 99]
    pages = sum(-(-n // page) for n in kv) + 8
    cache = torch.randn(pages, 2, page, hkv, d, generator=g)
    cache_gpu = cache.to("cuda", torch.bfloat16)
    indptr, indices, last = _page_table(kv, page, pages, g)
    q = torch.randn(sum(qo), hq, d, generator=g).to("cuda", torch.bfloat16)
    ws = torch.empty(1, device="cuda")
    ref_w = compiled_attn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD")
    ref_w.plan(_indptr(qo), indptr, indices, last, hq, hkv, d, page, causal=True,
               q_data_type=torch.float64)
    ref = ref_w.run(q.double().cpu(), cache_gpu.double().cpu())
    exact = compiled_attn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    exact.plan(_indptr(qo), indptr, indices, last, hq, hkv, d, page, causal=True,
               q_data_type=torch.bfloat16)
    want = exact.run(q, cache_gpu)
    _close(want, ref)
    b = len(qo)
    bufs = paged_graph_bufs(b, indices.numel(), "cuda")
    long_idx = _poisoned(indices, pages).cuda()
    for w in (compiled_attn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD"),
              compiled_attn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True,
                                                                **bufs)):
        w.plan(_indptr(qo).cuda(), indptr.cuda(), long_idx, last.cuda(), hq, hkv, d, page,
               causal=True, q_data_type=torch.bfloat16)
        got = w.run(q, cache_gpu)
        torch.cuda.synchronize()
        _close(got, ref)
        if not w.is_cuda_graph_enabled:  # the same plan: the same launch
            assert torch.equal(got, want)
    # BatchPOD: the decode part reads the first pages of the same table, with a longer buffer
    kv_d = [77, 1, 33]
    di_ptr, di, dl = _page_table(kv_d, page, pages, g)
    q_d = torch.randn(len(kv_d), hq, d, generator=g)
    res = []
    for dev, dt, idx_p, idx_d in (("cuda", torch.bfloat16, long_idx, _poisoned(di, pages).cuda()),
                                  ("cpu", torch.float64, indices, di)):
        w = compiled_attn.BatchPODWithPagedKVCacheWrapper(torch.empty(1, device=dev), "NHD")
        w.plan(_indptr(qo), indptr, idx_p, last, _indptr([1] * len(kv_d)), di_ptr, idx_d, dl,
               hq, hkv, d, page, q_data_type=dt, kv_data_type=dt)
        c = cache.to(dev, dt)
        res.append(w.run(q.to(dev, dt), c, q_d.to(dev, dt), c, causal_p=True))
    _close(res[0][0], res[1][0])
    _close(res[0][1], res[1][1])


@pytest.mark.parametrize("layout", ["Q_PAGED_KV_NHD", "Q_PAGED_KV_HND"])
@pytest.mark.parametrize("page,hkv", [(32, 1), (128, 4)])
def test_trtllm_separate_k_v_pools(layout, page, hkv):
    """FlashInfer's test_trtllm_fmha_v2_prefill_non_interleaved_kv: K and V as the halves of
    one [2, P, ...] allocation with [B, 2, M] block tables (V offsets + P) give the stacked
    cache's output; here against the CPU float64 reference too, with the tables' unused
    columns poisoned."""
    g = torch.Generator().manual_seed(5)
    b, hq, d = 4, 8, 128
    seq = torch.randint(512, 1025, (b,), generator=g, dtype=torch.int32)
    max_kv = int(seq.max())
    max_blocks = -(-max_kv // page) + 1  # one column more than any request needs
    pages = b * max_blocks
    nhd = layout.endswith("NHD")
    shape = (pages, 2, page, hkv, d) if nhd else (pages, 2, hkv, page, d)
    paged = torch.randn(*shape, generator=g).to("cuda", torch.bfloat16)
    table = torch.full((b, max_blocks), -1, dtype=torch.int32)
    for i in range(b):
        n = -(-int(seq[i]) // page)
        table[i, :n] = torch.arange(i * max_blocks, i * max_blocks + n, dtype=torch.int32)
    cum = _indptr(seq.tolist())
    q = torch.randn(int(cum[-1]), hq, d, generator=g).to("cuda", torch.bfloat16)
    ws = torch.empty(1, device="cuda")

    def run(qkv, tables, dev):
        return compiled_attn.trtllm_fmha_v2_prefill(
            qkv, layout, ws.to(dev), seq.to(dev), max_kv, max_kv, 1 / d ** 0.5, 1.0, b,
            cum.to(dev), cum.to(dev), block_tables=tables.to(dev), mask_mode="causal")

    stacked = run((q, paged), table, "cuda")
    fused = torch.stack([paged[:, 0], paged[:, 1]])
    tables = torch.stack([table, torch.where(table >= 0, table + pages, table)], 1)
    separate = run((q, (fused[0], fused[1])), tables.to(torch.int32), "cuda")
    torch.cuda.synchronize()
    ref = run((q.double().cpu(), paged.double().cpu()), table, "cpu")
    _close(stacked, ref)
    _close(separate, ref)


def _fill(gen, *bufs):
    """Fresh random values written into each buffer in place (the same memory)."""
    for t in bufs:
        t.copy_(torch.randn(t.shape, generator=gen))


def _replay_equals_eager(graph, outs, call, exact=True):
    """Poison the graph's outputs, replay it, and compare with an eager call() on the same
    buffers bit for bit (exact; else within TOL: an eager call that may launch otherwise);
    returns the replayed outputs (copies)."""
    for o in outs:
        o.fill_(float("nan"))
    graph.replay()
    got = [o.clone() for o in outs]
    want = call()
    torch.cuda.synchronize()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert not a.float().isnan().any()
        if exact:
            assert torch.equal(a, b)
        else:
            assert torch.equal(a.isinf(), b.isinf())
            assert (a.float() - b.float()).nan_to_num(posinf=0, neginf=0).abs().max() < TOL
    return got


@pytest.mark.parametrize("launch", ["fused", "apart", "policy"])
@pytest.mark.parametrize("page", [1, 16])
def test_pod_cuda_graph_replay_is_exact(page, launch):
    """PODWithPagedKVCacheWrapper(use_cuda_graph=True), as a serving engine drives it: an eager
    run(), run() captured once, then before each replay new values written into the same q /
    k / v / cache buffers, and in the second round a re-plan with new decode lengths (into the
    plan buffers) followed by allocations that take the blocks the re-plan freed. Each replay
    equals an eager run() on the same buffers bit for bit where both take one launch (the
    policy's POD_FUSED / POD_APART), and the CPU float64 reference. Under the policy's own
    choice a captured call may go apart where the eager one is fused (few decodes: the captured
    decodes then run the swapped products): the replay then equals the eager call to rounding.
    (A graph whose own tensors a re-plan freed, the prefill part made by the eager run and the
    first plan's decode qo_indptr, would read the zeros allocated over them.)"""
    from compiled_attn.ops.policy import POD_APART, POD_FUSED, override

    with override(**{"fused": POD_FUSED, "apart": POD_APART, "policy": {}}[launch]):
        _pod_replay_case(page, exact=launch != "policy")


def _pod_replay_case(page, exact):
    g = torch.Generator().manual_seed(6)
    hq, hkv, d, qo, kv = 32, 8, 128, 77, 300  # an odd prefill chunk, qo_len != kv_len
    rounds = [[600, 1, 33, 257, 0], [17, 512, 1, 90, 301]]
    b = len(rounds[0])
    pages = max(sum(-(-n // page) for n in r) for r in rounds) + 8
    dev, bf16 = "cuda", torch.bfloat16
    bufs = dict(paged_kv_indptr_buffer=torch.zeros(b + 1, dtype=torch.int32, device=dev),
                paged_kv_indices_buffer=torch.zeros(pages, dtype=torch.int32, device=dev),
                paged_kv_last_page_len_buffer=torch.zeros(b, dtype=torch.int32, device=dev))
    w = compiled_attn.PODWithPagedKVCacheWrapper(torch.empty(1, device=dev), "NHD",
                                                 use_cuda_graph=True, **bufs)
    inputs = tuple(torch.empty(*shape, dtype=bf16, device=dev)
                   for shape in ((qo, hq, d), (kv, hkv, d), (kv, hkv, d), (b, hq, d),
                                 (pages, 2, page, hkv, d)))

    def call():
        (o_p, o_d), (l_p, l_d) = w.run(*inputs, causal_p=True, return_lse_p=True,
                                       return_lse_d=True)
        return o_p, o_d, l_p, l_d

    graph, junk = None, []
    for kv_d in rounds:
        table = _page_table(kv_d, page, pages, g)
        w.plan(*table, hq, hkv, d, page, q_data_type=bf16)
        _fill(g, *inputs)
        if graph is None:
            call()  # eager, on this stream: the capture reuses the prefill part it keeps
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = call()
        else:
            junk = [torch.zeros(128, dtype=torch.int32, device=dev) for _ in range(8192)]
        got = _replay_equals_eager(graph, outs, call, exact)
        ref_w = compiled_attn.PODWithPagedKVCacheWrapper(torch.empty(1), "NHD")
        ref_w.plan(*table, hq, hkv, d, page, q_data_type=torch.float64)
        ref = ref_w.run(*(t.double().cpu() for t in inputs), causal_p=True)
        _close(got[0], ref[0])
        _close(got[1], ref[1])
    del junk


def test_batch_pod_cuda_graph_replay_is_exact():
    """BatchPOD's run() captured once; new values written into the same q / cache buffers
    before each replay: each replay equals an eager run() bit for bit, and the CPU float64
    reference. GQA 7:1, a prefill request with qo_len > kv_len, a decode request without keys."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, page, pages = 28, 4, 128, 16, 96
    qo_p, kv_p = [100, 1, 37], [300, 1, 20]
    kv_d = [77, 1, 500, 0, 33]
    dev, bf16 = "cuda", torch.bfloat16
    table_p = _page_table(kv_p, page, pages, g)
    table_d = _page_table(kv_d, page, pages, g)
    w = compiled_attn.BatchPODWithPagedKVCacheWrapper(torch.empty(1, device=dev), "NHD")
    w.plan(_indptr(qo_p), *table_p, _indptr([1] * len(kv_d)), *table_d, hq, hkv, d, page,
           q_data_type=bf16)
    inputs = tuple(torch.empty(*shape, dtype=bf16, device=dev)
                   for shape in ((sum(qo_p), hq, d), (pages, 2, page, hkv, d),
                                 (len(kv_d), hq, d), (pages, 2, page, hkv, d)))

    def call():
        (o_p, o_d), (l_p, l_d) = w.run(*inputs, causal_p=True, return_lse=True)
        return o_p, o_d, l_p, l_d

    ref_w = compiled_attn.BatchPODWithPagedKVCacheWrapper(torch.empty(1), "NHD")
    ref_w.plan(_indptr(qo_p), *table_p, _indptr([1] * len(kv_d)), *table_d, hq, hkv, d, page,
               q_data_type=torch.float64)
    graph = None
    for _ in range(3):
        _fill(g, *inputs)
        if graph is None:
            graph, outs = capture_graph(call)
        got = _replay_equals_eager(graph, outs, call)
        ref = ref_w.run(*(t.double().cpu() for t in inputs), causal_p=True)
        _close(got[0], ref[0])
        _close(got[1], ref[1])


def test_plans_read_their_index_arrays_in_one_copy_and_write_int32(monkeypatch):
    """A plan of index arrays on the GPU reads them in one device-to-host copy, and every
    index array it writes to the device is int32 on the host (a copy alone, no conversion), also
    where the page table starts past 0 in a longer, poisoned buffer: the result is the float64
    reference's."""
    g = torch.Generator().manual_seed(7)
    hq, hkv, d, page = 16, 4, 128, 16
    qo, kv = [37, 5, 64], [300, 17, 64]
    pages = sum(-(-n // page) for n in kv) + 8
    cache = torch.randn(pages, 2, page, hkv, d, generator=g)
    indptr, indices, last = _page_table(kv, page, pages, g)
    q = torch.randn(sum(qo), hq, d, generator=g)
    ref_w = compiled_attn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD")
    ref_w.plan(_indptr(qo), indptr, indices, last, hq, hkv, d, page, causal=True,
               q_data_type=torch.float64)
    ref = ref_w.run(q.double(), cache.double())
    # the same table 3 entries into a buffer whose other entries no kernel may read
    head = torch.tensor([pages, -1, 2 ** 31 - 1], dtype=torch.int32)
    idx_off = _poisoned(torch.cat([head, indices]), pages).cuda()
    ind_off = (indptr + 3).cuda()
    reads, writes = [], []
    real_to, real_copy = torch.Tensor.to, torch.Tensor.copy_

    def counting_to(self, *args, **kwargs):
        out = real_to(self, *args, **kwargs)
        if out.device.type != self.device.type:
            (reads if out.device.type == "cpu" else writes).append(self.dtype)
        return out

    def counting_copy(self, src, *args, **kwargs):  # (a re-plan into its tensors)
        if src.device.type != self.device.type:
            (reads if self.device.type == "cpu" else writes).append(src.dtype)
        return real_copy(self, src, *args, **kwargs)

    def counted(plan, writes_any=True):
        reads.clear()
        writes.clear()
        monkeypatch.setattr(torch.Tensor, "to", counting_to)
        monkeypatch.setattr(torch.Tensor, "copy_", counting_copy)
        try:
            plan()
        finally:
            monkeypatch.setattr(torch.Tensor, "to", real_to)
            monkeypatch.setattr(torch.Tensor, "copy_", real_copy)
        # (index arrays int32 on the host; a float32 write is the ALiBi slopes, made once a
        # process and heads count; writes_any False: a re-plan of the last plan's values,
        # which writes nothing, _host.to_device's sent)
        assert (torch.int32 in writes) == writes_any, writes
        assert set(writes) <= {torch.int32, torch.float32}, writes
        return len(reads)

    ws = torch.empty(1, device="cuda")
    pw = compiled_attn.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    assert counted(lambda: pw.plan(_indptr(qo).cuda(), ind_off, idx_off, last.cuda(), hq, hkv,
                                   d, page, causal=True, q_data_type=torch.bfloat16)) == 1
    got = pw.run(q.to("cuda", torch.bfloat16), cache.to("cuda", torch.bfloat16))
    _close(got, ref)
    rw = compiled_attn.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    assert counted(lambda: rw.plan(_indptr(qo).cuda(), _indptr(kv).cuda(), hq, hkv, d,
                                   causal=True, q_data_type=torch.bfloat16)) == 1
    # host index arrays: nothing to read back; and the last plan's values: nothing to write
    assert counted(lambda: rw.plan(_indptr(qo), _indptr(kv), hq, hkv, d, causal=True,
                                   q_data_type=torch.bfloat16), writes_any=False) == 0
    assert counted(lambda: rw.plan(_indptr(qo), _indptr(kv[::-1]), hq, hkv, d, causal=True,
                                   q_data_type=torch.bfloat16)) == 0
    dp, di, dl = _page_table([77, 1, 200, 33], page, pages, g)
    dw = compiled_attn.PODWithPagedKVCacheWrapper(ws, "NHD")
    assert counted(lambda: dw.plan(dp.cuda(), di.cuda(), dl.cuda(), hq, hkv, d, page,
                                   q_data_type=torch.bfloat16)) == 1
    bw = compiled_attn.BatchPODWithPagedKVCacheWrapper(ws, "NHD")
    assert counted(lambda: bw.plan(
        _indptr(qo).cuda(), ind_off, idx_off, last.cuda(), _indptr([1] * 4).cuda(), dp.cuda(),
        di.cuda(), dl.cuda(), hq, hkv, d, page, q_data_type=torch.bfloat16)) == 1
