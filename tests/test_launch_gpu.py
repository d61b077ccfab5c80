"""Bound launches (ops/launch.py, op_call.bound_run) on the GPU: a replayed eager call gives the
full path's bits for every entry point and kernel (the Gluon kernel with its host descriptors and
persistent counter, the Triton kernel's K/V paths, split-KV with its merge, POD), and CUDA-graph
capture after replays stays exact."""

import contextlib
import gc
import os
from unittest import mock
import weakref

import pytest
import torch

from compiled_attn.ops import choose
import compiled_attn as fi
from compiled_attn.ops import launch, policy
from tests.helpers import indptr, make_paged

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
QO, KV = [37, 300, 1, 128], [200, 517, 64, 128]
HQ, HKV = 32, 8
# Under compute-sanitizer the finished Python frames of calls that entered CUDA (the launchers,
# allocations, copies) stay alive, held by no Python object (gc finds no referrer; without the
# sanitizer none survives: benchmarks/NOTES.md, 2026-11-30), and with them those frames' tensors
SANITIZER = "NV_SANITIZER_INJECTION_PORT_BASE" in os.environ


def _rand(*shape, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    return torch.randn(*shape, generator=g).to("cuda", BF16)


def _ws():
    return torch.empty(1 << 20, dtype=torch.uint8, device="cuda")


def _entry(kind, d, seed, page=16):
    """A zero-argument call of entry point ``kind`` on fresh inputs (seed), its outputs a tuple
    of tensors."""
    if kind == "single":
        q, k, v = _rand(300, HQ, d, seed=seed), _rand(517, HKV, d, seed=seed + 1), \
            _rand(517, HKV, d, seed=seed + 2)
        return lambda: fi.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
    q = _rand(sum(QO), HQ, d, seed=seed)
    if kind == "ragged":
        k, v = _rand(sum(KV), HKV, d, seed=seed + 1), _rand(sum(KV), HKV, d, seed=seed + 2)
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(_ws())
        w.plan(indptr(QO).cuda(), indptr(KV).cuda(), HQ, HKV, d, causal=True, q_data_type=BF16)
        return lambda: w.run(q, k, v, return_lse=True)
    cache, kvi, idx, last, _, _ = make_paged(KV, HKV, d, d, page, dtype=BF16, seed=seed)
    cache = cache.cuda()
    if kind == "paged":
        w = fi.BatchPrefillWithPagedKVCacheWrapper(_ws())
        w.plan(indptr(QO).cuda(), kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page,
               causal=True, q_data_type=BF16)
        return lambda: w.run(q, cache, return_lse=True)
    qd = _rand(len(KV), HQ, d, seed=seed + 3)
    if kind == "pod":
        w = fi.PODWithPagedKVCacheWrapper(_ws())
        w.plan(kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page, q_data_type=BF16)
        kp, vp = _rand(300, HKV, d, seed=seed + 4), _rand(300, HKV, d, seed=seed + 5)
        qp = _rand(200, HQ, d, seed=seed + 6)
        return lambda: _flat(w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_p=True,
                                   return_lse_d=True))
    w = fi.BatchPODWithPagedKVCacheWrapper(_ws())
    qo_d = indptr([1] * len(KV)).cuda()
    w.plan(indptr(QO).cuda(), kvi.cuda(), idx.cuda(), last.cuda(), qo_d, kvi.cuda(), idx.cuda(),
           last.cuda(), HQ, HKV, d, page, q_data_type=BF16)
    return lambda: _flat(w.run(q, cache, qd, cache, causal_p=True, return_lse=True))


def _flat(res):
    return tuple(x for pair in res for x in pair)


def _replay_vs_full(call):
    call()  # records
    torch.full((1 << 24,), float("nan"), device="cuda")  # poison the allocator's next blocks
    got = call()  # replays
    with policy.override(bound_launches=False):
        want = call()
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert not g.float().isnan().any()
        assert torch.equal(g, w)


@pytest.mark.parametrize("kind", ["single", "ragged", "paged", "pod", "batch_pod"])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_replay_is_the_full_path(kind, d):
    _replay_vs_full(_entry(kind, d, seed=d))


@pytest.mark.parametrize("page", [1, 4])
def test_replay_gathered_pages(page):
    _replay_vs_full(_entry("paged", 128, seed=7, page=page))


@pytest.mark.parametrize("path", list(choose.KV_PATHS))
def test_replay_every_kv_path(path):
    # host descriptors, the persistent grid's counter, device descriptors, pointer loads
    with policy.override(**choose.KV_PATHS[path][1]):
        _replay_vs_full(_entry("ragged", 128, seed=11))
        _replay_vs_full(_entry("single", 128, seed=12))


def test_replay_split_kv_plan():
    # few long requests: the plan splits their keys; replay runs the kernel and the merge
    q = _rand(64, HQ, 128, seed=20)
    k, v = _rand(32768, HKV, 128, seed=21), _rand(32768, HKV, 128, seed=22)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(_ws())
    w.plan(indptr([64]).cuda(), indptr([32768]).cuda(), HQ, HKV, 128, causal=True,
           q_data_type=BF16)
    assert w._plan.merge is not None and w._plan.work.shape[1] == 4
    _replay_vs_full(lambda: w.run(q, k, v, return_lse=True))


def test_capture_after_replays_is_exact():
    call = _entry("paged", 128, seed=30)
    call()
    call()  # a replay
    want = call()
    graph = torch.cuda.CUDAGraph()
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        got = call()
    graph.replay()
    torch.cuda.synchronize()
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_replay_new_pointers_reencode_descriptors():
    # the same metadata with other tensors: the replay's descriptors take the new pointers
    # (the Gluon kernel's host descriptors; single prefill forced onto them at this size)
    d, page = 128, 16
    cache, kvi, idx, last, _, _ = make_paged(KV, HKV, d, d, page, dtype=BF16, seed=40)
    caches = [cache.cuda(), (cache.cuda() * 0.5).contiguous()]
    qs = [_rand(sum(QO), HQ, d, seed=41), _rand(sum(QO), HQ, d, seed=42)]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(_ws())
    w.plan(indptr(QO).cuda(), kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page,
           causal=True, q_data_type=BF16)
    w.run(qs[0], caches[0], return_lse=True)
    w.run(qs[0], caches[0], return_lse=True)
    got = w.run(qs[1], caches[1], return_lse=True)
    assert w._memo.hits == 2
    with policy.override(bound_launches=False):
        want = w.run(qs[1], caches[1], return_lse=True)
    for g, r in zip(got, want):
        assert torch.equal(g, r)
    # back to the first cache and on, as a model's layers take turns: each replay on its own
    # cache's descriptors (kept by base pointer; launch.DESC_BASES of them, 1 clears at every
    # change)
    with policy.override(bound_launches=False):
        wants = [w.run(qs[i], caches[i], return_lse=True) for i in (0, 1)]
    for bases in (launch.DESC_BASES, 1):
        with mock.patch.object(launch, "DESC_BASES", bases):
            policy.touch()  # (a fresh record, its descriptor cache holding one base)
            w.run(qs[0], caches[0], return_lse=True)
            hits = w._memo.hits
            for i in (1, 0, 1, 0):
                got = w.run(qs[i], caches[i], return_lse=True)
                for g, r in zip(got, wants[i]):
                    assert torch.equal(g, r)
            assert w._memo.hits == hits + 4
    with policy.override(host_tma_min_flop=0):
        calls = [_entry("single", 128, seed=s) for s in (43, 44)]
        calls[0]()
        calls[0]()
        got = calls[1]()
        with policy.override(bound_launches=False):
            want = calls[1]()
    for g, r in zip(got, want):
        assert torch.equal(g, r)


@pytest.mark.skipif(SANITIZER, reason="compute-sanitizer keeps finished frames, and their "
                    "tensors, alive")
@pytest.mark.parametrize("kind", ["single", "paged", "pod"])
def test_a_bound_call_holds_none_of_its_tensors(kind):
    # The direct launcher keeps descriptor expansions by base pointer and the templates keep no
    # tensor: a recorded call's inputs and outputs (a 128 MiB cache here) are freed once the
    # caller drops them, and the next call on fresh tensors still replays the full path's bits
    d, page = 128, 16
    _, kvi, idx, last, _, _ = make_paged(KV, HKV, d, d, page, dtype=BF16, seed=50)
    pages = 2048  # more pages than the plan reads: a cache the size a model would keep

    def inputs(seed):
        if kind == "single":
            return [_rand(300, HQ, d, seed=seed), _rand(pages * page, HKV, d, seed=seed + 1)[:517],
                    _rand(pages * page, HKV, d, seed=seed + 2)[:517]]
        cache = _rand(pages, 2, page, HKV, d, seed=seed + 1)
        if kind == "paged":
            return [_rand(sum(QO), HQ, d, seed=seed), cache]
        return [_rand(200, HQ, d, seed=seed + 2), _rand(300, HKV, d, seed=seed + 3),
                _rand(300, HKV, d, seed=seed + 4), _rand(len(KV), HQ, d, seed=seed + 5), cache]

    if kind == "single":
        memo = fi.prefill._SINGLE_MEMO

        def call(x):
            return fi.single_prefill_with_kv_cache(*x, causal=True, return_lse=True)
    elif kind == "paged":
        w = fi.BatchPrefillWithPagedKVCacheWrapper(_ws())
        w.plan(indptr(QO).cuda(), kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page,
               causal=True, q_data_type=BF16)
        memo = w._memo

        def call(x):
            return w.run(x[0], x[1], return_lse=True)
    else:
        w = fi.PODWithPagedKVCacheWrapper(_ws())
        w.plan(kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page, q_data_type=BF16)
        memo = w._memo

        def call(x):
            return _flat(w.run(*x, causal_p=True, return_lse_p=True, return_lse_d=True))

    memo.clear()
    with policy.override(host_tma_min_flop=0):  # (single prefill on host descriptors too)
        x = inputs(51)
        call(x)  # records
        hits = memo.hits
        outs = call(x)  # replays
        assert memo.hits == hits + 1
        torch.cuda.synchronize()
        refs = [weakref.ref(t) for t in (*x, *outs)]
        before = torch.cuda.memory_allocated()
        del x, outs
        gc.collect()
        assert [r() is None for r in refs] == [True] * len(refs), "the memo holds a call's tensors"
        assert torch.cuda.memory_allocated() <= before - pages * 2 * page * HKV * d * 2
        x = inputs(52)
        got = call(x)
        assert memo.hits == hits + 2
        with policy.override(bound_launches=False):
            want = call(x)
    torch.cuda.synchronize()
    for g, r in zip(got, want, strict=True):
        assert not g.float().isnan().any() and torch.equal(g, r)


def test_pod_run_of_a_new_prefill_length_does_not_wait_for_the_device():
    # POD's eager run() of a new prefill length writes that part's arrays from the host
    # (pod._host_part): never a copy that synchronizes the stream (it would wait for the
    # step's earlier layers), nor anything else that does; the replay neither
    d, page = 128, 16
    cache, kvi, idx, last, _, _ = make_paged(KV, HKV, d, d, page, dtype=BF16, seed=70)
    cache = cache.cuda()
    qd = _rand(len(KV), HQ, d, seed=71)
    kp, vp = _rand(600, HKV, d, seed=72), _rand(600, HKV, d, seed=73)
    qp = _rand(200, HQ, d, seed=74)
    w = fi.PODWithPagedKVCacheWrapper(_ws())
    w.plan(kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page, q_data_type=BF16)
    w.run(qp, kp[:300], vp[:300], qd, cache, causal_p=True)  # compiles the kernel eagerly
    torch.cuda.synchronize()
    want = [w.run(qp, kp[:kv], vp[:kv], qd, cache, causal_p=True) for kv in (400, 500)]
    torch.cuda.synchronize()
    w.plan(kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page, q_data_type=BF16)
    torch.cuda._sleep(50_000_000)  # (the stream busy: a synchronizing copy would wait)
    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = [w.run(qp, kp[:kv], vp[:kv], qd, cache, causal_p=True) for kv in (400, 500, 400)]
    finally:
        torch.cuda.set_sync_debug_mode(prev)
    torch.cuda.synchronize()
    for g, r in zip(got, [*want, want[0]]):
        for a, b in zip(g, r):
            assert torch.equal(a, b)


def test_pod_prefill_part_made_in_a_capture_is_not_kept():
    # POD keeps its prefill request's small device tensors per length for eager calls; ones
    # made while a CUDA graph captures hold their values only in the graph's replays, so an
    # eager call after a capture-first wrapper must not reuse them
    d, page = 128, 16
    cache, kvi, idx, last, _, _ = make_paged(KV, HKV, d, d, page, dtype=BF16, seed=60)
    cache = cache.cuda()
    qd = _rand(len(KV), HQ, d, seed=61)
    kp, vp, qp = _rand(300, HKV, d, seed=62), _rand(300, HKV, d, seed=63), _rand(200, HQ, d,
                                                                               seed=64)

    def wrapper():
        w = fi.PODWithPagedKVCacheWrapper(_ws())
        w.plan(kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page, q_data_type=BF16)
        return w

    ref = wrapper()
    want = ref.run(qp, kp, vp, qd, cache, causal_p=True)  # compiles the kernel eagerly
    torch.cuda.synchronize()
    w = wrapper()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # this wrapper's first call is captured
        w.run(qp, kp, vp, qd, cache, causal_p=True)
    torch.full((1 << 24,), float("nan"), device="cuda")
    got = w.run(qp, kp, vp, qd, cache, causal_p=True)  # eager, before any replay
    torch.cuda.synchronize()
    for g, r in zip(got, want):
        assert torch.equal(g, r)
    # ALiBi asked in run() of a plan without it: its slopes were made in the first call, a
    # copy from the host inside the capture; they are the plan's since (made at plan time)
    alibi = dict(causal_p=True, pos_encoding_mode_p="ALIBI", pos_encoding_mode_d="ALIBI")
    want = ref.run(qp, kp, vp, qd, cache, **alibi)
    w = wrapper()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = w.run(qp, kp, vp, qd, cache, **alibi)
    torch.full((1 << 24,), float("nan"), device="cuda")
    got = w.run(qp, kp, vp, qd, cache, **alibi)
    graph.replay()
    torch.cuda.synchronize()
    for g, c, r in zip(got, captured, want):
        assert torch.equal(g, r) and torch.equal(c, r)


def _big_call(kind, seed, fused=True):
    """(call, q) for a persistent Gluon launch of more work items than resident programs (the
    counter hands out the rest): a paged prefill batch, or POD with a long prefill (fused: each
    call under the policy's POD_FUSED, else under the caller's policy)."""
    d, page, qo, kv = 128, 16, [2048, 1500], [2048, 3000]
    cache, kvi, idx, last, _, _ = make_paged(kv, HKV, d, d, page, dtype=BF16, seed=seed)
    cache = cache.cuda()
    if kind == "paged":
        q = _rand(sum(qo), HQ, d, seed=seed + 1)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(_ws())
        w.plan(indptr(qo).cuda(), kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page,
               causal=True, q_data_type=BF16)
        return (lambda: w.run(q, cache, return_lse=True)), q
    w = fi.PODWithPagedKVCacheWrapper(_ws())
    # planned without decode key chunks (their gather and merge are launches of their own)
    with policy.override(pod_chunks="off"):
        w.plan(kvi.cuda(), idx.cuda(), last.cuda(), HQ, HKV, d, page, q_data_type=BF16)
    qp, kp, vp = (_rand(2048, h, d, seed=seed + i) for i, h in ((2, HQ), (3, HKV), (4, HKV)))
    qd = _rand(len(kv), HQ, d, seed=seed + 5)

    def call():  # one fused launch
        with policy.override(**policy.POD_FUSED) if fused else contextlib.nullcontext():
            return _flat(w.run(qp, kp, vp, qd, cache, causal_p=True, return_lse_p=True,
                               return_lse_d=True))
    return call, qp


@pytest.mark.parametrize("kind", ["paged", "pod"])
def test_captured_persistent_launch_needs_no_zeroing(kind):
    # the persistent programs leave their counter 0 (prefill_gluon._next_item), so a CUDA
    # graph takes a counter slot zeroed once (launch._GRAPH_POOLS): its replay runs the kernel
    # alone, and every replay hands out every item again
    call, q = _big_call(kind, seed=70)
    call()  # eager first: compiles, and makes the device's graph counters
    torch.cuda.synchronize()
    dev = torch.cuda.current_device()
    slot = launch._GRAPH_POOLS[dev][1]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = call()
    assert launch._GRAPH_POOLS[dev][1] == slot + 1  # the launch's counter: one graph slot
    for seed in (71, 72, 73):
        q.copy_(_rand(*q.shape, seed=seed))
        for g in got:
            g.fill_(float("nan"))
        graph.replay()
        with policy.override(bound_launches=False):
            want = call()
        torch.cuda.synchronize()
        for g, w in zip(got, want):
            assert torch.equal(g, w)
        assert int(launch._GRAPH_POOLS[dev][0][slot]) == 0  # left 0 by every replay
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        torch.cuda._sleep(1000)  # a kernel the profiler must see: its "spin_kernel"
        torch.cuda.synchronize()
        graph.replay()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    if not any("spin" in n for n in names):  # (compute-sanitizer holds CUPTI: no events)
        pytest.skip("the profiler records no kernels in this process; replays checked above")
    kernels = [n for n in names if "spin" not in n]
    assert len(kernels) == 1 and "_gluon" in kernels[0], kernels


@pytest.mark.parametrize("kind", ["paged", "pod"])
def test_replays_reuse_their_streams_reset_counter(kind):
    # eager replays of a persistent launch pass their stream's own counter slot
    # (launch._reset_slot) instead of a pool's: every launch leaves it 0, so replay after
    # replay, on one stream and on a second one (its own slot), hands out every item again.
    # (One policy scope for the whole test: a change of policy sends the next call through
    # the full path.)
    with policy.override(**policy.POD_FUSED):
        call, q = _big_call(kind, seed=80, fused=False)
        refs = [_big_call(kind, seed=80, fused=False) for _ in range(4)]  # (their plans first)
        call()  # records
        dev = torch.cuda.current_device()
        main, side = torch.cuda.current_stream(), torch.cuda.Stream()
        for n, (seed, (ref, ref_q)) in enumerate(zip((81, 82, 83, 84), refs)):
            stream = side if n % 2 else main
            q.copy_(_rand(*q.shape, seed=seed))
            ref_q.copy_(q)
            want = ref()  # a new wrapper's first call: the full path
            stream.wait_stream(main)
            recorded = launch.recordings()
            with torch.cuda.stream(stream):
                got = call()
            assert launch.recordings() == recorded  # a replay
            main.wait_stream(stream)
            torch.cuda.synchronize()
            for g, w in zip(got, want):
                assert torch.equal(g, w)
            assert int(launch._RESET_SLOTS[dev, stream.cuda_stream][0]) == 0


@pytest.mark.parametrize("page", [16, 1])
def test_pod_replays_a_growing_prefill_at_any_key_count(page):
    # a chunked prefill's keys grow every step (POD's contiguous k_p / v_p): run()'s bound call
    # keys its launch choices, not the key count (launch.Memo's free sizes), so after two
    # recordings that launch alike (Bound.same_but_sizes) it replays every count of the class,
    # its K / V descriptors expanded over each layer's base and count; a re-plan whose decodes
    # grew (more pages, more bytes) keeps the memo. Each call bit for bit against the full
    # path.
    d, kv_d = 128, [200, 517, 64, 128]  # (the last request's last page full at page 16 and 1)
    cache, kvi, idx, last, _, _ = make_paged(kv_d + [2 * page], HKV, d, d, page, dtype=BF16,
                                             seed=80)
    cache = cache.cuda()
    qd = _rand(len(kv_d), HQ, d, seed=81)
    layers = [(_rand(64, HQ, d, seed=82 + 3 * i), _rand(1200, HKV, d, seed=83 + 3 * i),
               _rand(1200, HKV, d, seed=84 + 3 * i)) for i in range(2)]
    w, ref = fi.PODWithPagedKVCacheWrapper(_ws()), fi.PODWithPagedKVCacheWrapper(_ws())
    n = int(kvi[4])

    def plan(wr, pages):  # the four decodes, the last one a key into ``pages`` more pages
        ind, lens = kvi[:5].clone(), last[:4].clone()
        ind[4] += pages
        if pages:
            lens[3] = 1
        wr.plan(ind.cuda(), idx[:n + pages].cuda(), lens.cuda(), HQ, HKV, d, page,
                q_data_type=BF16)

    counts = [320, 384, 448, 512, 576, 640, 1216, 704, 1024]

    def pages(step):  # the table outgrows the first plan's, then grows into its room
        return 0 if step < 2 else 1 if step < 4 else 2

    def call(wr, layer, kv):
        qp, kp, vp = layer
        return _flat(wr.run(qp, kp[:kv], vp[:kv], qd, cache, causal_p=True, return_lse_p=True,
                            return_lse_d=True))

    # (one policy version throughout: a bound call's key holds it, so the reference calls
    # come first, under their own override; planned without decode key chunks, whose merge
    # launch a call of another key count does not replay as it is)
    with policy.override(**policy.POD_FUSED, pod_chunks="off"):
        with policy.override(bound_launches=False):
            want = []
            for step, kv in enumerate(counts):
                plan(ref, pages(step))
                want.extend(call(ref, layer, kv) for layer in layers)
        got, recorded = [], []
        for step, kv in enumerate(counts):
            plan(w, pages(step))
            before = launch.recordings()
            for layer in layers:
                torch.full((1 << 24,), float("nan"), device="cuda")
                got.append(call(w, layer, kv))
            recorded.append(launch.recordings() - before)
    torch.cuda.synchronize()
    for i, (g, r) in enumerate(zip(got, want, strict=True)):
        for a, b in zip(g, r, strict=True):
            assert not a.float().isnan().any() and torch.equal(a, b), (i, counts[i // 2])
    # the first two counts record (the second found the first's launches alike), and two more
    # after the first re-plan, whose table outgrew the first's (a new memo); after them every
    # count replays
    assert recorded == [1, 1, 1, 1, 0, 0, 0, 0, 0], recorded
    assert any(b.generic for b in w._memo._bound.values() if isinstance(b, launch.Bound))
