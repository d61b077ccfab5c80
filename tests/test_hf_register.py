"""compiled_attn.hf.register(): attn_implementation="compiled_attn" in HF transformers runs
our op (padding through the registered mask function, sliding window, Gemma2 soft cap) and
matches the model's own eager/sdpa attention."""

from __future__ import annotations

import pytest
import torch

import compiled_attn
from compiled_attn import fx_passes

from .helpers import assert_close_rel, hf_model, inputs

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


@pytest.mark.slow
def test_hf_attention_sinks_gpt_oss():
    """GPT-OSS passes its attention sinks as s_aux (one logit per query head in each row's
    softmax denominator): they reach the op's sinks (they were dropped, 0.28 off at logits of
    0.56), on alternating sliding-window layers, and match the model's eager attention."""
    if not hasattr(transformers, "GptOssConfig"):
        pytest.skip("this transformers has no GPT-OSS")
    torch.manual_seed(0)
    cfg = transformers.GptOssConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
        num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=128)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "sinks"):
                m.sinks.normal_(0, 2.0)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def logits(impl):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            return model(input_ids=ids, use_cache=False).logits

    ref = logits("eager")
    assert_close_rel(logits("compiled_attn"), ref)
    # The eager attention itself, compiled: the rewrite finds its sink form on every layer
    # (softmax over the logits and a sink column, sliced back) and passes the sinks to the op.
    model.set_attn_implementation("eager")
    torch._dynamo.reset()
    fx_passes.counters.clear()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        out = compiled_attn.compile(model)(input_ids=ids, use_cache=False).logits
    c = dict(fx_passes.counters)
    assert c.get("pattern:matmul_softmax_sinks") == 2 and c.get("sinks") == 2, c
    assert not [k for k in c if k.startswith(("skipped:", "unmatched:"))], c
    assert_close_rel(out, ref)


def test_hf_unsupported_arguments_raise():
    """What the op cannot take raises NotImplementedError naming it: T5's position_bias, a
    head_mask, an additive float mask (each was dropped or misreported)."""
    from compiled_attn.hf import attention_forward

    class Module(torch.nn.Module):
        is_causal = True

    q = k = v = torch.randn(1, 2, 4, 8)
    bias = torch.zeros(1, 2, 4, 4)
    for kw, match in ((dict(position_bias=bias), "position_bias"),
                      (dict(head_mask=torch.ones(2)), "head_mask")):
        with pytest.raises(NotImplementedError, match=match):
            attention_forward(Module(), q, k, v, None, **kw)
    with pytest.raises(NotImplementedError, match="additive torch.float32 mask"):
        attention_forward(Module(), q, k, v, bias)
    attention_forward(Module(), q, k, v, None, position_bias=None)  # None: nothing to drop


def test_hf_packbits_no_guard_on_padding():
    """The HF mask packing (compiled_attn.packbits, little-endian) is numpy's, and under
    torch.compile(dynamic=True) one graph serves lengths whose B * S * S bits do or do not
    fill whole bytes (it branched on the padding: a recompile when that flipped)."""
    import numpy as np
    from torch._dynamo.utils import counters

    from compiled_attn.utils import packbits

    def _packbits_rows(m):
        return packbits(m, bitorder="little")

    g = torch.Generator().manual_seed(7)
    for shape in ((1, 1, 1), (2, 5, 5), (2, 16, 16), (3, 7, 11)):
        m = torch.rand(shape, generator=g) > 0.5
        want = np.packbits(m.reshape(-1).numpy(), bitorder="little")
        assert np.array_equal(_packbits_rows(m).numpy(), want), shape
    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(_packbits_rows, dynamic=True, fullgraph=True, backend="eager")
    for s in (5, 9, 16, 11):  # 2 * s * s % 8: 2, 2, 0, 2
        m = torch.rand(2, s, s, generator=g) > 0.5
        assert torch.equal(f(m), _packbits_rows(m))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_hf_sparse_attention_indices_raise():
    """DeepSeek-V3.2-style sparse attention passes the keys each query attends as ``indices``
    to any implementation but eager / sdpa: the op has no such input, so it raises (it was
    dropped: dense attention)."""
    from compiled_attn.hf import attention_forward

    class Module(torch.nn.Module):
        is_causal = True

    q = k = v = torch.randn(1, 2, 4, 8)
    for name in ("indices", "block_indices", "sinks"):
        with pytest.raises(NotImplementedError, match=name):
            attention_forward(Module(), q, k, v, None, **{name: torch.zeros(1, 4, 2)})


def test_hf_model_computing_attention_itself_raises():
    """Bloom computes its attention itself and adds the mask it asks for as a float mask: with
    attn_implementation="compiled_attn" its mask function raises instead of handing it a bool
    mask (future keys and padding stayed visible)."""
    cfg = transformers.BloomConfig(vocab_size=128, hidden_size=64, n_layer=1, n_head=4,
                                   attn_implementation="compiled_attn")
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    with torch.no_grad(), pytest.raises(NotImplementedError, match="bloom computes its "
                                                                   "attention itself"):
        model(torch.randint(0, 128, (1, 6)))


def test_hf_gemma4_logits_to_keep_with_kv_shared_layers():
    """Gemma 4 keeps only the last queries before its KV-shared layers, with the masks it built:
    every mask is built for it (a None mask, causal top-left, is wrong for those queries);
    logits_to_keep and a static-cache generate() match eager."""
    if not hasattr(transformers, "Gemma4TextConfig"):
        pytest.skip("this transformers has no Gemma 4")
    import copy

    cfg = transformers.Gemma4TextConfig(
        vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=16,
        max_position_embeddings=128, sliding_window=8, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=100, num_kv_shared_layers=2,
        layer_types=["sliding_attention", "full_attention"] * 2)
    models = {}
    for impl in ("compiled_attn", "eager"):
        torch.manual_seed(0)
        models[impl] = transformers.AutoModelForCausalLM.from_config(
            copy.deepcopy(cfg), attn_implementation=impl).eval()
    models["compiled_attn"].load_state_dict(models["eager"].state_dict())
    ids = torch.randint(3, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = {n: m(ids, logits_to_keep=4).logits for n, m in models.items()}
        assert_close_rel(out["compiled_attn"], out["eager"])
        gen = {n: torch.stack(m.generate(ids, max_new_tokens=3, do_sample=False,
                                         cache_implementation="static", output_logits=True,
                                         return_dict_in_generate=True).logits, 1)
               for n, m in models.items()}
        assert_close_rel(gen["compiled_attn"], gen["eager"])
