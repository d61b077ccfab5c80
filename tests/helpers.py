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
import compiled_attn as fi
from compiled_attn.ops import contracts
from compiled_attn.ops.policy import POD_APART, POD_FUSED
import datetime
import socket
import traceback

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
    """bool [qo_len, kv_len]: which keys each query row sees (spec.md, bottom-right aligned:
    row i sits at key position p = kv_len - qo_len + i)."""
    p = torch.arange(qo_len)[:, None] + (kv_len - qo_len)
    j = torch.arange(kv_len)[None, :]
    if mask is not None:
        vis = mask[:qo_len, :kv_len].to(torch.bool).clone()
    elif causal:
        vis = j <= p
    else:
        vis = torch.ones(qo_len, kv_len, dtype=torch.bool)
    if window_left >= 0:
        vis &= j >= p - window_left
    if chunk > 0:
        vis &= (j >= torch.div(p, chunk, rounding_mode="floor") * chunk) & (j <= p)
    return vis


def dense_request(q, k, v, *, sm_scale, causal=False, window_left=-1, mask=None, chunk=0,
                  soft_cap=0.0, alibi_slopes=None, rope=None, sinks=None, v_scale=1.0):
    """One request, densely in float64, a head at a time.

    q [qo, Hq, Dqk], k [kv, Hkv, Dqk], v [kv, Hkv, Dvo] (any dtype, upcast to float64; v
    finite: a key a row does not see weighs exactly 0). rope: None or (rope_scale,
    rope_theta). Returns out [qo, Hq, Dvo] float64 and the base-2 LSE [qo, Hq] float64 (-inf
    for rows that see nothing; their output is 0).
    """
    q, k, v = q.double(), k.double(), v.double()
    assert torch.isfinite(v).all(), "dense_request: v must be finite"
    qo, hq, _ = q.shape
    kv, hkv, dvo = v.shape
    group = hq // hkv
    if rope is not None:
        q = rotate_half_rope(q, [kv - qo + i for i in range(qo)], *rope)
        k = rotate_half_rope(k, list(range(kv)), *rope)
    vis = visibility(qo, kv, causal=causal, window_left=window_left, mask=mask, chunk=chunk)
    rows = vis.any(1)  # rows that see a key; the others keep output 0 and LSE -inf
    if alibi_slopes is not None:  # key position minus the row's position
        dist = (torch.arange(kv, dtype=torch.float64)[None, :]
                - torch.arange(kv - qo, kv, dtype=torch.float64)[:, None])
    out = torch.zeros(qo, hq, dvo, dtype=torch.float64)
    lse = torch.full((qo, hq), float("-inf"), dtype=torch.float64)
    if not bool(rows.any()):
        return out, lse
    for h in range(hq):
        kh = h // group
        s = (q[:, h, :] @ k[:, kh, :].T) * sm_scale
        if soft_cap > 0:
            s = soft_cap * torch.tanh(s / soft_cap)
        if alibi_slopes is not None:
            s = s + float(alibi_slopes[h]) * dist
        s = s.masked_fill(~vis, float("-inf"))[rows]
        lse[rows, h] = torch.logsumexp(s, dim=1) / LN2
        if sinks is None:
            w = torch.softmax(s, dim=1)
        else:
            sink = torch.tensor(float(sinks[h]), dtype=torch.float64)
            m = torch.maximum(s.amax(dim=1, keepdim=True), sink)
            e = torch.exp(s - m)
            w = e / (e.sum(dim=1, keepdim=True) + torch.exp(sink - m))
        out[rows, h] = (w @ v[:, kh, :]) * v_scale
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


def paged_graph_bufs(batch: int, pages: int, device="cpu") -> dict:
    """The four index buffers of a use_cuda_graph=True BatchPrefillWithPagedKVCacheWrapper for
    ``batch`` requests over at most ``pages`` page-table entries (int32 zeros), by keyword."""
    z = lambda n: torch.zeros(n, dtype=torch.int32, device=device)  # noqa: E731
    return dict(qo_indptr_buf=z(batch + 1), paged_kv_indptr_buf=z(batch + 1),
                paged_kv_indices_buf=z(pages), paged_kv_last_page_len_buf=z(batch))


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


def counted_copies(monkeypatch) -> list:
    """The host arrays plan() copies to the device (compiled_attn._host.copy_to's), appended
    as they are copied: clear the list before a plan, read it after."""
    from compiled_attn import _host

    copies = []
    copy_to = _host.copy_to
    monkeypatch.setattr(_host, "copy_to", lambda t, *a: copies.append(t) or copy_to(t, *a))
    return copies


def poisoned_tail(idx: torch.Tensor, n_pages: int) -> torch.Tensor:
    """idx followed by entries a kernel must never read: -1, a page past the cache, int32 max
    (a pre-allocated buffer sized for a larger batch)."""
    tail = torch.tensor([-1, n_pages, 2 ** 31 - 1], dtype=idx.dtype)
    return torch.cat([idx, tail])


def ragged_kv(kv_lens, hkv, dqk, dvo, seed, layout="NHD"):
    k, v = rand(sum(kv_lens), hkv, dqk, seed=seed), rand(sum(kv_lens), hkv, dvo, seed=seed + 1)
    ks = list(k.split(kv_lens))
    vs = list(v.split(kv_lens))
    if layout == "HND":
        k, v = k.transpose(0, 1).contiguous(), v.transpose(0, 1).contiguous()
    return k, v, ks, vs


def batch_invariance(kind, *, qo_lens, kv_lens, inv, page=1, hq=4, hkv=2, d=16,
                     fixed_split_size=None, disable_split_kv=False, causal=True, layout="NHD",
                     pos_encoding_mode="NONE", dtype=D64, device="cpu", seed=0):
    """FlashInfer's batch-invariance check: plan and run the batch, re-plan its first ``inv``
    requests with the same index buffers (the paged indices' whole buffer, as serving engines
    keep them) and run those; the shared rows' output and LSE must be equal bit for bit where
    the kernel runs (GPU, interpreter). The CPU reference attends densely over the batch's
    keys, so its sums round by the batch's key count: equal to rounding there.
    Returns (wrapper after the first plan's run: its plan, out, lse, ks, vs, q) for further
    checks (ks / vs per request, float64)."""
    n_inv = sum(qo_lens[:inv])
    q = rand(sum(qo_lens), hq, d, seed=seed, dtype=dtype).to(device)
    opts = dict(causal=causal, pos_encoding_mode=pos_encoding_mode, q_data_type=dtype,
                fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv)
    qi = indptr(qo_lens).to(device)
    if kind == "paged":
        cache, kvi, idx, last, ks, vs = make_paged(kv_lens, hkv, d, d, page, layout=layout,
                                                   dtype=dtype, seed=seed + 1)
        cache, kvi, idx, last = (t.to(device) for t in (cache, kvi, idx, last))
        w = fi.BatchPrefillWithPagedKVCacheWrapper(WS.to(device), layout)
        w.plan(qi, kvi, idx, last, hq, hkv, d, page, **opts)
        plan = w._plan
        out, lse = w.run(q, cache, return_lse=True)
        w.plan(qi[:inv + 1], kvi[:inv + 1], idx, last[:inv], hq, hkv, d, page, **opts)
        out_s, lse_s = w.run(q[:n_inv], cache, return_lse=True)
    else:
        k, v, ks, vs = ragged_kv(kv_lens, hkv, d, d, seed=seed + 1, layout=layout)
        k, v = k.to(dtype).to(device), v.to(dtype).to(device)
        ks = [x.to(dtype).to(D64) for x in ks]
        vs = [x.to(dtype).to(D64) for x in vs]
        kvi = indptr(kv_lens).to(device)
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS.to(device), layout)
        w.plan(qi, kvi, hq, hkv, d, **opts)
        plan = w._plan
        out, lse = w.run(q, k, v, return_lse=True)
        n_kv = sum(kv_lens[:inv])
        k_s, v_s = (k[:, :n_kv], v[:, :n_kv]) if layout == "HND" else (k[:n_kv], v[:n_kv])
        w.plan(qi[:inv + 1], kvi[:inv + 1], hq, hkv, d, **opts)
        out_s, lse_s = w.run(q[:n_inv], k_s, v_s, return_lse=True)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    if contracts._use_kernel(q):
        assert torch.equal(out[:n_inv], out_s)
        assert torch.equal(lse[:n_inv], lse_s)
    else:  # rounding of the output dtype (float64: 1e-12)
        tol = dict(rtol=1e-12, atol=1e-12) if out.dtype == D64 else {}
        torch.testing.assert_close(out[:n_inv], out_s, **tol)
        torch.testing.assert_close(lse[:n_inv], lse_s, rtol=1e-6, atol=1e-6)
    return plan, out, lse, ks, vs, q


def check_fixed_split_plan(plan, qo_lens, kv_lens, chunk_keys, group, causal=True):
    """A fixed-split plan's work list: chunk columns, and each tile cut into
    ceil(keys / chunk_keys) chunks, keys its rows' causal bound."""
    work = plan.work.cpu()
    assert work.shape[1] == 4
    bm = plan.block_m
    seen = set()
    for b, row, c, n in work.tolist():
        if (b, row) in seen:
            continue
        seen.add((b, row))
        last_tok = min(row + bm, qo_lens[b] * group) // group
        keys = min(kv_lens[b], kv_lens[b] - qo_lens[b] + last_tok) if causal else kv_lens[b]
        assert n == max(1, -(-keys // chunk_keys)), (b, row, n, keys)
    assert any(n > 1 for *_, n in work.tolist())


fn = compiled_attn.trtllm_fmha_v2_prefill


def _cum(lens):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)


def _seqs(qo_lens, kv_lens, hq, hkv, dqk, dvo, dtype=torch.float64):
    qs = [torch.randn(n, hq, dqk, dtype=torch.float64).to(dtype) for n in qo_lens]
    ks = [torch.randn(n, hkv, dqk, dtype=torch.float64).to(dtype) for n in kv_lens]
    vs = [torch.randn(n, hkv, dvo, dtype=torch.float64).to(dtype) for n in kv_lens]
    return qs, ks, vs


def _paged(ks, vs, page, layout, seed, dtype=None):
    """[P, 2, page, Hkv, D] (NHD) or [P, 2, Hkv, page, D] (HND) and a shuffled block table
    (-1 where unused)."""
    g = torch.Generator().manual_seed(seed)
    bsz, hkv, d = len(ks), ks[0].shape[1], ks[0].shape[2]
    max_pages = max(-(-k.shape[0] // page) for k in ks)
    total = bsz * max_pages + 1
    cache = torch.randn(total, 2, page, hkv, d, dtype=torch.float64)
    table = shuffled_block_table([k.shape[0] for k in ks], page, max_pages, total, g)
    for b, (k, v) in enumerate(zip(ks, vs)):
        for t in range(k.shape[0]):
            pg = int(table[b, t // page])
            cache[pg, 0, t % page] = k[t].double()
            cache[pg, 1, t % page] = v[t].double()
    if dtype is not None:
        cache = cache.to(dtype)
    if layout == "HND":
        cache = cache.transpose(2, 3).contiguous()
    return cache, table


def _build(layout, qs, ks, vs, seed=0, page=4, kv_dtype=None):
    q = torch.cat(qs)
    if layout == "PACKED_QKV":
        return torch.stack([q, torch.cat(ks), torch.cat(vs)], 1), None
    if layout == "CONTIGUOUS_Q_KV":
        return (q, torch.stack([torch.cat(ks), torch.cat(vs)], 1)), None
    if layout == "SEPARATE_Q_K_V":
        return (q, torch.cat(ks), torch.cat(vs)), None
    cache, table = _paged(ks, vs, page, layout[-3:], seed, kv_dtype)
    return (q, cache), table


def _call(qkv, layout, table, qo_lens, kv_lens, out=None, **kw):
    kw.setdefault("bmm1_scale", 0.3)
    kw.setdefault("bmm2_scale", 1.0)
    return fn(qkv, layout, WS, torch.tensor(kv_lens, dtype=torch.int32),
              max_q_len=max(qo_lens), max_kv_len=max(kv_lens), batch_size=len(qo_lens),
              cum_seq_lens_q=_cum(qo_lens), cum_seq_lens_kv=_cum(kv_lens), block_tables=table,
              out=out, **kw)


def oracle_stats(qs, ks, *, sm_scale, causal=True, soft_cap=0.0, window_left=-1):
    """float64 (row max m, natural LSE) [T, Hq] of the final logits, per request densely."""
    mxs, lses = [], []
    for q, k in zip(qs, ks):
        q, k = q.double(), k.double()
        vis = visibility(q.shape[0], k.shape[0], causal=causal, window_left=window_left)
        group = q.shape[1] // k.shape[1]
        s = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * sm_scale
        if soft_cap > 0:
            s = soft_cap * torch.tanh(s / soft_cap)
        s = s.masked_fill(~vis[None], float("-inf"))
        if s.shape[-1] == 0:  # no keys
            s = torch.full((*s.shape[:2], 1), float("-inf"), dtype=torch.float64)
        mxs.append(s.amax(-1).T)
        lses.append(torch.logsumexp(s, -1).T)
    return torch.cat(mxs), torch.cat(lses)


def check_stats(stats, qs, ks, *, bmm1_scale, soft_cap=0.0, causal=True, rtol=1e-5,
                atol=1e-5):
    """stats float32 [T, Hq, 2] in FlashInfer's Hopper encoding (trtllm_fmha_v2_prefill's
    docstring) against oracle_stats: the stored max, and the LSE rebuilt as FlashInfer's own
    test rebuilds it."""
    d = qs[0].shape[-1]
    mx, lse = oracle_stats(qs, ks, sm_scale=bmm1_scale, causal=causal, soft_cap=soft_cap)
    assert stats.dtype == torch.float32 and stats.shape == (*mx.shape, 2)
    assert not torch.isnan(stats).any()
    div = d ** 0.5 * (1.0 if soft_cap > 0 else bmm1_scale)
    torch.testing.assert_close(stats[..., 0].double(), mx / div, rtol=rtol, atol=atol)
    rebuilt = stats[..., 0].double() * div + torch.log(stats[..., 1].double())
    torch.testing.assert_close(rebuilt, lse, rtol=rtol, atol=atol)


def peaked_seqs(qo_lens, kv_lens, hq, hkv, d, tile, dtype=torch.float64, seed=0, peak=1.0):
    """Requests whose keys of the first ``tile`` positions share a direction with every query
    (large logits) while later keys are small noise: skip-softmax then leaves out later tiles
    of most rows, but not all of their keys weigh nothing."""
    g = torch.Generator().manual_seed(seed)
    u = torch.ones(d, dtype=torch.float64)
    qs, ks, vs = [], [], []
    for qo, kv in zip(qo_lens, kv_lens):
        q = torch.randn(qo, hq, d, generator=g, dtype=torch.float64) * 0.5 + peak * u
        k = torch.randn(kv, hkv, d, generator=g, dtype=torch.float64) * 0.5
        k[:tile] += peak * u
        qs.append(q.to(dtype))
        ks.append(k.to(dtype))
        vs.append(torch.randn(kv, hkv, d, generator=g, dtype=torch.float64).to(dtype))
    return qs, ks, vs


def skip_oracle(qs, ks, vs, *, sm_scale, factor, tile, causal=True):
    """float64 output of the skip-softmax rule written out row by row: key tiles of ``tile``
    positions in ascending order; a row leaves out a tile whose max m_t has
    exp(m_t - m) < factor / kv_len, m its running max over the tiles it kept. Also returns the
    exact output and each row's left-out softmax mass [T, Hq]."""
    outs, exact, masses = [], [], []
    for q, k, v in zip(qs, ks, vs):
        q, k, v = q.double(), k.double(), v.double()
        qo, hq, _ = q.shape
        kv, hkv, _ = k.shape
        group = hq // hkv
        vis = visibility(qo, kv, causal=causal)
        o = torch.zeros(qo, hq, v.shape[-1], dtype=torch.float64)
        oe = torch.zeros_like(o)
        mass = torch.zeros(qo, hq, dtype=torch.float64)
        for h in range(hq):
            s = (q[:, h] @ k[:, h // group].T) * sm_scale
            s = s.masked_fill(~vis, float("-inf"))
            for i in range(qo):
                if not bool(vis[i].any()):
                    continue
                keep = torch.zeros(kv, dtype=torch.bool)
                run = float("-inf")
                for t0 in range(0, kv, tile):
                    m_t = float(s[i, t0:t0 + tile].max())
                    if m_t > float("-inf") and m_t - run >= math.log(factor / kv):
                        keep[t0:t0 + tile] = True
                        run = max(run, m_t)
                w = torch.softmax(s[i], 0)
                mass[i, h] = w[~keep].sum()
                oe[i, h] = w @ v[:, h // group]
                wk = torch.softmax(s[i].masked_fill(~keep, float("-inf")), 0)
                o[i, h] = wk @ v[:, h // group]
        outs.append(o)
        exact.append(oe)
        masses.append(mass)
    return torch.cat(outs), torch.cat(exact), torch.cat(masses)


def check_skip(got, qs, ks, vs, *, sm_scale, factor, tile, causal=True, atol=1e-6,
               rtol=1e-6):
    """got against skip_oracle, and against exact attention within the left-out mass's bound
    (|out - exact| <= 2 * mass * max|v| <= 2 * factor * max|v|), with some rows actually
    skipping (else the case tests nothing)."""
    ref, exact, mass = skip_oracle(qs, ks, vs, sm_scale=sm_scale, factor=factor, tile=tile,
                                   causal=causal)
    assert not torch.isnan(got).any()
    assert float(mass.max()) > 1e-4, "no row left out any softmax mass"
    assert float(mass.max()) < factor
    vmax = max(float(v.double().abs().max()) for v in vs)
    err = (got.double() - exact).abs().amax(-1)
    assert bool((err <= 2 * mass * vmax + atol + rtol * exact.abs().amax(-1)).all())
    assert float(err.max()) > 1e-4  # the approximation is in effect
    torch.testing.assert_close(got.double(), ref, atol=atol, rtol=rtol)


def _worker(rank, world, port, backend, body, results):
    import faulthandler

    import torch.distributed as dist

    faulthandler.enable()  # a rank killed by a signal prints its Python stack to stderr
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    found = {}

    def attempt(key, fn):
        try:
            fn()
            found[key] = None
        except Exception:  # noqa: BLE001  (recorded for the test that reports it)
            found[key] = f"rank {rank}: {traceback.format_exc()}"

    body(rank, world, attempt)
    results.put((rank, found))
    dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(body, world: int, backend: str = "gloo") -> dict:
    """Spawn ``world`` ranks of a ``backend`` group on 127.0.0.1, each running
    ``body(rank, world, attempt)`` (a module-level function; ``attempt(key, fn)`` records fn's
    exception under key); returns key -> the ranks' tracebacks, or None where every rank
    passed.

    A group whose rank is killed by a signal (a crash inside torch's C++ / gloo, e.g. glibc's
    heap check aborting: it hit CI once, 2026-12-01, and did not recur in 12 runs of the same
    group; our code here is Python over torch ops) is spawned once more, with a warning naming
    the signal; a second crash fails the test. A failed check is never re-run: it is recorded by
    ``attempt`` and reported by its test."""
    import warnings

    import torch.multiprocessing as mp

    for tries in (1, 2):
        queue = mp.get_context("spawn").SimpleQueue()
        try:
            mp.spawn(_worker, args=(world, _free_port(), backend, body, queue), nprocs=world,
                     join=True)
            break
        except mp.ProcessExitedException as e:
            if tries == 2 or not e.signal_name:
                raise
            warnings.warn(f"run_ranks: a rank of the {world}-rank {backend} group died by "
                          f"{e.signal_name} (its stack is in the captured stderr); spawning "
                          "the group once more")
    merged: dict = {}
    for _ in range(world):
        _, found = queue.get()
        for key, err in found.items():
            merged[key] = "\n".join(e for e in (merged.get(key), err) if e) or None
    return merged


class KernelRecorder:
    """Stands in for a launched kernel (``kernel[grid](...)``): records the grid, positional
    arguments and keywords of the last launch; ``arg(name)`` is the positional argument the
    kernel names ``name``."""

    def __init__(self, kernel):
        self.arg_names = kernel.arg_names

    def __getitem__(self, grid):
        def call(*args, **kw):
            self.grid, self.args, self.kw = grid, args, kw
        return call

    def arg(self, name):
        return self.args[self.arg_names.index(name)]


# The launch policy's settings that keep every POD call in one launch, or send every call with
# two non-empty parts to two launches (ops.choose.pod_apart), by name.
POD_LAUNCHES = {"fused": POD_FUSED, "apart": POD_APART}


def check_pod_launch(pod_launch, both_parts: bool) -> None:
    """The ops a POD wrapper's call ran under the pod_launch fixture (tests/conftest.py): a
    prefill op then batch_paged_prefill where it went apart with two non-empty parts, else the
    one POD op."""
    kind, called = pod_launch
    if kind == "apart" and both_parts:
        assert len(called) == 2 and called[1] == "batch_paged_prefill", called
    else:
        assert called == ["pod_prefill_decode"], called
