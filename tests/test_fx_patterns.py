"""Each named pattern of compiled_attn.fx_passes.patterns, exported and rewritten: the counter
keys it must produce, the op in the graph, and output vs eager; the forms that must be left
alone are skipped with their reason and still compute the eager result. Two patterns also go
through compiled_attn.compile (Inductor path)."""

from __future__ import annotations

import inspect

import pytest
import torch

import compiled_attn
from compiled_attn import fx_passes
from compiled_attn.fx_passes import patterns as P

B, HQ, HKV, S, D = 2, 4, 2, 12, 16


class Wrap(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def make_inputs(fn):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, HQ, S, D, generator=g)
    hkv = HKV if any(w in fn.__name__ for w in ("gqa", "interleave", "hf_eager", "gemma2",
                                                 "gpt_oss")) \
        else 1 if "mqa" in fn.__name__ else HQ
    k = torch.randn(B, hkv, S, D, generator=g)
    v = torch.randn(B, hkv, S, D, generator=g)
    args = [q, k, v]
    params = list(inspect.signature(fn).parameters)[3:]
    for p in params:
        if p == "keep":
            pad = torch.ones(B, S, dtype=torch.bool)
            pad[0, :3] = False  # left padding of request 0
            causal = torch.tril(torch.ones(S, S, dtype=torch.bool))
            args.append((causal[None] & pad[:, None, :])[:, None])
        elif p == "bias":
            args.append(torch.randn(B, HQ, S, S, generator=g))
        elif p == "keep_per_head":
            args.append(torch.rand(B, HQ, S, S, generator=g) > 0.3)
        elif p == "sinks":
            args.append(torch.randn(HQ, generator=g))
    return args


def run_export(fn):
    args = make_inputs(fn)
    model = Wrap(fn).eval()
    with torch.no_grad():
        ref = model(*args)
        fx_passes.counters.clear()
        ep = compiled_attn.export(model, tuple(args))
        out = ep.module()(*args)
    ops = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    return ref, out, ops


def close(out, ref):
    assert out.shape == ref.shape, (out.shape, ref.shape)
    err = (out - ref).abs().max().item()
    assert not torch.isnan(out).any()
    assert err <= 2e-5 * ref.abs().max().item() + 1e-6, err


@pytest.mark.parametrize("name", list(P.PATTERNS))
def test_pattern_rewritten(name):
    fn, expected = P.PATTERNS[name]
    ref, out, ops = run_export(fn)
    c = dict(fx_passes.counters)
    assert c.get("rewritten") == 1, c
    for key, n in expected.items():
        assert c.get(key) == n, (key, c)
    assert not [k for k in c if k.startswith("skipped:")], c
    assert torch.ops.compiled_attn.single_prefill.default in ops
    assert not [o for o in ops if "softmax" in str(o) or "scaled_dot" in str(o)], ops
    assert not [o for o in ops if "matmul" in str(o) or "bmm" in str(o)], ops  # no dead scores
    assert "gqa:None" not in c, c  # no GQA: no gqa key at all
    close(out, ref)


@pytest.mark.parametrize("name", list(P.NOT_REWRITTEN))
def test_pattern_skipped_with_reason(name):
    fn, reason = P.NOT_REWRITTEN[name]
    ref, out, ops = run_export(fn)
    c = dict(fx_passes.counters)
    assert c.get("rewritten", 0) == 0, c
    assert sum(v for k, v in c.items() if k.startswith(reason)) == 1, c
    assert torch.ops.compiled_attn.single_prefill.default not in ops
    close(out, ref)


def test_counters_clear():
    fx_passes.counters["rewritten"] += 3
    fx_passes.counters.clear()
    assert fx_passes.counters["rewritten"] == 0


def _compile_pattern(fn):
    """(compiled output, eager output, counters) of pattern fn through compiled_attn.compile."""
    args = make_inputs(fn)
    model = Wrap(fn).eval()
    torch._dynamo.reset()
    fx_passes.counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        ref = model(*args)
        out = compiled_attn.compile(model, fullgraph=True)(*args)
    return out, ref, dict(fx_passes.counters)


def test_float_bias_skipped_under_compile():
    # An additive learned bias through compiled_attn.compile: skipped (with reason), correct.
    out, ref, c = _compile_pattern(P.matmul_softmax_with_bias)
    assert c.get("rewritten", 0) == 0 and any(k.startswith("skipped:additive bias") for k in c), c
    close(out, ref)


def test_softcap_window_under_compile():
    out, ref, c = _compile_pattern(P.gemma2_softcap_sliding)
    assert c.get("rewritten") == 1 and c.get("soft_cap") == 1 \
        and c.get("mask:causal_window") == 1, c
    close(out, ref)


def test_inplace_scale_under_compile():
    # Falcon's `scores /= sqrt(d)`, functionalized: div between two reshapes of the scores.
    out, ref, c = _compile_pattern(P.falcon_inplace_scale)
    assert c.get("rewritten") == 1 and c.get("mask:custom") == 1, c
    close(out, ref)


def test_eager_fully_masked_rows_match():
    # Left padding makes rows 0..2 of request 0 see no key: eager with a dtype-min mask gives
    # the mean of v there; the rewrite patches those rows to match (checked on all rows).
    fn = P.bert_eager_padding
    args = make_inputs(fn)
    ref, out, _ = run_export(fn)
    assert not args[3][0, 0, 0].any()  # the case is really exercised
    close(out, ref)


def _const_node(t: torch.Tensor):
    """A get_attr node of a one-buffer graph holding t (a mask constant as Dynamo leaves it)."""
    import torch.fx as fx

    gm = fx.GraphModule(torch.nn.Module(), fx.Graph())
    gm.register_buffer("m", t)
    node = gm.graph.get_attr("m")
    node.meta["val"] = t
    return node


def test_additive_mask_constant_is_checked_by_value():
    # Dynamo may fold a mask into a graph constant (get_attr): its values decide.
    import math

    from compiled_attn.fx_passes.masks import NotProven, zero_or_neg

    f32 = torch.float32
    assert zero_or_neg(_const_node(torch.tensor([[0.0, -math.inf]])), f32) is False
    assert zero_or_neg(_const_node(torch.tensor([[0.0, torch.finfo(f32).min]])), f32) is True
    with pytest.raises(NotProven, match="values other than 0"):
        zero_or_neg(_const_node(torch.tensor([[0.0, 0.5]])), f32)
    # float16's minimum masks half-precision logits only (below)
    half_min = _const_node(torch.tensor([[0.0, torch.finfo(torch.float16).min]]))
    assert zero_or_neg(half_min, torch.float16) is True
    assert zero_or_neg(half_min, torch.bfloat16) is True
    with pytest.raises(NotProven, match="values other than 0"):
        zero_or_neg(half_min, f32)


def test_masking_constant_depends_on_the_logits_dtype():
    # A finite masking constant must swallow any logit added to it, as -inf would: float32 /
    # bfloat16's minimum (and anything <= -1e30) does in every dtype, float16's -65504 (and
    # below) in float16 and bfloat16 logits; in float32 ones a row whose keys all carry it is
    # softmax of its logits.
    from compiled_attn.fx_passes.masks import is_neg_value

    half_min = torch.finfo(torch.float16).min
    for dt in (torch.float16, torch.bfloat16):
        assert is_neg_value(half_min, dt) and is_neg_value(-1e9, dt)
        assert not is_neg_value(-60000.0, dt)
        # the spacing of dt at -65504 (32 / 512) swallows an ordinary logit: -inf's effect
        assert torch.tensor(half_min, dtype=dt) + 8 == torch.tensor(half_min, dtype=dt)
    for dt in (torch.float32, torch.float64, None):
        assert not is_neg_value(half_min, dt) and not is_neg_value(-1e9, dt)
    assert torch.tensor(half_min) + 8 != torch.tensor(half_min)  # float32: a shift
    for dt in (torch.float16, torch.bfloat16, torch.float32, torch.float64, None):
        assert is_neg_value(float("-inf"), dt) and is_neg_value(-1e30, dt)
        assert is_neg_value(torch.finfo(torch.float32).min, dt)
        assert is_neg_value(torch.finfo(torch.bfloat16).min, dt)
        assert not is_neg_value(0.0, dt) and not is_neg_value(-1.0, dt)


def test_additive_mask_constant_under_fake_mode():
    # Inductor runs the pass with a FakeTensorMode active; the constant is a real tensor.
    import math

    from torch._subclasses.fake_tensor import FakeTensorMode

    from compiled_attn.fx_passes.masks import zero_or_neg

    node = _const_node(torch.tensor([[0.0, -math.inf]], dtype=torch.bfloat16))
    with FakeTensorMode():
        assert zero_or_neg(node, torch.bfloat16) is False


def test_unknown_attention_form_is_counted_as_unmatched():
    # Inductor's CPU decomposition of SDPA with a broadcast K/V head wraps the softmax in a
    # where that zeroes fully masked rows, a form the pass does not match: it is neither
    # rewritten nor skipped, and the counters say so (the output stays eager's).
    out, ref, c = _compile_pattern(P.falcon_mqa_sdpa)
    assert c.get("rewritten", 0) == 0 and c.get("unmatched:softmax @ v") == 1, c
    close(out, ref)
    # a skipped site is not counted again, and a rewritten one leaves nothing to count
    for fn in (P.matmul_softmax_with_bias, P.bert_eager_padding):
        ref, out, _ = run_export(fn)
        assert "unmatched:softmax @ v" not in fx_passes.counters, dict(fx_passes.counters)


_BACKEND_CALLS = {
    "efficient": lambda q, k, v: torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, False, 0.0, True)[0],
    "flash": lambda q, k, v: torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, True)[0],
}
if hasattr(torch.ops.aten, "_scaled_dot_product_cudnn_attention"):
    _BACKEND_CALLS["cudnn"] = lambda q, k, v: torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, False, 0.0, True, False)[0]


@pytest.mark.parametrize("backend", list(_BACKEND_CALLS))
def test_backend_op_with_fewer_kv_heads_is_gqa(backend):
    """CUDA's SDPA backend ops (what Inductor's graph holds for SDPA(enable_gqa=True) there)
    take K/V with fewer heads than Q and group them as enable_gqa does: the rewrite reads that
    as GQA (it skipped such sites before). Traced on the meta device (the backends have no CPU
    kernel); the GPU tier runs the numbers (tests/test_graph_dispatch_gpu.py)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from compiled_attn.fx_passes import rewrite_graph

    q = torch.randn(B, HQ, S, 64, device="meta", dtype=torch.float16)
    k, v = (torch.randn(B, HKV, S, 64, device="meta", dtype=torch.float16) for _ in range(2))
    gm = make_fx(_BACKEND_CALLS[backend], tracing_mode="fake")(q, k, v)
    gm.graph.eliminate_dead_code()  # the op's unused outputs (logsumexp, ...)
    fx_passes.counters.clear()
    rewrite_graph(gm.graph)
    c = dict(fx_passes.counters)
    assert c == {"rewritten": 1, "pattern:sdpa": 1, "gqa:enable_gqa": 1, "mask:causal": 1}, c
    ops = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.compiled_attn.single_prefill.default in ops
    assert not any("scaled_dot_product" in str(t) for t in ops)


def test_pass_uuid_covers_the_inlined_op_code(monkeypatch):
    # Inductor's FX graph cache keys on the pass's uuid(); the rewrite inlines the ops'
    # implementation (the Triton launch on GPU, the reference on CPU) into the cached graph, so
    # their code must be in the key: an upgrade that changes it once got the old body served.
    import os

    from compiled_attn.ops import dispatch, schedule
    from compiled_attn.fx_passes import passes, rewrite
    from compiled_attn.ops import contracts, prefill_gluon, prefill_kernel, reference

    seen = []
    monkeypatch.setattr(passes, "get_hash_for_files",
                        lambda paths, extra="": seen.append((paths, extra)) or b"")
    passes.AttentionRewritePass().uuid()
    (paths, extra), = seen
    hashed = {os.path.realpath(p) for p in paths}
    for mod in (contracts, prefill_kernel, prefill_gluon, reference, schedule, dispatch,
                passes, rewrite):
        assert os.path.realpath(mod.__file__) in hashed, mod.__name__
    assert "enabled=True" in extra and "graph_gluon=" in extra


def _gpt_oss_eager(q, k, v, sinks):
    # GPT-OSS's eager attention (transformers) with a constant causal mask: softmax over the
    # logits and a sink column, sliced back to the keys.
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25
    s = q.shape[2]
    w = w + torch.triu(torch.full((s, s), float("-inf")), 1)
    sk = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, s, -1)
    c = torch.cat([w, sk], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    return torch.matmul(torch.softmax(c, dim=-1)[..., :-1], v)


def _two_finite_masks(q, k, v, keep_pad):
    # Causal and padding as two separate 0 / finfo.min masks: a key both hide sums to -inf.
    neg = torch.finfo(torch.float32).min
    s = q.shape[2]
    causal = torch.triu(torch.full((s, s), neg), 1)
    pad = torch.where(keep_pad[:, None, None, :], 0.0, neg)
    return torch.softmax(q @ k.transpose(-1, -2) * 0.25 + causal + pad, -1) @ v


@pytest.mark.parametrize("dynamic", [False, True])
def test_gpt_oss_sinks_through_compile(dynamic):
    # The sink form through Inductor: the op takes the sinks; the constant causal mask is
    # classified with static shapes and packed as a custom mask with dynamic ones.
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    sinks = torch.randn(4, generator=g)
    torch._dynamo.reset()
    fx_passes.counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        out = compiled_attn.compile(_gpt_oss_eager, fullgraph=True, dynamic=dynamic)(q, k, v,
                                                                                    sinks)
    c = dict(fx_passes.counters)
    mask = "mask:custom" if dynamic else "mask:causal"
    assert c == {"rewritten": 1, "pattern:matmul_softmax_sinks": 1, "sinks": 1, mask: 1}, c
    ref = _gpt_oss_eager(*(t.double() for t in (q, k, v, sinks)))
    eager_err = (_gpt_oss_eager(q, k, v, sinks).double() - ref).abs().max().item()
    assert not out.isnan().any()
    assert (out.double() - ref).abs().max().item() <= 4 * eager_err + 1e-7


def _two_sink_columns(q, k, v, sinks):
    # The sink form with the per-head logit expanded to two columns (two sinks' weight in each
    # denominator): not the op's one sink per head.
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25
    col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[2], 2)
    return torch.matmul(torch.softmax(torch.cat([w, col], dim=-1), dim=-1)[..., :-2], v)


def _one_sink_for_all_heads(q, k, v, sink):
    # The sink form with one logit broadcast to every head: the op takes one per head.
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25
    col = sink.reshape(1, 1, 1, 1).expand(q.shape[0], q.shape[1], q.shape[2], 1)
    return torch.matmul(torch.softmax(torch.cat([w, col], dim=-1), dim=-1)[..., :-1], v)


@pytest.mark.parametrize("case", ["two_finite_masks", "two_sink_columns", "one_sink"])
def test_sites_left_alone_with_a_trace(case):
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    if case == "two_sink_columns":
        fn, extra, want = _two_sink_columns, torch.randn(4, generator=g), "unmatched:softmax @ v"
    elif case == "one_sink":
        fn, extra = _one_sink_for_all_heads, torch.randn(1, generator=g)
        want = "skipped:sinks are not one logit per query head"
    else:
        extra = torch.ones(2, 6, dtype=torch.bool)
        extra[0, :3] = False  # query rows 0-2 of batch 0 see no key (one hidden twice)
        fn, want = _two_finite_masks, "skipped:two finite masks add up"
    torch._dynamo.reset()
    fx_passes.counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        out = compiled_attn.compile(fn, fullgraph=True)(q, k, v, extra)
    c = dict(fx_passes.counters)
    assert c.get("rewritten", 0) == 0 and any(key.startswith(want) for key in c), c
    torch.testing.assert_close(out, fn(q, k, v, extra))


def _attention(q, k, v):
    return torch.softmax(q @ k.transpose(-2, -1) * D ** -0.5, dim=-1) @ v


class _AttentionOut(torch.nn.Module):
    """Returns the attention result itself: the rewritten node is the graph's output."""

    def forward(self, q, k, v):
        return _attention(q, k, v)


class _AttentionAndOther(torch.nn.Module):
    def forward(self, q, k, v):
        return _attention(q, k, v), q.sum(-1)


class _Projected(torch.nn.Module):
    """x [B, S, HQ * D] -> qkv projection -> attention -> (output projection if ``out_proj``)."""

    def __init__(self, out_proj: bool):
        super().__init__()
        self.qkv = torch.nn.Linear(HQ * D, 3 * HQ * D)
        self.o = torch.nn.Linear(HQ * D, HQ * D) if out_proj else None

    def forward(self, x):
        q, k, v = self.qkv(x).view(B, S, 3, HQ, D).permute(2, 0, 3, 1, 4)
        a = _attention(q, k, v)
        return a if self.o is None else self.o(a.transpose(1, 2).reshape(B, S, HQ * D))


@pytest.mark.parametrize("case", ["attention_out", "attention_and_other", "projection_before",
                                  "projections_around"])
def test_export_save_load_with_attention_as_output(case, tmp_path):
    """The rewrite renames the signature's output spec when it replaces a graph output, so
    torch.export.save accepts the program; the loaded program matches a float64 eager run."""
    g = torch.Generator().manual_seed(1)
    if case in ("attention_out", "attention_and_other"):
        model = _AttentionOut() if case == "attention_out" else _AttentionAndOther()
        args = [torch.randn(B, HQ, S, D, generator=g) for _ in range(3)]
    else:
        torch.manual_seed(1)
        model = _Projected(out_proj=case == "projections_around")
        args = [torch.randn(B, S, HQ * D, generator=g)]
    model.eval()
    with torch.no_grad():
        ref = model.double()(*[a.double() for a in args])
        eager = model.float()(*args)
        fx_passes.counters.clear()
        ep = compiled_attn.export(model, tuple(args))
        assert fx_passes.counters["rewritten"] == 1, dict(fx_passes.counters)
        torch.export.save(ep, tmp_path / "ep.pt2")
        ep2 = torch.export.load(tmp_path / "ep.pt2")
        assert any(n.target is torch.ops.compiled_attn.single_prefill.default
                   for n in ep2.graph.nodes)
        out = ep2.module()(*args)
    refs, eagers, outs = ((x,) if torch.is_tensor(x) else tuple(x) for x in (ref, eager, out))
    assert len(outs) == len(refs)
    for o, r, e in zip(outs, refs, eagers):
        assert o.shape == r.shape and not torch.isnan(o).any()
        err, eager_err = ((t.double() - r).abs().max().item() for t in (o, e))
        assert err <= 4 * eager_err + 1e-6 * r.abs().max().item(), (err, eager_err)


def _export_counts(fn, args):
    """(eager output, exported-and-rewritten output, the pass's counters) of fn(*args)."""
    model = Wrap(fn).eval()
    with torch.no_grad():
        ref = model(*args)
        fx_passes.counters.clear()
        out = compiled_attn.export(model, tuple(args)).module()(*args)
    return ref, out, dict(fx_passes.counters)


def _sdpa_mask_and_causal(q, k, v, keep):
    # SDPA with both attn_mask and is_causal (torch applies both: mask & tril)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                                            is_causal=True)


def test_sdpa_mask_with_is_causal_keeps_both():
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    keep = torch.ones(2, 1, 1, 6, dtype=torch.bool)
    keep[0, ..., 4:] = False  # padding at the end: every row still sees key 0
    ref, out, c = _export_counts(_sdpa_mask_and_causal, [q, k, v, keep])
    assert c == {"rewritten": 1, "pattern:sdpa": 1, "mask:custom": 1}, c
    close(out, ref)


class _ConstMaskAndCausal(torch.nn.Module):
    """is_causal with a constant mask: all True (then plain causal) or a band of 3 keys (then
    causal with window_left 2)."""

    def __init__(self, band: bool):
        super().__init__()
        self.band = band

    def forward(self, q, k, v):
        s = q.shape[2]
        i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
        keep = (j >= i - 2) if self.band else torch.ones(s, s, dtype=torch.bool)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep,
                                                                is_causal=True)


@pytest.mark.parametrize("band,kind", [(False, "mask:causal"), (True, "mask:causal_window")])
def test_sdpa_constant_mask_with_is_causal_classified_with_it(band, kind):
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    model = _ConstMaskAndCausal(band).eval()
    with torch.no_grad():
        ref = model(q, k, v)
        fx_passes.counters.clear()
        out = compiled_attn.export(model, (q, k, v)).module()(q, k, v)
    assert dict(fx_passes.counters) == {"rewritten": 1, "pattern:sdpa": 1, kind: 1}
    close(out, ref)


class _RandomMask(torch.nn.Module):
    """A mask drawn by torch.rand at every call: never a compile-time constant."""

    def __init__(self, threshold: float):
        super().__init__()
        self.threshold = threshold

    def forward(self, q, k, v):
        keep = torch.rand(q.shape[2], k.shape[2]) > self.threshold
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)


@pytest.mark.parametrize("threshold", [-1.0, 0.3])
def test_random_mask_stays_a_run_time_mask(threshold):
    """Not evaluated (nor removed) at rewrite time, even where every draw keeps every key
    (threshold -1); the rewritten graph draws at each call as eager does."""
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 2, 6, 8, generator=g) for _ in range(3))
    model = _RandomMask(threshold).eval()
    with torch.no_grad():
        fx_passes.counters.clear()
        mod = compiled_attn.export(model, (q, k, v)).module()
        assert dict(fx_passes.counters) == {"rewritten": 1, "pattern:sdpa": 1, "mask:custom": 1}
        torch.manual_seed(1)
        got = mod(q, k, v)
        torch.manual_seed(1)
        close(got, model(q, k, v))


def _inf_beside_finite(q, k, v, keep_pad):
    # nanoGPT's -inf causal mask beside a finfo.min padding mask: a fully masked row averages v
    # over the keys only the padding hides
    s = q.shape[2]
    att = q @ k.transpose(-2, -1) * 0.25 + torch.triu(torch.full((s, s), float("-inf")), 1)
    att = att + torch.where(keep_pad[:, None, None, :], 0.0, torch.finfo(q.dtype).min)
    return torch.softmax(att, -1) @ v


def _probs_to_bool(q, k, v):
    # not attention: the probabilities cast to bool and back
    return torch.softmax(q @ k.transpose(-2, -1) * 0.25, -1).to(torch.bool).to(q.dtype) @ v


@pytest.mark.parametrize("case", ["inf_beside_finite", "probs_to_bool"])
def test_look_alikes_left_alone_by_export(case):
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(2, 4, 6, 8, generator=g) for _ in range(3))
    if case == "inf_beside_finite":
        keep = torch.ones(2, 6, dtype=torch.bool)
        keep[0, :3] = False  # rows 0-2 of batch 0 see no key
        fn, args, want = _inf_beside_finite, [q, k, v, keep], "skipped:a finite-NEG mask"
    else:
        fn, args, want = _probs_to_bool, [q, k, v], "unmatched:softmax @ v"
    ref, out, c = _export_counts(fn, args)
    assert c.get("rewritten", 0) == 0 and any(key.startswith(want) for key in c), c
    torch.testing.assert_close(out, ref)


def _scale_through_a_view(q, k, v):
    # the scores scaled in place through a view of them, and the scores read afterwards
    s = q @ k.transpose(-1, -2)
    sv = s.view(s.shape)
    sv.div_(4.0)
    return torch.softmax(sv, -1) @ v, s.sum(-1)


def test_inplace_scale_through_a_view_is_not_erased():
    """An in-place scale on a view writes through to the viewed tensor: the site is skipped
    (its div_ was erased as private, and the other reader of the scores got them unscaled)."""
    g = torch.Generator().manual_seed(40)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    ref, out, counts = _export_counts(_scale_through_a_view, (q, k, v))
    for a, b in zip(ref, out):
        torch.testing.assert_close(b, a)
    assert counts == {"skipped:unsupported op div_.Tensor between q @ k^T and softmax": 1}


def test_training_graph_counts_hand_written_sites():
    """With grad enabled the graph is a training graph: the pass rewrites nothing and counts
    every site, hand-written ones too (they were not counted)."""
    g = torch.Generator().manual_seed(41)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g, requires_grad=True) for _ in range(3))

    def attend(q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1) @ v

    fx_passes.counters.clear()
    out = compiled_attn.compile(attend)(q, k, v)
    torch.testing.assert_close(out, attend(q, k, v))
    assert dict(fx_passes.counters) == {"skipped:training graph (ops are inference-only)": 1}

    def attend_sin(q, k, v):  # a site the inference path skips with a reason (the count raised)
        return torch.softmax(torch.sin(q @ k.transpose(-1, -2)), -1) @ v

    torch._dynamo.reset()
    fx_passes.counters.clear()
    out = compiled_attn.compile(attend_sin)(q, k, v)
    torch.testing.assert_close(out, attend_sin(q, k, v))
    assert dict(fx_passes.counters) == {"skipped:training graph (ops are inference-only)": 1}


class _CacheAfterScores(torch.nn.Module):
    """A K buffer read by the scores, then written (copy_) before P @ V; or written before the
    scores (a cache update, as gpt-fast's), which the rewrite keeps."""

    def __init__(self, after: bool):
        super().__init__()
        self.after = after
        self.register_buffer("kbuf", torch.randn(2, 4, 8, 16,
                                                 generator=torch.Generator().manual_seed(43)))

    def forward(self, q, knew, v):
        if not self.after:
            self.kbuf.copy_(knew)
        p = torch.softmax(q @ self.kbuf.transpose(-1, -2) * 0.25, -1)
        if self.after:
            self.kbuf.copy_(knew)
        return p @ v


def _q_written_after_scores(q, k, v):
    p = torch.softmax(q @ k.transpose(-1, -2) * 0.25, -1)
    q.mul_(2.0)  # (through q's own node: a view of it would write the same storage)
    return p @ v


@pytest.mark.parametrize("case", ["cache_after", "q_after", "cache_before"])
def test_export_site_with_inputs_written_after_the_scores(case):
    """Export's IR keeps in-place ops; the rewrite's op sits at the output, so a q, k or mask
    written in place between the scores and the output would reach it written (2.30 and 1.47
    off): such a site is skipped with its reason. A cache written before the scores is read
    as the original reads it: rewritten."""
    import copy

    g = torch.Generator().manual_seed(44)
    q, k, v = (torch.randn(2, 4, 8, 16, generator=g) for _ in range(3))
    model = (Wrap(_q_written_after_scores) if case == "q_after"
             else _CacheAfterScores(case == "cache_after")).eval()
    with torch.no_grad():
        ref = copy.deepcopy(model)(q.clone(), k, v)
        fx_passes.counters.clear()
        ep = compiled_attn.export(copy.deepcopy(model), (q.clone(), k, v))
        out = ep.module()(q.clone(), k, v)
    counts = dict(fx_passes.counters)
    torch.testing.assert_close(out, ref)
    if case == "cache_before":
        assert counts.get("rewritten") == 1, counts
    else:
        assert counts == {"skipped:q, k or a mask written in place between the scores and the "
                          "output": 1}, counts
