"""Dynamic shapes: compiled_attn.compile(model, dynamic=True) and compiled_attn.export with a
dynamic sequence dim, on a tiny HF Llama (GQA, random weights), run at several sequence lengths
with one compiled artifact. Each: exact rewrite count, nothing skipped, output vs eager (float32,
tolerance relative to the output's scale, padded query rows excluded).

What dynamic shapes change for the rewrite: sizes in the emitted nodes are SymInts (sym_size
nodes; the packed mask uses the unfold path of _pack_bits), masks built from iota with symbolic
sizes cannot be evaluated at compile time (so even HF's plain causal mask stays a custom mask,
"mask:custom"), and with Inductor Dynamo passes float module attributes (HF's ``self.scaling``)
as 0-d tensor inputs, which the matmul/softmax path folds into q ("scale:runtime").
"""

from __future__ import annotations

import pytest
import torch

import compiled_attn
from compiled_attn import fx_passes

from .helpers import assert_close_rel, check_counters, hf_model

transformers = pytest.importorskip("transformers")

B = 2


def ids_and_mask(s: int, padding: str | None):
    g = torch.Generator().manual_seed(s)
    ids = torch.randint(0, 128, (B, s), generator=g)
    am = torch.ones(B, s, dtype=torch.long)
    if padding == "left":
        am[0, :5] = 0
    return ids, am


def _compile_dynamic(model, runs, record_property):
    """compiled_attn.compile(dynamic=True) run at each (S, padding) of runs, vs eager."""
    from torch._dynamo.utils import counters as dynamo_counters

    fx_passes.counters.clear()
    torch._dynamo.reset()
    dynamo_counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        compiled = compiled_attn.compile(model, dynamic=True, fullgraph=True)
        for s, padding in runs:
            ids, am = ids_and_mask(s, padding)
            out = compiled(ids, am)
            assert out.shape[1] == s
            assert_close_rel(out, model(ids, am), am.bool())
    graphs = dynamo_counters["stats"]["unique_graphs"]
    # Recorded, not required: with dynamic=True one graph serves every length (observed on
    # torch 2.13: 1 graph, no recompile). The requirement is the outputs above.
    record_property("dynamo_unique_graphs", graphs)
    return graphs


# No padding at 16 then 24, then left padding at 24 and at 16: all through the same compiled
# model (the attention mask is a [B, S] input in every call).
RUNS = [(16, None), (24, None), (24, "left"), (16, "left")]


@pytest.mark.slow
def test_compile_dynamic_llama_sdpa(record_property):
    model = hf_model("llama", "sdpa")
    graphs = _compile_dynamic(model, RUNS, record_property)
    # One rewrite per layer per compiled graph; nothing skipped.
    check_counters({"pattern:sdpa": 2 * graphs, "gqa:repeat_kv": 2 * graphs,
                    "mask:custom": 2 * graphs}, layers=2 * graphs)


def test_compile_dynamic_llama_eager_runtime_scale(record_property):
    # HF eager attention: logits * self.scaling, where dynamic=True makes the float a 0-d
    # tensor graph input. Before the fix this site was skipped ("neither side of a logits add
    # leads to q @ k^T"), and reading the where(mask, 0, min) constant crashed under Inductor's
    # fake mode.
    model = hf_model("llama", "eager")
    graphs = _compile_dynamic(model, [(16, "left"), (24, "left")], record_property)
    check_counters({"pattern:matmul_softmax": 2 * graphs, "gqa:repeat_kv": 2 * graphs,
                    "mask:custom": 2 * graphs, "scale:runtime": 2 * graphs},
                   layers=2 * graphs)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("padding", [None, "left", "no_mask"])
def test_export_dynamic_seq(impl, padding):
    model = hf_model("llama", impl)
    seq = torch.export.Dim("seq", min=2, max=64)
    ids, am = ids_and_mask(16, padding)
    if padding == "no_mask":
        am = None
    with torch.no_grad():
        fx_passes.counters.clear()
        ep = compiled_attn.export(model, (ids, am),
                                  dynamic_shapes=({1: seq}, None if am is None else {1: seq}))
        pattern = "pattern:sdpa" if impl == "sdpa" else "pattern:matmul_softmax"
        check_counters({pattern: 2, "gqa:repeat_kv": 2, "mask:custom": 2})
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert "compiled_attn.single_prefill.default" in targets
        assert not [t for t in targets if "scaled_dot_product" in t or "softmax" in t]
        # The sequence length stays symbolic in the program, the packed mask's length too (a
        # pad op once fixed it to the example's: AOTInductor then packed a fixed-size mask).
        ph = next(n for n in ep.graph.nodes if n.op == "placeholder" and n.name == "input_ids")
        assert not isinstance(ph.meta["val"].shape[1], int)
        for n in ep.graph.nodes:
            if n.target is torch.ops.compiled_attn.single_prefill.default:
                assert not isinstance(n.args[3].meta["val"].shape[0], int), n.args[3]
        m = ep.module()
        for s in (16, 24, 7):
            ids, am = ids_and_mask(s, padding)
            if padding == "no_mask":
                am = None
            out = m(ids, am)
            assert out.shape[1] == s
            assert_close_rel(out, model(ids, am), None if am is None else am.bool())


class RuntimeSoftCap(torch.nn.Module):
    """Gemma2-style eager attention whose scale and soft cap are float attributes: under
    dynamic=True Dynamo passes both as 0-d tensor inputs. The scale folds into q; the soft cap
    cannot (the kernel's logits_soft_cap is a compile-time float), so the site is skipped."""

    def __init__(self, cap: float | None):
        super().__init__()
        self.scaling, self.cap = 0.25, cap

    def forward(self, q, k, v):
        w = torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if self.cap is not None:
            w = torch.tanh(w / self.cap) * self.cap
        s = q.shape[2]
        keep = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
        w = w.masked_fill(~keep, float("-inf"))
        return torch.matmul(torch.softmax(w, dim=-1), v)


@pytest.mark.parametrize("cap", [None, 5.0])
def test_compile_dynamic_runtime_soft_cap(cap):
    model = RuntimeSoftCap(cap)
    fx_passes.counters.clear()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        compiled = compiled_attn.compile(model, dynamic=True, fullgraph=True)
        for s in (16, 24):
            q, k, v = torch.randn(3, 2, 4, s, 16, generator=torch.Generator().manual_seed(s))
            assert_close_rel(compiled(q, k, v), model(q, k, v))
    c = fx_passes.counters
    if cap is None:
        assert c["rewritten"] >= 1 and c["scale:runtime"] == c["rewritten"], dict(c)
        assert not [k for k in c if k.startswith("skipped:")], dict(c)
    else:
        assert c["rewritten"] == 0, dict(c)
        assert c["skipped:soft cap by a runtime value (an unspecialized float)"] >= 1, dict(c)


def _sdpa_of_three_inputs(q, k, v):
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)


def test_compile_automatic_dynamic_sdpa_of_separate_inputs():
    """A function of q, k and v as three inputs, compiled (Dynamo's automatic dynamic: its
    second length makes each length a symbol of its own): the SDPA site is rewritten at every
    length (it was skipped from the second on, k's and v's lengths not provably equal), with a
    run-time check that they are; q and k of unprovably equal length take the causal mask as
    packed bits (top-left, as SDPA's is_causal); batch and lengths changing together too."""
    torch._dynamo.reset()
    compiled = compiled_attn.compile(_sdpa_of_three_inputs, fullgraph=True)
    g = torch.Generator().manual_seed(3)
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        for b, sq, skv, want in ((2, 8, 8, "mask:causal"), (2, 13, 13, "mask:custom"),
                                 (3, 11, 17, "mask:custom")):
            q = torch.randn(b, 4, sq, 16, generator=g)
            k, v = (torch.randn(b, 4, skv, 16, generator=g) for _ in range(2))
            fx_passes.counters.clear()
            assert_close_rel(compiled(q, k, v), _sdpa_of_three_inputs(q, k, v))
            c = dict(fx_passes.counters)
            if c:  # (a call the last graph serves adds nothing)
                assert c == {"rewritten": 1, "pattern:sdpa": 1, want: 1}, c
        # k and v of other lengths: SDPA's precondition, checked where the graph is built
        q, k = torch.randn(2, 4, 13, 16), torch.randn(2, 4, 13, 16)
        with pytest.raises(Exception, match="q, k and v disagree in batch, key length"):
            compiled(q, k, torch.randn(2, 4, 15, 16))
