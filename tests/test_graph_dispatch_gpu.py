"""GPU tier of compiled_attn.ops.dispatch (run on the H100: ``pytest -m gpu
tests/test_graph_dispatch_gpu.py``): torch.compile'd calls that the Gluon kernel takes eagerly
(POD's Gluon launch included) stay opaque op calls and launch it; AOTInductor packages still
inline the Triton kernel.

Each compiled output is compared bit for bit with the eager op's (the same launch), and with a
float64 reference: error at most twice SDPA's own bf16 error on the same inputs plus one bf16
rounding step of the output's scale, NaN failing. Inputs are fresh random tensors; the ops
allocate their outputs (nothing to poison), and the CUDA-graph case refills its inputs between
replays so that a replay reading stale values would miss the reference.
"""

from __future__ import annotations

import pytest
import torch

import compiled_attn
from compiled_attn.ops import choose
from compiled_attn import fx_passes
from compiled_attn.ops import MASK_CAUSAL, POS_NONE, dispatch, launch, policy
from compiled_attn.ops import prefill_kernel as pk
from compiled_attn.ops.schedule import block_m_for, build_work
from tests.helpers import run_compiled

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(not (torch.cuda.is_available() and choose.device_of(torch.device("cuda")).gluon),
                       reason="the Gluon kernel needs a Hopper GPU"),
]


@pytest.fixture
def gluon_launches(monkeypatch):
    """A list that counts the Gluon kernel's launches from here on. Bound launches are off
    meanwhile: a replay launches the recorded kernel without the launcher counted here (the
    replay itself: test_compiled_call_replays_the_gluon_launch)."""
    calls = []
    real = pk._gluon.launch

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(pk._gluon, "launch", counted)
    with policy.override(bound_launches=False):
        yield calls


def _ragged_call(b=4, s=4096, h=16, d=128):
    """(f, its tensor arguments, the op's other arguments): batch_ragged_prefill through
    torch.ops on B x S causal requests (FlashInfer-sweep shape by default: the Gluon kernel's
    eager choice)."""
    q, k, v = (_rand(b * s, h, d) for _ in range(3))
    indptr = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
    block_m = block_m_for(d, d, 1, s, True, qo_lens=[s] * b)
    work = build_work([s] * b, 1, block_m, "cuda", kv_lens=[s] * b)
    tail = (None, None, None, None, block_m, MASK_CAUSAL, -1, 0, d ** -0.5, 0.0, POS_NONE, 1.0,
            1e4, 1.0, None)

    def f(q, k, v, indptr, work):
        return torch.ops.compiled_attn.batch_ragged_prefill(q, k, v, indptr, indptr, work, *tail)

    return f, (q, k, v, indptr, work), tail


def test_compiled_call_replays_the_gluon_launch():
    """With bound launches on, the compiled graph's run-time call of the opaque op replays the
    eager call's recorded launch (the Gluon kernel), bit for bit the eager result."""
    f, (q, k, v, indptr, work), _ = _ragged_call()
    launch.DEFAULT.clear()
    eager = f(q, k, v, indptr, work)
    kernels = {entry[0].fn.__name__ for bound in launch.DEFAULT._bound.values()
               if isinstance(bound, launch.Bound) for entry in bound.launches}
    assert kernels == {"_gluon_fwd"}, kernels
    hits = launch.DEFAULT.hits
    out, code = run_compiled(torch.compile(f, fullgraph=True), q, k, v, indptr, work)
    assert code.count("torch.ops.compiled_attn.batch_ragged_prefill.default(") == 1
    assert launch.DEFAULT.hits > hits
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


def _sdpa_bound(out, q, k, v):
    """Asserts out ([B, S, H, D], bf16, causal attention of q/k/v [B, S, H, D]) is within twice
    SDPA bf16's own error of the float64 result, plus a bf16 step of the output's scale."""
    def sdpa(*t, dt):
        t = [x.to(dt).transpose(1, 2) for x in t]
        return torch.nn.functional.scaled_dot_product_attention(
            *t, is_causal=True, enable_gqa=True).transpose(1, 2)

    ref = sdpa(q, k, v, dt=torch.float64)
    own = (sdpa(q, k, v, dt=torch.bfloat16).double() - ref).abs().max().item()
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert not torch.isnan(out).any()
    err = (out.double() - ref).abs().max().item()
    assert err <= 2 * own + ref.abs().max().item() * 2.0 ** -8, (err, own)


def _rand(*shape):
    return torch.randn(*shape, device="cuda", dtype=torch.bfloat16)


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_ragged_call_runs_gluon(gluon_launches, dynamic):
    """batch_ragged_prefill (FlashInfer-sweep shape, B 4 x 4k, H 16, D 128, causal) inside
    torch.compile (static or symbolic shapes): one opaque op call, the Gluon kernel launched,
    bitwise the eager result."""
    s = 4096
    f, (q, k, v, indptr, work), tail = _ragged_call(s=s)
    assert dispatch.eager_gluon("batch_ragged_prefill", (q, k, v, indptr, indptr, work,
                                                                *tail))
    eager = f(q, k, v, indptr, work)
    n_eager = len(gluon_launches)
    assert n_eager >= 1
    out, code = run_compiled(torch.compile(f, fullgraph=True, dynamic=dynamic), q, k, v, indptr,
                         work)
    assert code.count("torch.ops.compiled_attn.batch_ragged_prefill.default(") == 1
    assert "_prefill_fwd" not in code
    assert len(gluon_launches) > n_eager  # the compiled call launched it too
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    _sdpa_bound(out[0][:s].unsqueeze(0), *(t[:s].unsqueeze(0) for t in (q, k, v)))


def test_compiled_paged_page16_runs_gluon(gluon_launches):
    """batch_paged_prefill, page 16, shuffled pages: opaque and Gluon in a compiled graph."""
    b, s, h, d, page = 2, 1024, 8, 128, 16
    n_pages = b * s // page
    kc, vc = _rand(n_pages, page, h, d), _rand(n_pages, page, h, d)
    q = _rand(b * s, h, d)
    idx = torch.randperm(n_pages, device="cuda").to(torch.int32)
    qo = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
    pind = torch.arange(0, n_pages + 1, s // page, device="cuda", dtype=torch.int32)
    last = torch.full((b,), page, device="cuda", dtype=torch.int32)
    block_m = block_m_for(d, d, 1, s, True, True, page_size=page, qo_lens=[s] * b)
    work = build_work([s] * b, 1, block_m, "cuda", kv_lens=[s] * b)
    tail = (None, None, None, None, block_m, MASK_CAUSAL, -1, 0, d ** -0.5, 0.0, POS_NONE, 1.0,
            1e4, 1.0, None)

    def f(q, kc, vc, qo, pind, idx, last, work):
        return torch.ops.compiled_attn.batch_paged_prefill(q, kc, vc, qo, pind, idx, last, work,
                                                           *tail)

    eager = f(q, kc, vc, qo, pind, idx, last, work)
    assert len(gluon_launches) == 1
    out, code = run_compiled(torch.compile(f, fullgraph=True), q, kc, vc, qo, pind, idx, last, work)
    assert code.count("torch.ops.compiled_attn.batch_paged_prefill.default(") == 1
    assert len(gluon_launches) > 1  # the compiled call launched it too
    assert torch.equal(out[0], eager[0])
    # request 0's keys in order, checked against SDPA
    k0 = kc[idx[: s // page].long()].reshape(1, s, h, d)
    v0 = vc[idx[: s // page].long()].reshape(1, s, h, d)
    _sdpa_bound(out[0][:s].unsqueeze(0), q[:s].unsqueeze(0), k0, v0)


def _pod_call(kv_d, page, qo, hq=32, hkv=8, d=128):
    """(f, its arguments, the wrapper): a bf16 PODWithPagedKVCacheWrapper planned for decodes
    of kv_d keys on a shuffled cache of page-sized pages, f its causal run() of a qo-token
    prefill."""
    pages = [-(-n // page) for n in kv_d]
    total = sum(pages)
    cache = _rand(total, 2, page, hkv, d)
    i32 = dict(device="cuda", dtype=torch.int32)
    indptr = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), **i32)
    last = torch.tensor([(n - 1) % page + 1 for n in kv_d], **i32)
    idx = torch.randperm(total, device="cuda").to(torch.int32)
    w = compiled_attn.PODWithPagedKVCacheWrapper(torch.empty(1, device="cuda"), "NHD")
    w.plan(indptr, idx, last, hq, hkv, d, page, q_data_type=torch.bfloat16)

    def f(q_p, k_p, v_p, q_d, cache):
        return w.run(q_p, k_p, v_p, q_d, cache, causal_p=True)

    return f, (_rand(qo, hq, d), _rand(qo, hkv, d), _rand(qo, hkv, d), _rand(len(kv_d), hq, d),
               cache), w


@pytest.mark.parametrize("page", [16, 1])
def test_compiled_pod_runs_gluon(monkeypatch, page):
    """PODWithPagedKVCacheWrapper.run under torch.compile (fullgraph), both parts in the Gluon
    POD launch's scope (bf16, D 128, page 16 read by boxes, page 1 gathered, causal): one
    opaque pod_prefill_decode call that
    launches it, equal bit for bit to the eager call's fused launch (the policy keeps both
    fused: a traced call never runs apart)."""
    launches = []
    real = pk._gluon.launch_pod
    monkeypatch.setattr(pk._gluon, "launch_pod", lambda *a, **k: launches.append(1) or real(
        *a, **k))
    f, (q_p, k_p, v_p, q_d, cache), _ = _pod_call([900, 1, 4096, 33], page, 300)
    with policy.override(bound_launches=False, **policy.POD_FUSED):
        eager = f(q_p, k_p, v_p, q_d, cache)
        assert len(launches) == 1
        out, code = run_compiled(torch.compile(f, fullgraph=True), q_p, k_p, v_p, q_d, cache)
    assert code.count("torch.ops.compiled_attn.pod_prefill_decode.default(") == 1, code
    assert len(launches) > 1  # the compiled call launched it too
    for o, e in zip(out, eager):
        assert not o.float().isnan().any() and torch.equal(o, e)
    _sdpa_bound(out[0].unsqueeze(0), q_p.unsqueeze(0), k_p.unsqueeze(0), v_p.unsqueeze(0))


@pytest.mark.parametrize("page", [16, 1])
def test_eager_runs_after_a_compiled_run(page):
    """A POD wrapper compiled and run first (its graph's op call binds the op's launch: the
    Gluon POD launch on page 16, on page 1 with both parts gathered), then run eagerly
    three times: every eager run computes, bit for bit the compiled run's outputs (a wrapper
    that recorded a replay of the op-level bound call once replayed without that launch:
    benchmarks/NOTES.md, 2026-11-28). Eager calls kept to the launch a traced one makes: fused
    (page 1's decodes here are small enough for the eager rule to run the parts apart, which a
    traced call never does) and uncut (the eager call would cut these 16 decodes, policy
    pod_chunks); either would differ within rounding."""
    launch.DEFAULT.clear()
    with policy.override(pod_chunks="off", **policy.POD_FUSED):
        f, (q_p, k_p, v_p, q_d, cache), w = _pod_call([4096] * 15 + [33], page, 2048)
        want, _ = run_compiled(torch.compile(f, fullgraph=True), q_p, k_p, v_p, q_d, cache)
        for _ in range(3):
            got = f(q_p, k_p, v_p, q_d, cache)
            for o, e in zip(got, want):
                assert not o.float().isnan().any() and torch.equal(o, e)
    assert w._memo.hits == 2
    _sdpa_bound(want[0].unsqueeze(0), q_p.unsqueeze(0), k_p.unsqueeze(0), v_p.unsqueeze(0))


def test_compiled_pod_page1_runs_apart(gluon_launches):
    """Page 1 without the gathered Gluon POD launch (pod_gather off): a
    PODWithPagedKVCacheWrapper.run under torch.compile runs the parts as two launches, as the
    eager call does (pod._traced_apart), the decodes' an opaque op on the Gluon kernel
    (gathered pages on the 64-row tile), the prefill's on the kernel its own call takes; the
    decodes equal to eager bit for bit."""
    with policy.override(pod_gather=False):
        _compiled_pod_page1_runs_apart(gluon_launches)


def _compiled_pod_page1_runs_apart(gluon_launches):
    # (sizes above the small-launch bound)
    f, (q_p, k_p, v_p, q_d, cache), w = _pod_call([4096] * 31 + [1], 1, 2048)
    assert (w._plan["block_m"], w._plan["block_m_d"]) == (128, 64)
    eager = f(q_p, k_p, v_p, q_d, cache)
    n_eager = len(gluon_launches)
    assert n_eager >= 1  # the decodes' (the prefill's where its own rules take Gluon)
    out, code = run_compiled(torch.compile(f, fullgraph=True), q_p, k_p, v_p, q_d, cache)
    assert "pod_prefill_decode" not in code, code
    assert code.count("torch.ops.compiled_attn.batch_paged_prefill.default(") == 1, code
    assert len(gluon_launches) >= 2 * n_eager
    assert not out[1].float().isnan().any() and torch.equal(out[1], eager[1])  # the same launch
    _sdpa_bound(out[0].unsqueeze(0), q_p.unsqueeze(0), k_p.unsqueeze(0), v_p.unsqueeze(0))


class _Llama(torch.nn.Module):
    """Causal GQA SDPA on [B, S, H, D] projections seen as [B, H, S, D], as HF Llama writes it
    (enable_gqa; the rewrite passes K/V with packed heads)."""

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=True).transpose(1, 2)


def _llama_inputs():
    return _rand(1, 4096, 32, 128), _rand(1, 4096, 8, 128), _rand(1, 4096, 8, 128)


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_rewrite_runs_gluon(gluon_launches, mode):
    """compiled_attn.compile (the rewrite): the SDPA site becomes one opaque single_prefill
    call that launches the Gluon kernel, also when CUDA graphs capture and replay it
    (reduce-overhead: three calls on fresh inputs copied into the same input tensors)."""
    x = _llama_inputs()
    fx_passes.counters.clear()
    with torch.no_grad():
        model = compiled_attn.compile(_Llama(), fullgraph=True, mode=mode)
        out, code = run_compiled(model, *x)
        assert fx_passes.counters["rewritten"] == 1, dict(fx_passes.counters)
        assert code.count("torch.ops.compiled_attn.single_prefill.default(") == 1
        assert gluon_launches, "the compiled call did not launch the Gluon kernel"
        _sdpa_bound(out, *x)
        for _ in range(3):
            for t in x:
                t.copy_(torch.randn_like(t))
            out = model(*x).clone()
            _sdpa_bound(out, *x)


def test_aoti_package_inlines_triton():
    """AOTInductor (built here; loading packages crashes on this machine's torch, see
    dev/gpu_aoti_probe.py): the same module's package launches the Triton kernel and holds
    no call of our op, though torch.compile keeps that call opaque."""
    import zipfile

    x = _llama_inputs()
    with torch.no_grad():
        ep = compiled_attn.export(_Llama(), x)
        pkg = torch._inductor.aoti_compile_and_package(ep)
    with zipfile.ZipFile(pkg) as z:
        names = z.namelist()
        text = "\n".join(z.read(n).decode(errors="replace") for n in names
                         if n.endswith((".cpp", ".json")))
    assert "compiled_attn" not in text
    assert "_prefill_fwd" in text or any("_prefill_fwd" in n for n in names)
