"""A plan's validated options: heads, head dims, the scalar attention options and the dtypes.

``PlanOptions`` is built once per plan() from that call's FlashInfer arguments, read by name
(``args``: the plan's arguments as a dict, e.g. ``dict(locals())`` on entry), and shared by the
paged and ragged batch plans (``of_batch``) and both POD plans (``of_pod``); each builder checks
its arguments in the order FlashInfer's signature lists them, so the first bad one is the one
named. ``scalar_options`` is the part every entry point shares with single-request prefill and
the deprecated forward(). A serving step re-plans with the same options: ``options_key`` says
when a wrapper may reuse its previous plan's, which ``LastOptions`` keeps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import torch

from . import _validate as V


# the option values a reuse key takes (immutable, compared by value)
_PLAIN = (type(None), bool, int, float, str, torch.dtype)
# a batch plan's arguments PlanOptions.of_batch reads
BATCH_OPTION_ARGS = ("num_qo_heads", "num_kv_heads", "head_dim_qk", "head_dim_vo",
                     "pos_encoding_mode", "sm_scale", "window_left", "logits_soft_cap",
                     "rope_scale", "rope_theta", "use_fp16_qk_reduction", "q_data_type",
                     "kv_data_type", "o_data_type")


def options_key(args: Mapping, names: Sequence[str], *context) -> tuple | None:
    """The key under which options made from ``args[name]`` for ``names`` (and whatever else
    they depend on: ``context``, hashable) may be reused: each value with its type (True and 1
    stay apart: the checks tell them apart), or None where a value is not of a plain immutable
    type (then the options are made anew)."""
    vals = []
    for name in names:
        v = args[name]
        if type(v) not in _PLAIN:
            return None
        vals.append((type(v), v))
    return (tuple(vals), *context)


class LastOptions:
    """A wrapper's last plan's options, reused while their options_key is the same."""

    def __init__(self) -> None:
        self._key = self._value = None

    def get(self, key: tuple | None, make):
        """make()'s answer, or the last one where ``key`` is not None and is the last key (a
        make() that raises leaves the last answer as it was)."""
        if key is None or key != self._key:
            self._value = make()
            self._key = key
        return self._value


def scalar_options(*, head_dim_qk: int, pos_encoding_mode, sm_scale, window_left,
                   logits_soft_cap, rope_scale, rope_theta, use_fp16_qk_reduction) -> dict:
    """Validated scalar options with FlashInfer's defaults applied.

    use_fp16_qk_reduction is a permission to reduce q.k in fp16; compiled_attn always reduces
    in fp32 (at least as accurate), which honours it."""
    if not isinstance(use_fp16_qk_reduction, bool):
        raise TypeError(f"use_fp16_qk_reduction: got {use_fp16_qk_reduction!r}; pass a bool")
    pos = V.check_pos_encoding_mode(pos_encoding_mode)
    V.check_rope_dim(head_dim_qk, pos)
    return dict(
        pos_encoding_mode=pos,
        sm_scale=V.check_scale("sm_scale", sm_scale, 1.0 / math.sqrt(head_dim_qk),
                               positive=False),
        window_left=V.check_window_left(window_left),
        logits_soft_cap=V.check_soft_cap(logits_soft_cap),
        rope_scale=V.check_scale("rope_scale", rope_scale, 1.0),
        rope_theta=V.check_scale("rope_theta", rope_theta, 1e4),
    )


def _same_q_kv_dtypes(q_dt: torch.dtype, kv_dt: torch.dtype) -> None:
    if kv_dt not in V.FP8_DTYPES and kv_dt != q_dt:
        raise TypeError(f"kv_data_type {kv_dt} differs from q_data_type {q_dt}; use one dtype "
                        "(only fp8 K/V may differ from q)")


@dataclasses.dataclass(frozen=True)
class PlanOptions:
    """What a plan fixed besides its index arrays (all validated): Hq / Hkv and their group
    size, the head dims, the scalar options (pos_encoding_mode as its integer code) and the
    q / K/V / output dtypes."""

    num_qo_heads: int
    num_kv_heads: int
    group: int
    head_dim_qk: int
    head_dim_vo: int
    pos_encoding_mode: int
    sm_scale: float
    window_left: int
    logits_soft_cap: float
    rope_scale: float
    rope_theta: float
    q_dtype: torch.dtype
    kv_dtype: torch.dtype
    o_dtype: torch.dtype

    @classmethod
    def of_batch(cls, args: Mapping, device_type: str) -> PlanOptions:
        """From the arguments of a paged or ragged batch plan() (FlashInfer's names)."""
        dqk = args["head_dim_qk"]
        dvo = dqk if args["head_dim_vo"] is None else args["head_dim_vo"]
        group = V.check_heads(args["num_qo_heads"], args["num_kv_heads"])
        V.check_head_dims(dqk, dvo, device_type)
        opts = scalar_options(
            head_dim_qk=dqk, pos_encoding_mode=args["pos_encoding_mode"],
            sm_scale=args["sm_scale"], window_left=args["window_left"],
            logits_soft_cap=args["logits_soft_cap"], rope_scale=args["rope_scale"],
            rope_theta=args["rope_theta"], use_fp16_qk_reduction=args["use_fp16_qk_reduction"])
        q_dt = V.canonical_dtype("q_data_type", args["q_data_type"])
        kv_dt = (q_dt if args["kv_data_type"] is None
                 else V.canonical_dtype("kv_data_type", args["kv_data_type"]))
        o_dt = (q_dt if args["o_data_type"] is None
                else V.canonical_dtype("o_data_type", args["o_data_type"]))
        V.check_q_dtype("q_data_type", q_dt, device_type)
        V.check_kv_dtype("kv_data_type", kv_dt, device_type)
        V.check_out_dtype("o_data_type", o_dt, device_type)
        _same_q_kv_dtypes(q_dt, kv_dt)
        return cls(num_qo_heads=args["num_qo_heads"], num_kv_heads=args["num_kv_heads"],
                   group=group, head_dim_qk=dqk, head_dim_vo=dvo, q_dtype=q_dt, kv_dtype=kv_dt,
                   o_dtype=o_dt, **opts)

    @classmethod
    def of_pod(cls, args: Mapping, device_type: str) -> PlanOptions:
        """From the arguments of a POD or BatchPOD plan() (FlashInfer's names): one head_dim,
        no soft cap, the output in q's dtype, and page_size checked here (FlashInfer lists it
        among the options). data_type (deprecated) sets both q_data_type and kv_data_type where
        those are None; q_data_type defaults to float16. (FlashInfer's signature defaults
        q_data_type to "float16", which makes data_type silently miss q.)"""
        d, page_size = args["head_dim"], args["page_size"]
        group = V.check_heads(args["num_qo_heads"], args["num_kv_heads"])
        V.check_head_dims(d, d, device_type, names=("head_dim", "head_dim"))
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
            raise ValueError(f"page_size: got {page_size!r}; use a Python int >= 1")
        pos = V.check_pos_encoding_mode(args["pos_encoding_mode"])
        V.check_rope_dim(d, pos)
        q_data_type, kv_data_type = args["q_data_type"], args["kv_data_type"]
        if args["data_type"] is not None:
            q_data_type = args["data_type"] if q_data_type is None else q_data_type
            kv_data_type = args["data_type"] if kv_data_type is None else kv_data_type
        q_dt = V.canonical_dtype("q_data_type",
                                 q_data_type if q_data_type is not None else "float16")
        kv_dt = q_dt if kv_data_type is None else V.canonical_dtype("kv_data_type", kv_data_type)
        V.check_q_dtype("q_data_type", q_dt, device_type)
        V.check_kv_dtype("kv_data_type", kv_dt, device_type)
        _same_q_kv_dtypes(q_dt, kv_dt)
        return cls(num_qo_heads=args["num_qo_heads"], num_kv_heads=args["num_kv_heads"],
                   group=group, head_dim_qk=d, head_dim_vo=d, pos_encoding_mode=pos,
                   window_left=V.check_window_left(args["window_left"]),
                   sm_scale=V.check_scale("sm_scale", args["sm_scale"], 1.0 / math.sqrt(d),
                                          positive=False),
                   logits_soft_cap=0.0,
                   rope_scale=V.check_scale("rope_scale", args["rope_scale"], 1.0),
                   rope_theta=V.check_scale("rope_theta", args["rope_theta"], 1e4),
                   q_dtype=q_dt, kv_dtype=kv_dt, o_dtype=q_dt)

    def fields(self) -> dict:
        """The options by name (a plan stores them beside its tensors)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
