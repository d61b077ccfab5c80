"""compiled_attn.cp on CPU: the head-tail layout in one process, and context-parallel prefill in
gloo groups of 2 and 3 spawned ranks (127.0.0.1 only) on the reference path, against the same
op on the whole sequence in one process and a float64 oracle.

Each group size is one spawn that runs every case (process start and imports dominate); a case's
failure on any rank is recorded and reported by its own test. The CPU reference is not
bit-reproducible across call shapes (its matrix products block differently), so the all-gather
method is held to a few float32 roundings here; bitwise equality with the single-GPU op is a GPU
test (tests/test_cp_gpu.py).
"""

from __future__ import annotations

import zlib

import pytest
import torch

from compiled_attn import cp
from compiled_attn.ops import reference
from tests.helpers import _free_port, _worker, run_ranks  # noqa: F401

D = 16
# name -> (indptr, Hq, Hkv, causal, method, options)
CASES = {
    "gqa_causal_all_gather": ([0, 24], 4, 2, True, "all_gather", {}),
    "gqa_causal_two_slices": ([0, 24], 4, 2, True, "all_gather", {"head_slices": 2}),
    "mha_causal_ring": ([0, 24], 2, 2, True, "ring", {}),
    "mha_causal_auto": ([0, 24], 2, 2, True, "auto", {}),
    "uneven_all_gather": ([0, 23], 4, 2, True, "all_gather", {}),
    "uneven_ring": ([0, 23], 2, 2, True, "ring", {}),
    "docs_all_gather": ([0, 5, 5, 18, 19], 4, 2, True, "all_gather", {}),
    "docs_ring": ([0, 5, 5, 18, 19], 2, 2, True, "ring", {}),
    "docs_noncausal_all_gather": ([0, 5, 5, 18, 19], 4, 1, False, "all_gather", {}),
    "docs_noncausal_ring": ([0, 5, 5, 18, 19], 2, 2, False, "ring", {}),
    "short_docs_ring": ([0, 1, 3], 2, 2, True, "ring", {}),
    "window_cap_all_gather": ([0, 23], 4, 2, True, "all_gather",
                              {"window_left": 3, "logits_soft_cap": 5.0}),
    "gqa_ring": ([0, 7, 24], 4, 2, True, "ring", {"sm_scale": 0.3}),
    "fp16_ring": ([0, 24], 2, 2, True, "ring", {"dtype": torch.float16}),
}
SINGLETON = ("docs_all_gather", "docs_ring")  # also run on one-rank groups (N = 1)
# also under torch.compile(fullgraph=True) and torch.export: the ring on 2 ranks, the
# all-gather on 3
COMPILED = {2: "docs_ring", 3: "docs_all_gather"}


def _params(opts: dict, causal: bool) -> dict:
    return dict(mask_mode=1 if causal else 0, window_left=opts.get("window_left", -1),
                chunk_size=0, sm_scale=opts.get("sm_scale", D ** -0.5),
                logits_soft_cap=opts.get("logits_soft_cap", 0.0), pos_encoding_mode=0,
                rope_scale=1.0, rope_theta=1e4, v_scale=1.0)


def _whole(q, k, v, indptr, causal, opts, dtype):
    """(the op on the whole sequence in this dtype, the float64 oracle)."""
    ip = torch.tensor(indptr, dtype=torch.int32)
    p = _params(opts, causal)
    one = torch.ops.compiled_attn.batch_ragged_prefill(
        q, k, v, ip, ip, torch.zeros(0, 2, dtype=torch.int32), None, None, None, None, 64,
        p["mask_mode"], p["window_left"], 0, p["sm_scale"], p["logits_soft_cap"], 0, 1.0, 1e4,
        1.0, dtype)
    ref = reference.batch_ragged_prefill(q.double(), k.double(), v.double(), ip, ip, None,
                                         None, None, None, out_dtype=torch.float64, **p)
    return one, ref


def _gathered(t, world, group, indptr):
    import torch.distributed as dist

    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous(), group=group)
    return cp.unshard(torch.cat(parts), world, indptr=indptr)


def _check(name, out, lse, ql, lay, rank, world, group, indptr, q, k, v, causal, method, opts,
           dtype):
    assert out.shape == ql.shape[:2] + (v.shape[-1],) and lse.shape == ql.shape[:2]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert not out.isnan().any() and not lse.isnan().any(), "NaN"
    # padding rows: output 0, LSE -inf
    pad = torch.ones(lay.local_len, dtype=torch.bool)
    for b in range(len(lay.lengths)):
        start = lay.local_starts[b]
        pad[start:start + lay.real_rows(b, rank)] = False
    assert torch.all(out[pad] == 0) and torch.all(lse[pad] == float("-inf")), "padding rows"
    o = _gathered(out, world, group, indptr)
    s = _gathered(lse, world, group, indptr)
    (one_o, one_s), (r_o, r_s) = _whole(q, k, v, indptr, causal, opts, dtype)
    fin = torch.isfinite(r_s)
    assert torch.equal(torch.isfinite(s), fin), "rows that see no key differ"
    assert torch.all(o[~fin] == 0)
    eps = torch.finfo(dtype).eps
    scale = r_o.abs().max().item() if r_o.numel() else 0.0
    if method == "all_gather" or (method == "auto" and q.shape[1] > k.shape[1]):
        diff = (o.double() - one_o.double()).abs().max().item() if o.numel() else 0.0
        assert diff <= 4 * eps * scale, f"all-gather vs the whole-sequence op: {diff:.3g}"
        sdiff = (s[fin] - one_s[fin]).abs().max().item() if fin.any() else 0.0
        assert sdiff <= 4 * torch.finfo(torch.float32).eps * max(1.0, r_s[fin].abs().max()), sdiff
    err = (o.double() - r_o).abs().max().item() if o.numel() else 0.0
    own = (one_o.double() - r_o).abs().max().item() if o.numel() else 0.0
    assert err <= 2 * own + eps * scale + 1e-7, f"error {err:.3g} vs the op's own {own:.3g}"
    lerr = (s[fin].double() - r_s[fin]).abs().max().item() if fin.any() else 0.0
    lown = (one_s[fin].double() - r_s[fin]).abs().max().item() if fin.any() else 0.0
    assert lerr <= 2 * lown + 1e-5, f"LSE error {lerr:.3g} vs the op's own {lown:.3g}"


def _run_case(name, spec, rank, world, group, compiled=False):
    indptr, hq, hkv, causal, method, opts = spec
    opts = dict(opts)
    dtype = opts.pop("dtype", torch.float32)
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    n = indptr[-1]
    q, k, v = (torch.randn(n, h, D, generator=g).to(dtype) for h in (hq, hkv, hkv))
    ql, kl, vl = (cp.shard(t, world, rank, indptr=indptr) for t in (q, k, v))
    lay = cp.Layout.of(world, indptr=indptr)

    def run(a, b, c):
        return cp.prefill(a, b, c, group=group, indptr=indptr, causal=causal, method=method,
                          **opts)

    out, lse = run(ql, kl, vl)
    _check(name, out, lse, ql, lay, rank, world, group, indptr, q, k, v, causal, method, opts,
           dtype)
    if compiled:
        torch._dynamo.reset()
        c_out, c_lse = torch.compile(run, fullgraph=True, backend="aot_eager")(ql, kl, vl)
        torch.testing.assert_close(c_out, out, atol=1e-6, rtol=0)
        torch.testing.assert_close(c_lse, lse, atol=1e-6, rtol=0)

        class Attn(torch.nn.Module):
            def forward(self, a, b, c):
                return run(a, b, c)

        ep = torch.export.export(Attn(), (ql, kl, vl))
        assert any("_c10d_functional" in str(n.target) for n in ep.graph.nodes)
        e_out, e_lse = ep.module()(ql, kl, vl)
        torch.testing.assert_close(e_out, out, atol=1e-6, rtol=0)
        torch.testing.assert_close(e_lse, lse, atol=1e-6, rtol=0)
        _check_as_op(run, out, lse, ql, kl, vl, group, indptr, causal, method, opts)


def _check_as_op(run, out, lse, ql, kl, vl, group, indptr, causal, method, opts):
    """as_op=True: the same results eagerly, compiled (one cp_prefill node, no collective
    nodes) and exported; the op's fake and schema pass torch.library.opcheck."""
    def run_op(a, b, c):
        return cp.prefill(a, b, c, group=group, indptr=indptr, causal=causal, method=method,
                          as_op=True, **opts)

    for o, s in (run_op(ql, kl, vl),
                 torch.compile(run_op, fullgraph=True, backend="aot_eager")(ql, kl, vl)):
        assert torch.equal(o, out) and torch.equal(s, lse)
    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(run_op, fullgraph=True, backend=keep)(ql, kl, vl)
    targets = [str(n.target) for g in graphs for n in g.graph.nodes]
    assert sum("cp_prefill" in t for t in targets) == 1
    assert not any("c10d" in t for t in targets)

    class Attn(torch.nn.Module):
        def forward(self, a, b, c):
            return run_op(a, b, c)

    ep = torch.export.export(Attn(), (ql, kl, vl))
    assert sum("cp_prefill" in str(n.target) for n in ep.graph.nodes) == 1
    e_out, e_lse = ep.module()(ql, kl, vl)
    assert torch.equal(e_out, out) and torch.equal(e_lse, lse)
    lay = cp.Layout.of(int(torch.distributed.get_world_size(group)), indptr=indptr)
    torch.library.opcheck(
        torch.ops.compiled_attn.cp_prefill.default,
        (ql, kl, vl, group.group_name, list(lay.lengths), method, causal,
         opts.get("sm_scale") or D ** -0.5, opts.get("window_left", -1),
         opts.get("logits_soft_cap") or 0.0, 1),
        test_utils=("test_schema", "test_faketensor", "test_autograd_registration"))


def _errors(rank, world, group):
    """Bad arguments raise with the argument's name (on every rank alike)."""
    x = torch.randn(4, 2, D)
    with pytest.raises(ValueError, match="method"):
        cp.prefill(x, x, x, group=group, method="tree")
    with pytest.raises(NotImplementedError, match="window_left"):
        cp.prefill(x, x, x, group=group, method="ring", causal=True, window_left=2)
    with pytest.raises(NotImplementedError, match="window_left"):
        cp.prefill(x, x, x, group=group, causal=False, window_left=2)
    with pytest.raises(ValueError, match="local rows"):
        cp.prefill(x, x, x, group=group, indptr=[0, 100], causal=True)
    with pytest.raises(ValueError, match="head_slices"):
        cp.prefill(x, x, x, group=group, method="all_gather", head_slices=3)
    with pytest.raises(ValueError, match="group"):
        cp.prefill(x, x, x, group=None)
    with pytest.raises(TypeError, match="as_op"):
        cp.prefill(x, x, x, group=group, as_op="yes")
    with pytest.raises(TypeError, match="causal: got 'no'"):  # (it was read as truthy)
        cp.prefill(x, x, x, group=group, causal="no")


def _new_lengths(rank, world, group):
    """Compiled with torch's default (automatic dynamic shapes) and with dynamic=True: each new
    length compiles again and gives the eager call's bits."""
    def run(a, b, c):
        return cp.prefill(a, b, c, group=group, causal=True, method="ring")

    for dynamic in (None, True):
        torch._dynamo.reset()
        f = torch.compile(run, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        for n in (24, 32, 40):
            g = torch.Generator().manual_seed(n)
            ql, kl, vl = (cp.shard(torch.randn(n, 2, D, generator=g), world, rank)
                          for _ in range(3))
            (o, lse), (r, rlse) = f(ql, kl, vl), run(ql, kl, vl)
            assert torch.equal(o, r) and torch.equal(lse, rlse), (dynamic, n)

    def run_docs(a, b, c, indptr):  # new document lengths in the list, same local rows
        return cp.prefill(a, b, c, group=group, indptr=indptr, causal=True, method="ring")

    for dynamic in (None, True):
        torch._dynamo.reset()
        f = torch.compile(run_docs, fullgraph=True, backend="aot_eager", dynamic=dynamic)
        for indptr in ([0, 10, 24], [0, 14, 24], [0, 3, 24]):
            g = torch.Generator().manual_seed(indptr[1])
            ql, kl, vl = (cp.shard(torch.randn(24, 2, D, generator=g), world, rank,
                                   indptr=indptr) for _ in range(3))
            (o, lse), (r, rlse) = f(ql, kl, vl, indptr), run_docs(ql, kl, vl, indptr)
            assert torch.equal(o, r) and torch.equal(lse, rlse), (dynamic, indptr)


def _ring_partials(rank, world, group):
    """The ring's steps ask the op for float32 outputs, merged in float32 and rounded to q's
    dtype once (they were rounded each step: a larger error than the one-launch op's); the
    all-gather's one launch writes q's dtype."""
    seen = []
    real = cp._attend

    def spy(*a, **kw):
        out = real(*a, **kw)
        seen.append(out[0].dtype)
        return out

    cp._attend = spy
    try:
        x = cp.shard(torch.randn(24, 2, D, generator=torch.Generator().manual_seed(5),
                                 dtype=torch.float16), world, rank)
        for method, want in (("ring", torch.float32), ("all_gather", torch.float16)):
            seen.clear()
            o, _ = cp.prefill(x, x, x, group=group, causal=True, method=method)
            assert o.dtype == torch.float16 and seen and set(seen) == {want}, (method, seen)
    finally:
        cp._attend = real


def _cpu_cases(rank, world, attempt):
    """Every CPU case on this rank of a gloo group of ``world`` ranks."""
    import torch.distributed as dist

    singles = [dist.new_group([r]) for r in range(world)]
    for name, spec in CASES.items():
        attempt(name, lambda: _run_case(name, spec, rank, world, dist.group.WORLD))
    for name in SINGLETON:
        attempt(f"{name}@1", lambda: _run_case(name, CASES[name], 0, 1, singles[rank]))
    name = COMPILED[world]
    attempt(f"{name}@compiled",
            lambda: _run_case(name, CASES[name], rank, world, dist.group.WORLD, True))
    attempt("errors", lambda: _errors(rank, world, dist.group.WORLD))
    attempt("ring_partials_float32", lambda: _ring_partials(rank, world, dist.group.WORLD))
    if world == 2:
        attempt("new_lengths_compiled", lambda: _new_lengths(rank, world, dist.group.WORLD))


_RESULTS: dict = {}


def _results(world: int) -> dict:
    """The CPU cases' results in a group of ``world`` ranks, spawned once per group size."""
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_cpu_cases, world)
    return _RESULTS[world]


KEYS = (list(CASES) + [f"{n}@1" for n in SINGLETON]
        + [f"{n}@compiled" for n in sorted(set(COMPILED.values()))]
        + ["errors", "ring_partials_float32", "new_lengths_compiled"])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("key", KEYS)
def test_prefill(world, key):
    if key.endswith("@compiled") and key != f"{COMPILED[world]}@compiled":
        pytest.skip(f"compiled for {COMPILED[world]} on {world} ranks (CI time)")
    if key == "new_lengths_compiled" and world != 2:
        pytest.skip("run on 2 ranks (CI time)")
    res = _results(world)
    assert key in res, f"{key} did not run"
    assert res[key] is None, res[key]


# --------------------------------------------------------------------------------------------
# layout, in one process
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 3])
@pytest.mark.parametrize("indptr", [[0, 24], [0, 23], [0, 5, 5, 18, 19], [0, 1], [0]])
def test_shard_unshard_round_trip(world, indptr):
    x = torch.randn(indptr[-1], 3)
    lay = cp.Layout.of(world, indptr=indptr)
    parts = [cp.shard(x, world, r, indptr=indptr) for r in range(world)]
    assert all(p.shape == (lay.local_len, 3) for p in parts)
    assert torch.equal(cp.unshard(torch.cat(parts), world, indptr=indptr), x)
    # every token once, padding zeros: the parts hold x's tokens and nothing else
    assert sum(int((p != 0).any(1).sum()) for p in parts) == indptr[-1]


def test_auto_method_takes_the_all_gather_for_head_slices():
    """head_slices apply to the all-gather only: "auto" takes it for MHA where they are asked
    (it took the ring, which then refused them, naming a method the caller had not chosen)."""
    assert cp._method("auto", 4, 4, True, -1) == "ring"
    assert cp._method("auto", 4, 4, True, -1, sliced=True) == "all_gather"
    assert cp._method("auto", 8, 2, True, -1) == "all_gather"


def test_shard_matches_torch_head_tail_order():
    lb = pytest.importorskip(
        "torch.distributed.tensor.experimental._context_parallel._load_balancer")
    for world, n in ((2, 8), (3, 24), (4, 32)):
        x = torch.arange(n)
        idx = lb._HeadTailLoadBalancer(n, world, "cpu")._generate_indices()[0]
        theirs = x[idx.long()].chunk(world)
        for r in range(world):
            assert torch.equal(cp.shard(x, world, r), theirs[r])


def test_shard_along_dim_and_packed_doc_order():
    x = torch.arange(2 * 10).reshape(2, 10)
    # documents of 4 and 6 tokens over 2 ranks: chunks of 1 and 2 tokens (the second padded)
    r0 = cp.shard(x, 2, 0, indptr=[0, 4, 10], dim=1)
    assert r0[0].tolist() == [0, 3, 4, 5, 0, 0]  # doc0 chunk 0 | chunk 3, doc1 chunk 0 | chunk 3
    r1 = cp.shard(x, 2, 1, indptr=[0, 4, 10], dim=1)
    assert r1[0].tolist() == [1, 2, 6, 7, 8, 9]
    back = cp.unshard(torch.cat([r0, r1], 1), 2, indptr=[0, 4, 10], dim=1)
    assert torch.equal(back, x)


def test_layout_errors():
    with pytest.raises(ValueError, match="indptr"):
        cp.Layout.of(2, indptr=[0, 5, 3])
    for bad in ([0, 4.7, 10], [0, True, 10]):  # (a float entry was truncated)
        with pytest.raises(TypeError, match="indptr: got .*; pass ints"):
            cp.Layout.of(2, indptr=bad)
    for bad in (True, 1.0, "1"):  # (a type, not a range: ValueError said 0 <= rank)
        with pytest.raises(TypeError, match=r"rank: got .*\(\w+\); pass an int"):
            cp.shard(torch.zeros(8), 2, bad)
    # an integer type is an int (world_size takes them too)
    assert torch.equal(cp.shard(torch.arange(8.0), 2, torch.tensor(1)),
                       cp.shard(torch.arange(8.0), 2, 1))
    with pytest.raises(ValueError, match="rank"):
        cp.shard(torch.zeros(8), 2, 2)
    with pytest.raises(ValueError, match="x"):
        cp.shard(torch.zeros(8), 2, 0, indptr=[0, 9])
    for fn in (lambda x, d: cp.shard(x, 2, 0, dim=d), lambda x, d: cp.unshard(x, 2, dim=d,
                                                                               seq_len=8)):
        for x, d in ((torch.zeros(8), 1), (torch.zeros(8, 2), -3), (torch.tensor(1.0), 0)):
            with pytest.raises(ValueError, match=r"dim: got -?\d for x of \d dims"):
                fn(x, d)  # (an IndexError named nothing)
    with pytest.raises(ValueError, match="lengths: got -3"):
        cp.Layout(2, [-3])
    with pytest.raises(ValueError, match="rank order"):
        cp.unshard(torch.zeros(7), 2, seq_len=8)
    with pytest.raises(ValueError, match="seq_len"):
        cp.unshard(torch.zeros(8), 2)


def test_ring_merge_step_matches_merge_state():
    """The ring's merge (_merge_step: the first step's output in q's dtype, later ones into a
    float32 accumulator) against merge_state on float32 copies; rows where both LSEs are -inf
    give 0 / -inf, a NaN LSE gives NaN."""
    from compiled_attn.utils import merge_state

    g = torch.Generator().manual_seed(5)
    o_a = torch.randn(6, 3, 8, generator=g).to(torch.bfloat16)
    o_b = torch.randn(6, 3, 8, generator=g).to(torch.bfloat16)
    s_a, s_b = torch.randn(6, 3, generator=g) * 4, torch.randn(6, 3, generator=g) * 4
    s_a[0, 0] = s_b[0, 0] = float("-inf")  # no key on either side
    s_a[1, 1] = float("-inf")  # one side only
    s_b[2, 2] = float("nan")
    want_v, want_s = merge_state(o_a.float(), s_a, o_b.float(), s_b)
    got_v, got_s = cp._merge_step(o_a, s_a, o_b, s_b)
    assert got_v.dtype == torch.float32
    torch.testing.assert_close(got_v, want_v, rtol=1e-6, atol=1e-6, equal_nan=True)
    torch.testing.assert_close(got_s, want_s, equal_nan=True)
    assert got_v[0, 0].eq(0).all() and got_s[0, 0] == float("-inf")
    assert got_v[2, 2].isnan().all() and got_s[2, 2].isnan()
    acc = got_v.clone()  # a float32 accumulator merges in place
    v2, s2 = cp._merge_step(acc, got_s, o_a, s_a)
    assert v2.data_ptr() == acc.data_ptr()
    want2 = merge_state(want_v, want_s, o_a.float(), s_a)
    torch.testing.assert_close(v2, want2[0], rtol=1e-6, atol=1e-6, equal_nan=True)


def test_index_cache_reused_per_request_list():
    """A repeated launch over the same requests (every head slice, every layer) reuses its
    index tensors; other requests or tile heights get their own."""
    cp._INDEX_CACHE.clear()
    a = cp._indices((4, 4), (4, 12), 2, 16, torch.device("cpu"))
    assert cp._indices((4, 4), (4, 12), 2, 16, torch.device("cpu")) is a
    b = cp._indices((4, 4), (4, 11), 2, 16, torch.device("cpu"))
    assert b is not a and cp._indices((4, 4), (4, 12), 2, 32, torch.device("cpu")) is not a
    assert a[0].tolist() == [0, 4, 8] and a[1].tolist() == [0, 4, 16]
    assert a[2].dtype == torch.int32 and a[2].shape[1] == 2


def test_prefill_refuses_cuda_graph_capture(monkeypatch):
    """Under CUDA-graph capture cp.prefill raises, naming why (its collectives and cached index
    tensors are not captured), before touching the group."""
    monkeypatch.setattr(cp, "_capturing", lambda dev: True)
    x = torch.randn(4, 2, D)
    with pytest.raises(NotImplementedError, match="CUDA-graph capture"):
        cp.prefill(x, x, x, group=None, causal=True)



def _fake_spawn(monkeypatch, exits):
    """torch.multiprocessing.spawn replaced: each call takes the next of ``exits`` (a signal
    name, "" for a rank that exited with an error code, or None for a group whose every rank
    passed: each records {"ran": None}). Returns the list of calls made."""
    import torch.multiprocessing as mp

    calls = []

    def spawn(fn, args, nprocs, join):
        calls.append(nprocs)
        sig = exits[len(calls) - 1]
        if sig is not None:
            raise mp.ProcessExitedException(
                f"process 0 terminated with {sig or 'exit code 1'}", error_index=0,
                error_pid=1, exit_code=-6 if sig else 1, signal_name=sig or None)
        for rank in range(nprocs):
            args[-1].put((rank, {"ran": None}))
    monkeypatch.setattr(mp, "spawn", spawn)
    return calls


def test_run_ranks_spawns_a_crashed_group_once_more(monkeypatch):
    """A rank killed by a signal costs one re-spawn, with a warning naming the signal, and the
    second spawn's results are the ones returned; a second crash, or a rank that exited with
    an error code, raises."""
    import torch.multiprocessing as mp

    calls = _fake_spawn(monkeypatch, ["SIGABRT", None])
    with pytest.warns(UserWarning, match="died by SIGABRT"):
        assert run_ranks(None, 2) == {"ran": None}
    assert calls == [2, 2]
    calls = _fake_spawn(monkeypatch, ["SIGSEGV", "SIGABRT"])
    with pytest.warns(UserWarning, match="died by SIGSEGV"), \
            pytest.raises(mp.ProcessExitedException, match="SIGABRT"):
        run_ranks(None, 2)
    calls = _fake_spawn(monkeypatch, [""])
    with pytest.raises(mp.ProcessExitedException, match="exit code 1"):
        run_ranks(None, 2)
    assert calls == [2]
