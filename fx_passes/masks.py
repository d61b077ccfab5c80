"""Mask analysis for the attention rewrite: which (query, key) pairs a mask lets through.

A site's masks arrive either as boolean SDPA masks (True = attend) or as tensors added to the
logits. An additive tensor is only rewritten when its values are *provably* in {0} and a set
of "masking" values NEG (-inf, or a finite value that swallows any logit added to it in the
logits' dtype: ``is_neg_value``): then it is exactly the boolean mask ``m == 0`` (softmax
weight exp(s + NEG - max) is 0 for every row that keeps a key).
The proof is a walk over the ops that built it (``zero_or_neg``); anything else (a learned
bias, ALiBi, a mask read from a model input) is a general additive bias and is skipped.

Masks must not vary over heads (single_prefill takes one [B, Sq, Skv] mask for all heads):
``head_invariant`` proves that the head axis only comes from broadcasting.

When a mask is built from constants alone (iota/arange/full/tril..., static shapes), it is
evaluated at compile time and classified (``classify``): all-true -> no mask, bottom-right
causal -> MASK_CAUSAL, causal with a left window -> MASK_CAUSAL + window_left; anything else
stays a custom mask. A mask that depends on inputs (padding) is always a custom mask.
"""

from __future__ import annotations

import math
import operator

import torch
from torch.fx import Node
from torch.fx.node import map_arg

from .graph_utils import aten, arg, dtype, prims, rank, shape, static_int, val

# Ops that move or copy elements without creating new values (the output's values are a
# subset of the input's): a value-set property of the input holds for the output.
_STRUCTURAL = {
    aten.expand.default, aten.view.default, aten._unsafe_view.default, aten.reshape.default,
    aten.slice.Tensor, aten.select.int, aten.unsqueeze.default, aten.squeeze.dim,
    aten.squeeze.dims, aten.squeeze.default, aten.permute.default, aten.transpose.int,
    aten.clone.default, aten.contiguous.default, aten.alias.default, aten.index.Tensor,
    aten.index_select.default, aten.repeat.default, aten.expand_copy.default,
    aten.lift_fresh_copy.default, aten.detach.default, aten.t.default,
    aten._to_copy.default, prims.convert_element_type.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten.type_as.default,
}
# Elementwise ops whose head-axis dependence is the union of their tensor inputs'.
_ELEMENTWISE = {
    aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar,
    aten.add.Tensor, aten.sub.Tensor, aten.mul.Tensor, aten.div.Tensor,
    aten.eq.Tensor, aten.eq.Scalar, aten.ne.Tensor, aten.ne.Scalar, aten.lt.Tensor,
    aten.lt.Scalar, aten.le.Tensor, aten.le.Scalar, aten.gt.Tensor, aten.gt.Scalar,
    aten.ge.Tensor, aten.ge.Scalar, aten.bitwise_and.Tensor, aten.bitwise_or.Tensor,
    aten.bitwise_not.default, aten.logical_and.default, aten.logical_or.default,
    aten.logical_not.default, aten.__and__.Tensor, aten.__or__.Tensor,
    aten.masked_fill.Scalar, aten.masked_fill.Tensor, aten.neg.default,
    aten.clone.default, aten.contiguous.default, aten._to_copy.default,
    prims.convert_element_type.default, aten.to.dtype, aten.to.dtype_layout,
    aten.to.device, aten.type_as.default, aten.alias.default, aten.detach.default,
    aten.triu.default, aten.tril.default,
}


_HALF = (torch.float16, torch.bfloat16)  # half-precision logits dtypes


def is_neg_value(x, logit_dtype: torch.dtype | None) -> bool:
    """A masking constant for logits of ``logit_dtype`` (the dtype the mask is added or
    filled in): one that swallows any logit added to it, as -inf does. -inf, or anything at or
    below -1e30 (float32 / bfloat16's most negative finite values among them) in every dtype;
    in float16 / bfloat16 logits also anything at or below float16's minimum -65504 (the
    spacing there, 32 / 512, swallows ordinary logits; HF and torch build half masks with it).
    In float32 logits -65504 is a constant shift: a row whose keys all carry it is softmax of
    its logits, not uniform, so it is no masking constant there (None: the dtype is unknown,
    likewise)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)):
        return False
    x = float(x)
    if x == -math.inf or x <= -1e30:
        return True
    return logit_dtype in _HALF and x <= torch.finfo(torch.float16).min


def _scalar_in_set(x, logit_dtype) -> bool:
    return x == 0 or is_neg_value(x, logit_dtype)


class NotProven(Exception):
    """An additive mask whose values are not provably in {0} and NEG; .reason says why."""


def zero_or_neg(n, logit_dtype: torch.dtype | None) -> bool:
    """Prove n's values are all 0 or NEG (is_neg_value for logits of logit_dtype, the dtype
    the mask is added in). Returns whether some NEG value is finite (then a fully masked row
    gives eager softmax's uniform weights, not 0). Raises NotProven."""
    return neg_kinds(n, logit_dtype)[0]


def neg_kinds(n, logit_dtype: torch.dtype | None, depth: int = 0) -> tuple[bool, bool]:
    """zero_or_neg's proof, returning (some NEG value may be finite, some may be -inf): a
    finite NEG added to another may overflow to -inf. Raises NotProven."""
    if not isinstance(n, Node):
        if isinstance(n, (int, float)) and _scalar_in_set(n, logit_dtype):
            return (not (float(n) == -math.inf or float(n) == 0), float(n) == -math.inf)
        raise NotProven(f"mask constant {n!r} is not 0/-inf/dtype-min for {logit_dtype} logits")
    if depth > 64:
        raise NotProven("mask expression too deep to analyse")
    dt = dtype(n)
    if dt is None or not dt.is_floating_point:
        raise NotProven(f"additive mask of dtype {dt} (not floating point)")
    if n.op == "get_attr":
        # A constant of the graph (e.g. a mask Dynamo folded into a tensor constant): its
        # values are known at rewrite time and cannot change, so check them.
        owner = n.graph.owning_module
        const = getattr(owner, n.target, None) if owner is not None else None
        if isinstance(const, torch.Tensor) and const.dtype.is_floating_point:
            from torch._subclasses.fake_tensor import unset_fake_temporarily

            with unset_fake_temporarily():  # the pass may run under Inductor's fake mode
                neg = (const == -math.inf) | (const <= -1e30)
                if logit_dtype in _HALF:
                    neg |= const <= torch.finfo(torch.float16).min
                zero_or_neg_only = bool(((const == 0) | neg).all())
                finite_neg = bool((neg & torch.isfinite(const)).any())
                inf_neg = bool((const == -math.inf).any())
            if zero_or_neg_only:
                return finite_neg, inf_neg
            raise NotProven(f"additive bias constant {n.target} holds values other than 0 and "
                            f"-inf/dtype-min for {logit_dtype} logits")

    def sub(x) -> tuple[bool, bool]:  # an operand, in the same logits
        return neg_kinds(x, logit_dtype, depth + 1)

    def either(*kinds) -> tuple[bool, bool]:
        return any(f for f, _ in kinds), any(i for _, i in kinds)

    if n.op != "call_function":
        raise NotProven(f"additive bias from {n.op} {n.target} (a model input or constant, "
                        "values unknown)")
    t = n.target
    if t in (aten.where.self, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.Scalar):
        a, b = n.args[1], n.args[2]
        return either(sub(a), sub(b))
    if t in (aten.masked_fill.Scalar, aten.masked_fill.Tensor):
        return either(sub(n.args[0]), sub(n.args[2]))
    if t is aten.add.Tensor:
        alpha = n.kwargs.get("alpha", 1)
        if not (isinstance(alpha, (int, float)) and alpha > 0):
            raise NotProven("mask add with a non-positive alpha")
        # 0+0 = 0, 0+NEG = NEG, NEG+NEG <= NEG (or -inf): the set is closed under add.
        (fa, ia), (fb, ib) = sub(n.args[0]), sub(n.args[1])
        return fa or fb, ia or ib or (fa and fb)
    if t in (aten.full.default, aten.full_like.default, aten.new_full.default):
        return sub(n.args[-1] if t is not aten.full.default else n.args[1])
    if t in (aten.scalar_tensor.default,):
        return sub(n.args[0])
    if t in (aten.zeros.default, aten.zeros_like.default, aten.new_zeros.default):
        return False, False
    if t in (aten.triu.default, aten.tril.default):
        return sub(n.args[0])  # keeps values, writes zeros elsewhere
    if t is aten.constant_pad_nd.default:
        return either(sub(n.args[0]), sub(arg(n, 2, "value", 0)))
    if t is aten.cat.default:
        return either(*(sub(x) for x in n.args[0]))
    if t in _STRUCTURAL:
        src = n.args[0]
        if not isinstance(src, Node) or not (dtype(src) is not None
                                             and dtype(src).is_floating_point):
            raise NotProven(f"additive mask cast from a non-float tensor by {t}")
        return sub(src)
    raise NotProven(f"additive bias built by {t} (not provably a 0/-inf mask)")


def head_axis(n) -> int | None:
    """Index of the head axis of a mask broadcast against [B, H, Sq, Skv] (dim -3)."""
    r = rank(n)
    return None if r is None or r < 3 else r - 3


def head_invariant(n, out_rank: int = 4, depth: int = 0) -> bool:
    """True when n, broadcast to out_rank dims, provably takes the same value for every index
    of dim out_rank-3 (the head axis): that axis has size 1, or comes only from expand."""
    if not isinstance(n, Node):
        return True
    s = shape(n)
    if s is None:
        return False
    hd = len(s) - 3
    if hd < 0 or static_int(s[hd]) == 1:
        return True
    if depth > 64 or n.op != "call_function":
        return False
    t = n.target
    if t is aten.expand.default:
        src = n.args[0]
        ss = shape(src)
        if ss is None:
            return False
        # Dims line up from the right.
        k = len(ss) - (len(s) - hd)
        if k < 0 or static_int(ss[k]) == 1:
            return True
        return head_invariant(src, len(ss), depth + 1)
    if t in (aten.slice.Tensor,) and arg(n, 1, "dim", 0) % len(s) != hd:
        return head_invariant(n.args[0], len(s), depth + 1)
    if t in _ELEMENTWISE:
        ok = True
        for a in list(n.args) + list(n.kwargs.values()):
            if isinstance(a, Node) and isinstance(val(a), torch.Tensor):
                ok = ok and head_invariant(a, len(s), depth + 1)
        return ok
    return False


def _nondeterministic(t) -> bool:
    """An op whose result is random (rand, bernoulli, dropout, ...): torch tags them."""
    return torch.Tag.nondeterministic_seeded in getattr(t, "tags", ())


def constant_ancestors(n: Node) -> list[Node] | None:
    """n and its ancestors in topological order when every one is a deterministic
    call_function with static shapes (no graph input, parameter, SymInt or random op feeds
    it); else None."""
    seen: dict[Node, None] = {}
    order: list[Node] = []
    stack = [(n, False)]
    while stack:
        x, done = stack.pop()
        if done:
            order.append(x)
            continue
        if x in seen:
            continue
        seen[x] = None
        if x.op != "call_function" or _nondeterministic(x.target):
            return None  # (a random op's value differs at every call: not a constant)
        v = val(x)
        if isinstance(v, torch.Tensor):
            if any(static_int(d) is None for d in v.shape):
                return None
        elif not isinstance(v, (int, float, bool)):
            return None
        stack.append((x, True))
        for a in x.all_input_nodes:
            stack.append((a, False))
        if len(order) > 4096:
            return None
    return order


def evaluate(n: Node) -> torch.Tensor | None:
    """Concrete value of a node built from constants alone, or None."""
    order = constant_ancestors(n)
    if order is None:
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    env: dict[Node, object] = {}
    try:
        with unset_fake_temporarily(), torch.no_grad():
            for x in order:
                if x in env:
                    continue
                args = map_arg(x.args, lambda a: env[a])
                kwargs = map_arg(x.kwargs, lambda a: env[a])
                env[x] = x.target(*args, **kwargs)
    except Exception:  # noqa: BLE001 - an op we cannot run eagerly: keep the mask dynamic
        return None
    out = env[n]
    return out if isinstance(out, torch.Tensor) else None


def scalar_value(n: Node) -> float | None:
    """The Python float held by a one-element node built from constants alone, or None.
    Read outside any active fake mode (the pass may run inside Inductor's, where even
    ``reshape`` of the real tensor ``evaluate`` returns would raise)."""
    c = evaluate(n)
    if c is None or c.numel() != 1:
        return None
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return float(c.reshape(()).item())


def classify(visible: torch.Tensor, sq: int, skv: int) -> tuple[str, int]:
    """Classify a concrete bool mask broadcastable to [b, Sq, Skv] (one for all heads).

    Returns ("none", -1), ("causal", window_left) with bottom-right alignment (row i sees
    keys j <= i + skv - sq, and j >= i + skv - sq - window_left when window_left >= 0), or
    ("custom", -1).
    """
    m = visible.to(torch.bool).cpu()
    while m.dim() < 3:
        m = m.unsqueeze(0)
    m = m.expand(m.shape[0], sq, skv)
    if bool(m.all()):
        return "none", -1
    if sq > skv:
        return "custom", -1
    i = torch.arange(sq)[:, None] + (skv - sq)
    j = torch.arange(skv)[None, :]
    causal = j <= i
    if bool((m == causal).all()):
        return "causal", -1
    # A left window w keeps w + 1 keys ending at the row's position: read w off the last row.
    w = int(m[0, -1].sum().item()) - 1
    if w >= 0 and bool((m == (causal & (j >= i - w))).all()):
        return "causal", w
    return "custom", -1


__all__ = ["NotProven", "zero_or_neg", "head_invariant", "evaluate", "classify", "is_neg_value",
           "head_axis", "scalar_value", "operator"]
