"""HF transformers integration: ``attn_implementation="compiled_attn"``.

``register(name)`` adds one attention function to transformers' ``AttentionInterface`` and a
mask function to its ``AttentionMaskInterface`` (without the latter, transformers would build
no mask for an unknown implementation and padding would be silently dropped). The mask function
is transformers' own ``sdpa_mask``: a bool [B, 1, Sq, Skv] mask (True = attend, sliding window
and padding included), or None when plain causal attention is exact; for a model that computes
attention itself instead of calling transformers' attention functions it raises (the model would
misread the mask). The attention function runs
``torch.ops.compiled_attn.single_prefill`` on [B, S, H, D] views of HF's [B, H, S, D] tensors
(GQA without repeat_kv), with the mask as packed custom-mask bits, or MASK_CAUSAL when the mask
is None, Gemma2's ``softcap`` as logits_soft_cap, and attention sinks (GPT-OSS's ``s_aux``: one
logit per query head in the softmax denominator) as the op's sinks. Rows that see no key return
0, as SDPA does. What the op cannot take raises NotImplementedError: a model's additive bias
(T5's ``position_bias``), a ``head_mask``, a float mask, sparse attention's ``indices``; a head
dim the kernel does not run (on CUDA: a multiple of 8 from 16 to 256, or 512) raises ValueError
naming the supported set.
"""

from __future__ import annotations

import functools

import torch

from .op_call import call_op
from .utils import packbits

__all__ = ["register", "attention_forward", "attention_mask"]


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
    for name, what in _UNSUPPORTED.items():
        if kwargs.get(name) is not None:
            raise NotImplementedError(
                f"compiled_attn attention: {name} ({what}) is not supported by its kernels; "
                "use attn_implementation='sdpa' or 'eager' for this model")
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
        # causal module, top-left aligned as SDPA's is_causal (a static cache's prefill: the
        # keys past the queries are its empty slots), so the keys are cropped to the queries.
        # (A model that keeps only its last queries after building its masks would need the
        # bottom-right alignment: attention_mask builds every mask for those.)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        causal = bool(causal) and sq > 1
        if causal and skv > sq:
            key, value, skv = key[:, :, :sq], value[:, :, :sq], sq
        mode = MASK_CAUSAL if causal else MASK_NONE
        if causal and sliding_window:
            window_left = int(sliding_window) - 1  # HF: key j visible iff j > i - window
    out, _ = call_op(
        "single_prefill",
        query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), packed, None, sinks,
        mode, window_left, 0, scale, float(softcap or 0.0), 0, 1.0, 1e4, 1.0, None)
    return out, None


# Keyword arguments some models pass to their attention function whose effect the op has not
# got (each raises where it is not None): {name: what it does}.
_UNSUPPORTED = {
    "position_bias": "a bias added to the logits, e.g. T5's relative positions",
    "head_mask": "a per-head weight",
    "indices": "the keys each query attends (sparse attention's top-k, e.g. DeepSeek-V3.2)",
    "block_indices": "the key blocks each query attends (block-sparse attention)",
    "sinks": "attention sinks under a name other than GPT-OSS's s_aux",
}


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
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)
    return name


def attention_mask(*args, config=None, **kwargs):
    """The registered mask function: transformers' ``sdpa_mask`` (bool, True = attend; None
    where plain causal attention is exact), for models that run their attention through
    transformers' attention functions. A model that computes attention itself (Bloom, MPT,
    Falcon, GPT-Neo: their modeling module holds no ``ALL_ATTENTION_FUNCTIONS``) would add this
    mask to its logits as a float one and never reach the op: that raises
    NotImplementedError instead (in eager calls: such a model's first forward)."""
    from transformers.masking_utils import sdpa_mask

    # (checked eagerly only: the model's module lookup is no graph for torch.compile to trace)
    if (config is not None and not torch.compiler.is_compiling()
            and _computes_attention_itself(getattr(config, "model_type", None))):
        raise NotImplementedError(
            f"attn_implementation={config._attn_implementation!r}: {config.model_type} "
            "computes its attention itself, not through transformers' attention functions, so "
            "compiled_attn's kernels would not run and its mask would be misread; use "
            "attn_implementation='eager' or 'sdpa' for this model")
    if getattr(config, "num_kv_shared_layers", 0):
        # Gemma 4 keeps only the last queries before its KV-shared layers, with the masks it
        # built, unless its implementation is named "sdpa" and a mask is None: a None mask
        # (causal, top-left) would then be wrong for the queries it keeps. Build them all.
        kwargs["allow_is_causal_skip"] = False
    return sdpa_mask(*args, config=config, **kwargs)


@functools.lru_cache(maxsize=None)
def _computes_attention_itself(model_type) -> bool:
    """Whether transformers' base model of model_type has a modeling module without
    ALL_ATTENTION_FUNCTIONS (False where that cannot be told: an unknown or custom model)."""
    import importlib

    import transformers
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    cls = getattr(transformers, MODEL_MAPPING_NAMES.get(model_type) or "", None)
    if cls is None:
        return False
    try:
        module = importlib.import_module(cls.__module__)
    except ImportError:
        return False
    return not hasattr(module, "ALL_ATTENTION_FUNCTIONS")
