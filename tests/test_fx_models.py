"""compiled_attn.compile / compiled_attn.export on tiny models (random weights, no download):
HF Llama (GQA), Mistral (sliding window), Gemma2 (soft cap + sliding window), Qwen2, GPT-2,
BERT (bidirectional, padding), eager and sdpa attention, with and without padding, and a
gpt-fast-style module. Each: exact rewrite count (one per attention layer, nothing skipped),
output vs eager (float32, tolerance relative to the output's scale, padded query rows
excluded), and that the compiled code no longer holds PyTorch's attention. A few go through
torch.export -> save/load -> AOTInductor -> a fresh process (test_fx_aoti.py).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_attn
from compiled_attn import fx_passes

transformers = pytest.importorskip("transformers")

B, S, LAYERS = 2, 16, 2


# ----------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------
class Logits(nn.Module):
    """Wraps an HF model so that it returns one tensor (logits or last hidden state)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def hf_model(name: str, impl: str):
    t = transformers
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS,
                  max_position_embeddings=64, attn_implementation=impl)
    if name == "llama":
        cfg = t.LlamaConfig(num_attention_heads=4, num_key_value_heads=2, **common)
    elif name == "mistral":
        cfg = t.MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=6,
                              **common)
    elif name == "gemma2":
        cfg = t.Gemma2Config(num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                             sliding_window=6, query_pre_attn_scalar=16,
                             attn_logit_softcapping=None if impl == "sdpa" else 5.0, **common)
    elif name == "qwen2":
        cfg = t.Qwen2Config(num_attention_heads=4, num_key_value_heads=1, **common)
    elif name == "gpt2":
        cfg = t.GPT2Config(vocab_size=128, n_embd=64, n_layer=LAYERS, n_head=4, n_positions=64,
                           attn_implementation=impl)
    elif name == "bert":
        cfg = t.BertConfig(vocab_size=128, hidden_size=64, num_hidden_layers=LAYERS,
                           num_attention_heads=4, intermediate_size=128,
                           max_position_embeddings=64, attn_implementation=impl)
    else:
        raise KeyError(name)
    torch.manual_seed(0)
    cls = t.BertModel if name == "bert" else t.AutoModelForCausalLM
    model = cls.from_config(cfg) if name != "bert" else cls(cfg)
    return Logits(model.eval())


def inputs(padding: str | None):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (B, S), generator=g)
    if padding is None:
        return ids, None
    am = torch.ones(B, S, dtype=torch.long)
    if padding == "left":
        am[0, :5] = 0
    elif padding == "right":
        am[1, -4:] = 0
    return ids, am


def rope(x, pos, theta=10000.0):
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    ang = pos[:, None].float() * inv[None]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class GptFastAttention(nn.Module):
    # gpt-fast (pytorch-labs/gpt-fast model.py): fused wqkv split, RoPE, KV cache written with
    # index_put at input_pos, repeat_interleave for GQA, SDPA with a mask read from a causal
    # buffer at input_pos.
    def __init__(self, dim=64, n_head=4, n_local_heads=2, max_seq=32):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim = n_head, n_local_heads, dim // n_head
        kv = 2 * n_local_heads * self.head_dim
        self.wqkv = nn.Linear(dim, dim + kv, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        shape = (1, n_local_heads, max_seq, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape))
        self.register_buffer("v_cache", torch.zeros(shape))

    def forward(self, x, mask, input_pos):
        bsz, seqlen, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.n_head * self.head_dim, kv_size, kv_size], dim=-1)
        q = rope(q.view(bsz, seqlen, self.n_head, self.head_dim), input_pos)
        k = rope(k.view(bsz, seqlen, self.n_local_heads, self.head_dim), input_pos)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        k_out = self.k_cache.clone()
        v_out = self.v_cache.clone()
        k_out[:, :, input_pos] = k
        v_out[:, :, input_pos] = v
        k = k_out.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v_out.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        return self.wo(y.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class GptFast(nn.Module):
    def __init__(self, layers=LAYERS, max_seq=32, dim=64, n_head=4, n_local_heads=2):
        super().__init__()
        torch.manual_seed(0)
        self.tok = nn.Embedding(128, dim)
        self.layers = nn.ModuleList(GptFastAttention(dim, n_head, n_local_heads, max_seq)
                                    for _ in range(layers))
        self.register_buffer("causal_mask", torch.tril(torch.ones(max_seq, max_seq,
                                                                  dtype=torch.bool)))
        self.out = nn.Linear(dim, 128, bias=False)

    def forward(self, idx, input_pos):
        mask = self.causal_mask[None, None, input_pos]  # [1, 1, S, max_seq]
        x = self.tok(idx)
        for layer in self.layers:
            x = x + layer(x, mask, input_pos)
        return self.out(x)


# ----------------------------------------------------------------------------------------------
# Helpers
# ----------------------------------------------------------------------------------------------
def assert_close_rel(out, ref, rows=None, rtol=2e-5):
    """|out - ref| <= rtol * max|ref| over the given rows ([B, S] bool) of [B, S, ...]. The
    shapes must match: a broadcast (e.g. one batch entry against the whole batch) is an error."""
    assert out.shape == ref.shape, f"output shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert not torch.isnan(out).any()
    if rows is not None:
        out, ref = out[rows], ref[rows]
    err = (out - ref).abs().max().item()
    scale = ref.abs().max().item()
    assert err <= rtol * scale + 1e-7, f"max err {err:.3e} vs output scale {scale:.3e}"


def compile_and_run(model, *args):
    """compiled_attn.compile with Inductor's caches off (the pass must run here); returns
    (output, generated code)."""
    from torch._inductor.utils import run_and_get_code

    fx_passes.counters.clear()
    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), torch.no_grad():
        compiled = compiled_attn.compile(model, fullgraph=True)
        out, code = run_and_get_code(compiled, *args)
    return out, "\n".join(code)


def check_counters(expected_kinds: dict, layers=LAYERS):
    c = fx_passes.counters
    skipped = {k: v for k, v in c.items() if k.startswith("skipped:")}
    assert not skipped, skipped
    assert c["rewritten"] == layers, dict(c)
    for k, v in expected_kinds.items():
        assert c[k] == v, (k, dict(c))


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
