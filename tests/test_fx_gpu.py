"""GPU tier of the FX rewrite (run on the H100: ``pytest -m gpu tests/test_fx_gpu.py``).

Tiny HF Llama (GQA, sdpa; causal and left padding), Mistral (sdpa, sliding window), Gemma2
(eager, soft cap + sliding window), Qwen2 (one KV head, left padding), GPT-2 (eager, left
padding), BERT (bidirectional, right padding), GPT-OSS (eager, attention sinks) and the
gpt-fast-style module (repeat_interleave GQA, KV-cache mask) in bf16 on CUDA through
``compiled_attn.compile``: the exact rewrite counts (one per layer, nothing skipped), that
Inductor's generated code launches our Triton kernel ``_prefill_fwd`` and no PyTorch attention,
and the output error against the same model (same bf16-rounded weights) in float64 on the CPU:
at most twice eager bf16's own error plus one bf16 rounding step of the output's scale, over
the non-padded rows.
"""

from __future__ import annotations

import copy

import pytest
import torch

import compiled_attn
from compiled_attn import fx_passes
from tests.helpers import GptFast, Logits

transformers = pytest.importorskip("transformers")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

B, S, LAYERS = 2, 128, 2


def build(name: str, impl: str):
    common = dict(vocab_size=256, hidden_size=256, intermediate_size=512,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2,
                  max_position_embeddings=512, attn_implementation=impl)
    if name == "llama":
        cfg = transformers.LlamaConfig(**common)
    elif name == "mistral":
        cfg = transformers.MistralConfig(sliding_window=48, **common)
    elif name == "gemma2":
        cfg = transformers.Gemma2Config(head_dim=64, sliding_window=48, query_pre_attn_scalar=64,
                                        attn_logit_softcapping=30.0, **common)
    elif name == "qwen2":
        cfg = transformers.Qwen2Config(**dict(common, num_key_value_heads=1))
    elif name == "gpt2":
        cfg = transformers.GPT2Config(vocab_size=256, n_embd=256, n_layer=LAYERS, n_head=4,
                                      n_positions=512, attn_implementation=impl)
    elif name == "bert":
        cfg = transformers.BertConfig(vocab_size=256, hidden_size=256, num_hidden_layers=LAYERS,
                                      num_attention_heads=4, intermediate_size=512,
                                      max_position_embeddings=512, attn_implementation=impl)
    elif name == "gpt_oss":
        if not hasattr(transformers, "GptOssConfig"):
            pytest.skip("this transformers has no GPT-OSS")
        cfg = transformers.GptOssConfig(head_dim=64, sliding_window=48, num_local_experts=4,
                                        num_experts_per_tok=2, **common)
    elif name == "gpt_fast":
        return GptFast(max_seq=S, dim=256).eval().to("cuda", torch.bfloat16)
    else:
        raise KeyError(name)
    torch.manual_seed(0)
    model = (transformers.BertModel(cfg) if name == "bert"
             else transformers.AutoModelForCausalLM.from_config(cfg)).eval()
    with torch.no_grad():  # GPT-OSS's sinks (zeros at init) large enough to matter
        for m in model.modules():
            if isinstance(getattr(m, "sinks", None), torch.nn.Parameter):
                m.sinks.normal_(0, 2.0)
    return Logits(model.to("cuda", torch.bfloat16))


def make_inputs(name, padding):
    """(CPU arguments, rows compared [B, S] bool): padded query rows are excluded except for
    BERT, whose padded rows see the valid keys."""
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (B, S), generator=g)
    if name == "gpt_fast":
        return (ids[:1] % 128, torch.arange(S)), torch.ones(1, S, dtype=torch.bool)
    am = torch.ones(B, S, dtype=torch.long)
    if padding == "left":
        am[0, :37] = 0
    elif padding == "right":
        am[1, -29:] = 0
    rows = am.bool() if padding and name != "bert" else torch.ones(B, S, dtype=torch.bool)
    return (ids, am if padding else None), rows


CASES = [
    ("llama", "sdpa", None, {"mask:causal": 2, "gqa:repeat_kv": 2}),
    ("llama", "sdpa", "left", {"mask:custom": 2}),
    ("mistral", "sdpa", None, {"mask:causal_window": 2}),
    ("gemma2", "eager", None, {"soft_cap": 2, "pattern:matmul_softmax": 2}),
    ("qwen2", "sdpa", "left", {"gqa:repeat_kv": 2, "mask:custom": 2}),
    ("gpt2", "eager", "left", {"pattern:matmul_softmax": 2, "mask:custom": 2}),
    ("bert", "sdpa", "right", {"pattern:sdpa": 2, "mask:custom": 2}),
    # GPT-OSS's eager attention: a sink column in the softmax, sliced off (alternating sliding
    # window and full layers); the sinks reach the op.
    ("gpt_oss", "eager", None, {"pattern:matmul_softmax_sinks": 2, "sinks": 2}),
    # gpt-fast: one prompt of S tokens at positions 0..S-1 (Inductor decomposes
    # repeat_interleave into repeat_kv's expand/reshape).
    ("gpt_fast", None, None, {"pattern:sdpa": 2, "gqa:repeat_kv": 2, "mask:custom": 2}),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-{c[2] or 'nopad'}")
def test_compile_bf16_runs_our_kernel(case):
    from torch._inductor.utils import run_and_get_code

    name, impl, padding, kinds = case
    model = build(name, impl)
    args, rows = make_inputs(name, padding)
    args_c = [a.cuda() if a is not None else None for a in args]
    m64 = copy.deepcopy(model).to("cpu", torch.float64)
    if name == "gpt_oss":
        # The reference's experts as a loop: grouped matmuls take no float64. (The compiled
        # model keeps them: the loop's routing has data-dependent shapes, which fullgraph
        # refuses on torch 2.11.)
        m64.model.config._experts_implementation = "eager"
    with torch.no_grad():
        ref64 = m64(*args)
        eager = model(*args_c).cpu().double()
        fx_passes.counters.clear()
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):
            out, code = run_and_get_code(compiled_attn.compile(model, fullgraph=True), *args_c)
    code = "\n".join(code)
    c = dict(fx_passes.counters)
    assert not [k for k in c if k.startswith("skipped:")], c
    assert c.get("rewritten") == LAYERS, c
    for k, v in kinds.items():
        assert c.get(k) == v, (k, c)
    assert "_prefill_fwd" in code, "compiled code does not launch compiled_attn's Triton kernel"
    assert "scaled_dot_product" not in code
    out = out.cpu().double()
    assert out.shape == ref64.shape, (out.shape, ref64.shape)
    assert not torch.isnan(out).any()
    err = (out - ref64)[rows].abs().max().item()
    eager_err = (eager - ref64)[rows].abs().max().item()
    scale = ref64[rows].abs().max().item()
    bound = 2 * eager_err + scale * 2.0 ** -8
    assert err <= bound, f"{name}: err {err:.3e} > {bound:.3e} (eager bf16 err {eager_err:.3e})"
