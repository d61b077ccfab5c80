"""Builders and oracles shared by the test modules (no test module imports another).

- The independent float64 oracle (``dense_request``, ``oracle_batch``), written from the spec
  alone: one request at a time, an explicit visibility matrix built row by row, explicit
  rotate-half RoPE, ALiBi with the slopes formula of the spec, ``torch.softmax`` for the
  probabilities and ``torch.logsumexp`` / ln 2 for the base-2 LSE. It shares no code with
  ops/reference.py.
- The public API's inputs: paged caches (``make_paged``), indptrs, seeded random tensors, and
  ``dense`` / ``dense_batch``: the oracle with the API's argument names.
- Tiny models for the FX rewrite tests (HF configs with random weights, a gpt-fast-style
  module) and the helpers that compile them with Inductor's caches off.

tests/kernel_cases.py holds the kernel-level case builders (the interpreter and GPU tiers).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import compiled_attn
from compiled_attn import fx_passes

LN2 = math.log(2.0)
D64 = torch.float64


# ------------------------------------------------------------------------------------------
# The independent oracle
# ------------------------------------------------------------------------------------------
def alibi_slopes_spec(num_heads: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """spec.md: n = 2^floor(log2 H); slope_h = 2^(-8(h+1)/n) for h < n; the remaining heads
    take 2^(-4/n) to the odd powers 1, 3, 5, ..."""
    n = 2 ** int(math.floor(math.log2(num_heads)))
    slopes = [2.0 ** (-8.0 * (h + 1) / n) for h in range(n)]
    base = 2.0 ** (-4.0 / n)
    slopes += [base ** (2 * i + 1) for i in range(num_heads - n)]
    return torch.tensor(slopes, dtype=dtype)


def rotate_half_rope(x: torch.Tensor, positions, rope_scale: float, rope_theta: float):
    """x [N, H, D] float64; pair (c, c + D/2) rotated by pos / scale * theta^(-2c/D)."""
    n, h, d = x.shape
    half = d // 2
    out = x.clone()
    for c in range(half):
        freq = rope_theta ** (-2.0 * c / d)
        ang = torch.tensor([p / rope_scale * freq for p in positions], dtype=torch.float64)
        cos, sin = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
        a, b = x[:, :, c], x[:, :, c + half]
        out[:, :, c] = a * cos - b * sin
        out[:, :, c + half] = b * cos + a * sin
    return out


def visibility(qo_len: int, kv_len: int, *, causal: bool, window_left: int = -1,
               mask: torch.Tensor | None = None, chunk: int = 0) -> torch.Tensor:
    """bool [qo_len, kv_len]: which keys each query row sees (spec.md, bottom-right aligned)."""
    vis = torch.zeros(qo_len, kv_len, dtype=torch.bool)
    for i in range(qo_len):
        p = kv_len - qo_len + i
        for j in range(kv_len):
            if mask is not None:
                ok = bool(mask[i, j])
            else:
                ok = (j <= p) if causal else True
            if window_left >= 0 and j < p - window_left:
                ok = False
            if chunk > 0 and not ((p // chunk) * chunk <= j <= p):
                ok = False
            vis[i, j] = ok
    return vis


def dense_request(q, k, v, *, sm_scale, causal=False, window_left=-1, mask=None, chunk=0,
                  soft_cap=0.0, alibi_slopes=None, rope=None, sinks=None, v_scale=1.0):
    """One request, densely in float64.

    q [qo, Hq, Dqk], k [kv, Hkv, Dqk], v [kv, Hkv, Dvo] (any dtype, upcast to float64).
    rope: None or (rope_scale, rope_theta). Returns out [qo, Hq, Dvo] float64 and the base-2
    LSE [qo, Hq] float64 (-inf for rows that see nothing; their output is 0).
    """
    q, k, v = q.double(), k.double(), v.double()
    qo, hq, _ = q.shape
    kv, hkv, dvo = v.shape
    group = hq // hkv
    if rope is not None:
        q = rotate_half_rope(q, [kv - qo + i for i in range(qo)], *rope)
        k = rotate_half_rope(k, list(range(kv)), *rope)
    vis = visibility(qo, kv, causal=causal, window_left=window_left, mask=mask, chunk=chunk)
    out = torch.zeros(qo, hq, dvo, dtype=torch.float64)
    lse = torch.full((qo, hq), float("-inf"), dtype=torch.float64)
    for h in range(hq):
        kh = h // group
        s = (q[:, h, :] @ k[:, kh, :].T) * sm_scale
        if soft_cap > 0:
            s = soft_cap * torch.tanh(s / soft_cap)
        if alibi_slopes is not None:
            for i in range(qo):
                p = kv - qo + i
                s[i] += float(alibi_slopes[h]) * (torch.arange(kv, dtype=torch.float64) - p)
        for i in range(qo):
            seen = vis[i]
            if not bool(seen.any()):
                continue
            row = s[i][seen]
            lse[i, h] = torch.logsumexp(row, dim=0) / LN2
            if sinks is None:
                w = torch.softmax(row, dim=0)
            else:
                m = torch.maximum(row.max(), torch.tensor(float(sinks[h]), dtype=torch.float64))
                e = torch.exp(row - m)
                w = e / (e.sum() + torch.exp(float(sinks[h]) - m))
            out[i, h] = (w[:, None] * v[seen, kh, :]).sum(0) * v_scale
    return out, lse


def pack_segments(masks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each bool mask flattened row-major, bits little-endian within a byte, each segment
    padded to whole bytes. Returns (uint8 bytes, int32 byte offsets [B+1])."""
    data: list[int] = []
    offsets = [0]
    for m in masks:
        bits = [bool(x) for x in m.reshape(-1).tolist()]
        for start in range(0, len(bits), 8):
            byte = 0
            for t, bit in enumerate(bits[start:start + 8]):
                byte |= int(bit) << t
            data.append(byte)
        offsets.append(len(data))
    return torch.tensor(data, dtype=torch.uint8), torch.tensor(offsets, dtype=torch.int32)


def shuffled_block_table(kv_lens, page: int, max_pages: int, total: int,
                         g: torch.Generator) -> torch.Tensor:
    """int32 [B, max_pages] block table: request b's pages, in order, drawn without repetition
    from a shuffled range of ``total`` pages; -1 where unused. Token t of request b is in page
    ``table[b, t // page]``, slot ``t % page``."""
    perm = torch.randperm(total, generator=g)
    table = torch.full((len(kv_lens), max_pages), -1, dtype=torch.int32)
    nxt = 0
    for b, n in enumerate(kv_lens):
        used = -(-int(n) // page)
        table[b, :used] = perm[nxt:nxt + used].to(torch.int32)
        nxt += used
    return table


def indptr(lens) -> torch.Tensor:
    out = [0]
    for n in lens:
        out.append(out[-1] + int(n))
    return torch.tensor(out, dtype=torch.int32)


def assert_lse(actual, expected, tol=dict(rtol=1e-6, atol=1e-6)):
    """Finite entries close, -inf exactly where the oracle has -inf, never NaN."""
    assert actual.dtype == torch.float32
    assert not torch.isnan(actual).any(), "NaN in the LSE"
    inf = torch.isinf(expected)
    assert torch.equal(torch.isinf(actual), inf), "-inf rows differ"
    assert (actual[inf] < 0).all()
    torch.testing.assert_close(actual[~inf].double(), expected[~inf], **tol)


def oracle_batch(q, ks, vs, qo_lens, *, masks=None, one=None, **kw):
    """Concatenate a per-request oracle (one: default dense_request) over a ragged q; ks/vs:
    per-request k/v; masks: per-request masks or None."""
    one = one or dense_request
    outs, lses = [], []
    start = 0
    for b, n in enumerate(qo_lens):
        o, l = one(q[start:start + n], ks[b], vs[b], mask=None if masks is None else masks[b],
                   **kw)
        outs.append(o)
        lses.append(l)
        start += n
    return torch.cat(outs), torch.cat(lses)


# ------------------------------------------------------------------------------------------
# The public API's inputs and the oracle under the API's names
# ------------------------------------------------------------------------------------------
TOL = dict(atol=1e-10, rtol=1e-10)
WS = torch.empty(16, dtype=torch.uint8)


def slopes(h: int) -> torch.Tensor:
    """ALiBi slopes for h heads in float64 (the API tests' tolerance is below float32's)."""
    return alibi_slopes_spec(h, D64)


def dense(q, k, v, *, causal=False, mask=None, window_left=-1, sm_scale=None, soft_cap=0.0,
          alibi=False, rope=False, rope_scale=1.0, rope_theta=1e4, sinks=None, v_scale=1.0):
    """One request through the float64 oracle (dense_request above), with the
    API's argument names. q [qo, Hq, D], k [kv, Hkv, D], v [kv, Hkv, Dv]. mask: bool [qo, kv]
    (or flat). Returns out [qo, Hq, Dv] and base-2 lse [qo, Hq]."""
    qo, hq, d = q.shape
    return dense_request(
        q, k, v, sm_scale=1.0 / math.sqrt(d) if sm_scale is None else sm_scale, causal=causal,
        window_left=window_left, mask=None if mask is None else mask.reshape(qo, k.shape[0]),
        soft_cap=soft_cap, alibi_slopes=slopes(hq) if alibi else None,
        rope=(rope_scale, rope_theta) if rope else None, sinks=sinks, v_scale=v_scale)


def dense_batch(q, qo_lens, ks, vs, masks=None, **kw):
    """Concatenate dense() over requests: ks / vs are per-request K/V lists."""
    return oracle_batch(q, ks, vs, qo_lens, masks=masks, one=dense, **kw)


def check(out, lse, ref_out, ref_lse, tol=TOL):
    torch.testing.assert_close(out.to(D64), ref_out, equal_nan=False, **tol)
    if lse is not None:
        torch.testing.assert_close(lse.to(D64), ref_lse, equal_nan=False,
                                   **({"atol": 1e-5, "rtol": 1e-6} if lse.dtype == torch.float32
                                      else tol))


def make_paged(kv_lens, hkv, dqk, dvo, page, *, layout="NHD", fmt="5d", dtype=D64, seed=0,
               spare_pages=3):
    """Random per-request K/V, written into a shuffled paged cache. Returns (cache, indptr,
    indices, last_page_len, ks, vs) with ks/vs the dense per-request tensors (float64)."""
    g = torch.Generator().manual_seed(seed)
    npages = [(n + page - 1) // page for n in kv_lens]
    total = sum(npages) + spare_pages
    perm = torch.randperm(total, generator=g)[:sum(npages)].to(torch.int32)
    dmax = max(dqk, dvo)
    kc = torch.randn(total, page, hkv, dmax, generator=g, dtype=D64)[..., :dqk].clone()
    vc = torch.randn(total, page, hkv, dmax, generator=g, dtype=D64)[..., :dvo].clone()
    ks, vs, p0 = [], [], 0
    for n, np_ in zip(kv_lens, npages):
        pages = perm[p0:p0 + np_].long()
        ks.append(kc[pages].reshape(-1, hkv, dqk)[:n])
        vs.append(vc[pages].reshape(-1, hkv, dvo)[:n])
        p0 += np_
    last = torch.tensor([(n - 1) % page + 1 if n else 0 for n in kv_lens], dtype=torch.int32)
    kc, vc = kc.to(dtype), vc.to(dtype)
    ks = [x.to(dtype).to(D64) for x in ks]
    vs = [x.to(dtype).to(D64) for x in vs]
    if layout == "HND":
        kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
    if fmt == "5d":
        assert dqk == dvo
        cache = torch.stack([kc, vc], dim=1)
    else:
        cache = (kc, vc)
    return cache, indptr(npages), perm, last, ks, vs


def rand(*shape, seed=0, dtype=D64):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ------------------------------------------------------------------------------------------
# Tiny models for the FX rewrite
# ------------------------------------------------------------------------------------------
B, S, LAYERS = 2, 16, 2


class Logits(nn.Module):
    """Wraps an HF model so that it returns one tensor (logits or last hidden state)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
        return out.logits if hasattr(out, "logits") else out.last_hidden_state


def hf_model(name: str, impl: str):
    """A tiny HF model (random weights, no download) wrapped in Logits; impl: 'sdpa' or
    'eager'. Skips the test when transformers is not installed."""
    t = pytest.importorskip("transformers")
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


def run_compiled(compiled, *args):
    """Run a torch.compile'd callable with Inductor's and AOTAutograd's caches off (a cache hit
    would skip the FX pass under test); returns (output, generated code)."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        out, code = run_and_get_code(compiled, *args)
    return out, "\n".join(code)


def compile_and_run(model, *args):
    """compiled_attn.compile (fullgraph) of model run once under no_grad with fresh counters and
    the caches off; returns (output, generated code)."""
    fx_passes.counters.clear()
    with torch.no_grad():
        return run_compiled(compiled_attn.compile(model, fullgraph=True), *args)


def check_counters(expected_kinds: dict, layers=LAYERS):
    c = fx_passes.counters
    skipped = {k: v for k, v in c.items() if k.startswith("skipped:")}
    assert not skipped, skipped
    assert c["rewritten"] == layers, dict(c)
    for k, v in expected_kinds.items():
        assert c[k] == v, (k, dict(c))
