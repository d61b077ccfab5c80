"""GPU tier of POD on the Gluon kernel's persistent work list (prefill_gluon.launch_pod, chosen
by ops.choose.pod_gluon): one launch whose resident programs take the prefill's tiles and the
decodes' items from one list. Every case runs pod_prefill_decode on bf16 inputs and checks
each part against the float64 reference with the project's bound (kernel_cases.check: twice
PyTorch's own error in the same dtype plus a rounding term; NaN never passes; outputs poisoned
first), and asserts that the Gluon launch ran. Cases: the one-page prefill cache that
PODWithPagedKVCacheWrapper passes (contiguous k_p / v_p) and a paged prefill (BatchPOD), pages
of 8 / 16 / 128 keys (TMA boxes) and of 1 / 3 keys (both parts gathered), GQA 4:1 and 7:1,
causal and no mask, odd lengths, requests without keys or rows, per-part scales, the decodes'
items on the swapped products (GQA up to 16:1, decodes of several rows); and the public
wrappers end to end against their CPU reference."""

import pytest
import torch

import compiled_attn
from compiled_attn import ops
from compiled_attn.ops import prefill_gluon
from compiled_attn.ops.policy import override
from tests.kernel_cases import (check_pod, make_case, one_page_prefill, params, pod_decodes,
                                retile)
from tests.helpers import POD_LAUNCHES

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

BF16 = torch.bfloat16
D = 128


@pytest.fixture
def gluon_pods(monkeypatch):
    """The number of POD launches that took the Gluon kernel (a list, one entry a launch)."""
    calls = []
    real = prefill_gluon.launch_pod

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(prefill_gluon, "launch_pod", spy)
    return calls


# (prefill qo_len, kv_len) of the one-page prefill; the decodes' kv lengths (one without keys)
DECODE_KV = [900, 1, 33, 0, 17, 2049, 128, 4096]


@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("mask", [ops.MASK_CAUSAL, ops.MASK_NONE], ids=["causal", "nomask"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (14, 2)], ids=["gqa4", "gqa7"])
@pytest.mark.parametrize("page", [8, 16, 128, 1])
def test_pod_one_page_prefill(mask, hq, hkv, page, block_m, gluon_pods):
    # both tile heights: the plans' (choose.pod_tile: 64 rows where the Gluon POD launch reads
    # the decodes' pages) and the 128-row ping-pong tile; page 1: the one-page prefill cache
    # gathered as one page beside the decodes' gathered pages
    g = hq // hkv
    pre = retile(one_page_prefill(300, 701, hq, hkv, seed=page + hq), block_m, [300], [701], g)
    dec = retile(pod_decodes(DECODE_KV, hq, hkv, page, seed=page + hq + 1), block_m,
                 [1] * len(DECODE_KV), DECODE_KV, g)
    p_pre = params(mask, head_dim=D)
    check_pod(pre, dec, p_pre, dict(p_pre, sm_scale=0.07))
    assert gluon_pods, "the launch did not take the Gluon kernel"


@pytest.mark.parametrize("block_m", [128, 64])
@pytest.mark.parametrize("page_p,page_d", [(16, 16), (128, 16), (16, 8), (1, 1), (3, 3)])
def test_pod_paged_prefill(page_p, page_d, block_m, gluon_pods):
    # BatchPOD's parts: a paged prefill batch (a request without rows, odd lengths, qo < kv)
    qo, kv = [300, 0, 129, 5], [700, 6, 129, 5]
    pre = retile(make_case("paged", qo, kv, 8, 2, D, dtype=BF16, device="cuda",
                           page_size=page_p, seed=3), block_m, qo, kv, 4)
    dec = retile(pod_decodes(DECODE_KV, 8, 2, page_d, seed=4), block_m, [1] * len(DECODE_KV),
                 DECODE_KV, 4)
    p = params(ops.MASK_CAUSAL, head_dim=D)
    check_pod(pre, dec, p, p)
    assert gluon_pods


@pytest.mark.parametrize("page", [16, 1])
@pytest.mark.parametrize("side", ["no_decode_keys", "no_prefill_rows"])
def test_pod_empty_sides(side, page, gluon_pods):
    if side == "no_decode_keys":
        pre = one_page_prefill(64, 64, 8, 2, seed=5)
        dec = pod_decodes([0, 0, 0], 8, 2, page, seed=6)
    else:
        pre = one_page_prefill(0, 64, 8, 2, seed=7)
        dec = pod_decodes([300, 17], 8, 2, page, seed=8)
    p = params(ops.MASK_CAUSAL, head_dim=D)
    check_pod(pre, dec, p, p)
    assert gluon_pods


@pytest.fixture
def swapped(monkeypatch):
    """The swap_d of each Gluon POD launch (a list, one entry a launch)."""
    calls = []
    real = prefill_gluon.launch_pod

    def spy(*a, **kw):
        calls.append(kw.get("swap_d", False))
        return real(*a, **kw)

    monkeypatch.setattr(prefill_gluon, "launch_pod", spy)
    return calls


@pytest.mark.parametrize("mask", [ops.MASK_CAUSAL, ops.MASK_NONE], ids=["causal", "nomask"])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (14, 2), (32, 2)], ids=["gqa4", "gqa7", "gqa16"])
@pytest.mark.parametrize("page", [8, 16, 1])
def test_pod_swapped_decodes(mask, hq, hkv, page, swapped):
    # the decodes' items on the swapped products beside the one-page prefill's 64-row tiles
    # (POLICY.pod_decode_swap): groups up to SWAP_ROWS, pages read by TMA boxes, decodes
    # without keys, with one key, and past a ring's worth of tiles; gathered pages (page 1)
    # keep the tile's own products (choose.pod_swap_decodes)
    g = hq // hkv
    pre = retile(one_page_prefill(300, 701, hq, hkv, seed=page + hq), 64, [300], [701], g)
    dec = retile(pod_decodes(DECODE_KV, hq, hkv, page, seed=page + hq + 1), 64,
                 [1] * len(DECODE_KV), DECODE_KV, g)
    p_pre = params(mask, head_dim=D)
    with override(pod_decode_swap=True):
        check_pod(pre, dec, p_pre, dict(p_pre, sm_scale=0.07))
    assert swapped == [page != 1], "the decodes' products are not the rule's"


@pytest.mark.parametrize("page_p,page_d", [(16, 16), (128, 8)])
def test_pod_swapped_decodes_of_several_rows(page_p, page_d, swapped):
    # BatchPOD's parts with decode requests of several rows: one of 5 rows (20 packed rows at
    # GQA 4: two passes over its keys), one without rows, a paged prefill batch beside them
    qo, kv = [300, 0, 129, 5], [700, 6, 129, 5]
    qo_d, kv_d = [5, 1, 0, 1, 2, 1], [900, 33, 17, 2049, 4096, 1]
    pre = retile(make_case("paged", qo, kv, 8, 2, D, dtype=BF16, device="cuda",
                           page_size=page_p, seed=13), 64, qo, kv, 4)
    dec = retile(make_case("paged", qo_d, kv_d, 8, 2, D, dtype=BF16, device="cuda",
                           page_size=page_d, seed=14), 64, qo_d, kv_d, 4)
    p = params(ops.MASK_CAUSAL, head_dim=D)
    with override(pod_decode_swap=True):
        check_pod(pre, dec, p, p)
    assert swapped == [True]


def test_pod_out_of_scope_takes_the_triton_launch(gluon_pods):
    # a window on the decode part is outside the Gluon kernel's scope: the Triton POD launch
    pre = one_page_prefill(100, 300, 8, 2, seed=9)
    dec = pod_decodes([500, 33], 8, 2, 16, seed=10)
    p = params(ops.MASK_CAUSAL, head_dim=D)
    check_pod(pre, dec, p, dict(p, window_left=64))
    assert not gluon_pods


def _pod_inputs(dev, dtype, seed=0, qo=513, kv_d=(700, 4096, 1, 333), page=16, hq=32, hkv=8):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dev, dtype)  # noqa: E731
    pages = [(n + page - 1) // page for n in kv_d]
    total = sum(pages) + 2
    perm = torch.randperm(total, generator=g)[:sum(pages)].to(torch.int32)
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page + 1 for n in kv_d], dtype=torch.int32)
    return dict(q_p=rnd(qo, hq, D), k_p=rnd(qo, hkv, D), v_p=rnd(qo, hkv, D),
                q_d=rnd(len(kv_d), hq, D), cache=rnd(total, 2, page, hkv, D),
                indptr=indptr, indices=perm, last=last, hq=hq, hkv=hkv, page=page)


def _run_pod(x, dev):
    w = compiled_attn.PODWithPagedKVCacheWrapper(torch.empty(1, device=dev), "NHD")
    w.plan(x["indptr"], x["indices"], x["last"], x["hq"], x["hkv"], D, x["page"],
           q_data_type=x["q_p"].dtype)
    return w.run(x["q_p"], x["k_p"], x["v_p"], x["q_d"], x["cache"], causal_p=True,
                 return_lse_p=True, return_lse_d=True)


@pytest.mark.parametrize("launch,page", [("fused", 16), ("uncut", 16), ("apart", 16),
                                         ("fused", 1), ("uncut", 1), ("apart", 1),
                                         ("swapped", 16), ("swapped", 1)])
def test_pod_wrapper_matches_reference(gluon_pods, pod_merges, launch, page):
    """PODWithPagedKVCacheWrapper on the GPU (the Gluon launch, page 1's with both parts
    gathered, its four decodes (32 programs, the longest 4096 keys) cut into key chunks beside
    the 513-row prefill's 264 items; "uncut": the same launch with the policy's pod_chunks off;
    "apart": the launch policy's two launches, ops.choose.pod_apart, each part on its own
    kernel, the decodes in the key chunks a paged call of them alone takes; "swapped": the
    fused launch with its decode chunks on the swapped products) against the same
    wrapper on the CPU in float64 (the reference), within the bf16
    bound of kernel_cases.check: twice the error of the same math in float32 with bf16
    products, plus rounding."""
    gpu = _pod_inputs("cuda", BF16, page=page)
    chunks = "off" if launch == "uncut" else "gluon"
    with override(**POD_LAUNCHES["apart" if launch == "apart" else "fused"], pod_chunks=chunks,
                  pod_decode_swap=launch == "swapped"):
        (out_p, out_d), (lse_p, lse_d) = _run_pod(gpu, "cuda")
    assert bool(gluon_pods) == (launch != "apart")
    assert bool(pod_merges) == (launch != "uncut")
    ref64 = _pod_inputs("cpu", torch.float64, page=page)
    (r_p, r_d), (rl_p, rl_d) = _run_pod(ref64, "cpu")
    low = {k: (v.to(BF16).to(torch.float32) if torch.is_tensor(v) and v.is_floating_point()
               else v) for k, v in ref64.items()}
    (t_p, t_d), (tl_p, tl_d) = _run_pod(low, "cpu")
    for out, ref, torch_out in ((out_p, r_p, t_p), (out_d, r_d, t_d)):
        assert not torch.isnan(out).any()
        err = (out.double().cpu() - ref).abs().max().item()
        terr = (torch_out.to(BF16).double() - ref).abs().max().item()
        assert err <= 2 * terr + torch.finfo(BF16).eps * ref.abs().max().item() + 1e-6
    for lse, ref, torch_lse in ((lse_p, rl_p, tl_p), (lse_d, rl_d, tl_d)):
        assert not torch.isnan(lse).any()
        lerr = (lse.double().cpu() - ref).abs().max().item()
        lterr = (torch_lse.double() - ref).abs().max().item()
        assert lerr <= 2 * lterr + 1e-4 * max(1.0, ref.abs().max().item())


def test_pod_wrapper_gluon_equals_triton_launch_closely():
    """The same POD call on the Gluon launch and on the Triton POD launch (policy pod_gluon
    off): both within bf16 rounding of each other (different accumulation orders)."""
    x = _pod_inputs("cuda", BF16, seed=1)
    (g_p, g_d), _ = _run_pod(x, "cuda")
    with override(pod_gluon=False):
        (t_p, t_d), _ = _run_pod(x, "cuda")
    for a, b in ((g_p, t_p), (g_d, t_d)):
        assert (a.float() - b.float()).abs().max().item() < 2e-2


def _wrapper_call(kind: str, x: dict):
    """(wrapper, call) for _pod_inputs' x (a 777-row prefill request): a POD wrapper over x's
    contiguous k_p / v_p, or (kind "batch_pod") a BatchPOD wrapper whose prefill's pages are
    appended to x["cache"] (replaced); call() runs it with both LSEs, (out_p, out_d, lse_p,
    lse_d), reading x's tensors at call time."""
    if kind == "pod":
        w = compiled_attn.PODWithPagedKVCacheWrapper(torch.empty(1, device="cuda"), "NHD")
        w.plan(x["indptr"], x["indices"], x["last"], x["hq"], x["hkv"], D, x["page"],
               q_data_type=BF16)

        def call():
            (o_p, o_d), (l_p, l_d) = w.run(x["q_p"], x["k_p"], x["v_p"], x["q_d"], x["cache"],
                                           causal_p=True, return_lse_p=True, return_lse_d=True)
            return o_p, o_d, l_p, l_d
        return w, call
    qo, page = x["q_p"].shape[0], x["page"]
    pages_p = (qo + page - 1) // page
    x["cache"] = torch.cat([x["cache"], torch.randn(
        pages_p, *x["cache"].shape[1:], device="cuda").to(BF16)])
    idx_p = torch.arange(x["cache"].shape[0] - pages_p, x["cache"].shape[0], dtype=torch.int32)
    w = compiled_attn.BatchPODWithPagedKVCacheWrapper(torch.empty(1, device="cuda"), "NHD")
    w.plan(torch.tensor([0, qo], dtype=torch.int32), torch.tensor([0, pages_p], dtype=torch.int32),
           idx_p, torch.tensor([(qo - 1) % page + 1], dtype=torch.int32),
           torch.arange(x["q_d"].shape[0] + 1, dtype=torch.int32), x["indptr"], x["indices"],
           x["last"], x["hq"], x["hkv"], D, page, q_data_type=BF16)

    def call():
        (o_p, o_d), (l_p, l_d) = w.run(x["q_p"], x["cache"], x["q_d"], x["cache"],
                                       causal_p=True, return_lse=True)
        return o_p, o_d, l_p, l_d
    return w, call


@pytest.mark.parametrize("kind", ["pod", "batch_pod"])
def test_pod_decode_chunks_replay_exactly(gluon_pods, pod_merges, kind):
    """POD and BatchPOD whose fused launch runs the decodes as key chunks (few long requests,
    one without keys and one of one key, beside a prefill of more than one wave): a CUDA graph
    of run() replays it bit for bit against eager calls on new values in the same buffers, and
    the decodes match the uncut launch (pod_chunks off) within bf16 rounding."""
    from tests.kernel_cases import capture_graph

    x = _pod_inputs("cuda", BF16, seed=3, qo=777, kv_d=(5000, 0, 1, 2049, 3001), hq=28, hkv=4)
    for t in ("q_p", "k_p", "v_p", "q_d", "cache"):
        x[t] = x[t].clone()
    w, call = _wrapper_call(kind, x)
    assert w._plan["chunks"] is not None
    eager = [t.clone() for t in call()]
    assert pod_merges and gluon_pods
    graph, outs = capture_graph(call)
    g = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(2):
        for t in ("q_p", "q_d", "cache"):
            x[t].copy_(torch.randn(x[t].shape, generator=g, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        again = call()
        for a, b in zip(outs, again):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
    with override(pod_chunks="off"):
        w._set_plan(dict(w._plan, chunks=None))
        uncut = call()
    for a, b in zip(again[1:4:2], uncut[1:4:2]):
        assert (a.float() - b.float()).nan_to_num().abs().max().item() < 2e-2
    assert not any(torch.isnan(t).any() for t in eager[:2])


def test_pod_decode_chunks_in_cuda_graph_mode(gluon_pods, pod_merges):
    """PODWithPagedKVCacheWrapper(use_cuda_graph=True) whose first plan cuts the decodes into
    key chunks: run() captured after that plan, then a re-plan with other lengths (a request
    without keys, one shorter than its chunks) into the same buffers. The replay gives the bits
    of an eager call of the re-planned wrapper, and its decodes match an uncut plan of the new
    lengths within bf16 rounding."""
    from tests.kernel_cases import capture_graph

    x = _pod_inputs("cuda", BF16, seed=3, qo=777, kv_d=(5000, 0, 1, 2049, 3001), hq=28, hkv=4)
    # the second plan's page table over the first's cache (its 430 pages, indices under 633)
    y = _pod_inputs("cpu", BF16, seed=4, qo=1, kv_d=(300, 4000, 17, 0, 2500), hq=28, hkv=4)
    i32 = dict(dtype=torch.int32, device="cuda")
    bufs = dict(paged_kv_indptr_buffer=torch.empty(6, **i32),
                paged_kv_indices_buffer=torch.empty(700, **i32),
                paged_kv_last_page_len_buffer=torch.empty(5, **i32))

    def plan(w, t):
        w.plan(t["indptr"], t["indices"], t["last"], 28, 4, D, 16, q_data_type=BF16)

    def run(w):
        (o_p, o_d), (l_p, l_d) = w.run(x["q_p"], x["k_p"], x["v_p"], x["q_d"], x["cache"],
                                       causal_p=True, return_lse_p=True, return_lse_d=True)
        return o_p, o_d, l_p, l_d

    with override(**POD_LAUNCHES["fused"]):
        w = compiled_attn.PODWithPagedKVCacheWrapper(torch.empty(1, device="cuda"), "NHD",
                                                     use_cuda_graph=True, **bufs)
        plan(w, x)
        assert w._plan["chunks"] is not None
        graph, outs = capture_graph(lambda: run(w))
        plan(w, y)
        graph.replay()
        torch.cuda.synchronize()
        replayed = [t.clone() for t in outs]
        eager = run(w)
        for a, b in zip(replayed, eager):
            assert torch.equal(a.nan_to_num(), b.nan_to_num())
        u = compiled_attn.PODWithPagedKVCacheWrapper(torch.empty(1, device="cuda"), "NHD")
        with override(pod_chunks="off", decode_chunks="off"):
            plan(u, y)
            uncut = run(u)
    assert pod_merges and gluon_pods
    assert not torch.isnan(replayed[1]).any()
    assert (replayed[1].float() - uncut[1].float()).abs().max().item() < 2e-2
    assert (replayed[3] - uncut[3]).nan_to_num().abs().max().item() < 2e-2


@pytest.mark.parametrize("kind,kv_d,page,share", [("pod", (700, 4096, 1, 333), 16, 0.5),
                                                  ("pod", (5000, 0, 1, 2049, 3001), 16, 0.5),
                                                  ("batch_pod", (700, 4096, 0, 1, 2049), 16, 0.5),
                                                  ("pod", (700, 4096, 1, 333), 1, 0.5),
                                                  ("batch_pod", (700, 4096, 0, 1, 2049), 1, 0.5),
                                                  ("pod", (5000, 0, 1, 2049, 3001), 16, 0.8),
                                                  ("pod", (700, 4096, 1, 333), 1, 0.8)])
def test_pod_side_by_side_equals_apart(monkeypatch, kind, kv_d, page, share):
    """POD and BatchPOD with their parts side by side (policy POD_SIDE: the decodes first on a
    high-priority stream, their persistent grid capped at ``share`` of the SMs (half, or the
    decode-heavy calls' larger share), the prefill on the current stream; few long decodes
    also in key chunks and merged there; pages read by TMA boxes, or gathered) give the bits
    of the parts apart (POD_APART: the same kernels one after the other), LSEs included;
    the first eager call is recorded and the next replay it as a bound call on the same two
    streams (the decodes' launches on the side stream, the prefill's on the current one);
    a CUDA graph of the call replayed on new values in the same buffers gives the bits of
    eager calls."""
    from compiled_attn import pod as pod_mod
    from compiled_attn.ops import launch as L
    from compiled_attn.ops.policy import POD_APART, POD_SIDE
    from tests.kernel_cases import capture_graph

    sides, caps, streams = [], [], []
    real_side, real_launch = pod_mod._side_by_side, prefill_gluon.launch
    real_entry = L._launch_entry
    monkeypatch.setattr(pod_mod, "_side_by_side",
                        lambda *a: sides.append(a[2]) or real_side(*a))
    monkeypatch.setattr(prefill_gluon, "launch",
                        lambda *a, **kw: caps.append(L.programs_cap_now()) or real_launch(*a, **kw))
    monkeypatch.setattr(L, "_launch_entry",
                        lambda e, stream, p: streams.append(stream) or real_entry(e, stream, p))
    x = _pod_inputs("cuda", BF16, seed=5, qo=777, kv_d=kv_d, page=page, hq=28, hkv=4)
    w, call = _wrapper_call(kind, x)
    with override(**POD_APART):
        apart = [t.clone() for t in call()]
    assert not sides
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cap = round(sms * share)
    with override(**POD_SIDE, pod_side_sms=share):
        caps.clear()
        streams.clear()
        hits = w._memo.hits
        runs = [[t.clone() for t in call()] for _ in range(3)]
        assert sides == [cap]  # recorded once, then two replays of the bound call
        assert w._memo.hits == hits + 2
        # the decodes' launch capped (the prefill's, where it is a Gluon launch, not)
        assert cap in caps and set(caps) <= {0, cap}
        # each replay launches on both streams: the side stream's and the current one's
        side = pod_mod._side_stream(torch.device("cuda", 0)).cuda_stream
        cur = torch.cuda.current_stream().cuda_stream
        assert set(streams) == {side, cur}
        for got in runs:
            for a, b in zip(got, apart):
                assert torch.equal(a.nan_to_num(), b.nan_to_num())
        assert not any(torch.isnan(t).any() for t in runs[0][:2])
        graph, outs = capture_graph(call)
        # (capture_graph's warm-up call, on another stream, replays; the captured one does
        # not: a capture takes the whole path)
        assert len(sides) == 2
        g = torch.Generator(device="cuda").manual_seed(12)
        for _ in range(2):
            for t in ("q_p", "q_d", "cache"):
                x[t].copy_(torch.randn(x[t].shape, generator=g, device="cuda"))
            for t in outs:
                t.fill_(float("nan"))
            graph.replay()
            torch.cuda.synchronize()
            again = call()
            for a, b in zip(outs, again):
                assert torch.equal(a.nan_to_num(), b.nan_to_num())
            assert not any(torch.isnan(t).any() for t in outs[:2])
