"""compiled_attn.ops.dispatch on CPU: which traced calls stay opaque (for the Gluon kernel)
and which decompose into the Triton launch.

The device description of the launch decision (ops.choose.device_of) is an H100's, so that CPU
tensors stand in for a Hopper GPU's; the ops then still run their CPU
implementation (the reference), so what is checked is the graph: an opaque call in
torch.compile's generated code, none in the decomposed one, none in an AOTInductor package.
The GPU tier (tests/test_fx_gpu.py) runs the same choice on the H100 with the Gluon kernel.
"""

from __future__ import annotations

import math
import zipfile

import pytest
import torch
from torch._library.triton import set_wrap_triton_enabled

from compiled_attn.ops import choose
import compiled_attn
from compiled_attn.ops import dispatch as gd
from compiled_attn.ops import MASK_CAUSAL, MASK_CUSTOM, MASK_NONE, POS_ALIBI, POS_ROPE_LLAMA
from compiled_attn.ops import contracts
from compiled_attn.ops import prefill_kernel as pk
from compiled_attn.ops.policy import POLICY

from .helpers import run_compiled

pytestmark = pytest.mark.skipif(contracts.INTERPRET, reason="ops are plain custom ops under "
                                "TRITON_INTERPRET=1: nothing decomposes")


def test_rule_installed():
    """The rule sits in front of every Gluon-capable op's decomposition (it reaches into
    CustomOpDef._torch_dispatch_fns: a torch that renames it fails here, not silently)."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    assert gd.INSTALLED
    for name in (*OPS, gd.POD_OP):
        rule = getattr(contracts, name)._torch_dispatch_fns[FunctionalTensorMode]
        assert rule.__name__ == "rule" and rule.__module__ == gd.__name__

OPS = gd.GLUON_OPS


@pytest.fixture
def hopper(monkeypatch):
    """CPU tensors pass for a Hopper GPU's (the device checks of the rule and the launcher)."""
    monkeypatch.setattr(choose, "device_of", lambda device: choose.H100)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def call(name, dtype=torch.bfloat16, d=128, dvo=None, mask=MASK_CAUSAL, page=16, split=False,
         out_dtype=None, kv_layout="packed", **opts):
    """The op's arguments (its own order) for a small call on fresh random CPU tensors:
    2 requests of 24 / 40 query and key tokens, 4 query heads over 2 KV heads. kv_layout:
    "packed" (NHD), "hnd" (K/V heads outermost, seen through a permuted view) or "offset"
    (NHD starting one element into their storage: not 16-byte aligned)."""
    dvo = dvo or d
    g = torch.Generator().manual_seed(0)
    lens = [24, 40]
    n = sum(lens)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=g).to(dt)

    def kv_rnd(*shape):  # K or V [..., tokens, Hkv, D] in kv_layout
        if kv_layout == "hnd":
            return rnd(*shape[:-3], shape[-2], shape[-3], shape[-1]).transpose(-3, -2)
        if kv_layout == "offset":
            return rnd(math.prod(shape) + 1)[1:].view(shape)
        return rnd(*shape)

    indptr = torch.tensor([0, 24, 64], dtype=torch.int32)
    params = dict(mask_mode=mask, window_left=-1, chunk_size=0, sm_scale=d ** -0.5,
                  logits_soft_cap=0.0, pos_encoding_mode=0, rope_scale=1.0, rope_theta=1e4,
                  v_scale=1.0)
    params.update({k: v for k, v in opts.items() if k in params})
    alibi = torch.ones(4) if params["pos_encoding_mode"] == POS_ALIBI else None
    sinks = torch.zeros(4) if opts.get("sinks") else None
    mask_bits = torch.zeros(64 * 64, dtype=torch.uint8) if mask == MASK_CUSTOM else None
    tail = (*params.values(), out_dtype)
    if name == "single_prefill":
        return (rnd(1, n, 4, d), kv_rnd(1, n, 2, d), kv_rnd(1, n, 2, dvo), mask_bits, alibi, sinks,
                *tail)
    group = 2
    paged = name == "batch_paged_prefill"
    block_m = opts.get("block_m") or choose.tile(
        d, dvo, group, max(lens), mask != MASK_NONE, paged=paged,
        page_size=page if paged else 0, qo_lens=lens)
    work = torch.zeros(3, 4 if split else 2, dtype=torch.int32)
    mask_indptr = torch.tensor([0, 72, 272], dtype=torch.int32) if mask_bits is not None else None
    head = (rnd(n, 4, d),)
    if paged:
        pages = [-(-x // page) for x in lens]
        kv = (kv_rnd(sum(pages), page, 2, d), kv_rnd(sum(pages), page, 2, dvo),
              indptr, torch.tensor([0, pages[0], sum(pages)], dtype=torch.int32),
              torch.randperm(sum(pages), generator=g).to(torch.int32),
              torch.tensor([x - (p - 1) * page for x, p in zip(lens, pages)], dtype=torch.int32))
    else:
        kv = (kv_rnd(n, 2, d), kv_rnd(n, 2, dvo), indptr, indptr)
    return (*head, *kv, work, mask_bits, mask_indptr, alibi, sinks, block_m, *tail)


def launcher_takes_gluon(name, args) -> bool:
    """The eager launcher's own choice for these arguments (prefill_kernel's argument builders
    with gluon as the op's launch passes it, as in an eager call: wrap_triton off)."""
    a, params = gd.bind(name, args)
    common = (a["alibi_slopes"], a["sinks"])
    out_dtype = a["out_dtype"] or a["q"].dtype
    with set_wrap_triton_enabled(False):
        if name == "single_prefill":
            built = pk._dense_args(a["q"], a["k"], a["v"], a["packed_mask"], *common, out_dtype,
                                   params, gluon=True)
        elif name == "batch_ragged_prefill":
            built = pk._ragged_args(a["q"], a["k"], a["v"], a["qo_indptr"], a["kv_indptr"],
                                    a["packed_mask"], a["mask_indptr"], *common, a["block_m"],
                                    out_dtype, params, a["work"])
        else:
            built = pk._paged_args(a["q"], a["k_cache"], a["v_cache"], a["qo_indptr"],
                                   a["kv_page_indptr"], a["kv_page_indices"],
                                   a["kv_last_page_len"], a["packed_mask"], a["mask_indptr"],
                                   *common, a["block_m"], out_dtype, params, a["work"])
    return built[2].cfg.get("gluon") is not None


# One property away from the base call (bf16, D 128, causal, page 16, NHD K/V) each.
VARIANTS = [
    {}, {"mask": MASK_NONE}, {"mask": MASK_CUSTOM}, {"dtype": torch.float16},
    {"dtype": torch.float32}, {"d": 64}, {"d": 64, "block_m": 128}, {"d": 256},
    {"d": 256, "page": 64}, {"dvo": 64}, {"window_left": 8},
    {"chunk_size": 16}, {"logits_soft_cap": 30.0}, {"pos_encoding_mode": POS_ALIBI},
    {"pos_encoding_mode": POS_ROPE_LLAMA}, {"sinks": True}, {"v_scale": 0.5},
    {"sm_scale": -0.1}, {"out_dtype": torch.float32}, {"split": True}, {"page": 1},
    {"page": 4}, {"page": 8}, {"page": 64}, {"kv_layout": "hnd"}, {"kv_layout": "offset"},
]


@pytest.mark.parametrize("name", OPS)
def test_eager_gluon_agrees_with_the_launcher(hopper, monkeypatch, name):
    """eager_gluon (static: what a trace knows) equals the launcher's own choice on real,
    contiguous tensors, for every variant; the launcher's size rule both ways."""
    seen = set()
    for threshold in (POLICY.host_tma_min_flop, 0):
        monkeypatch.setattr(POLICY, "host_tma_min_flop", threshold)
        for var in VARIANTS:
            if name != "batch_paged_prefill" and "page" in var:
                continue
            if name == "single_prefill" and "split" in var:
                continue
            args = call(name, **var)
            want = launcher_takes_gluon(name, args)
            assert gd.eager_gluon(name, args) == want, (name, var, threshold, want)
            seen.add(want)
    assert seen == {True, False}, (name, seen)  # the grid has calls on both sides


@pytest.mark.parametrize("name", OPS)
def test_head_dim_tiles_stay_opaque(hopper, monkeypatch, name):
    """D 256 and D 64 on 128-row tiles (prefill_gluon.TILES by head dim; no Triton
    descriptors in _config) are the Gluon kernel's eagerly, so traced calls of them stay
    opaque; a soft cap keeps them out of its scope."""
    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    variants = [{"d": 256}] + ([] if name == "single_prefill" else [{"d": 64, "block_m": 128}])
    if name == "batch_paged_prefill":
        variants = [dict(v, page=128) for v in variants]
    for var in variants:
        args = call(name, **var)
        assert gd.eager_gluon(name, args) and launcher_takes_gluon(name, args), var
        capped = call(name, logits_soft_cap=30.0, **var)
        assert not gd.eager_gluon(name, capped) and not launcher_takes_gluon(name, capped)


def test_not_hopper_never_opaque():
    args = call("batch_ragged_prefill")
    assert not gd.eager_gluon("batch_ragged_prefill", args)  # CPU tensors: no Gluon kernel


def test_keep_opaque_only_for_python_wrapper_graphs(hopper, monkeypatch):
    from torch._inductor import config
    from torch._inductor.virtualized import V

    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    args = call("batch_ragged_prefill")
    assert gd.keep_opaque("batch_ragged_prefill", args)
    with V.set_aot_compilation(True):
        assert not gd.keep_opaque("batch_ragged_prefill", args)
    with config.patch(cpp_wrapper=True):
        assert not gd.keep_opaque("batch_ragged_prefill", args)
    monkeypatch.setattr(POLICY, "graph_gluon", False)
    assert not gd.keep_opaque("batch_ragged_prefill", args)
    assert not gd.keep_opaque("pod_prefill_decode", ())


def op_fn(name, args):
    """(fn, tensors): fn(*tensors) calls op ``name`` on args with its tensors passed in (the
    graph's inputs under torch.compile), the other arguments fixed."""
    pos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

    def fn(*ts):
        full = list(args)
        for i, t in zip(pos, ts):
            full[i] = t
        return getattr(torch.ops.compiled_attn, name)(*full)

    return fn, [args[i] for i in pos]


def test_compiled_op_call_stays_opaque(hopper, monkeypatch):
    """A direct call of the op under torch.compile: one fallback call of the op in the
    generated code (the eager launcher runs it), equal to the eager call; graph_gluon off: the
    op decomposed, no call of it left."""
    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    fn, ts = op_fn("batch_ragged_prefill", call("batch_ragged_prefill"))
    eager = fn(*ts)
    out, code = run_compiled(torch.compile(fn, fullgraph=True), *ts)
    assert code.count("torch.ops.compiled_attn.batch_ragged_prefill.default(") == 1, code
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])
    monkeypatch.setattr(POLICY, "graph_gluon", False)
    out, code = run_compiled(torch.compile(fn, fullgraph=True), *ts)
    assert "compiled_attn.batch_ragged_prefill" not in code
    torch.testing.assert_close(out[0], eager[0])


@pytest.mark.parametrize("name", OPS)
def test_dynamic_shapes_stay_opaque(hopper, monkeypatch, name):
    """torch.compile(dynamic=True): the rule reads symbolic sizes (head dims, tile and page
    specialised as constexprs are) and still keeps the call opaque, equal to eager."""
    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    fn, ts = op_fn(name, call(name))
    out, code = run_compiled(torch.compile(fn, fullgraph=True, dynamic=True), *ts)
    assert code.count(f"torch.ops.compiled_attn.{name}.default(") == 1, code
    eager = fn(*ts)
    assert torch.equal(out[0], eager[0]) and torch.equal(out[1], eager[1])


def pod_call(dtype=torch.bfloat16, d=128, page=16, block_m=64, mask_p=MASK_CAUSAL,
             mask_d=None, one_page=True, out_dtype=None, kv_layout="packed", **opts):
    """pod_prefill_decode's arguments (its own order) on fresh random CPU tensors: a prefill of
    24 rows against 30 keys (a one-page cache, as PODWithPagedKVCacheWrapper passes contiguous
    k / v, or pages of ``page`` keys) and 3 single-row decodes of 40 / 17 / 33 keys on pages of
    ``page`` keys; 4 query heads over 2 KV heads. kv_layout "offset": the decode caches start
    one element into their storage (not 16-byte aligned)."""
    g = torch.Generator().manual_seed(1)
    i32 = dict(dtype=torch.int32)

    def rnd(*shape, shift=False):
        if shift:
            return torch.randn(math.prod(shape) + 1, generator=g).to(dtype)[1:].view(shape)
        return torch.randn(*shape, generator=g).to(dtype)

    def paged(lens, shift=False):
        pages = [-(-n // page) for n in lens]
        total = sum(pages)
        return (rnd(total, page, 2, d, shift=shift), rnd(total, page, 2, d, shift=shift),
                torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), **i32),
                torch.randperm(total, generator=g).to(torch.int32),
                torch.tensor([n - (p - 1) * page for n, p in zip(lens, pages)], **i32))

    if one_page:
        prefill = (rnd(1, 30, 2, d), rnd(1, 30, 2, d), torch.tensor([0, 1], **i32),
                   torch.zeros(1, **i32), torch.tensor([30], **i32))
    else:
        prefill = paged([30])
    decode = paged([40, 17, 33], shift=kv_layout == "offset")
    params = dict(window_left=-1, sm_scale=d ** -0.5, logits_soft_cap=0.0)
    params.update({k: v for k, v in opts.items() if k in params})
    common = dict(pos_encoding_mode=0, rope_scale=1.0, rope_theta=1e4, v_scale=1.0)
    common.update({k: v for k, v in opts.items() if k in common})
    alibi = torch.ones(4) if common["pos_encoding_mode"] == POS_ALIBI else None
    part = lambda mask: (mask, *params.values())  # noqa: E731
    return (rnd(24, 4, d), *prefill[:2], torch.tensor([0, 24], **i32), *prefill[2:],
            rnd(3, 4, d), *decode[:2], torch.arange(4, **i32), *decode[2:],
            torch.zeros(3, 3, **i32), None, None, alibi, block_m, *part(mask_p),
            *part(mask_p if mask_d is None else mask_d), *common.values(), out_dtype)


def launcher_takes_gluon_pod(args, monkeypatch) -> bool:
    """Whether the eager POD launcher (prefill_kernel.launch_pod, wrap_triton off) hands these
    arguments to the Gluon POD launch: it runs with both launches replaced by recorders."""
    taken = []
    monkeypatch.setattr(pk._gluon, "launch_pod", lambda *a, **k: taken.append("gluon"))
    monkeypatch.setattr(pk.launch, "run", lambda *a, **k: taken.append("triton"))
    _, p_params, d_params = gd.bind_pod(args)
    with set_wrap_triton_enabled(False):
        pk.launch_pod(*args[:19], p_params, d_params)
    assert len(taken) == 1, taken
    return taken[0] == "gluon"


POD_VARIANTS = [
    {}, {"dtype": torch.float16}, {"block_m": 128}, {"one_page": False}, {"mask_p": MASK_NONE},
    {"dtype": torch.float32}, {"d": 64}, {"page": 1}, {"page": 4}, {"block_m": 256},
    {"mask_d": MASK_NONE}, {"window_left": 8}, {"logits_soft_cap": 30.0},
    {"pos_encoding_mode": POS_ALIBI}, {"pos_encoding_mode": POS_ROPE_LLAMA}, {"v_scale": 0.5},
    {"out_dtype": torch.float32}, {"kv_layout": "offset"},
]


def test_pod_eager_gluon_agrees_with_the_launcher(hopper, monkeypatch):
    """eager_gluon of pod_prefill_decode (choose.pod_gluon, static) equals the eager POD
    launcher's own choice on real tensors, for every variant (a cache starting one element
    into its storage included: its storage offset is known to a trace)."""
    seen = set()
    for var in POD_VARIANTS:
        args = pod_call(**var)
        want = launcher_takes_gluon_pod(args, monkeypatch)
        assert gd.eager_gluon(gd.POD_OP, args) == want, (var, want)
        seen.add(want)
    assert seen == {True, False}
    assert gd.keep_opaque(gd.POD_OP, pod_call())
    monkeypatch.setattr(POLICY, "pod_gluon", False)
    assert not gd.eager_gluon(gd.POD_OP, pod_call())


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_pod_call_stays_opaque(hopper, monkeypatch, dynamic):
    """A POD call under torch.compile that the eager launcher would send to the Gluon POD
    launch stays one fallback call of the op (its eager launcher runs it), equal to the eager
    call (pages read by boxes, page 1's gathered); out of that scope (pages of 12 keys: neither
    boxes nor gathers) and with graph_gluon off it decomposes."""
    for var, opaque in (({}, True), ({"page": 1}, True), ({"page": 12}, False)):
        fn, ts = op_fn(gd.POD_OP, pod_call(**var))
        eager = fn(*ts)
        out, code = run_compiled(torch.compile(fn, fullgraph=True, dynamic=dynamic), *ts)
        assert code.count("torch.ops.compiled_attn.pod_prefill_decode.default(") == opaque, code
        for o, e in zip(out, eager):
            torch.testing.assert_close(o, e)
    monkeypatch.setattr(POLICY, "graph_gluon", False)
    fn, ts = op_fn(gd.POD_OP, pod_call())
    out, code = run_compiled(torch.compile(fn, fullgraph=True), *ts)
    assert "compiled_attn.pod_prefill_decode" not in code


def test_compiled_pod_wrapper_stays_opaque(hopper, monkeypatch):
    """PODWithPagedKVCacheWrapper.run under torch.compile, planned for a Hopper GPU (the Gluon
    POD launch's scope: D 128, page 16, bf16): the traced call stays fused (pod._traced_apart)
    and its op one opaque call, on page 1 too (its pages gathered); planned for pages of 12
    keys (neither boxes nor gathers), or page 1 with pod_gather off, it runs the parts as two
    ops. Equal to the eager call either way (the CPU reference underneath)."""
    monkeypatch.setattr(choose, "_plan_device", lambda: choose.H100)
    g = torch.Generator().manual_seed(3)
    hq, hkv, d = 4, 2, 128
    kv_d = [40, 17, 33]
    for page, fused, gather in ((16, True, True), (1, True, True), (12, False, True),
                                (1, False, False)):
        monkeypatch.setattr(POLICY, "pod_gather", gather)
        pages = [-(-n // page) for n in kv_d]
        total = sum(pages)
        cache = torch.randn(total, 2, page, hkv, d, generator=g).to(torch.bfloat16)
        i32 = dict(dtype=torch.int32)
        w = compiled_attn.PODWithPagedKVCacheWrapper(torch.empty(1), "NHD")
        w.plan(torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), **i32),
               torch.randperm(total, generator=g).to(torch.int32),
               torch.tensor([(n - 1) % page + 1 for n in kv_d], **i32), hq, hkv, d, page,
               q_data_type=torch.bfloat16)
        assert w._plan["fused_gluon"] is fused
        q_p, k_p, v_p = (torch.randn(n, h, d, generator=g).to(torch.bfloat16)
                         for n, h in ((24, hq), (30, hkv), (30, hkv)))
        q_d = torch.randn(len(kv_d), hq, d, generator=g).to(torch.bfloat16)

        def f(q_p, k_p, v_p, q_d, cache):
            return w.run(q_p, k_p, v_p, q_d, cache, causal_p=True)

        eager = f(q_p, k_p, v_p, q_d, cache)
        out, code = run_compiled(torch.compile(f, fullgraph=True), q_p, k_p, v_p, q_d, cache)
        assert code.count("torch.ops.compiled_attn.pod_prefill_decode.default(") == fused, code
        for o, e in zip(out, eager):
            torch.testing.assert_close(o, e)


class _Causal(torch.nn.Module):
    """Causal SDPA on [B, S, H, D] projections seen as [B, H, S, D] (as HF models do): the
    rewrite hands the op K/V with packed heads, which the Gluon kernel reads."""

    def forward(self, q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def _sdpa_inputs():
    g = torch.Generator().manual_seed(5)
    return [torch.randn(1, 32, 4, 128, generator=g).to(torch.bfloat16) for _ in range(3)]


def test_rewrite_keeps_gluon_calls_opaque(hopper, monkeypatch):
    """compiled_attn.compile: the rewritten SDPA site becomes one opaque single_prefill call
    (not the inlined implementation) where the Gluon kernel would take it."""
    from compiled_attn import fx_passes

    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    qkv = _sdpa_inputs()
    fx_passes.counters.clear()
    with torch.no_grad():
        out, code = run_compiled(compiled_attn.compile(_Causal(), fullgraph=True), *qkv)
        ref = _Causal()(*qkv)
    assert fx_passes.counters["rewritten"] == 1, dict(fx_passes.counters)
    assert code.count("torch.ops.compiled_attn.single_prefill.default(") == 1, code
    assert "aten._scaled_dot_product" not in code  # no PyTorch attention call left
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


def test_export_keeps_the_op_without_asking(hopper, monkeypatch):
    """torch.export (dynamic sequence length) and its run_decompositions(), which runs the ops'
    FunctionalTensorMode rule: the op stays a node as before, and the rule is not consulted
    (it would specialise symbolic sizes an export must keep)."""
    asked = []
    monkeypatch.setattr(gd, "keep_opaque", lambda *a, **k: asked.append(a) or True)

    class Op(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.ops.compiled_attn.single_prefill(
                q, k, v, None, None, None, MASK_CAUSAL, -1, 0, 0.1, 0.0, 0, 1.0, 1e4, 1.0,
                None)[0]

    s = torch.export.Dim("s", min=2, max=64)
    ep = torch.export.export(Op(), tuple(_sdpa_inputs()), dynamic_shapes=[{1: s}] * 3)
    ep = ep.run_decompositions()
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.compiled_attn.single_prefill.default in targets and not asked


@pytest.mark.slow
def test_aoti_package_decomposes(hopper, monkeypatch, tmp_path):
    """AOTInductor: even for a call the rule would keep opaque under torch.compile, the package
    holds no call of our op (the C++ runs without Python): the op decomposed."""
    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    qkv = _sdpa_inputs()
    with torch.no_grad():
        ep = compiled_attn.export(_Causal(), qkv)
        node = next(n for n in ep.graph.nodes
                    if n.target is torch.ops.compiled_attn.single_prefill.default)
        vals = tuple(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in node.args)
        assert gd.eager_gluon("single_prefill", vals)  # torch.compile would keep it opaque
        pkg = torch._inductor.aoti_compile_and_package(ep, package_path=str(tmp_path / "m.pt2"))
        with zipfile.ZipFile(pkg) as z:
            text = "\n".join(z.read(n).decode(errors="replace") for n in z.namelist()
                             if n.endswith((".cpp", ".json")))
        assert "compiled_attn" not in text
        out = torch._inductor.aoti_load_package(pkg)(*qkv)
        ref = _Causal()(*qkv)
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)


class _RopeCausal(torch.nn.Module):
    """Llama's shape of attention: projections [B, S, H, D] seen as [B, H, S, D], a pointwise
    rotary step on q and k, then causal SDPA. In eager the rotary output keeps the projection's
    [B, S, H, D] memory order (so the rewrite's permute back is contiguous); Inductor is free to
    lay that pointwise kernel's output out head-major instead."""

    def forward(self, q, k, v, cos, sin):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))

        def rot(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin

        return torch.nn.functional.scaled_dot_product_attention(rot(q), rot(k), v,
                                                                is_causal=True)


def test_rewrite_pins_the_traced_strides(hopper, monkeypatch):
    """The opaque call receives q / k / v with the strides the trace saw ([B, S, H, D]
    contiguous: the eager launcher's Gluon views), not whatever layout Inductor picked for the
    rotary kernel feeding it (head-major with a zero batch stride, on the H100, made the
    launcher decline Gluon and build per-item descriptors: 0.96x causal SDPA end to end)."""
    from compiled_attn import fx_passes
    from compiled_attn.ops import reference

    seen = []
    ref_single = reference.single_prefill

    def recording(q, k, v, *rest, **kw):  # the CPU body of the op (the fallback call runs it)
        seen.append([t.stride() for t in (q, k, v)])
        return ref_single(q, k, v, *rest, **kw)

    monkeypatch.setattr(reference, "single_prefill", recording)
    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    g = torch.Generator().manual_seed(7)
    b, s, h, d = 1, 32, 4, 128
    qkv = [torch.randn(b, s, h, d, generator=g).to(torch.bfloat16) for _ in range(3)]
    cos, sin = (torch.randn(s, d, generator=g).to(torch.bfloat16) for _ in range(2))
    fx_passes.counters.clear()
    with torch.no_grad():
        out, code = run_compiled(compiled_attn.compile(_RopeCausal(), fullgraph=True),
                              *qkv, cos, sin)
        ref = _RopeCausal()(*qkv, cos, sin)
    assert code.count("torch.ops.compiled_attn.single_prefill.default(") == 1, code
    assert fx_passes.counters["rewritten"] == 1, dict(fx_passes.counters)
    packed = (s * h * d, h * d, d, 1)
    assert seen == [[packed] * 3], seen
    torch.testing.assert_close(out, ref, rtol=2e-2, atol=2e-2)
