"""compiled_attn.compile / compiled_attn.export on tiny models (random weights, no download):
HF Llama (GQA), Mistral (sliding window), Gemma2 (soft cap + sliding window), Qwen2, GPT-2,
BERT (bidirectional, padding), eager and sdpa attention, with and without padding, and a
gpt-fast-style module. Each: exact rewrite count (one per attention layer, nothing skipped),
output vs eager (float32, tolerance relative to the output's scale, padded query rows
excluded), and that the compiled code no longer holds PyTorch's attention. A few go through
torch.export -> save/load -> AOTInductor -> a fresh process (test_fx_aoti.py).
"""

from __future__ import annotations

import pytest
import torch

import compiled_attn
from compiled_attn import fx_passes

from .helpers import GptFast, assert_close_rel, check_counters, compile_and_run, hf_model, inputs

transformers = pytest.importorskip("transformers")

# (model, impl, padding, expected counters besides rewritten == LAYERS)
HF_CASES = [
    ("llama", "sdpa", None, {"pattern:sdpa": 2, "gqa:repeat_kv": 2, "mask:causal": 2}),
    ("llama", "sdpa", "left", {"pattern:sdpa": 2, "gqa:repeat_kv": 2, "mask:custom": 2}),
    ("llama", "eager", None, {"pattern:matmul_softmax": 2, "gqa:repeat_kv": 2,
                              "mask:causal": 2}),
    ("llama", "eager", "left", {"pattern:matmul_softmax": 2, "mask:custom": 2}),
    ("mistral", "sdpa", None, {"mask:causal_window": 2}),
    ("mistral", "eager", "left", {"mask:custom": 2}),
    ("gemma2", "eager", None, {"soft_cap": 2, "mask:causal_window": 1, "mask:causal": 1}),
    ("gemma2", "eager", "left", {"soft_cap": 2, "mask:custom": 2}),
    ("qwen2", "sdpa", "left", {"gqa:repeat_kv": 2, "mask:custom": 2}),
    ("qwen2", "eager", None, {"gqa:repeat_kv": 2, "mask:causal": 2}),
    ("gpt2", "eager", "left", {"pattern:matmul_softmax": 2, "mask:custom": 2}),
    ("gpt2", "sdpa", None, {"pattern:sdpa": 2, "mask:causal": 2}),
    ("bert", "sdpa", "right", {"pattern:sdpa": 2, "mask:custom": 2}),
    ("bert", "eager", "right", {"pattern:matmul_softmax": 2, "mask:custom": 2}),
    ("bert", "sdpa", None, {"pattern:sdpa": 2, "mask:none": 2}),
]


def _id(case):
    return f"{case[0]}-{case[1]}-{case[2] or 'nopad'}"


@pytest.mark.parametrize("case", HF_CASES, ids=_id)
def test_hf_compile(case):
    name, impl, padding, kinds = case
    model = hf_model(name, impl)
    ids, am = inputs(padding)
    with torch.no_grad():
        ref = model(ids, am)
    out, code = compile_and_run(model, ids, am)
    check_counters(kinds)
    assert "scaled_dot_product" not in code
    # Padded query rows are compared too where they see valid keys (BERT, right padding).
    rows = am.bool() if am is not None and name != "bert" else None
    assert_close_rel(out, ref, rows)


@pytest.mark.parametrize("case", HF_CASES, ids=_id)
def test_hf_export(case):
    name, impl, padding, kinds = case
    model = hf_model(name, impl)
    ids, am = inputs(padding)
    with torch.no_grad():
        ref = model(ids, am)
        fx_passes.counters.clear()
        ep = compiled_attn.export(model, (ids, am))
        check_counters({})
        targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
        assert "compiled_attn.single_prefill.default" in targets
        leftover = [t for t in targets if "scaled_dot_product" in t or "softmax" in t]
        assert not leftover, leftover
        out = ep.module()(ids, am)
    assert_close_rel(out, ref, am.bool() if am is not None and name != "bert" else None)


def test_gpt_fast_compile_and_export():
    model = GptFast().eval()
    idx = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(12)
    with torch.no_grad():
        ref = model(idx, pos)
    out, code = compile_and_run(model, idx, pos)
    # Inductor decomposes repeat_interleave into repeat_kv's unsqueeze/expand/reshape.
    check_counters({"pattern:sdpa": 2, "gqa:repeat_kv": 2, "mask:custom": 2})
    assert_close_rel(out, ref)
    with torch.no_grad():
        fx_passes.counters.clear()
        ep = compiled_attn.export(model, (idx, pos))
        check_counters({"gqa:repeat_interleave": 2, "mask:custom": 2})
        assert_close_rel(ep.module()(idx, pos), ref)
