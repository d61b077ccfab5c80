"""The four compiled_attn ops under torch.library.opcheck, torch.compile and torch.export (CPU).

opcheck runs its default utilities on every op and argument variant: the schema (no hidden
mutation or aliasing), the autograd registration, the fake (FakeTensor) implementation against
the real one, and AOT dispatch with static and dynamic shapes (``test_aot_dispatch_dynamic``).
Dynamic shapes are exercised once more through torch.compile(dynamic=True) on two sizes. A
backward through an op raises the clear inference-only error. torch.compile(fullgraph=True) and
torch.export of a function calling each op give eager's result.
"""

from __future__ import annotations

import pytest
import torch

import compiled_attn  # noqa: F401
from compiled_attn.ops import schedule
from compiled_attn.ops import (
    MASK_CAUSAL,
    MASK_CUSTOM,
    MASK_NONE,
    POS_ALIBI,
    POS_NONE,
    POS_ROPE_LLAMA,
)
from tests.helpers import alibi_slopes_spec, indptr, pack_segments

OPS = torch.ops.compiled_attn
DEFAULT_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor",
                 "test_aot_dispatch_dynamic")


def _tail(mask_mode=MASK_NONE, window=-1, chunk=0, sm=0.3, cap=0.0, pos=POS_NONE, v_scale=1.0,
          out_dtype=None):
    return (mask_mode, window, chunk, sm, cap, pos, 1.0, 1e4, v_scale, out_dtype)


def single_args(variant: str, sq=5, skv=7):
    hq, hkv, d = (7, 1, 8) if variant == "rope_gqa" else (4, 2, 8)
    q = torch.randn(2, sq, hq, d)
    k = torch.randn(2, hkv, skv, d).transpose(1, 2)  # HND view
    v = torch.randn(2, skv, hkv, d)
    packed = slopes = sinks = None
    tail = _tail(MASK_CAUSAL)
    if variant == "custom_mask":
        packed, _ = pack_segments([torch.rand(2 * sq * skv) < 0.5])
        tail = _tail(MASK_CUSTOM)
    elif variant == "alibi_window":
        slopes = alibi_slopes_spec(hq)
        tail = _tail(MASK_NONE, window=2, pos=POS_ALIBI)
    elif variant == "rope_gqa":
        tail = _tail(MASK_CAUSAL, pos=POS_ROPE_LLAMA)
    elif variant == "sinks_cap":
        sinks = torch.randn(hq)
        tail = _tail(MASK_CAUSAL, cap=2.0, out_dtype=torch.float64)
    return (q, k, v, packed, slopes, sinks) + tail


def _work(qo_lens, hq, hkv, d):
    bm = schedule.block_m_for(d, d, hq // hkv)
    return schedule.build_work(qo_lens, hq // hkv, bm), bm


def ragged_args(variant: str, qo_lens=(3, 5, 0), kv_lens=(6, 5, 2)):
    hq, hkv, d = 4, 2, 8
    q = torch.randn(sum(qo_lens), hq, d)
    k, v = torch.randn(sum(kv_lens), hkv, d), torch.randn(sum(kv_lens), hkv, d)
    work, bm = _work(qo_lens, hq, hkv, d)
    packed = mind = slopes = sinks = None
    tail = _tail(MASK_CAUSAL)
    if variant == "custom_mask":
        packed, mind = pack_segments([torch.rand(a, b) < 0.5 for a, b in zip(qo_lens, kv_lens)])
        tail = _tail(MASK_CUSTOM, window=3)
    elif variant == "alibi":
        slopes = alibi_slopes_spec(hq)
        tail = _tail(MASK_CAUSAL, pos=POS_ALIBI)
    elif variant == "sinks_chunk":
        sinks = torch.randn(hq)
        tail = _tail(MASK_NONE, chunk=2, v_scale=0.5)
    extra = (None, True, 2.0) if variant == "stats_skip" else ()  # merge, row_max, skip
    return (q, k, v, indptr(qo_lens), indptr(kv_lens), work, packed, mind, slopes, sinks,
            bm) + tail + extra


def paged_args(variant: str, qo_lens=(4, 2), kv_lens=(9, 5), page=4):
    hq, hkv, d = (7, 1, 8) if variant == "gqa7" else (4, 2, 8)
    npages = [-(-n // page) for n in kv_lens]
    total = sum(npages) + 1
    cache = torch.randn(total, 2, hkv, page, d)  # HND 5-D cache, handed over as views
    kc, vc = cache[:, 0].transpose(1, 2), cache[:, 1].transpose(1, 2)
    idx = torch.randperm(total)[: sum(npages)].to(torch.int32)
    last = torch.tensor([n - (p - 1) * page for n, p in zip(kv_lens, npages)], dtype=torch.int32)
    q = torch.randn(sum(qo_lens), hq, d)
    work, bm = _work(qo_lens, hq, hkv, d)
    packed = mind = None
    tail = _tail(MASK_CAUSAL)
    if variant == "custom_mask":
        packed, mind = pack_segments([torch.rand(a, b) < 0.5 for a, b in zip(qo_lens, kv_lens)])
        tail = _tail(MASK_CUSTOM)
    elif variant == "rope":
        tail = _tail(MASK_CAUSAL, pos=POS_ROPE_LLAMA, window=3)
    extra = (None, True, 2.0) if variant == "stats_skip" else ()  # merge, row_max, skip
    if variant == "q_rows":  # the op's rows read q's rows through a map (decode key chunks)
        extra = (None, False, 0.0, torch.tensor([1, 0, 2, 1, 1, 0], dtype=torch.int32))
        q = q[:3]
    return (q, kc, vc, indptr(qo_lens), indptr(npages), idx, last, work, packed, mind, None,
            None, bm) + tail + extra


def pod_args(variant: str, qo_p=(5,), kv_p=(8,), n_dec=3):
    hq, hkv, d, page = 4, 2, 8, 4
    p_args = paged_args("plain", qo_p, kv_p, page)
    d_args = paged_args("plain", (1,) * n_dec, (5, 9, 2)[:n_dec], page)
    bm = p_args[12]
    wp = schedule.build_work(list(qo_p), hq // hkv, bm)
    wd = schedule.build_work([1] * n_dec, hq // hkv, bm)
    work = torch.cat([torch.cat([torch.zeros(len(wp), 1, dtype=torch.int32), wp], 1),
                      torch.cat([torch.ones(len(wd), 1, dtype=torch.int32), wd], 1)])
    packed = mind = slopes = None
    pos, mm = POS_NONE, MASK_CAUSAL
    if variant == "alibi_mask":
        slopes = alibi_slopes_spec(hq)
        pos = POS_ALIBI
        packed, mind = pack_segments([torch.rand(a, b) < 0.5 for a, b in zip(qo_p, kv_p)])
        mm = MASK_CUSTOM
    return (p_args[:7] + d_args[:7] + (work, packed, mind, slopes, bm)
            + (mm, -1, 0.3, 0.0, MASK_NONE, 2, 0.25, 1.5, pos, 1.0, 1e4, 1.0, None))


CASES = (
    [("single_prefill", single_args, v)
     for v in ("plain", "custom_mask", "alibi_window", "rope_gqa", "sinks_cap")]
    + [("batch_ragged_prefill", ragged_args, v)
       for v in ("plain", "custom_mask", "alibi", "sinks_chunk", "stats_skip")]
    + [("batch_paged_prefill", paged_args, v)
       for v in ("plain", "custom_mask", "rope", "gqa7", "stats_skip", "q_rows")]
    + [("pod_prefill_decode", pod_args, v) for v in ("plain", "alibi_mask")]
)
IDS = [f"{c[0]}-{c[2]}" for c in CASES]


# The dynamic-shape AOT dispatch utility costs seconds per case on this machine: it runs on the
# first variant of each op and on the masked ragged/paged variants; the other three utilities run
# on every variant.
_DYNAMIC = {"single_prefill-plain", "batch_ragged_prefill-plain", "batch_ragged_prefill-custom_mask",
            "batch_paged_prefill-plain", "pod_prefill_decode-alibi_mask",
            "batch_paged_prefill-stats_skip"}
OPCHECK_PARAMS = [pytest.param(c, u, id=f"{i}-{u}") for c, i in zip(CASES, IDS)
                  for u in DEFAULT_UTILS if u != "test_aot_dispatch_dynamic" or i in _DYNAMIC]


def test_row_map_is_checked():
    # the paged op's and POD's row maps: 1-D int32 on q's device, named when they are not
    args = list(paged_args("q_rows"))
    for bad in (torch.tensor([1, 0, 2, 1, 1, 0]), torch.zeros(6, 1, dtype=torch.int32),
                torch.zeros(12, dtype=torch.int32)[::2]):
        with pytest.raises(ValueError, match="q_rows: a row map"):
            OPS.batch_paged_prefill(*args[:-1], bad)
    p = list(pod_args("plain"))
    with pytest.raises(ValueError, match="q_rows_d: a row map"):
        OPS.pod_prefill_decode(*p, torch.zeros(3, dtype=torch.int64))


@pytest.mark.parametrize("case,util", OPCHECK_PARAMS)
def test_opcheck(case, util):
    """One opcheck utility at a time, so a failure names the utility (all four together are
    opcheck's default test_utils)."""
    name, make, variant = case
    torch.manual_seed(CASES.index(case))
    args = make(variant)
    results = torch.library.opcheck(getattr(OPS, name).default, args, test_utils=util)
    assert results == {util: "SUCCESS"}, results


def test_opcheck_default_utils_are_these():
    """opcheck's default utilities are the four run above (dynamic AOT dispatch included)."""
    import inspect

    default = inspect.signature(torch.library.opcheck).parameters["test_utils"].default
    assert set(default) == set(DEFAULT_UTILS)


@pytest.mark.parametrize("name,make", [
    ("single_prefill", single_args), ("batch_ragged_prefill", ragged_args),
    ("batch_paged_prefill", paged_args), ("pod_prefill_decode", pod_args)])
def test_backward_raises_clear_error(name, make):
    args = list(make("plain"))
    args[0] = args[0].clone().requires_grad_(True)
    outs = getattr(OPS, name)(*args)
    assert outs[0].requires_grad
    with pytest.raises(RuntimeError, match="no backward.*inference-only"):
        outs[0].sum().backward()


def _assert_same(a, b):
    for x, y in zip(a, b):
        assert x.shape == y.shape and x.dtype == y.dtype
        assert not torch.isnan(x).any()
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name,make", [
    ("single_prefill", single_args), ("batch_ragged_prefill", ragged_args),
    ("batch_paged_prefill", paged_args), ("pod_prefill_decode", pod_args)])
def test_compile_fullgraph_and_export_match_eager(name, make):
    torch.manual_seed(0)
    args = make("plain")
    op = getattr(OPS, name)
    tensor_pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    class M(torch.nn.Module):
        def forward(self, *tensors):
            full = list(args)
            for i, t in zip(tensor_pos, tensors):
                full[i] = t
            return op(*full)

    tensors = tuple(args[i] for i in tensor_pos)
    eager = op(*args)
    torch._dynamo.reset()
    compiled = torch.compile(M(), fullgraph=True, backend="inductor")(*tensors)
    _assert_same(compiled, eager)
    ep = torch.export.export(M(), tensors)
    assert any(n.target is op.default for n in ep.graph.nodes if n.op == "call_function"), \
        "the op is not a node of the exported graph"
    _assert_same(ep.module()(*tensors), eager)


def test_compile_dynamic_shapes_ragged():
    """One compile with dynamic token counts serves two sizes (no recompile), results = eager."""
    torch.manual_seed(1)

    def f(q, k, v, qi, ki, work):
        return OPS.batch_ragged_prefill(q, k, v, qi, ki, work, None, None, None, None, 64,
                                        *_tail(MASK_CAUSAL))

    cnt = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    torch._dynamo.reset()
    cf = torch.compile(f, fullgraph=True, backend=cnt)
    for qo, kv in (((3, 5), (6, 5)), ((7, 4), (9, 13))):
        a = ragged_args("plain", qo, kv)
        for t in a[:3]:
            torch._dynamo.mark_dynamic(t, 0)
        _assert_same(cf(*a[:6]), f(*a[:6]))
    assert cnt.frame_count == 1
