"""Decode key chunks (POLICY.decode_chunks; compiled_attn/prefill.py _plan_chunks, ops/
decode_chunks.py) under the Triton interpreter, where the chunk requests run on the Triton
kernel: a paged wrapper's decode batch cut into chunks against a float64 reference on fresh
random inputs (outputs poisoned first), and against the same plan uncut; the bound run()'s
replay against its full path; the calls a chunk plan must not cut (sinks, a window passed to
run(), a traced run) against the uncut plan, bit for bit; CUDA-graph plans re-planned into
fixed chunk buffers; and the merge kernel (its padding rows included) against
compiled_attn.utils.merge_states, chunks that saw no key included. ``decode_chunks="always"``
cuts on this device, and chunks of 8 keys keep the shapes small."""

import pytest
import torch

import compiled_attn as ca
from compiled_attn.ops import decode_chunks
from compiled_attn.ops.policy import override
from compiled_attn.utils import merge_states
from tests.helpers import assert_lse, dense_batch, indptr, make_paged, rand

F32 = torch.float32
WS = torch.empty(16, dtype=torch.uint8)

# name: (qo_lens, kv_lens, page, Hq, Hkv, causal, dtype): odd lengths, a request without rows
# and a row without keys, page 1, GQA 7:1, one KV head, MHA
CASES = {
    "odd": ([1, 0, 1, 1, 1], [37, 20, 0, 61, 5], 4, 4, 2, True, F32),
    "page1-gqa7": ([1, 1], [45, 19], 1, 7, 1, False, torch.float16),
    "page16-mha": ([1, 1, 1], [70, 33, 128], 16, 2, 2, True, F32),
}


def _wrapper(qo, kv, page, hq, hkv, causal, dt, mode, seed=0, **plan):
    cache, kvi, idx, last, ks, vs = make_paged(kv, hkv, 16, 16, page, seed=seed, dtype=dt)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
    with override(decode_chunks=mode, decode_chunk_min_keys=8):
        w.plan(indptr(qo), kvi, idx, last, hq, hkv, 16, page, causal=causal, q_data_type=dt,
               **plan)
    return w, cache, ks, vs


@pytest.mark.parametrize("name", sorted(CASES))
def test_chunked_decode_matches_float64(name):
    qo, kv, page, hq, hkv, causal, dt = CASES[name]
    w, cache, ks, vs = _wrapper(qo, kv, page, hq, hkv, causal, dt, "always", seed=3)
    p = w._plan
    assert p.chunk_work is not None and int(p.chunk_merge[:, 2].max()) > 1
    assert p.chunk_merge.shape[0] == sum(qo)  # a merge row per row
    q = rand(sum(qo), hq, 16, seed=4, dtype=dt)
    out = torch.full((sum(qo), hq, 16), float("nan"), dtype=dt)
    lse = torch.full((sum(qo), hq), float("nan"))
    w.run(q, cache, out=out, lse=lse, return_lse=True)
    ref_out, ref_lse = dense_batch(q.double(), qo, ks, vs, causal=causal)
    own_out, _ = dense_batch(q.to(F32), qo, [k.to(F32) for k in ks], [v.to(F32) for v in vs],
                             causal=causal)
    own = (own_out.to(dt).double() - ref_out).abs().max().item()
    err = (out.double() - ref_out).abs().max().item()
    assert not out.isnan().any()
    # twice PyTorch's own error in this dtype (float32 compute, rounded to dt), plus one step
    # of dt at the output's scale: the chunks round their outputs to dt before the merge
    assert err <= 2 * own + torch.finfo(dt).eps * ref_out.abs().max().item() + 1e-6, (err, own)
    assert_lse(lse, ref_lse, dict(rtol=1e-5, atol=1e-5))
    # the same plan uncut: the split-free path (the interpreter never splits), within the bound
    w_off, *_ = _wrapper(qo, kv, page, hq, hkv, causal, dt, "off", seed=3)
    assert w_off._plan.chunk_work is None
    base = w_off.run(q, cache)
    assert (out.double() - base.double()).abs().max().item() <= 2 * max(err, own) + 1e-6


def test_chunk_plan_bound_run_replays_its_full_path():
    qo, kv, page, hq, hkv, causal, dt = CASES["odd"]
    w, cache, *_ = _wrapper(qo, kv, page, hq, hkv, causal, dt, "always", seed=5)
    q = rand(sum(qo), hq, 16, seed=6, dtype=dt)
    first = w.run(q, cache, return_lse=True)  # recorded: the row gather (the Triton kernel
    # takes no row map), the paged op, the merge
    second = w.run(q, cache, return_lse=True)  # replayed
    assert w._memo.records == 1 and w._memo.hits == 1 and w._memo.refused == 0
    with override(bound_launches=False):
        full = w.run(q, cache, return_lse=True)
    for a, b, c in zip(first, second, full):
        assert torch.equal(a, b) and torch.equal(a, c)
    # a replay writes fresh outputs every call
    assert second[0].data_ptr() != first[0].data_ptr()


@pytest.mark.parametrize("call", ["sinks", "window", "traced", "grad"])
def test_calls_a_chunk_plan_does_not_cut_run_uncut(call):
    """Sinks and a window passed to run() (the merge takes no sinks; a window counts from each
    chunk's own end), a traced run (the chunks' launches are eager only) and a q that requires
    grad (whose backward the op refuses) take the plan's uncut path: the same bits as the plan
    made with decode_chunks off."""
    qo, kv, page, hq, hkv, causal, dt = CASES["odd"]
    w, cache, *_ = _wrapper(qo, kv, page, hq, hkv, causal, dt, "always", seed=7)
    w_off, *_ = _wrapper(qo, kv, page, hq, hkv, causal, dt, "off", seed=7)
    assert w._plan.chunk_work is not None
    q = rand(sum(qo), hq, 16, seed=8, dtype=dt)
    if call == "sinks":
        s = rand(hq, seed=9, dtype=F32)
        got, want = (x.run(q, cache, sinks=s, return_lse=True) for x in (w, w_off))
    elif call == "window":
        got, want = (x.run(q, cache, window_left=6, return_lse=True) for x in (w, w_off))
    elif call == "grad":
        qg = q.clone().requires_grad_()
        got, want = (x.run(qg, cache, return_lse=True) for x in (w, w_off))
        with pytest.raises(RuntimeError, match="backward"):
            got[0].sum().backward()
        got, want = [t.detach() for t in got], [t.detach() for t in want]
    else:
        got = torch.compile(lambda a, c: w.run(a, c, return_lse=True), backend="eager",
                            fullgraph=True)(q, cache)
        want = w_off.run(q, cache, return_lse=True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


@pytest.mark.parametrize("plan", [dict(disable_split_kv=True), dict(fixed_split_size=2),
                                  dict(pos_encoding_mode="ROPE_LLAMA"), dict(window_left=4),
                                  dict(logits_soft_cap=5.0)])
def test_plans_that_are_not_cut(plan):
    """disable_split_kv and fixed_split_size (batch-invariant plans), and options whose chunks
    would differ (positions and windows count from a chunk's own end) or leave the Gluon
    kernel's scope, are never cut; nor is a batch with a multi-row request."""
    qo, kv, page, hq, hkv, causal, dt = CASES["odd"]
    w, *_ = _wrapper(qo, kv, page, hq, hkv, causal, dt, "always", **plan)
    assert w._plan.chunk_work is None
    w, *_ = _wrapper([2, 1], [40, 40], page, hq, hkv, causal, dt, "always")
    assert w._plan.chunk_work is None


def test_cuda_graph_plans_refill_their_chunk_buffers():
    """use_cuda_graph=True: a first plan that is cut fixes the chunk buffers; re-plans with
    other lengths, a request without rows, a two-row request (kept whole) and
    disable_split_kv (one chunk a request) fill the same buffers, padded, and each run()
    against float64 (q with a row past the plan's, as a captured buffer has). A wrapper whose
    first plan is not cut never cuts."""
    from compiled_attn.prefill import _CHUNK_FIELDS
    from tests.helpers import paged_graph_bufs

    page, hq, hkv, d, b, dt = 4, 4, 2, 16, 3, F32
    plans = [([1, 1, 1], [100, 37, 0], {}), ([1, 0, 1], [20, 5, 300], {}),
             ([2, 1, 0], [40, 9, 17], {}), ([1, 1, 1], [50, 50, 50], dict(disable_split_kv=True))]
    w = ca.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(b, 128))
    first = None
    for seed, (qo, kv, extra) in enumerate(plans):
        cache, kvi, idx, last, ks, vs = make_paged(kv, hkv, d, d, page, seed=80 + seed)
        with override(decode_chunks="always", decode_chunk_min_keys=8):
            w.plan(indptr(qo), kvi, idx, last, hq, hkv, d, page, causal=True, q_data_type=dt,
                   **extra)
        p = w._plan
        ptrs = [getattr(p, f).data_ptr() for f in _CHUNK_FIELDS]
        first = first or ptrs
        assert ptrs == first  # what a captured run() reads
        merges = p.chunk_merge[p.chunk_merge[:, 0] >= 0]
        assert merges.shape[0] == sum(qo)
        if seed == 0:
            assert int(merges[:, 2].max()) > 1
        if extra:
            assert bool((merges[:, 2] == 1).all())
        q = rand(sum(qo) + 1, hq, d, seed=90 + seed, dtype=dt)
        out, lse = w.run(q, cache.to(dt), return_lse=True)
        ref_out, ref_lse = dense_batch(q[:sum(qo)].double(), qo, ks, vs, causal=True)
        torch.testing.assert_close(out[:sum(qo)].double(), ref_out, rtol=1e-5, atol=1e-5)
        assert_lse(lse[:sum(qo)], ref_lse, dict(rtol=1e-4, atol=1e-4))
    w = ca.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(b, 128))
    for qo, kv, extra in (plans[3], plans[0]):
        cache, kvi, idx, last, *_ = make_paged(kv, hkv, d, d, page)
        with override(decode_chunks="always", decode_chunk_min_keys=8):
            w.plan(indptr(qo), kvi, idx, last, hq, hkv, d, page, causal=True, q_data_type=dt,
                   **extra)
        assert w._plan.chunk_work is None


def test_merge_chunks_is_merge_states_with_unseen_chunks():
    """Merge rows of 1 to 5 chunks (at most MAX_CHUNKS), chunks of LSE -inf among them and a
    row of only such chunks, into out rows in another order: merge_states' numbers."""
    h, d = 3, 24  # (a head dim that is not a power of two)
    counts = [4, 1, 5, 2]
    g = torch.Generator().manual_seed(1)
    r = sum(counts)
    o = torch.randn(r, h, d, generator=g)
    lse = torch.randn(r, h, generator=g) * 3
    lse[0:2] = float("-inf")  # chunks that saw no key
    lse[5:10, 1] = float("-inf")  # a row (head 1) whose chunks saw none
    o[lse == float("-inf")] = 0
    firsts = [0, 4, 5, 10]
    rows = [2, 0, 3, 1]
    merge = torch.tensor(list(zip(rows, firsts, counts)) + [(-1, 0, 0)], dtype=torch.int32)
    out, out_lse = decode_chunks.merge_chunks(o, lse, merge, 5)
    out[4], out_lse[4] = 7.0, 7.0  # row 4: no merge row names it (only the padding row)
    merge[-1, 0] = -1
    out, out_lse = out.clone(), out_lse.clone()
    decode_chunks._merge_chunks[(merge.shape[0], h)](
        merge, o, lse, out, out_lse, out.stride(0), out.stride(1), out_lse.stride(0),
        out_lse.stride(1), HQ=h, D=d, BLOCK_C=16, BLOCK_D=32)
    assert bool((out[4] == 7.0).all()) and bool((out_lse[4] == 7.0).all())
    for row, first, n in zip(rows, firsts, counts):
        v, s = merge_states(o[first:first + n].unsqueeze(0).double(),
                            lse[first:first + n].unsqueeze(0).double())
        assert not out[row].isnan().any()
        assert (out[row].double() - v[0]).abs().max().item() <= 4 * torch.finfo(F32).eps * (
            v.abs().max().item() + 1)
        assert_lse(out_lse[row:row + 1], s.double(), dict(rtol=1e-6, atol=1e-6))
    assert torch.equal(out[3, 1], torch.zeros(d)) and out_lse[3, 1] == float("-inf")


def test_gather_rows():
    q = rand(5, 3, 24, seed=2, dtype=F32)[:, :, :20]  # (strided rows and heads)
    src = torch.tensor([4, 4, 0, 2], dtype=torch.int32)
    got = decode_chunks.gather_rows(q, src)
    assert got.is_contiguous() and torch.equal(got, q[src.long()])
    # a head dim of stride 2 (it was read as unit stride: a decode batch's q sliced every
    # other element gave wrong numbers through the chunks, and only there)
    q2 = rand(5, 3, 40, seed=3, dtype=F32)[:, :, ::2]
    assert torch.equal(decode_chunks.gather_rows(q2, src), q2[src.long()])


def test_chunked_decode_takes_a_strided_head_dim():
    """A decode batch whose q has a head-dim stride of 2, through the chunks: the numbers of
    the contiguous q."""
    qo, kv, page, hq, hkv, causal, dt = CASES["odd"]
    w, cache, ks, vs = _wrapper(qo, kv, page, hq, hkv, causal, dt, "always", seed=5)
    assert w._plan.chunk_work is not None
    q = rand(sum(qo), hq, 16, seed=6, dtype=dt)
    q2 = torch.full((sum(qo), hq, 32), float("nan"), dtype=dt)[:, :, ::2]
    q2.copy_(q)
    assert q2.stride(-1) == 2
    o1, l1 = w.run(q, cache, return_lse=True)
    o2, l2 = w.run(q2, cache, return_lse=True)
    assert torch.equal(o1, o2) and torch.equal(l1, l2)


def test_replans_between_cut_and_uncut_plans_compute_each_plans_numbers():
    """One wrapper re-planned through cut, uncut and cut plans of the same and of other
    values (a plan copies only the index arrays whose values the last plan did not write,
    the chunk arrays included: _host.to_device's sent): each run() gives a fresh wrapper's
    bits for that plan."""
    qo, kv, page, hq, hkv, causal, dt = CASES["odd"]
    q = rand(sum(qo), hq, 16, seed=60, dtype=dt)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD")
    steps = [("always", kv, 61), ("always", kv, 61), ("off", kv, 61), ("always", kv, 61),
             ("always", [37, 20, 0, 63, 5], 62)]
    for mode, lens, seed in steps:
        cache, kvi, idx, last, _, _ = make_paged(lens, hkv, 16, 16, page, seed=seed, dtype=dt)
        with override(decode_chunks=mode, decode_chunk_min_keys=8):
            w.plan(indptr(qo), kvi, idx, last, hq, hkv, 16, page, causal=causal,
                   q_data_type=dt)
            fresh, *_ = _wrapper(qo, lens, page, hq, hkv, causal, dt, mode, seed=seed)
        assert (w._plan.chunk_work is None) == (mode == "off")
        got, want = w.run(q, cache, return_lse=True), fresh.run(q, cache, return_lse=True)
        for a, b in zip(got, want):
            assert not a.isnan().any() and torch.equal(a, b), (mode, lens)
