"""Bound launches (ops/launch.py) under the Triton interpreter: the first eager call with a given
metadata records its launches, a later call with the same metadata and fresh tensors replays
them, and the replay's outputs equal the full path's bit for bit (the policy's bound_launches
off). What the key holds (aliasing, strides, the policy) and what the recorder refuses are
pinned here too."""

import gc
import weakref

import pytest
import torch

from compiled_attn.ops import choose
import compiled_attn as fi
from compiled_attn import op_call
from compiled_attn.ops import launch, policy
from compiled_attn.ops import contracts as C
from compiled_attn.ops.schedule import build_split_work
from tests import kernel_cases as kc
from tests.helpers import POD_LAUNCHES, WS, indptr, make_paged, rand

F16, F32 = torch.float16, torch.float32
QO, KV = [5, 0, 9], [13, 7, 9]
HQ, HKV, D = 4, 2, 32


def _args(c, p):
    tail = (p["mask_mode"], p["window_left"], p["chunk_size"], p["sm_scale"],
            p["logits_soft_cap"], p["pos_encoding_mode"], p["rope_scale"], p["rope_theta"],
            p["v_scale"], None)
    if c.kind == "single":
        return "single_prefill", (c.q, c.k, c.v, c.packed_mask, c.alibi, c.sinks, *tail), {}
    if c.kind == "ragged":
        return "batch_ragged_prefill", (c.q, c.k, c.v, c.qo_indptr, c.kv_indptr, c.work,
                                        c.packed_mask, c.mask_indptr, c.alibi, c.sinks,
                                        c.block_m, *tail), {"merge": c.merge}
    return "batch_paged_prefill", (c.q, c.k, c.v, c.qo_indptr, c.kv_indptr, c.page_indices,
                                   c.last_page_len, c.work, c.packed_mask, c.mask_indptr,
                                   c.alibi, c.sinks, c.block_m, *tail), {"merge": c.merge}


def _twice(make, p, cache):
    """Record with one case, replay with a fresh one of the same metadata; returns the replay's
    outputs and the full path's on the same inputs."""
    name, args, kw = _args(make(seed=1), p)
    op_call.call_op(name, *args, launches=cache, **kw)
    assert cache.records == 1 and cache.hits == 0
    name, args, kw = _args(make(seed=2), p)
    for t in args:  # poison nothing the op reads; the outputs are fresh
        assert not (isinstance(t, torch.Tensor) and t.is_floating_point() and t.isnan().any())
    got = op_call.call_op(name, *args, launches=cache, **kw)
    assert cache.hits == 1, "the second call did not replay"
    with policy.override(bound_launches=False):
        want = op_call.call_op(name, *args, **kw)
    return got, want


CASES = {
    "single causal": (lambda seed: kc.make_case("single", [9], [13], HQ, HKV, D, seed=seed),
                      dict()),
    "single HND window soft cap": (
        lambda seed: kc.make_case("single", [9], [17], HQ, HKV, D, layout="HND", seed=seed),
        dict(window_left=5, logits_soft_cap=20.0)),
    "single custom mask alibi sinks": (
        lambda seed: kc.make_case("single", [7], [11], HQ, HKV, D, custom_mask=True, alibi=True,
                                  sinks=True, seed=seed),
        dict(mask_mode=C.MASK_CUSTOM, pos_encoding_mode=C.POS_ALIBI)),
    "single rope": (lambda seed: kc.make_case("single", [9], [13], HQ, HKV, D, seed=seed),
                    dict(pos_encoding_mode=C.POS_ROPE_LLAMA)),
    "ragged causal": (lambda seed: kc.make_case("ragged", QO, KV, HQ, HKV, D, seed=seed), dict()),
    "ragged custom mask": (
        lambda seed: kc.make_case("ragged", QO, KV, HQ, HKV, D, custom_mask=True, seed=seed),
        dict(mask_mode=C.MASK_CUSTOM)),
    "paged page 4": (lambda seed: kc.make_case("paged", QO, KV, HQ, HKV, D, page_size=4,
                                               seed=seed), dict()),
    "paged page 1 tuple": (lambda seed: kc.make_case("paged", QO, KV, HQ, HKV, D, page_size=1,
                                                     tuple_cache=True, seed=seed), dict()),
}


@pytest.mark.parametrize("case", list(CASES))
def test_replay_equals_the_full_path(case):
    make, opts = CASES[case]
    (out, lse), (ref_out, ref_lse) = _twice(make, kc.params(**opts, head_dim=D),
                                           launch.LaunchCache())
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def test_split_plan_replays_both_launches():
    # a split-KV plan: the prefill launch writes scratch partials, the merge launch reads them
    qo, kv = [3, 6], [300, 260]

    def make(seed):
        c = kc.make_case("ragged", qo, kv, HQ, HKV, D, seed=seed)
        c.work, c.merge = build_split_work(qo, kv, HQ // HKV, c.block_m, HKV, num_sms=32,
                                           min_keys_per_chunk=64)
        assert c.work.shape[1] == 4 and c.merge.shape[0] > 0
        return c

    cache = launch.LaunchCache()
    (out, lse), (ref_out, ref_lse) = _twice(make, kc.params(head_dim=D), cache)
    bound = next(b for b in cache._bound.values() if b is not launch._UNBOUND)
    assert len(bound.launches) == 2 and len(bound.scratch) == 2
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)


def _wrapper_runs(kind):
    q1, q2 = rand(sum(QO), HQ, D, seed=4, dtype=F32), rand(sum(QO), HQ, D, seed=5, dtype=F32)
    if kind == "ragged":
        kv = [(rand(sum(KV), HKV, D, seed=s, dtype=F32), rand(sum(KV), HKV, D, seed=s + 1,
                                                              dtype=F32)) for s in (6, 8)]
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
        w.plan(indptr(QO), indptr(KV), HQ, HKV, D, causal=True, q_data_type=F32)
        return w, [lambda: w.run(q1, *kv[0], return_lse=True),
                   lambda: w.run(q2, *kv[1], return_lse=True)]
    caches = [make_paged(KV, HKV, D, D, 4, dtype=F32, seed=s)[0] for s in (7, 9)]
    _, kvi, idx, last, _, _ = make_paged(KV, HKV, D, D, 4, dtype=F32, seed=7)
    qd = [rand(len(KV), HQ, D, seed=s, dtype=F32) for s in (10, 11)]
    if kind == "pod":
        w = fi.PODWithPagedKVCacheWrapper(WS)
        w.plan(kvi, idx, last, HQ, HKV, D, 4, q_data_type=F32)
        kp = [rand(11, HKV, D, seed=s, dtype=F32) for s in (12, 13)]
        return w, [lambda i=i: _flat(w.run(q, kp[i], kp[i], qd[i], caches[i], causal_p=True,
                                           return_lse_p=True, return_lse_d=True))
                   for i, q in enumerate((q1[:9], q2[:9]))]
    if kind == "batch_pod":
        w = fi.BatchPODWithPagedKVCacheWrapper(WS)
        w.plan(indptr(QO), kvi, idx, last, indptr([1] * len(KV)), kvi, idx, last, HQ, HKV, D,
               4, q_data_type=F32)
        # one cache for both parts (aliases in the key)
        return w, [lambda i=i: _flat(w.run(q, caches[i], qd[i], caches[i], causal_p=True,
                                           return_lse=True))
                   for i, q in enumerate((q1, q2))]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(indptr(QO), kvi, idx, last, HQ, HKV, D, 4, causal=True, q_data_type=F32)
    return w, [lambda: w.run(q1, caches[0], return_lse=True),
               lambda: w.run(q2, caches[1], return_lse=True)]


def _flat(res):
    return tuple(x for pair in res for x in pair)


@pytest.mark.parametrize("kind,apart", [("ragged", False), ("paged", False), ("pod", False),
                                        ("batch_pod", False), ("pod", True),
                                        ("batch_pod", True)])
def test_wrapper_run_replays_its_plan(kind, apart):
    # apart: POD's parts as two launches (ops.choose.pod_apart), one bound call of both
    with policy.override(**POD_LAUNCHES["apart" if apart else "fused"]):
        w, runs = _wrapper_runs(kind)
        runs[0]()
        got = runs[1]()
        if apart:
            (bound,) = w._memo._bound.values()
            assert len(bound.launches) == 2
        assert w._memo.records == 1 and w._memo.hits == 1  # run() itself replayed
        with policy.override(bound_launches=False):
            want = runs[1]()
    for g, r in zip(got, want):
        assert not g.isnan().any() and torch.equal(g, r)


@pytest.mark.parametrize("kind,apart", [("ragged", False), ("pod", False), ("pod", True)])
def test_wrapper_records_after_a_direct_op_call(kind, apart):
    """A wrapper's first run() after a call of the same op with the same metadata outside it
    (here its own run() under torch.compile, whose graph calls the op: Inductor's run-time
    call, or a serving engine's torch.ops call) records the op's launches, not a replay of the
    op-level bound call around its recorder: its later replays compute (they once launched
    nothing, leaving the outputs unwritten)."""
    with policy.override(**POD_LAUNCHES["apart" if apart else "fused"]):
        launch.DEFAULT.clear()
        w, runs = _wrapper_runs(kind)
        compiled = torch.compile(runs[0], fullgraph=True, backend="eager")
        want = compiled()
        first, again = runs[0](), runs[0]()
        assert w._memo.records == 1 and w._memo.hits == 1
        (bound,) = w._memo._bound.values()
        assert len(bound.launches) == (2 if apart else 1)
    for a, b, r in zip(first, again, want):
        assert not r.isnan().any() and torch.equal(a, r) and torch.equal(b, r)


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_plan_pointers_bound_into_the_gpu_template(kind, monkeypatch):
    # On a GPU (no interpreter) a bound launch holds the plan's tensors as pointers in its
    # template: a replay patches only the call's own tensors, its outputs and its scratch.
    bind = launch.Bound.__init__

    def bind_for_gpu(self, *a, **kw):  # (only the binding as it is on a GPU)
        with monkeypatch.context() as m:
            m.setattr(launch, "INTERPRET", False)
            bind(self, *a, **kw)

    monkeypatch.setattr(launch.Bound, "__init__", bind_for_gpu)
    w, runs = _wrapper_runs(kind)
    runs[0]()
    (bound,) = w._memo._bound.values()
    p = w._plan
    (fn, _g, template, patches, *_), = bound.launches
    assert patches and {src[0] for _, _, src in patches} <= {"in", "out", "tmp"}
    ints = {a for a in template if type(a) is int}
    for t in (p.work, p.qo_indptr, p.kv_indptr):
        assert t.data_ptr() in ints


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_bound_run_keeps_every_check(kind):
    # after a replayed run(), inputs that the checks refuse still raise their messages
    w, runs = _wrapper_runs(kind)
    runs[0]()
    runs[1]()
    q = rand(sum(QO), HQ, D, seed=4, dtype=F16)
    kv = (rand(sum(KV), HKV, D, seed=6, dtype=F32),) * 2
    cache = kv if kind == "ragged" else (make_paged(KV, HKV, D, D, 4, dtype=F32, seed=7)[0],)
    with pytest.raises(TypeError, match="q: dtype torch.float16 but the plan has q_data_type"):
        w.run(q, *cache)
    with pytest.raises(ValueError, match="q: shape"):
        w.run(rand(sum(QO) + 1, HQ, D, seed=4, dtype=F32), *cache)
    assert w._memo.hits == 1


def test_aliasing_is_part_of_the_key():
    # recorded with k and v one tensor, then called with two: a new record, right numbers
    cache = launch.LaunchCache()
    p = kc.params(head_dim=D)
    c = kc.make_case("single", [9], [13], HQ, HQ, D, seed=3)
    name, args, kw = _args(c, p)
    args = (args[0], args[1], args[1], *args[3:])
    op_call.call_op(name, *args, launches=cache, **kw)
    name, args, kw = _args(kc.make_case("single", [9], [13], HQ, HQ, D, seed=4), p)
    got = op_call.call_op(name, *args, launches=cache, **kw)
    assert cache.records == 2 and cache.hits == 0
    with policy.override(bound_launches=False):
        want = op_call.call_op(name, *args, **kw)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_kv_tuple_keys_as_its_tensors_in_line():
    """A (k, v) cache keys as its two tensors in line (flattened once, before any tensor is
    keyed); an empty tuple, or no tensor at all, has no key."""
    memo = launch.Memo()
    q, k, v = rand(5, HQ, D, seed=1), rand(7, HKV, D, seed=2), rand(7, HKV, D, seed=3)
    flat = memo.eager_key((q, k, v, None, 3), ("x",))
    assert memo.eager_key((q, (k, v), None, 3), ("x",)) == flat
    assert memo.eager_key((q, [k, v], None, 3), ("x",)) == flat
    assert memo.eager_key((q, (k, v), None, 3), ("y",))[0] != flat[0]
    assert memo.eager_key((q, (), None), ()) is None and memo.eager_key((None, 3), ()) is None
    # the same tensor twice: the aliasing is in the key
    assert memo.eager_key((q, (k, k), None, 3), ("x",))[0] != flat[0]


def test_the_light_key_alone_is_eager_keys_light_key():
    """replay_fast's light key (Memo._light_key, the replay's hot path) is the tuple eager_key
    gives for the same call, under which a recording keeps the call's guards: plain values,
    static tensors, a (k, v) cache met mid-way, aliasing, views at an offset; a call with an
    empty tuple or no tensor has neither."""
    q, k, v = rand(5, HQ, D, seed=1), rand(7, HKV, D, seed=2), rand(7, HKV, D, seed=3)
    table = torch.arange(4, dtype=torch.int32)
    memo = launch.Memo(static=(table,))
    for values in ((q, k, v, None, 3), (q, (k, v), None, 3.0, "NHD"), (q, [k, v], table, True),
                   (q, (k, k), None), (q[1:], k, k[2:], table), (None, q, 2)):
        full, light = memo.eager_key(values, ("x", 1)), memo._light_key(values, ("x", 1))
        assert light[0] == full[3] and light[1] == full[1] and light[2] == full[2], values
    for values in ((q, (), None), (None, 3)):
        assert memo.eager_key(values, ()) is None and memo._light_key(values, ()) is None


def test_option_types_are_part_of_the_key():
    """True == 1 == 1.0: a call whose option has the wrong type is not a replay of one with the
    right type (the replay skips the checks), so it raises as it does first."""
    q, k, v = rand(3, HQ, D, seed=1).float(), rand(5, HKV, D, seed=2).float(), \
        rand(5, HKV, D, seed=3).float()
    for good, bad, exc in ((dict(sm_scale=1.0), dict(sm_scale=True), TypeError),
                           (dict(window_left=2), dict(window_left=2.0), ValueError)):
        fi.single_prefill_with_kv_cache(q, k, v, **good)
        fi.single_prefill_with_kv_cache(q, k, v, **good)  # (a replay)
        with pytest.raises(exc, match=next(iter(bad))):
            fi.single_prefill_with_kv_cache(q, k, v, **bad)


def test_an_unhashable_option_takes_the_full_path():
    """An option that is no plain value and no tensor (a list: unhashable) has no replay and
    is never recorded: the call takes the full path, whose checks raise what they raise."""
    memo = fi.prefill._SINGLE_MEMO
    q, k, v = rand(3, HQ, D, seed=1).float(), rand(5, HKV, D, seed=2).float(), \
        rand(5, HKV, D, seed=3).float()
    key = memo.eager_key((q, k, v), ([2],))[0]
    assert memo.lookup(key, [q, k, v]) is None and memo.known_unbound(key)
    records = memo.records
    for _ in range(2):
        with pytest.raises(ValueError, match="window_left: got \\[2\\]"):
            fi.single_prefill_with_kv_cache(q, k, v, window_left=[2])
    assert memo.records == records


def test_guarded_replay_matches_where_the_key_would():
    """replay_fast (the light key, and Dynamo's tensor guards in C++ for the rest) replays where
    the full key would, and only there: fresh tensors of the recorded metadata replay through
    it (the full path's bits); a call differing only in strides, dtype or rows (the same light
    key) is no match there, and the full key records it; a call under inference mode (another
    dispatch state) takes the full key once, then guards of its own; a light key keeps its
    newest guards; the same tensor passed twice (the guards take it once) replays through it
    too."""
    cache = launch.LaunchCache()
    p = kc.params(head_dim=D)
    fast = []
    replay_fast = cache.replay_fast

    def spy(values, extra=()):
        out = replay_fast(values, extra)
        fast.append(out is not None)
        return out

    cache.replay_fast = spy

    def call(c, alias=False):
        name, args, kw = _args(c, p)
        if alias:
            args = (args[0], args[1], args[1], *args[3:])
        return op_call.call_op(name, *args, launches=cache, **kw)

    def case(seed, **kw):
        return kc.make_case("single", kw.pop("qo", [9]), [13], HQ, HKV, D, seed=seed, **kw)

    checked = []  # (case, alias, outputs): against the full path at the end (an override
    call(case(3))  # changes the policy's version, so every key after it)
    c = case(4)
    checked.append((c, False, call(c)))
    assert fast[-1] and (cache.records, cache.hits) == (1, 1)
    for n, other in enumerate((case(5, layout="HND"), case(6, dtype=F32), case(7, qo=[8]))):
        checked.append((other, False, call(other)))
        assert not fast[-1] and cache.records == 2 + n
    hits = cache.hits
    with torch.inference_mode():
        call(case(8))
        assert not fast[-1] and (cache.records, cache.hits) == (4, hits + 1)
        c = case(9)
        checked.append((c, False, call(c)))
        assert fast[-1] and cache.hits == hits + 2
    call(case(10))
    assert fast[-1] and cache.records == 4
    # a fifth guard under one light key (HND under inference mode) takes the oldest one's place
    # (the first call's): the newest GUARDS are kept
    assert launch.Memo.GUARDS == 4
    with torch.inference_mode():
        call(case(11, layout="HND"))
        assert not fast[-1] and cache.records == 4
        call(case(12, layout="HND"))
        assert fast[-1]
    call(case(13))
    assert not fast[-1] and cache.records == 4
    call(case(14))
    assert fast[-1] and cache.records == 4
    call(kc.make_case("single", [9], [13], HQ, HQ, D, seed=11), alias=True)
    c = kc.make_case("single", [9], [13], HQ, HQ, D, seed=12)
    checked.append((c, True, call(c, alias=True)))
    assert fast[-1] and cache.records == 5
    with policy.override(bound_launches=False):
        for c, alias, got in checked:
            want = call(c, alias)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_without_tensor_guards_every_call_keys_in_full(monkeypatch):
    """A torch without Dynamo's tensor guards (launch._TensorGuards None): no guard is kept,
    and calls replay through the full key, the full path's bits."""
    monkeypatch.setattr(launch, "_TensorGuards", None)
    memo, runs = _entry_calls("pod", return_lse=True)
    memo.clear()
    hits = memo.hits
    runs[0]()
    got = runs[1]()
    assert memo.hits == hits + 1 and not memo._fast
    with policy.override(bound_launches=False):
        want = runs[1]()
    for g, r in zip(got, want, strict=True):
        assert not g.isnan().any() and torch.equal(g, r)


def test_strides_and_policy_are_part_of_the_key():
    cache = launch.LaunchCache()
    p = kc.params(head_dim=D)
    name, args, kw = _args(kc.make_case("single", [9], [13], HQ, HKV, D, seed=3), p)
    op_call.call_op(name, *args, launches=cache, **kw)
    name, args, kw = _args(kc.make_case("single", [9], [13], HQ, HKV, D, layout="HND",
                                        seed=4), p)
    op_call.call_op(name, *args, launches=cache, **kw)
    assert cache.records == 2 and cache.hits == 0
    with policy.override(tma_min_kv=10 ** 9):
        op_call.call_op(name, *args, launches=cache, **kw)
    assert cache.records == 3 and cache.hits == 0


def test_unexplained_launch_argument_is_never_bound(monkeypatch):
    # a launch argument of unknown origin (here: a tensor the launch path made without
    # launch.scratch / launch.counter) leaves the key unbound: every call takes the full path
    real = launch.counter
    monkeypatch.setattr(launch, "counter", lambda device: real(device).clone())
    cache = launch.LaunchCache()
    p = kc.params(head_dim=D)
    with policy.override(**choose.KV_PATHS["persistent"][1]):
        for seed in (1, 2):
            name, args, kw = _args(kc.make_case("ragged", QO, KV, HQ, HKV, D, seed=seed), p)
            out, lse = op_call.call_op(name, *args, launches=cache, **kw)
            assert not out.isnan().any()
    assert cache.refused == 1 and cache.records == 0 and cache.hits == 0


def test_policy_override_restores_and_names_settings():
    before = policy.POLICY.settings()
    v = policy.version()
    with policy.override(use_tma=False):
        assert policy.POLICY.use_tma is False and policy.version() > v
    assert policy.POLICY.settings() == before
    with pytest.raises(AttributeError, match="no setting 'use_tmaa'"):
        with policy.override(use_tmaa=False):
            pass


@pytest.mark.parametrize("case", ["single causal", "paged page 4"])
def test_direct_op_call_replays(case):
    """A call through torch.ops (a serving engine's direct call; Inductor's run-time call of an
    op node) replays a bound launch from the op's own body, with the full path's bits; a call
    with other metadata records anew, and with bound_launches off none replays."""
    make, opts = CASES[case]
    p = kc.params(**opts, head_dim=D)
    launch.DEFAULT.clear()
    name, args, kw = _args(make(seed=1), p)
    op = getattr(torch.ops.compiled_attn, name)
    op(*args, **kw)
    hits, records = launch.DEFAULT.hits, launch.DEFAULT.records
    name, args, kw = _args(make(seed=2), p)
    got = op(*args, **kw)
    assert launch.DEFAULT.hits == hits + 1 and launch.DEFAULT.records == records
    with policy.override(bound_launches=False):
        want = op(*args, **kw)
    assert launch.DEFAULT.hits == hits + 1
    assert not got[0].isnan().any()
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def _entry_calls(kind, return_lse):
    """Two calls of an entry point on fresh inputs of one metadata (the LSE asked for or not),
    and its bound-call memo."""
    memo, inputs, call = _fresh_calls(kind, return_lse)
    xs = [inputs(s) for s in (40, 50)]
    return memo, [lambda x=x: call(x) for x in xs]


def _flat_outs(res) -> tuple:
    """An entry point's outputs (a tensor, or tuples of tensors and Nones) as one tuple."""
    res = res if isinstance(res, tuple) else (res,)
    return tuple(t for x in res for t in (x if isinstance(x, tuple) else (x,)) if t is not None)


@pytest.mark.parametrize("kind", ["single", "ragged", "pod"])
def test_dropped_lse_written_into_one_kept_tensor(kind):
    # An LSE the caller does not ask for is written, at every replay, into the recorded call's
    # own tensor (Bound.held) instead of a new allocation; the outputs returned are the full
    # path's, and a call asking for the LSE is another key that returns its own.
    memo, runs = _entry_calls(kind, return_lse=False)
    memo.clear()
    records, hits = memo.records, memo.hits
    runs[0]()
    (bound,) = [b for b in memo._bound.values() if b is not launch._UNBOUND]
    assert sorted(bound.held) == ([2, 3] if kind == "pod" else [1])
    held = [t.data_ptr() for t in bound.held.values()]
    replayed = []
    replay = bound.replay
    bound.replay = lambda tensors, ptrs=None, sizes=None: (
        replayed.append(replay(tensors, ptrs, sizes)) or replayed[-1])
    got = runs[1]()
    assert (memo.records, memo.hits) == (records + 1, hits + 1), "the second call did not replay"
    assert [replayed[0][j].data_ptr() for j in sorted(bound.held)] == held
    assert all(t.data_ptr() not in held for t in got)
    with policy.override(bound_launches=False):
        want = runs[1]()
    assert len(got) == len(want) == (2 if kind == "pod" else 1)
    for g, r in zip(got, want):
        assert not g.isnan().any() and torch.equal(g, r)
    # a dropped output over launch.HELD_MAX_BYTES is allocated at each replay, as a kept one
    # would be: nothing held, the same bits
    memo.clear()
    with pytest.MonkeyPatch.context() as m:
        m.setattr(launch, "HELD_MAX_BYTES", 0)
        runs[0]()
    (bound,) = [b for b in memo._bound.values() if b is not launch._UNBOUND]
    assert not bound.held
    got = runs[1]()
    for g, r in zip(got, want):
        assert torch.equal(g, r)
    # the same calls asking for the LSE: recorded under another key, nothing held
    memo, runs = _entry_calls(kind, return_lse=True)
    memo.clear()
    runs[0]()
    got = runs[1]()
    with_lse = [b for b in memo._bound.values() if b is not launch._UNBOUND and not b.held]
    assert len(with_lse) == 1
    with policy.override(bound_launches=False):
        want = runs[1]()
    assert len(got) == len(want) == (4 if kind == "pod" else 2)
    for g, r in zip(got, want):
        assert not g.isnan().any() and torch.equal(g, r)


def test_a_recording_holds_its_scratch_until_bound():
    """Scratch a launch path frees inside a recorded call (a launcher's own buffer, e.g. the
    rows gathered for a kernel without a row map) stays allocated until the call is bound, so
    no later allocation of the same call (an output) takes its address and is mistaken for it
    when the launches' arguments are traced to their sources."""
    rec = launch.Recorder()
    launch._TLS.rec = rec
    try:
        t = launch.scratch((4096,), torch.float32, "cpu")
        p = t.data_ptr()
        adopted = torch.empty(4096)
        launch.adopt_scratch(adopted)
        q = adopted.data_ptr()
        del t, adopted
        later = [torch.empty(4096) for _ in range(4)]
        assert all(x.data_ptr() not in (p, q) for x in later)
        assert set(rec.scratch) == {p, q} and len(rec.held) == 2
    finally:
        launch._TLS.rec = None


def test_programs_cap_is_part_of_the_key():
    """A call made inside launch.programs_cap records under a key of its own (its persistent
    grid may differ), so neither call replays the other's launches; each then replays its own
    with the full path's bits."""
    cache = launch.LaunchCache()
    p = kc.params(head_dim=D)
    make = CASES["paged page 4"][0]
    outs = {}
    for cap in (0, 3, 0, 3):
        name, args, kw = _args(make(seed=1), p)
        with launch.programs_cap(cap):
            outs.setdefault(cap, []).append(op_call.call_op(name, *args, launches=cache, **kw))
    assert launch.programs_cap_now() == 0
    assert cache.records == 2 and cache.hits == 2
    for a, b in outs.values():
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


def _fresh_calls(kind, return_lse=True):
    """(memo, inputs(seed) -> a call's tensors, call(tensors) -> its outputs, flattened) of an
    entry point (single prefill; paged, ragged or POD run()) whose calls share one metadata,
    every tensor fresh (the paged caches and POD's k_p / v_p among them); return_lse: the LSE
    asked for."""
    if kind == "single":
        return fi.prefill._SINGLE_MEMO, (lambda s: [rand(n, h, D, seed=s + i, dtype=F32) for i, (
            n, h) in enumerate(((9, HQ), (13, HKV), (13, HKV)))]), (
            lambda x: _flat_outs(fi.single_prefill_with_kv_cache(*x, causal=True,
                                                                 return_lse=return_lse)))
    if kind == "ragged":
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
        w.plan(indptr(QO), indptr(KV), HQ, HKV, D, causal=True, q_data_type=F32)
        return w._memo, (lambda s: [rand(sum(QO), HQ, D, seed=s, dtype=F32)] + [
            rand(sum(KV), HKV, D, seed=s + i, dtype=F32) for i in (1, 2)]), (
            lambda x: _flat_outs(w.run(*x, return_lse=return_lse)))
    _, kvi, idx, last, _, _ = make_paged(KV, HKV, D, D, 4, dtype=F32, seed=7)
    if kind == "pod":
        w = fi.PODWithPagedKVCacheWrapper(WS)
        w.plan(kvi, idx, last, HQ, HKV, D, 4, q_data_type=F32)
        return w._memo, (lambda s: [
            rand(9, HQ, D, seed=s, dtype=F32), rand(11, HKV, D, seed=s + 1, dtype=F32),
            rand(11, HKV, D, seed=s + 2, dtype=F32), rand(len(KV), HQ, D, seed=s + 3, dtype=F32),
            make_paged(KV, HKV, D, D, 4, dtype=F32, seed=s + 4)[0]]), (
            lambda x: _flat_outs(w.run(*x, causal_p=True, return_lse_p=return_lse,
                                       return_lse_d=return_lse)))
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(indptr(QO), kvi, idx, last, HQ, HKV, D, 4, causal=True, q_data_type=F32)
    return w._memo, (lambda s: [rand(sum(QO), HQ, D, seed=s, dtype=F32),
                                make_paged(KV, HKV, D, D, 4, dtype=F32, seed=s + 1)[0]]), (
        lambda x: _flat_outs(w.run(x[0], x[1], return_lse=return_lse)))


@pytest.mark.parametrize("kind", ["single", "paged", "pod"])
def test_a_bound_call_holds_none_of_its_tensors(kind):
    """A bound call keeps how to launch again (each argument's source and geometry, the plan's
    tensors), not the recorded call's tensors: once the caller drops a call's inputs and outputs
    (a KV cache among them), nothing else holds them, and later calls still replay, equal to
    the full path."""
    memo, inputs, call = _fresh_calls(kind)
    memo.clear()
    records, hits = memo.records, memo.hits
    x = inputs(80)
    outs = call(x)
    assert memo.records == records + 1
    refs = [weakref.ref(t) for t in (*x, *outs)]
    del x, outs
    gc.collect()
    assert [r() is None for r in refs] == [True] * len(refs), "the memo holds a call's tensors"
    x = inputs(90)
    got = call(x)
    assert memo.hits == hits + 1, "the second call did not replay"
    with policy.override(bound_launches=False):
        want = call(x)
    for g, r in zip(got, want, strict=True):
        assert not g.isnan().any() and torch.equal(g, r)


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_a_replan_of_the_same_shapes_keeps_its_bound_launches(kind):
    """A serving step re-plans, then each layer calls run(): where the new plan has the old
    one's shapes and options (new lengths and page order here), plan() writes into the old
    plan's tensors and run() replays the calls bound for it, computing the new plan's
    numbers; a plan of other shapes starts a new memo; a replay still refuses a plan whose
    page indices leave the cache."""
    page, total = 4, 12
    q = rand(sum(QO), HQ, D, seed=20, dtype=F32)
    k, v = rand(40, HKV, D, seed=21, dtype=F32), rand(40, HKV, D, seed=22, dtype=F32)
    cache = rand(total, 2, page, HKV, D, seed=23, dtype=F32)
    g = torch.Generator().manual_seed(24)

    def plan(w, qo, kv, **kw):
        if kind == "ragged":
            return w.plan(indptr(qo), indptr(kv), HQ, HKV, D, causal=True, q_data_type=F32, **kw)
        pages = [-(-n // page) for n in kv]
        idx = kw.pop("idx", torch.randperm(total, generator=g)[:sum(pages)].to(torch.int32))
        last = torch.tensor([(n - 1) % page + 1 for n in kv], dtype=torch.int32)
        return w.plan(indptr(qo), indptr(pages), idx, last, HQ, HKV, D, page, causal=True,
                      q_data_type=F32, **kw)

    def run(w):
        return w.run(q, k, v, return_lse=True) if kind == "ragged" else \
            w.run(q, cache, return_lse=True)

    w = (fi.BatchPrefillWithRaggedKVCacheWrapper if kind == "ragged"
         else fi.BatchPrefillWithPagedKVCacheWrapper)(WS)
    plan(w, QO, KV)
    first = run(w)
    memo, tensors = w._memo, [t for t in w._plan.__dict__.values() if torch.is_tensor(t)]
    # the same tiles and page count, other lengths per request (and another page order)
    plan(w, [9, 0, 5], [9, 7, 13])
    assert w._memo is memo and [t for t in w._plan.__dict__.values() if torch.is_tensor(t)] \
        == tensors
    before = launch.recordings()
    got = run(w)
    assert memo.records == 1 and memo.hits == 1  # the new plan's first run() replayed
    assert launch.recordings() == before
    with policy.override(bound_launches=False):
        want = run(w)
    for g_, w_, f in zip(got, want, first):
        assert not g_.isnan().any() and torch.equal(g_, w_) and not torch.equal(g_, f)
    plan(w, [5, 9], [13, 16])  # another batch size: new tensors, a new memo
    assert w._memo is not memo
    run(w)
    assert w._memo.records == 1
    if kind == "paged":
        # the same shapes, one page index past this cache: no replay, the full path's error
        memo = w._memo
        bad = torch.arange(8, dtype=torch.int32)
        bad[4] = total
        plan(w, [5, 9], [13, 16], idx=bad)
        assert w._memo is memo
        with pytest.raises(ValueError, match="entry 4 is 12 but paged_kv_cache has only 12"):
            run(w)
        assert memo.hits == 0


@pytest.mark.parametrize("launches", ["fused", "apart"])
def test_a_pod_replan_of_the_same_shapes_keeps_its_bound_launches(launches):
    """POD: a re-plan of the decodes with the last plan's shapes, options and bytes (another
    page order, other last-page lengths) writes into the last plan's tensors and keeps its bound
    calls and prefill parts, so run() replays and computes the new plan's numbers (as a fresh
    wrapper's full path); a plan of other bytes or batch size starts a new memo; a replay
    still refuses a plan whose page indices leave the cache."""
    page, total = 4, 12
    g = torch.Generator().manual_seed(40)
    cache = rand(total, 2, page, HKV, D, seed=41, dtype=F32)
    qp, kp, vp = (rand(9, HQ, D, seed=42, dtype=F32), rand(11, HKV, D, seed=43, dtype=F32),
                  rand(11, HKV, D, seed=44, dtype=F32))
    qd = rand(3, HQ, D, seed=45, dtype=F32)

    def plan(w, kv, idx=None):
        pages = [-(-n // page) for n in kv]
        if idx is None:
            idx = torch.randperm(total, generator=g)[:sum(pages)].to(torch.int32)
        last = torch.tensor([(n - 1) % page + 1 for n in kv], dtype=torch.int32)
        w.plan(indptr(pages), idx, last, HQ, HKV, D, page, q_data_type=F32)
        return idx

    def run(w, q=qd):
        return _flat(w.run(qp, kp, vp, q, cache, causal_p=True, return_lse_p=True,
                           return_lse_d=True))

    with policy.override(**POD_LAUNCHES[launches]):
        w = fi.PODWithPagedKVCacheWrapper(WS)
        plan(w, [13, 7, 9])
        first = run(w)
        memo, parts = w._memo, w._parts
        tensors = [t for t in w._plan.values() if torch.is_tensor(t)]
        idx = plan(w, [14, 6, 10])  # the same pages a request, other last pages and order
        assert w._memo is memo and w._parts is parts
        assert [t for t in w._plan.values() if torch.is_tensor(t)] == tensors
        before = launch.recordings()
        got = run(w)
        assert memo.records == 1 and memo.hits == 1 and launch.recordings() == before
        fresh = fi.PODWithPagedKVCacheWrapper(WS)
        plan(fresh, [14, 6, 10], idx)
        with policy.override(bound_launches=False):
            want = run(fresh)
        for g_, w_, f in zip(got, want, first, strict=True):
            assert not g_.isnan().any() and torch.equal(g_, w_)
        assert not torch.equal(got[1], first[1])  # (the decodes read other pages)
        plan(w, [14, 6, 14])  # one page more: other bytes, a new memo
        assert w._memo is not memo
        memo = w._memo
        plan(w, [14, 6])  # another batch size
        assert w._memo is not memo
        memo = w._memo
        # the same shapes, one page index past this cache: no replay, the full path's error
        run(w, qd[:2])
        bad = torch.arange(6, dtype=torch.int32)
        bad[4] = total
        plan(w, [14, 6], idx=bad)
        assert w._memo is memo
        with pytest.raises(ValueError, match="entry 4 is 12 but paged_kv_cache_d has only 12"):
            run(w, qd[:2])
        assert memo.hits == 0


@pytest.mark.parametrize("launches", ["fused", "apart"])
def test_a_batch_pod_replan_of_growing_requests_keeps_its_bound_launches(launches):
    """BatchPOD in a serving step: a prefill chunk of the same rows whose keys grow and decodes
    growing a key; once a page table has room (choose.page_table_capacity), re-plans of the
    same shapes and launch choices write into the last plan's tensors and keep its bound
    calls, computing a fresh wrapper's numbers; other launch choices (another policy) start
    a new memo; a replay refuses a page past a cache and a packed mask of the last plan's
    bytes."""
    from unittest import mock

    from compiled_attn import pod as pod_module, segment_packbits
    page, total = 4, 40
    g = torch.Generator().manual_seed(50)
    order = torch.randperm(total, generator=g).to(torch.int32)
    cache = rand(total, 2, page, HKV, D, seed=51, dtype=F32)
    qp, qd = rand(9, HQ, D, seed=52, dtype=F32), rand(3, HQ, D, seed=53, dtype=F32)

    def plan(w, kv_p, kv_d, idx=None):
        pp, pd = [-(-n // page) for n in kv_p], [-(-n // page) for n in kv_d]
        ind = order if idx is None else idx
        last = [torch.tensor([(n - 1) % page + 1 for n in kv], dtype=torch.int32)
                for kv in (kv_p, kv_d)]
        w.plan(indptr([4, 5]), indptr(pp), ind[:sum(pp)], last[0], indptr([1, 1, 1]),
               indptr(pd), ind[sum(pp):sum(pp) + sum(pd)], last[1], HQ, HKV, D, page,
               q_data_type=F32)

    def run(w, **kw):
        return _flat(w.run(qp, cache, qd, cache, causal_p=True, return_lse=True, **kw))

    with policy.override(**POD_LAUNCHES[launches]):
        w = fi.BatchPODWithPagedKVCacheWrapper(WS)
        plan(w, [13, 16], [13, 7, 9])  # the first plan's tables are exact
        run(w)
        plan(w, [17, 20], [14, 9, 13])  # more pages: tables with room, a new memo
        memo, tables = w._memo, (w._plan["kv_indices_p"], w._plan["kv_indices_d"])
        assert tables[0].numel() > 10 and tables[1].numel() > 11
        first = run(w)
        assert memo.records == 1
        plan(w, [21, 24], [16, 12, 17])  # more pages again, inside the room
        assert w._memo is memo and (w._plan["kv_indices_p"], w._plan["kv_indices_d"]) == tables
        before = launch.recordings()
        got = run(w)
        assert memo.records == 1 and memo.hits == 1 and launch.recordings() == before
        fresh = fi.BatchPODWithPagedKVCacheWrapper(WS)
        plan(fresh, [21, 24], [16, 12, 17])
        with policy.override(bound_launches=False):
            want = run(fresh)
        for g_, w_ in zip(got, want, strict=True):
            assert not g_.isnan().any() and torch.equal(g_, w_)
        assert not torch.equal(got[0], first[0]) and not torch.equal(got[1], first[1])
        # a packed mask of the last plan's bytes: no replay, the full path's error
        bits = [4 * 21, 5 * 24]
        mask = segment_packbits(torch.ones(sum(bits), dtype=torch.bool), indptr(bits),
                                bitorder="little")[0]
        run(w, packed_custom_mask_p=mask)
        plan(w, [25, 24], [16, 12, 17])
        assert w._memo is memo
        with pytest.raises(ValueError, match="packed_custom_mask_p: has"):
            run(w, packed_custom_mask_p=mask)
        # a page index past the cache: no replay, the full path's error
        bad = order.clone()
        bad[3] = total
        plan(w, [25, 24], [16, 12, 17], idx=bad)
        assert w._memo is memo
        with pytest.raises(ValueError, match="entry 3 is 40 but paged_kv_cache_p has only 40"):
            run(w)
        # launch choices that differ between the plans under the policy now: a new memo
        with mock.patch.object(pod_module, "_batch_choices", lambda p: p["decode_bytes"]):
            plan(w, [25, 24], [16, 12, 13])
            assert w._memo is not memo
    # under another policy the calls bound before do not replay (their key holds the policy's
    # version): a recording, the fresh wrapper's numbers
    with policy.override(**POD_LAUNCHES["apart" if launches == "fused" else "fused"]):
        plan(w, [25, 24], [16, 12, 17])
        before = launch.recordings()
        got = run(w)
        assert launch.recordings() == before + 1
        plan(fresh, [25, 24], [16, 12, 17])
        with policy.override(bound_launches=False):
            want = run(fresh)
        for g_, w_ in zip(got, want, strict=True):
            assert not g_.isnan().any() and torch.equal(g_, w_)


def test_a_growing_page_table_keeps_its_tensor_and_bound_calls():
    """Decode requests grow a page now and then: a re-plan whose page table outgrows the last
    one's allocates it with room (choose.page_table_capacity), and later plans within that
    room write into it (tail: page 0) and replay the calls bound for it, computing what a
    fresh wrapper's exact table computes."""
    page, total = 4, 16
    g = torch.Generator().manual_seed(30)
    cache = rand(total, 2, page, HKV, D, seed=31, dtype=F32)
    q = rand(3, HQ, D, seed=32, dtype=F32)
    order = torch.randperm(total, generator=g).to(torch.int32)

    def plan(w, kv):
        pages = [-(-n // page) for n in kv]
        last = torch.tensor([(n - 1) % page + 1 for n in kv], dtype=torch.int32)
        w.plan(indptr([1] * len(kv)), indptr(pages), order[:sum(pages)], last, HQ, HKV, D,
               page, q_data_type=F32)

    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    plan(w, [13, 7, 9])  # 9 pages: the first plan's table is exact
    assert w._plan.kv_indices.numel() == 9
    w.run(q, cache)
    memo = w._memo
    plan(w, [14, 7, 9])  # the same pages
    assert w._memo is memo
    plan(w, [17, 7, 9])  # a 10th page: a new table, with room
    table, memo = w._plan.kv_indices, w._memo
    assert memo is not None and table.numel() == choose.page_table_capacity(10, 74, page, 3)
    before = launch.recordings()
    w.run(q, cache)
    assert memo.records == 1 and launch.recordings() == before + 1
    plan(w, [17, 8, 13])  # 11 pages in the room
    assert w._memo is memo and w._plan.kv_indices is table
    assert torch.equal(table[11:], torch.zeros(table.numel() - 11, dtype=torch.int32))
    got = w.run(q, cache)
    assert memo.records == 1 and memo.hits == 1
    fresh = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    plan(fresh, [17, 8, 13])
    want = fresh.run(q, cache)
    assert fresh._plan.kv_indices.numel() == 11
    assert not got.isnan().any() and torch.equal(got, want)


def test_pod_calls_of_other_key_counts_keep_their_bound_calls():
    # POD's bound calls leave the prefill's key count out of the key (launch.Memo's free
    # sizes); a count met before replays its own bound call (the interpreter's launches never
    # go generic: Bound._sizable), each call bit for bit against the full path
    caches, kvi, idx, last, _, _ = make_paged(KV, HKV, D, D, 4, dtype=F32, seed=7)
    qd = rand(len(KV), HQ, D, seed=10, dtype=F32)
    qp, kp = rand(9, HQ, D, seed=11, dtype=F32), rand(20, HKV, D, seed=12, dtype=F32)
    with policy.override(**POD_LAUNCHES["fused"]):
        w = fi.PODWithPagedKVCacheWrapper(WS)
        w.plan(kvi, idx, last, HQ, HKV, D, 4, q_data_type=F32)

        def run(kv):
            return _flat(w.run(qp, kp[:kv], kp[:kv], qd, caches, causal_p=True,
                               return_lse_p=True, return_lse_d=True))
        got = []
        for kv in (11, 17, 11, 17):
            before = launch.recordings()
            got.append((kv, run(kv), launch.recordings() - before))
        with policy.override(bound_launches=False):
            want = {kv: run(kv) for kv in (11, 17)}
    assert [r for _, _, r in got] == [1, 1, 0, 0]
    for kv, outs, _ in got:
        for g, r in zip(outs, want[kv], strict=True):
            assert not g.isnan().any() and torch.equal(g, r)
