"""HF transformers integration: ``attn_implementation="compiled_attn"``.

``register(name)`` adds one attention function to transformers' ``AttentionInterface`` and a
mask function to its ``AttentionMaskInterface`` (without the latter, transformers would build
no mask for an unknown implementation and padding would be silently dropped). The mask function
is transformers' own ``sdpa_mask``: a bool [B, 1, Sq, Skv] mask (True = attend, sliding window
and padding included), or None when plain causal attention is exact. The attention function runs
``torch.ops.compiled_attn.single_prefill`` on [B, S, H, D] views of HF's [B, H, S, D] tensors
(GQA without repeat_kv), with the mask as packed custom-mask bits, or MASK_CAUSAL when the mask
is None, Gemma2's ``softcap`` as logits_soft_cap, and attention sinks (GPT-OSS's ``s_aux``: one
logit per query head in the softmax denominator) as the op's sinks. Rows that see no key return
0, as SDPA does. What the op cannot take raises NotImplementedError: a model's additive bias
(T5's ``position_bias``), a ``head_mask``, a float mask; a head dim the kernel does not run (on
CUDA: a multiple of 8 from 16 to 256, or 512) raises ValueError naming the supported set.
"""

from __future__ import annotations

import torch

from .op_call import call_op
from .utils import packbits

__all__ = ["register", "attention_forward"]


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: float | None = None, is_causal: bool | None = None,
                      sliding_window: int | None = None, softcap: float | None = None,
                      **kwargs):
    """transformers attention function: query [B, Hq, Sq, D], key/value [B, Hkv, Skv, D];
    attention_mask from sdpa_mask (bool [B, 1, Sq, Skv] or None). Returns ([B, Sq, Hq, Dv],
    None)."""
    from compiled_attn.ops import MASK_CAUSAL, MASK_CUSTOM, MASK_NONE

    if dropout and module.training:
        raise ValueError("compiled_attn attention is inference-only: dropout > 0 in training "
                         "mode is not supported (call model.eval())")
    if kwargs.get("output_attentions", False):
        raise ValueError("compiled_attn attention does not return attention weights "
                         "(output_attentions=True): use attn_implementation='eager'")
    for name in ("position_bias", "head_mask"):
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"compiled_attn attention: {name} (a bias added to the logits or a per-head "
                "weight, e.g. T5's relative positions) is not supported by its kernels; use "
                "attn_implementation='sdpa' or 'eager' for this model")
    sinks = kwargs.get("s_aux")
    if sinks is not None:  # GPT-OSS: [Hq] logits joining each row's softmax denominator
        sinks = sinks.to(torch.float32).contiguous()
    bsz, hq, sq, d = query.shape
    skv = key.shape[2]
    _check_head_dims(query, d, value.shape[-1])
    scale = float(scaling) if scaling is not None else d ** -0.5
    window_left = -1
    packed = None
    if attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise NotImplementedError(
                f"compiled_attn attention takes bool masks (True = attend), as its registered "
                f"mask function builds them; an additive {attention_mask.dtype} mask is not "
                "supported: pass a bool mask, or use attn_implementation='sdpa'")
        m = attention_mask
        if m.dim() == 4:
            if m.shape[1] != 1:
                raise ValueError("compiled_attn attention takes one mask for all heads "
                                 f"(got mask of shape {tuple(m.shape)})")
            m = m[:, 0]
        m = m.expand(bsz, sq, skv)
        packed = packbits(m, bitorder="little")
        mode = MASK_CUSTOM
    else:
        # Same rule as transformers' SDPA path: a None mask is causal for prefill (sq > 1) of a
        # causal module; sdpa_mask only returns None when q and kv align (sq == skv), or sq == 1.
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal) and sq > 1
        if causal and skv > sq:
            # SDPA's is_causal is top-left aligned; transformers crops the keys to match.
            key, value, skv = key[:, :, :sq], value[:, :, :sq], sq
        mode = MASK_CAUSAL if causal else MASK_NONE
        if causal and sliding_window:
            window_left = int(sliding_window) - 1  # HF: key j visible iff j > i - window
    out, _ = call_op(
        "single_prefill",
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), packed, None, sinks,
        mode, window_left, 0, scale, float(softcap or 0.0), 0, 1.0, 1e4, 1.0, None)
    return out, None


def _check_head_dims(query, dqk, dvo) -> None:
    """Where the op runs the kernel (CUDA; CPU under TRITON_INTERPRET=1), a ValueError naming
    the supported head dims (ops.contracts.KERNEL_HEAD_DIMS) and the way out for a model whose
    head dim is not one of them; traced symbolic dims are left to the launch's own check."""
    from compiled_attn.ops.contracts import _use_kernel, check_kernel_head_dims

    if type(dqk) is not int or type(dvo) is not int or not _use_kernel(query):
        return
    try:
        check_kernel_head_dims(dqk, dvo, names=("the model's head dim (query.shape[-1])",
                                                "value.shape[-1]"))
    except ValueError as e:
        raise ValueError(f"compiled_attn attention: {e}; or use attn_implementation='sdpa' for "
                         "this model") from None


def register(name: str = "compiled_attn") -> str:
    """Register compiled_attn with transformers under ``name`` (AttentionInterface and
    AttentionMaskInterface); then ``attn_implementation=name`` uses our kernels."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
