"""compiled_attn.hf.register(): attn_implementation="compiled_attn" in HF transformers runs
our op (padding through the registered mask function, sliding window, Gemma2 soft cap) and
matches the model's own eager/sdpa attention."""

from __future__ import annotations

import pytest
import torch

from .test_fx_models import Logits, assert_close_rel, hf_model, inputs

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module", autouse=True)
def registered():
    import compiled_attn.hf

    assert compiled_attn.hf.register() == "compiled_attn"


@pytest.mark.parametrize("name,ref_impl,padding", [
    ("llama", "sdpa", "left"), ("llama", "sdpa", None), ("mistral", "eager", None),
    ("mistral", "sdpa", "left"), ("gemma2", "eager", None), ("gemma2", "eager", "left"),
    ("bert", "sdpa", "right"),
])
def test_hf_attn_implementation(name, ref_impl, padding, monkeypatch):
    ref_model = hf_model(name, ref_impl)
    ours = hf_model(name, ref_impl)
    ours.model.set_attn_implementation("compiled_attn")
    calls = []
    op = torch.ops.compiled_attn.single_prefill
    import compiled_attn.hf as hf

    real = hf.attention_forward

    def spy(*a, **k):
        calls.append(1)
        return real(*a, **k)

    transformers.AttentionInterface.register("compiled_attn", spy)
    ids, am = inputs(padding)
    with torch.no_grad():
        ref = ref_model(ids, am)
        out = ours(ids, am)
    assert len(calls) == 2 and op is not None  # one call per layer went through our kernel
    rows = am.bool() if am is not None and name != "bert" else None
    assert_close_rel(out, ref, rows)


@pytest.mark.parametrize("padding", [None, "left"])
def test_hf_attn_implementation_torch_compile(padding):
    """attn_implementation="compiled_attn" under torch.compile(fullgraph=False): Dynamo traces
    the attention function and our op (no graph break), output matches eager sdpa."""
    from torch._dynamo.utils import counters as dynamo_counters

    ref_model = hf_model("llama", "sdpa")
    ours = hf_model("llama", "sdpa")
    ours.model.set_attn_implementation("compiled_attn")
    ids, am = inputs(padding)
    torch._dynamo.reset()
    dynamo_counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        ref = ref_model(ids, am)
        out = torch.compile(ours, fullgraph=False)(ids, am)
    assert not dict(dynamo_counters["graph_break"]), dict(dynamo_counters["graph_break"])
    rows = am.bool() if am is not None else None
    assert_close_rel(out, ref, rows)
