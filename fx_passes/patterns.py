"""The source-level attention patterns the rewrite recognises, as named plain torch functions.

The matcher (rewrite.py) is a hand-written walk over aten graphs, not a list of traced
patterns; this module is its specification: each function below is attention as some model
writes it, with a comment naming the model and a line saying what it is replaced by. Every
entry of ``PATTERNS`` is exported and checked by tests/test_fx_patterns.py (counter keys and
numerics), and ``NOT_REWRITTEN`` lists the forms that must be left alone, with the reason
recorded in ``counters``. All take q [B, Hq, S, D], k/v [B, Hkv, S, D].
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    # HF transformers' repeat_kv (Llama, Mistral, Qwen2, Gemma2): [B, Hkv, S, D] -> [B, Hkv*n, S, D]
    b, h, s, d = x.shape
    if n_rep == 1:
        return x
    return x[:, :, None, :, :].expand(b, h, n_rep, s, d).reshape(b, h * n_rep, s, d)


# --- F.scaled_dot_product_attention ----------------------------------------------------------
def sdpa_is_causal(q, k, v):
    # GPT-2 / Llama with attn_implementation="sdpa" and no padding: is_causal=True.
    # -> single_prefill(MASK_CAUSAL)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def sdpa_bool_mask(q, k, v, keep):
    # HF sdpa_mask output (Llama/Mistral/Qwen2 with padding): bool [B, 1, S, S], True = attend.
    # -> single_prefill(MASK_CUSTOM, packed bits of keep)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def sdpa_additive_min_mask(q, k, v, keep):
    # HF eager_mask / older HF SDPA masks: where(keep, 0, finfo.min) added to the logits.
    # -> single_prefill(MASK_CUSTOM, keep); rows with no key: mean of v as eager gives.
    mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def sdpa_gqa_scale(q, k, v):
    # torch>=2.5 GQA without repeat (HF use_gqa_in_sdpa): enable_gqa=True, explicit scale.
    # -> single_prefill on the Hkv-head k/v, sm_scale = 0.3
    return F.scaled_dot_product_attention(q, k, v, scale=0.3, enable_gqa=True)


def sdpa_gqa_min_mask(q, k, v, keep):
    # HF SDPA with GQA left to SDPA (use_gqa_in_sdpa) and a float padding mask: enable_gqa with
    # where(keep, 0, finfo.min) added to the logits.
    # -> single_prefill(MASK_CUSTOM) on the Hkv-head k/v; rows with no key: the mean of their
    # KV head's v, as eager gives.
    mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def sdpa_repeat_interleave_tril(q, k, v):
    # gpt-fast (model.py): k/v repeat_interleave'd over heads, mask from a tril buffer.
    # -> single_prefill(MASK_CAUSAL) on the un-repeated k/v (constant mask classified causal)
    n = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(n, dim=1), v.repeat_interleave(n, dim=1)
    s = q.shape[2]
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool, device=q.device))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


# --- matmul / softmax / matmul -----------------------------------------------------------------
def hf_eager(q, k, v, keep):
    # HF eager_attention_forward (Llama/Mistral/Qwen2): repeat_kv, matmul * scaling, additive
    # mask, softmax in float32 cast back, dropout (eval), matmul.
    # -> single_prefill(MASK_CUSTOM) on the un-repeated k/v
    n = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n), repeat_kv(v, n)
    mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min)
    w = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    w = w + mask
    w = F.softmax(w, dim=-1, dtype=torch.float32).to(q.dtype)
    w = F.dropout(w, p=0.1, training=False)
    return torch.matmul(w, v)


def gemma2_softcap_sliding(q, k, v):
    # Gemma2 eager: logits * scaling, soft cap tanh(x / c) * c, sliding-window causal mask.
    # -> single_prefill(MASK_CAUSAL, window_left=3, logits_soft_cap=20)
    n = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n), repeat_kv(v, n)
    s = q.shape[2]
    i = torch.arange(s, device=q.device)[:, None]
    j = torch.arange(s, device=q.device)[None, :]
    keep = (j <= i) & (j > i - 4)
    mask = torch.where(keep, 0.0, float("-inf"))[None, None]
    w = torch.matmul(q, k.transpose(2, 3)) * 0.25
    w = w / 20.0
    w = torch.tanh(w)
    w = w * 20.0
    w = w + mask
    return torch.matmul(torch.softmax(w.float(), dim=-1).to(q.dtype), v)


def gpt_oss_sinks(q, k, v, keep, sinks):
    # GPT-OSS eager (transformers' gpt_oss eager_attention_forward): repeat_kv, matmul *
    # scaling, additive finfo.min mask, one sink logit per head as an extra column, the row max
    # subtracted, softmax, the sink column sliced off, matmul. A row whose keys are all masked
    # puts its weight on the sink: output 0, as the op's.
    # -> single_prefill(MASK_CUSTOM, sinks=[Hq] float32) on the un-repeated k/v
    n = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, n), repeat_kv(v, n)
    w = torch.matmul(q, k.transpose(2, 3)) * q.shape[-1] ** -0.5
    w = w + torch.where(keep, 0.0, torch.finfo(q.dtype).min)
    col = sinks.reshape(1, -1, 1, 1).expand(q.shape[0], -1, q.shape[-2], -1)
    c = torch.cat([w, col], dim=-1)
    c = c - c.max(dim=-1, keepdim=True).values
    p = F.softmax(c, dim=-1, dtype=c.dtype)[..., :-1]
    return torch.matmul(F.dropout(p, p=0.1, training=False), v)


def nanogpt_masked_fill(q, k, v):
    # nanoGPT (karpathy): att = q @ k^T / sqrt(d); masked_fill(tril == 0, -inf); softmax; @ v.
    # -> single_prefill(MASK_CAUSAL)
    s, d = q.shape[2], q.shape[3]
    bias = torch.tril(torch.ones(s, s, device=q.device)).view(1, 1, s, s)
    att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(d))
    att = att.masked_fill(bias[:, :, :s, :s] == 0, float("-inf"))
    return F.softmax(att, dim=-1) @ v


def bert_eager_padding(q, k, v, keep):
    # BERT eager (bidirectional) with a padding mask: logits / sqrt(d) + where(keep, 0, min).
    # -> single_prefill(MASK_CUSTOM)
    mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min)
    att = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    return torch.matmul(torch.softmax(att + mask, dim=-1), v)


def falcon_inplace_scale(q, k, v, keep):
    # Falcon eager (HF modeling_falcon.py): scores = q @ k^T; scores /= sqrt(d) in place;
    # softmax(scores + mask) @ v. Export keeps the in-place div_ on the matmul's result;
    # torch.compile functionalizes it into a reshape round trip around the div.
    # -> single_prefill(MASK_CUSTOM); the dead matmul and div_ are dropped
    mask = torch.where(keep, 0.0, torch.finfo(q.dtype).min)
    scores = q @ k.transpose(-1, -2)
    scores /= math.sqrt(q.shape[-1])
    return F.softmax(scores + mask, dim=-1) @ v


def falcon_mqa_sdpa(q, k, v):
    # Falcon (multi-query, HF sdpa attention): one K/V head [B, 1, S, D] that SDPA broadcasts
    # to every query head, without enable_gqa or repeat_kv.
    # -> single_prefill(MASK_CAUSAL) with Hkv = 1
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


# --- left alone (skipped with a reason) ---------------------------------------------------------
def sdpa_learned_bias(q, k, v, bias):
    # T5 / ALiBi-style: a general float bias added to the logits. Not a 0/-inf mask: skipped.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=bias)


def per_head_mask(q, k, v, keep_per_head):
    # A mask that differs per head ([B, H, S, S]): single_prefill takes one mask for all heads.
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep_per_head)


def half_min_mask_float_logits(q, k, v, keep):
    # A float32 model given a mask built for a half one (where(keep, 0, float16's min)). In
    # float32 logits -65504 is a shift: a row whose keys all carry it is softmax of its logits
    # in eager, not the uniform row a masking constant gives. Skipped.
    mask = torch.where(keep, 0.0, torch.finfo(torch.float16).min)
    att = torch.matmul(q, k.transpose(-1, -2)) * 0.25 + mask
    return torch.matmul(torch.softmax(att, dim=-1), v)


def matmul_softmax_with_bias(q, k, v, bias):
    # Relative-position bias in eager attention (T5, DeBERTa-like): skipped.
    att = torch.matmul(q, k.transpose(-1, -2)) * 0.25 + bias
    return torch.matmul(torch.softmax(att, dim=-1), v)


# name -> (function, counter keys expected for one call). Extra inputs: "keep" a bool
# [B, 1, S, S] padding+causal mask; "bias" float [B, H, S, S]; "keep_per_head" bool [B, H, S, S];
# "sinks" float [Hq].
PATTERNS = {
    "sdpa_is_causal": (sdpa_is_causal, {"pattern:sdpa": 1, "mask:causal": 1}),
    "sdpa_bool_mask": (sdpa_bool_mask, {"pattern:sdpa": 1, "mask:custom": 1}),
    "sdpa_additive_min_mask": (sdpa_additive_min_mask, {"pattern:sdpa": 1, "mask:custom": 1}),
    "sdpa_gqa_scale": (sdpa_gqa_scale, {"pattern:sdpa": 1, "gqa:enable_gqa": 1,
                                        "mask:none": 1}),
    "sdpa_gqa_min_mask": (sdpa_gqa_min_mask, {"pattern:sdpa": 1, "gqa:enable_gqa": 1,
                                              "mask:custom": 1}),
    "sdpa_repeat_interleave_tril": (sdpa_repeat_interleave_tril,
                                    {"pattern:sdpa": 1, "gqa:repeat_interleave": 1,
                                     "mask:causal": 1}),
    "hf_eager": (hf_eager, {"pattern:matmul_softmax": 1, "gqa:repeat_kv": 1, "mask:custom": 1}),
    "gemma2_softcap_sliding": (gemma2_softcap_sliding,
                               {"pattern:matmul_softmax": 1, "soft_cap": 1,
                                "mask:causal_window": 1}),
    "gpt_oss_sinks": (gpt_oss_sinks, {"pattern:matmul_softmax_sinks": 1, "sinks": 1,
                                      "gqa:repeat_kv": 1, "mask:custom": 1}),
    "nanogpt_masked_fill": (nanogpt_masked_fill, {"pattern:matmul_softmax": 1,
                                                  "mask:causal": 1}),
    "bert_eager_padding": (bert_eager_padding, {"pattern:matmul_softmax": 1, "mask:custom": 1}),
    "falcon_inplace_scale": (falcon_inplace_scale, {"pattern:matmul_softmax": 1,
                                                    "mask:custom": 1}),
    "falcon_mqa_sdpa": (falcon_mqa_sdpa, {"pattern:sdpa": 1, "gqa:broadcast": 1,
                                          "mask:causal": 1}),
}

NOT_REWRITTEN = {
    "sdpa_learned_bias": (sdpa_learned_bias, "skipped:additive bias"),
    "per_head_mask": (per_head_mask, "skipped:head-dependent mask"),
    "matmul_softmax_with_bias": (matmul_softmax_with_bias, "skipped:additive bias"),
    "half_min_mask_float_logits": (half_min_mask_float_logits, "skipped:additive bias"),
}
