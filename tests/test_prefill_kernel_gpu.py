"""GPU tier of the Triton prefill kernel (pytest -m gpu, on the H100): FlashInfer's own test
grids, sampled rather than the full product, in bf16 and fp16; fp8 KV; CUDA-graph replay after a
re-plan; opcheck and torch.compile(fullgraph=True) on CUDA; more than 2^31 KV elements.

Every case compares the op with the float64 reference (tests/kernel_cases.py) and bounds its
error by twice PyTorch's own error in the same dtype plus a rounding term; the worst ratio seen
is printed at the end of the run (conftest collects it)."""

import random

import pytest
import torch

from compiled_attn import ops
from compiled_attn.ops.policy import POLICY
from compiled_attn.ops.schedule import block_m_for, build_split_work, build_work
from tests.kernel_cases import (capture_graph, check, force_kv_path, make_case, move_past_2_31,
                                params, record_tma, ref, run)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DTYPES = [torch.bfloat16, torch.float16]
RATIOS: list[tuple[str, float]] = []


def _check(name, c, p, **kw):
    e = check(c, p, **kw)
    RATIOS.append((name, e["ratio"]))
    return e


def _sample(grid, n, seed):
    rng = random.Random(seed)
    grid = list(grid)
    return rng.sample(grid, min(n, len(grid)))


# FlashInfer tests/test_single_prefill: kv_len x qo_len x head_dim x causal (qo <= kv if causal)
SINGLE = _sample([(kv, qo, d, causal, dt)
                  for kv in (501, 2042, 3771, 4932) for qo in (37, 127, 577, 1024)
                  for d in (64, 128, 256) for causal in (False, True) for dt in DTYPES
                  if not (causal and qo > kv)], 16, 0)


@pytest.mark.parametrize("kv,qo,d,causal,dt", SINGLE)
def test_single_prefill_grid(kv, qo, d, causal, dt):
    c = make_case("single", [qo], [kv], hq=8, hkv=8 if d == 256 else 2, dqk=d, dtype=dt,
                  device="cuda", seed=kv + qo + d)
    _check("single", c, params(mask_mode=ops.MASK_CAUSAL if causal else ops.MASK_NONE,
                               head_dim=d))


# FlashInfer tests/test_batch_prefill_kernels: batch x kv x qo x page x causal x rope
PAGED = _sample([(b, kv, qo, page, causal, rope, dt)
                 for b in (12, 17, 128) for kv in (54, 97, 512, 2048) for qo in (17, 37, 577)
                 for page in (1, 5, 16) for causal in (False, True) for rope in (False, True)
                 for dt in DTYPES if b * max(kv, qo) <= 40000], 24, 1)


@pytest.mark.parametrize("b,kv,qo,page,causal,rope,dt", PAGED)
def test_batch_paged_grid(b, kv, qo, page, causal, rope, dt):
    c = make_case("paged", [qo] * b, [kv] * b, hq=8, hkv=2, dqk=128, dtype=dt, device="cuda",
                  page_size=page, layout="HND" if page == 5 else "NHD", seed=b + kv + qo)
    p = params(mask_mode=ops.MASK_CAUSAL if causal else ops.MASK_NONE,
               pos_encoding_mode=ops.POS_ROPE_LLAMA if rope else ops.POS_NONE, head_dim=128)
    _check("paged", c, p)


@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("dt", DTYPES)
def test_variable_lengths(kind, dt):
    rng = random.Random(5)
    qo = [rng.randint(0, 300) for _ in range(9)] + [0, 1]
    kv = [q + rng.randint(0, 400) for q in qo]
    kv[3] = 0  # a request with no keys
    c = make_case(kind, qo, kv, hq=28, hkv=4, dqk=128, dtype=dt, device="cuda", page_size=16)
    _check(kind, c, params(head_dim=128))


def test_custom_mask_equals_causal():
    # FlashInfer's custom-mask test: a causal tril mask through the custom-mask path.
    qo, kv = [37, 200], [100, 200]
    c = make_case("ragged", qo, kv, hq=8, hkv=8, dqk=128, dtype=torch.bfloat16, device="cuda")
    segs = []
    for a, b in zip(qo, kv):
        m = torch.ones(a, b, dtype=torch.bool).tril(b - a)
        segs.append(m.flatten())
    from tests.kernel_cases import _indptr, _pack
    packed = [_pack(s) for s in segs]
    c.packed_mask = torch.cat(packed).cuda()
    c.mask_indptr = _indptr([x.numel() for x in packed], "cuda")
    out_c, lse_c = run(c, params(mask_mode=ops.MASK_CUSTOM, head_dim=128))
    out_k, lse_k = run(c, params(head_dim=128))
    # Same keys, same order: outputs agree to an ulp (the masked and unmasked loops, and the
    # pipeline depths, are compiled differently).
    torch.testing.assert_close(out_c, out_k)
    torch.testing.assert_close(lse_c, lse_k, atol=0, rtol=1e-6)


FEATURES = {
    "window": params(window_left=127, head_dim=128),
    "window_noncausal": params(mask_mode=ops.MASK_NONE, window_left=64, head_dim=128),
    "soft_cap_1": params(logits_soft_cap=1.0, head_dim=128),
    "soft_cap_30": params(logits_soft_cap=30.0, head_dim=128),
    "soft_cap_50": params(logits_soft_cap=50.0, head_dim=128),
    "alibi": params(pos_encoding_mode=ops.POS_ALIBI, head_dim=128),
    "custom": params(mask_mode=ops.MASK_CUSTOM, head_dim=128),
    "chunked": params(chunk_size=64, head_dim=128),
    "sinks": params(head_dim=128, v_scale=0.5),
}


@pytest.mark.parametrize("feature", sorted(FEATURES))
@pytest.mark.parametrize("kind", ["ragged_host", "paged", "ragged_persistent", "ragged_device",
                                  "ragged_pointers"])
def test_features(kind, feature, monkeypatch):
    # Every K/V load path of ragged batches, forced (these launches are small: by default
    # they would take the pointer loads).
    if kind.startswith("ragged_"):
        force_kv_path(monkeypatch, kind.split("_")[1])
        kind = "ragged"
    c = make_case(kind, [300, 17, 0, 129], [700, 17, 5, 129], hq=8, hkv=2, dqk=128,
                  dtype=torch.bfloat16, device="cuda", custom_mask=feature == "custom",
                  alibi=feature == "alibi", sinks=feature == "sinks", seed=len(feature))
    _check(feature, c, FEATURES[feature])


# Pages of 1-8 keys run 256-row tiles of 16 warps (prefill_kernel.SMALL_PAGE_BLOCK_M) when the
# requests fill them and the Triton kernel reads them (fp16 / bf16 pages at D 128 on a Hopper
# GPU are the Gluon kernel's, boxes or gathers, which block_m_for tiles as contiguous K/V: off
# here, USE_GLUON; fp8 K/V keep this tile):
# every feature on that tile (page 1, the per-key gather), and page sizes on the other gather
# paths (4: whole pages per tile; 5: per key, pages straddling tiles), with odd lengths,
# qo != kv, a request without queries and one without keys, GQA 4:1 and 7:1.
SMALL_PAGE = ([(f, 1) for f in sorted(FEATURES)]
              + [("plain", 4), ("plain", 5), ("gqa7_fp16", 1), ("noncausal", 2), ("rope", 1),
                 ("fp8", 4), ("fp8", 8), ("split", 1)])
SMALL_PAGE_EXTRA = {
    "plain": params(head_dim=128),
    "gqa7_fp16": params(head_dim=128),
    "noncausal": params(mask_mode=ops.MASK_NONE, head_dim=128),
    "rope": params(pos_encoding_mode=ops.POS_ROPE_LLAMA, head_dim=128),
    "fp8": params(head_dim=128, sm_scale=0.05, v_scale=2.0),
    "split": params(head_dim=128, v_scale=0.5),
}


@pytest.mark.parametrize("feature,page", SMALL_PAGE)
def test_small_page_256_row_tiles(feature, page, monkeypatch):
    monkeypatch.setattr(POLICY, "use_gluon", False)
    qo, kv = [300, 17, 0, 129, 1500], [700, 17, 5, 129, 1501]
    hq, hkv = (14, 2) if feature == "gqa7_fp16" else (8, 2)
    c = make_case("paged", qo, kv, hq=hq, hkv=hkv, dqk=128,
                  dtype=torch.float16 if feature == "gqa7_fp16" else torch.bfloat16,
                  kv_dtype=torch.float8_e4m3fn if feature == "fp8" else None, device="cuda",
                  page_size=page, custom_mask=feature == "custom", alibi=feature == "alibi",
                  sinks=feature == "sinks", seed=page + len(feature))
    c.block_m = block_m_for(128, 128, hq // hkv, max(kv), True, True, page_size=page,
                            qo_lens=qo, kv_dtype=c.k.dtype)
    assert c.block_m == ops.prefill_kernel.SMALL_PAGE_BLOCK_M
    if feature == "split":  # key ranges cut into chunks, merged by _merge_fwd
        c.work, c.merge = build_split_work(qo, kv, hq // hkv, c.block_m, hkv, "cuda",
                                           num_sms=132, min_keys_per_chunk=128)
        assert c.merge is not None
    else:
        c.work = build_work(qo, hq // hkv, c.block_m, "cuda", kv_lens=kv)
    _check(f"page{page}_{feature}", c, FEATURES.get(feature) or SMALL_PAGE_EXTRA[feature])


# Decode rows (ops.tiles.DECODE_ROWS): one-row requests (and a two-row one) with long, odd,
# one-key and empty key ranges take 64-row tiles on pages read by TMA boxes or gathered (page
# 1 and 3: the gathering warp group beside the 64-row tile's compute warps).
DECODE = [(32, 8, 16, "NHD", torch.bfloat16), (7, 1, 16, "NHD", torch.float16),
          (64, 8, 8, "HND", torch.bfloat16), (8, 8, 64, "NHD", torch.bfloat16),
          (32, 8, 1, "NHD", torch.bfloat16), (7, 1, 3, "HND", torch.float16)]


@pytest.mark.parametrize("hq,hkv,page,layout,dt", DECODE)
def test_decode_rows_64_row_tiles(hq, hkv, page, layout, dt):
    qo = [1, 1, 2, 1, 1, 0, 1]
    kv = [5000, 1, 2049, 0, 777, 40, 16]
    c = make_case("paged", qo, kv, hq=hq, hkv=hkv, dqk=128, dtype=dt, device="cuda",
                  page_size=page, layout=layout, seed=hq + page)
    c.block_m = block_m_for(128, 128, hq // hkv, max(kv), False, True, page_size=page,
                            qo_lens=qo, kv_dtype=c.k.dtype)
    assert c.block_m == 64 or torch.cuda.get_device_capability()[0] != 9  # (Hopper's Gluon)
    c.work = build_work(qo, hq // hkv, c.block_m, "cuda", kv_lens=kv)
    _check("decode", c, params(mask_mode=ops.MASK_NONE, head_dim=128))


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dt", DTYPES)
@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_fp8_kv(kv_dtype, dt, kind, monkeypatch):
    monkeypatch.setattr(POLICY, "tma_min_kv", 0)  # ragged: descriptors
    c = make_case(kind, [100, 250], [400, 250], hq=8, hkv=2, dqk=128, dtype=dt,
                  kv_dtype=kv_dtype, device="cuda", seed=2)
    _check("fp8", c, params(head_dim=128, sm_scale=0.05, v_scale=2.0))


def test_head_dim_192_128():
    c = make_case("ragged", [200, 33], [300, 33], hq=8, hkv=8, dqk=192, dvo=128,
                  dtype=torch.bfloat16, device="cuda")
    _check("d192", c, params(head_dim=192))


@pytest.mark.parametrize("path", ["host", "persistent", "device", "pointers"])
def test_cuda_graph_replay_after_replan(path, monkeypatch):
    # Fixed buffers (batch size 4): capture once, then re-plan with new lengths into the same
    # buffers and replay; the padded work rows (request -1) must be skipped. Host descriptors
    # are captured by value (the buffers stay put); device-built ones (forced at these short
    # lengths) get their scratch allocated inside the capture, and the persistent grid's item
    # counter its zeroing.
    force_kv_path(monkeypatch, path)
    torch.manual_seed(0)
    hq, hkv, d, cap_tokens, max_work = 8, 2, 128, 1024, 64
    q = torch.randn(cap_tokens, hq, d, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(cap_tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(cap_tokens, hkv, d, device="cuda", dtype=torch.bfloat16)
    qo_indptr = torch.zeros(5, dtype=torch.int32, device="cuda")
    kv_indptr = torch.zeros(5, dtype=torch.int32, device="cuda")
    work = torch.full((max_work, 2), -1, dtype=torch.int32, device="cuda")
    block_m = ops.choose.tile(d, d, hq // hkv)

    def replan(qo, kv):
        qo_indptr.copy_(torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist()))
        kv_indptr.copy_(torch.tensor([0] + torch.tensor(kv).cumsum(0).tolist()))
        w = build_work(qo, hq // hkv, block_m)
        work.fill_(-1)
        work[: w.shape[0]].copy_(w)

    p = params(head_dim=d)
    args = (p["mask_mode"], p["window_left"], p["chunk_size"], p["sm_scale"], 0.0, 0, 1.0,
            1e4, 1.0, None)

    def step():
        return ops.batch_ragged_prefill(q, k, v, qo_indptr, kv_indptr, work, None, None, None,
                                        None, block_m, *args)

    replan([100, 50, 7, 200], [100, 300, 7, 200])
    g, (out, lse) = capture_graph(step)
    for qo, kv in ([[100, 50, 7, 200], [100, 300, 7, 200]], [[300, 0, 1, 99], [310, 3, 600, 99]]):
        replan(qo, kv)
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        n = sum(qo)
        from tests.kernel_cases import Case
        c = Case("ragged", q[:n], k[: sum(kv)], v[: sum(kv)], qo_indptr=qo_indptr.clone(),
                 kv_indptr=kv_indptr.clone())
        r_out, _ = ref(c, p)
        err = (out[:n].double() - r_out).abs().max().item()
        assert err < 2e-2, err


@pytest.mark.parametrize("tokens,captured,expect", [(1024, False, 0), (8192, False, 2),
                                                     (1024, True, 2)],
                         ids=["small", "large", "small-captured"])
def test_eager_small_launch_skips_host_descriptors(tokens, captured, expect, monkeypatch):
    # An eager launch below HOST_TMA_MIN_FLOP would wait on its own host-side cost: it takes
    # the pointer loads (here, short keys) instead of host descriptors; a large one does not,
    # nor a small one captured into a CUDA graph (replays skip the host).
    c = make_case("ragged", [tokens // 2] * 2, [tokens // 2] * 2, hq=32, hkv=8, dqk=128,
                  dtype=torch.bfloat16, device="cuda", seed=3)
    p = params(head_dim=128)
    if not captured:
        seen = record_tma(monkeypatch)
        _check("small_launch", c, p)
        assert seen == [expect]
        return
    with monkeypatch.context() as m:  # compile the host-descriptor kernel outside the capture
        m.setattr(POLICY, "host_tma_min_flop", 0)
        run(c, p)
    seen = record_tma(monkeypatch)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, _ = run(c, p)
    out.fill_(float("nan"))
    g.replay()
    torch.cuda.synchronize()
    assert seen == [expect]
    r_out, _ = ref(c, p)
    assert (out.double() - r_out).abs().max().item() < 2e-2


def test_opcheck_cuda():
    c = make_case("paged", [33, 0, 70], [40, 5, 70], hq=4, hkv=2, dqk=64, dtype=torch.bfloat16,
                  device="cuda", page_size=16)
    p = params()
    args = (c.q, c.k, c.v, c.qo_indptr, c.kv_indptr, c.page_indices, c.last_page_len, c.work,
            None, None, None, None, c.block_m, p["mask_mode"], -1, 0, p["sm_scale"], 0.0, 0,
            1.0, 1e4, 1.0, None)
    torch.library.opcheck(torch.ops.compiled_attn.batch_paged_prefill.default, args)
    s = make_case("single", [40], [70], hq=4, hkv=2, dqk=64, dtype=torch.bfloat16, device="cuda")
    torch.library.opcheck(torch.ops.compiled_attn.single_prefill.default,
                          (s.q, s.k, s.v, None, None, None, 1, -1, 0, 0.125, 0.0, 0, 1.0, 1e4,
                           1.0, None))


@pytest.mark.parametrize("kv,block_m,traced,dynamic", [
    ([64, 300], 64, 3, False), ([64, 300], 64, 3, True), ([64, 300], 128, 0, False),
    ([1500, 2600], 128, 1, False)], ids=["persistent", "persistent-dynamic", "short", "long"])
def test_torch_compile_fullgraph_cuda(kv, block_m, traced, dynamic, monkeypatch):
    # Eager calls build K/V descriptors on the host at any length. A traced graph cannot carry
    # those (wrap_triton): 64-row tiles run a persistent grid that builds them once per
    # program; 128-row tiles take pointer loads for short keys and per-item descriptors for
    # long ones. Inductor's generated launch must provide the device descriptors' scratch.
    # Every case traces afresh (one f, several parametrizations; a cached graph would skip
    # the traces this test records).
    torch._dynamo.reset()
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    seen = record_tma(monkeypatch)
    c = make_case("ragged", [64, 100], kv, hq=8, hkv=2, dqk=128, dtype=torch.bfloat16,
                  device="cuda")
    c.block_m = block_m
    c.work = build_work([64, 100], 4, block_m, "cuda", kv_lens=kv)
    p = params(head_dim=128)

    def f(q, k, v, work):
        out, lse = ops.batch_ragged_prefill(q, k, v, c.qo_indptr, c.kv_indptr, work, None,
                                            None, None, None, c.block_m, 1, -1, 0,
                                            p["sm_scale"], 0.0, 0, 1.0, 1e4, 1.0, None)
        return out * 2, lse

    # eager: host descriptors even for this small launch (traced: the default paths)
    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    eager = f(c.q, c.k, c.v, c.work)
    assert seen == [2]
    # The traced Triton launch is under test (what AOTInductor packages): with HOST_TMA_MIN_FLOP
    # at 0 these calls are in the Gluon kernel's scope, and torch.compile would keep them opaque
    # (compiled_attn.ops.dispatch; tests/test_graph_dispatch_gpu.py covers that).
    monkeypatch.setattr(POLICY, "graph_gluon", False)
    # dynamic: the work list's length is symbolic, so is the persistent grid's size
    compiled = torch.compile(f, fullgraph=True, dynamic=dynamic)(c.q, c.k, c.v, c.work)
    # The calls made while tracing (the compiled code then launches from Inductor's wrapper).
    # Under dynamic shapes the op's body is traced more than once and an earlier trace may
    # take the pointer loads; the last is the launch Inductor compiles (its output code has
    # the zeroed counter and a sym_min grid).
    traces = seen[1:]
    assert traces and traces[-1] == traced and (dynamic or set(traces) == {traced}), seen
    torch.testing.assert_close(compiled[0], eager[0])
    torch.testing.assert_close(compiled[1], eager[1])
    _check("compile", c, p)


@pytest.mark.gpu_solo  # 8 GB of cache and more: beside 7 other shards it ran out of memory
def test_more_than_2_31_kv_elements():
    # A paged cache of > 2^31 elements; the request's pages sit at its end, so every key
    # offset is past 2^31 and must be computed in int64.
    c = make_case("paged", [300], [1000], hq=8, hkv=8, dqk=128, dtype=torch.bfloat16,
                  device="cuda", page_size=16)
    move_past_2_31(c)
    _check("2^31", c, params(head_dim=128))


def test_report_worst_ratio():
    # Runs last in this module: the worst error ratio against torch's own error.
    if RATIOS:
        worst = max(RATIOS, key=lambda x: x[1])
        print(f"\nGPU kernel cases: {len(RATIOS)}, worst error ratio vs torch's own error: "
              f"{worst[1]:.3f} ({worst[0]})")


@pytest.mark.parametrize("kind", ["ragged", "paged"])
@pytest.mark.parametrize("dt", DTYPES)
def test_split_kv_grid(kind, dt):
    # Few query rows against long keys: the split plan cuts tiles into chunks merged by
    # _merge_fwd (sinks and v_scale applied after the merge).
    qo, kv = [1, 17, 5, 0, 64], [8000, 3001, 129, 7, 4096]
    c = make_case(kind, qo, kv, hq=32, hkv=8, dqk=128, dtype=dt, device="cuda", page_size=16,
                  sinks=True, seed=8)
    c.work, c.merge = build_split_work(qo, kv, 4, c.block_m, 8, "cuda")
    assert c.merge is not None
    _check("split", c, params(head_dim=128, v_scale=0.5))
    _check("split", c, params(head_dim=128, mask_mode=ops.MASK_NONE, window_left=1000))
