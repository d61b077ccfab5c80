"""The attention rewrite: find attention sites in an aten FX graph and replace each with one
``torch.ops.compiled_attn.single_prefill`` call.

A site is anchored at its last op and read backwards (a hand-written walk rather than
Inductor's pattern matcher, so that one matcher serves Inductor's joint graph, torch.export's
training IR and core ATen, on torch 2.11 to 2.13):

- ``sdpa``: any scaled-dot-product-attention op (``aten.scaled_dot_product_attention`` and the
  backend ops it dispatches to: ``_scaled_dot_product_flash_attention_for_cpu``,
  ``_scaled_dot_product_flash_attention``, ``_scaled_dot_product_efficient_attention``,
  ``_scaled_dot_product_cudnn_attention``) with is_causal, a bool or additive mask, scale=,
  enable_gqa.
- ``matmul_softmax``: ``matmul(softmax(cap(scale * matmul(q, k^T)) + masks), v)`` with the
  softmax whole (``softmax``/``_softmax``/``_safe_softmax``) or decomposed (amax, sub, exp,
  sum, div), float32 upcast and cast back, eval-mode dropout, scale as mul or div, soft cap
  ``tanh(x / c) * c``, any number of additive masks.

Both then share: k/v un-repeated when they come from repeat_kv (unsqueeze, expand, reshape),
repeat_interleave on the head axis or an expand of one head (-> GQA on the original k/v);
masks analysed by ``masks`` (bool -> visible; additive -> proven 0/NEG -> ``m == 0``; head
invariant; constant masks classified causal / causal+window / none); the replacement is
``single_prefill(q^T, k^T, v^T)`` on [B, S, H, D] views of the [B, H, S, D] operands.

Invariants: a site is rewritten only when every op between its inputs and its output is
understood and the replacement computes the same function (up to float rounding, and except
rows that see no key, which the kernel defines as 0; with finite-NEG additive masks such rows
are patched to eager's uniform average over all keys, of each query head's own KV head under
GQA). A finite NEG is one that swallows any logit it is added to in the logits' dtype
(``masks.is_neg_value``: float16's -65504 masks half-precision logits, not float32 ones).
Everything else is left untouched, and sites that look like attention (softmax between two
matmuls, or an SDPA op) are counted as ``skipped:<reason>`` in ``counters``.
"""

from __future__ import annotations

import collections
import math
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from . import masks as M
from .graph_utils import (
    CAST_OPS, COPY_OPS, RESHAPE_OPS, Emitter, aten, arg, dtype, fake_mode_of, is_call, rank,
    same_shape, same_size, shape, static_int, strip_identity, val,
)

#: Rewrite statistics: "rewritten", "pattern:<name>", feature keys ("gqa:<how>",
#: "mask:<kind>", "soft_cap"), and "skipped:<reason>" per attention site left alone.
counters: collections.Counter = collections.Counter()


class Skip(Exception):
    """An attention site that cannot be rewritten exactly; str(self) is the reason."""


SDPA_OPS = {
    aten.scaled_dot_product_attention.default: "aten",
    aten._scaled_dot_product_flash_attention_for_cpu.default: "flash_cpu",
    aten._scaled_dot_product_flash_attention.default: "flash",
    aten._scaled_dot_product_efficient_attention.default: "efficient",
}
if hasattr(aten, "_scaled_dot_product_cudnn_attention"):
    SDPA_OPS[aten._scaled_dot_product_cudnn_attention.default] = "cudnn"


@dataclass
class Site:
    """What a matched attention site computes: softmax(cap(scale * q k^T) masked) v.

    q, k, v: [B, H, S, D] nodes (k/v possibly already repeated to Hq heads); out: the node
    whose value is the [B, Hq, Sq, Dvo] result; bool_masks: nodes, True = attend; add_masks:
    (additive-mask node, dtype of the logits it is added to), still to be proven 0/NEG;
    causal_top_left: SDPA's is_causal.
    """

    pattern: str
    out: Node
    q: Node
    k: Node
    v: Node
    scale: float | None = None
    soft_cap: float = 0.0
    bool_masks: list = field(default_factory=list)
    add_masks: list = field(default_factory=list)
    hide_masks: list = field(default_factory=list)  # bool, True = masked (masked_fill/where)
    hide_finite: bool = False  # some hide mask fills a finite NEG (eager: uniform row)
    hide_inf: bool = False  # some hide mask fills -inf
    causal_top_left: bool = False
    enable_gqa: bool = False
    drop: list = field(default_factory=list)  # nodes to erase with the site (e.g. asserts)
    # Runtime scalar factors of the logits: (0-d tensor node, "mul" | "div"), folded into q.
    scale_nodes: list = field(default_factory=list)
    # Per-head sink logits (GPT-OSS): a [1, Hq, 1, 1] node joining each row's softmax
    # denominator, as the op's sinks.
    sinks: Node | None = None
    # The q @ k^T node of a matmul site (None: SDPA, whose op reads q, k and v where the
    # rewrite's op will): the rewrite's op reads q, k and the masks at ``out`` instead.
    scores: Node | None = None


# ---------------------------------------------------------------------------------------------
# Matching
# ---------------------------------------------------------------------------------------------
def _as_4d_operand(n: Node) -> Node | None:
    """For a bmm operand [B*H, M, K], the 4-D node [B, H, M, K] it was flattened from."""
    if not is_call(n, *RESHAPE_OPS):
        return None
    src = n.args[0]
    while is_call(src, *COPY_OPS):
        src = src.args[0]
    s, so = shape(src), shape(n)
    if s is None or so is None or len(s) != 4 or len(so) != 3:
        return None
    if not (same_size(s[0] * s[1], so[0]) and same_size(s[2], so[1]) and same_size(s[3], so[2])):
        return None
    return src


def match_matmul(n: Node) -> tuple[Node, Node] | None:
    """(a, b) when n == a @ b with a, b and n all 4-D; else None."""
    if is_call(n, aten.matmul.default):
        a, b = n.args[0], n.args[1]
        if rank(a) == 4 and rank(b) == 4 and rank(n) == 4:
            return a, b
        return None
    if is_call(n, *RESHAPE_OPS) and rank(n) == 4 and is_call(n.args[0], aten.bmm.default):
        bmm = n.args[0]
        a4, b4 = _as_4d_operand(bmm.args[0]), _as_4d_operand(bmm.args[1])
        if a4 is None or b4 is None:
            return None
        s = shape(n)
        if not (same_size(shape(bmm)[0], s[0] * s[1]) and same_shape(shape(bmm)[1:], s[2:])):
            return None
        return a4, b4
    return None


def _last_dim(d, r: int | None) -> bool:
    """Whether dim d (an int, or a one-element list of one) is the last of rank r."""
    d = d[0] if isinstance(d, (list, tuple)) and len(d) == 1 else d
    return isinstance(d, int) and r is not None and d % r == r - 1


def _keepdim_last(red: Node, x: Node) -> bool:
    """Whether reduction red (amax / max.dim / sum: args (x, dim, keepdim)) reduces x over its
    last dim with keepdim."""
    return (red.args[0] is x and _last_dim(red.args[1], rank(x))
            and bool(arg(red, 2, "keepdim", False)))


def match_softmax(n: Node) -> Node | None:
    """The input x when n == softmax(x, dim=-1) (any spelling); else None."""
    if rank(n) is None:
        return None
    if is_call(n, aten._softmax.default, aten.softmax.int, aten._safe_softmax.default):
        return n.args[0] if _last_dim(n.args[1], rank(n)) else None
    # Decomposed: div(exp(x - amax(x, -1, keepdim)), sum(exp(...), -1, keepdim)).
    if is_call(n, aten.div.Tensor):
        e, s = n.args
        if not (is_call(e, aten.exp.default) and is_call(s, aten.sum.dim_IntList)
                and _keepdim_last(s, e)):
            return None
        sub = e.args[0]
        if not is_call(sub, aten.sub.Tensor):
            return None
        x, mx = sub.args
        if not (is_call(mx, aten.amax.default) and _keepdim_last(mx, x)):
            return None
        return x
    return None


def _number(x) -> float | None:
    if isinstance(x, bool):
        return None
    if isinstance(x, (int, float)):
        return float(x)
    return None


def _private_inplace(n: Node) -> bool:
    """n is an in-place op (export's training IR keeps them) on a temporary that nothing else
    reads and that is no view of another tensor (the op would write through to it): its
    result is then a plain function of its arguments (Falcon's `scores /= ...`)."""
    src = n.args[0] if n.args else None
    return (isinstance(src, Node) and src.op == "call_function" and len(src.users) == 1
            and _functional_op(src.target) and not _aliasing_op(src.target))


def _aliasing_op(t) -> bool:
    """An aten op whose result may share storage with an input (a view: view, transpose,
    expand, ...), by its schema's alias annotations."""
    return any(r.alias_info is not None for r in t._schema.returns)


_INPLACE_SCALES = {aten.mul_.Tensor: aten.mul.Tensor, aten.mul_.Scalar: aten.mul.Scalar,
                   aten.div_.Tensor: aten.div.Tensor, aten.div_.Scalar: aten.div.Scalar}


def _scale_factor(n: Node) -> tuple[Node, float] | None:
    """(x, c) when n == x * c or x / c (c a Python number), in place on a private temporary
    included."""
    if not (isinstance(n, Node) and n.op == "call_function"):
        return None
    target = n.target
    if target in _INPLACE_SCALES and _private_inplace(n):
        target = _INPLACE_SCALES[target]
    if target in (aten.mul.Tensor, aten.mul.Scalar):
        a, b = n.args
        if _number(b) is not None and isinstance(a, Node):
            return a, _number(b)
        if _number(a) is not None and isinstance(b, Node):
            return b, _number(a)
    if target in (aten.div.Tensor, aten.div.Scalar):
        a, b = n.args
        if _number(b) is not None and isinstance(a, Node) and _number(b) != 0 \
                and not n.kwargs.get("rounding_mode"):
            return a, 1.0 / _number(b)
    return None


def _tensor_scale(n: Node) -> tuple[Node, Node, str] | None:
    """(x, t, how) when n == x * t or x / t with t a 0-d floating tensor computed at run time
    (e.g. HF's ``self.scaling`` float, which Dynamo with dynamic=True passes to the graph as a
    0-d tensor input): a uniform factor, so exactly foldable into q."""
    if not is_call(n, aten.mul.Tensor, aten.div.Tensor):
        return None
    if is_call(n, aten.div.Tensor) and n.kwargs.get("rounding_mode"):
        return None
    a, b = n.args[:2]
    cands = [(a, b), (b, a)] if n.target is aten.mul.Tensor else [(a, b)]
    for x, t in cands:
        if not (isinstance(x, Node) and isinstance(t, Node)):
            continue
        tv = val(t)
        if (isinstance(tv, torch.Tensor) and tv.dim() == 0 and tv.dtype.is_floating_point
                and same_shape(shape(x), shape(n))):
            return x, t, "mul" if n.target is aten.mul.Tensor else "div"
    return None


def _soft_cap(n: Node) -> tuple[Node, float] | None:
    """(x, c) when n == tanh(x / c) * c (Gemma2's attn_logit_softcapping)."""
    sf = _scale_factor(n)
    if sf is None:
        return None
    t, c = sf
    if not is_call(t, aten.tanh.default):
        return None
    inner = _scale_factor(t.args[0])
    if inner is None or c <= 0 or not math.isclose(inner[1] * c, 1.0, rel_tol=1e-6):
        return None
    return inner[0], c


def _fill_mask(n: Node):
    """(logits, hide, fill) when n fills masked logits with a NEG constant:
    masked_fill(x, hide, NEG) or where(keep, x, NEG) (then hide is ("not", keep)); NEG for
    logits of n's dtype (masks.is_neg_value)."""
    if not isinstance(n, Node):
        return None
    dt = dtype(n)
    if is_call(n, aten.masked_fill.Scalar) and M.is_neg_value(n.args[2], dt):
        return n.args[0], n.args[1], n.args[2]
    if is_call(n, aten.where.ScalarOther) and M.is_neg_value(n.args[2], dt):
        return n.args[1], ("not", n.args[0]), n.args[2]
    if is_call(n, aten.where.self) and isinstance(n.args[2], Node):
        c = M.scalar_value(n.args[2])
        if c is not None and M.is_neg_value(c, dt):
            return n.args[1], ("not", n.args[0]), c
    # where(hide, NEG, x): masked_fill as Inductor decomposes it.
    if is_call(n, aten.where.ScalarSelf) and M.is_neg_value(n.args[1], dt) \
            and isinstance(n.args[2], Node):
        return n.args[2], n.args[0], n.args[1]
    if is_call(n, aten.where.self) and isinstance(n.args[1], Node) \
            and isinstance(n.args[2], Node):
        c = M.scalar_value(n.args[1])
        if c is not None and M.is_neg_value(c, dt):
            return n.args[2], n.args[0], c
    return None


def parse_scores(x: Node, full_shape, hides: list | None = None,
                 scale_nodes: list | None = None) -> tuple[Node, float, float, list]:
    """Read the logits fed to softmax back to q @ k^T.

    Accepted order (outermost first): casts and additive masks, then the soft cap, then scale
    factors, then the matmul. Returns (qk_matmul_node, scale, soft_cap, additive masks as
    (mask node, dtype of the logits it is added to)).
    Runtime 0-d tensor factors are appended to scale_nodes (when given) as (node, "mul" |
    "div"). Raises Skip for an op we do not understand on this path.
    """
    masks: list = []
    scale, cap = 1.0, 0.0
    seen_scale = False  # order (outermost first): casts/masks, soft cap, scales, matmul
    n = x
    for _ in range(64):
        n = strip_identity(n)
        if match_matmul(n) is not None:
            return n, scale, cap, masks
        fm = _fill_mask(n) if hides is not None else None
        if fm is not None:
            if seen_scale or cap:
                raise Skip("mask filled before the scale or soft cap")
            if not same_shape(shape(n), full_shape) or dtype(fm[1] if not isinstance(
                    fm[1], tuple) else fm[1][1]) != torch.bool:
                raise Skip("masked_fill/where mask is not a bool of the logits' shape")
            hides.append((fm[1], fm[2]))
            n = fm[0]
            continue
        if is_call(n, aten.add.Tensor) and n.kwargs.get("alpha", 1) == 1:
            if seen_scale or cap:
                raise Skip("mask added before the scale or soft cap")
            a, b = n.args
            if not (isinstance(a, Node) and isinstance(b, Node)):
                raise Skip("constant added to the logits")
            if not same_shape(shape(n), full_shape):
                raise Skip("additive mask broadcasts the logits to a larger shape")
            # The logits side is the one leading back to the matmul; the other is the mask,
            # added in the add's dtype.
            if _leads_to_matmul(a):
                masks.append((b, dtype(n)))
                n = a
            elif _leads_to_matmul(b):
                masks.append((a, dtype(n)))
                n = b
            else:
                raise Skip("neither side of a logits add leads to q @ k^T")
            continue
        sc = _soft_cap(n)
        if sc is not None:
            if seen_scale or cap:
                raise Skip("scale applied after the soft cap")
            n, cap = sc
            continue
        sf = _scale_factor(n)
        if sf is not None:
            n, c = sf
            scale *= c
            seen_scale = True
            continue
        ts = _tensor_scale(n) if scale_nodes is not None else None
        if ts is not None and is_call(strip_identity(ts[0]), aten.tanh.default):
            # tanh(x / c) * c with c a 0-d tensor input (Dynamo's unspecialized float, e.g.
            # Gemma2 under dynamic=True): the kernel's logits_soft_cap is a compile-time float.
            raise Skip("soft cap by a runtime value (an unspecialized float)")
        if ts is not None:
            n, t, how = ts
            scale_nodes.append((t, how))
            seen_scale = True
            continue
        what = n.target if isinstance(n, Node) else n
        raise Skip(f"unsupported op {getattr(what, '__name__', what)} between q @ k^T "
                   "and softmax")
    raise Skip("logits expression too deep")


def _leads_to_matmul(n: Node, depth: int = 0) -> bool:
    """Cheap test: does n reach a 4-D matmul through ops parse_scores can walk?"""
    for _ in range(64):
        n = strip_identity(n)
        if not isinstance(n, Node):
            return False
        if match_matmul(n) is not None:
            return True
        sc = _soft_cap(n) or _scale_factor(n) or _fill_mask(n) or _tensor_scale(n)
        if sc is not None:
            n = sc[0]
            continue
        if is_call(n, aten.tanh.default):  # a soft cap parse_scores may still refuse
            n = n.args[0]
            continue
        if is_call(n, aten.add.Tensor) and depth < 8:
            return any(isinstance(a, Node) and _leads_to_matmul(a, depth + 1) for a in n.args)
        return False
    return False


def _has_matmul_ancestor(n: Node, depth: int) -> bool:
    """A 4-D matmul within depth ops above n (through any ops)."""
    frontier, seen = [n], set()
    for _ in range(depth + 1):
        nxt = []
        for x in frontier:
            if not isinstance(x, Node) or x in seen:
                continue
            seen.add(x)
            if match_matmul(x) is not None:
                return True
            nxt.extend(x.all_input_nodes)
        frontier = nxt
    return False


def _row_max_removed(x: Node) -> Node:
    """c when x == c - max(c, -1, keepdim) (max.dim's values or amax): softmax(x) ==
    softmax(c), so the subtraction GPT-OSS does before its softmax changes nothing."""
    if is_call(x, aten.sub.Tensor) and isinstance(x.args[1], Node):
        c, mx = x.args
        if is_call(mx, operator.getitem) and mx.args[1] == 0:
            mx = mx.args[0]
        if is_call(mx, aten.max.dim, aten.amax.default) and _keepdim_last(mx, c):
            return c
    return x


def _sink_softmax(p0: Node) -> tuple[Node, Node] | None:
    """(logits, sinks) when p0 == softmax(cat([logits, sinks], -1))[..., :-1], GPT-OSS's eager
    attention (transformers' gpt_oss eager_attention_forward: a per-head sink logit expanded
    to one extra column, the row max subtracted, the column sliced back off), with sinks the
    [1, Hq, 1, 1] node the column was expanded from; else None."""
    if not (is_call(p0, aten.slice.Tensor) and arg(p0, 4, "step", 1) == 1
            and rank(p0) == 4 and arg(p0, 1, "dim", 0) % 4 == 3
            and arg(p0, 2, "start", None) in (0, None)):
        return None
    x = match_softmax(strip_identity(p0.args[0]))
    if x is None:
        return None
    c = _row_max_removed(strip_identity(x))
    if not (is_call(c, aten.cat.default) and len(c.args[0]) == 2
            and arg(c, 1, "dim", 0) % 4 == 3):
        return None
    logits, col = c.args[0]
    ps, ls, cols = shape(p0), shape(logits), shape(col)
    # one sink column, sliced off
    if (ps is None or ls is None or cols is None or static_int(cols[-1]) != 1
            or not same_size(ps[3], ls[3])):
        return None
    col = strip_identity(col)
    while is_call(col, aten.expand.default, *CAST_OPS) and isinstance(col.args[0], Node):
        col = col.args[0]
    cs = shape(col)
    if cs is None or len(cs) != 4 or not all(static_int(cs[i]) == 1 for i in (0, 2, 3)):
        return None
    return logits, col


def match_matmul_softmax(n: Node) -> Site | None:
    """A matmul(softmax(...), v) site anchored at n (or GPT-OSS's sink form of it:
    _sink_softmax), or None if n is not such a matmul."""
    mm = match_matmul(n)
    if mm is None:
        return None
    p, v = mm
    p0 = strip_identity(p)
    sinks = None
    x = match_softmax(p0)
    if x is None:
        sink_form = _sink_softmax(p0)
        if sink_form is None:
            return None
        x, sinks = sink_form
    xs = strip_identity(x)
    hides: list = []
    scale_nodes: list = []
    try:
        qk, scale, cap, add_masks = parse_scores(xs, shape(p0), hides, scale_nodes)
    except Skip:
        if _has_matmul_ancestor(xs, 8):
            raise  # softmax(f(q @ k^T)) @ v with an f we do not understand: counted as skipped
        return None  # softmax of something that is not q @ k^T: not attention
    q, kt = match_matmul(qk)
    site = Site(pattern="matmul_softmax" if sinks is None else "matmul_softmax_sinks", out=n,
                q=q, k=_untranspose(kt), v=v, scale=scale, soft_cap=cap, add_masks=add_masks,
                scale_nodes=scale_nodes, sinks=sinks, scores=qk)
    for hide, fill in hides:
        site.hide_masks.append(hide)
        site.hide_finite |= not (float(fill) == -math.inf)
        site.hide_inf |= float(fill) == -math.inf
    return site


def _untranspose(kt: Node):
    """k when kt == k.transpose(-2, -1) is visible in the graph; else ("T", kt) to be
    transposed by the emitter."""
    n = strip_identity(kt, allow_casts=False)
    if is_call(n, aten.transpose.int) and sorted(d % 4 for d in n.args[1:3]) == [2, 3]:
        return n.args[0]
    if is_call(n, aten.permute.default) and list(n.args[1]) in ([0, 1, 3, 2],):
        return n.args[0]
    if is_call(n, aten.t.default):
        return n.args[0]
    return ("T", kt)


def match_sdpa(n: Node) -> Site | None:
    """An SDPA-family site anchored at n (the op itself; tuple ops are read via getitem 0)."""
    kind = SDPA_OPS.get(n.target) if n.op == "call_function" else None
    if kind is None:
        return None
    q, k, v = n.args[:3]
    if kind == "aten":
        mask = arg(n, 3, "attn_mask")
        dropout = arg(n, 4, "dropout_p", 0.0)
        causal = arg(n, 5, "is_causal", False)
        scale = n.kwargs.get("scale", n.args[6] if len(n.args) > 6 else None)
        gqa = n.kwargs.get("enable_gqa", n.args[7] if len(n.args) > 7 else False)
        out = n
    else:
        if kind == "flash_cpu":
            dropout, causal = arg(n, 3, "dropout_p", 0.0), arg(n, 4, "is_causal", False)
            mask = n.kwargs.get("attn_mask")
        elif kind == "flash":
            dropout, causal = arg(n, 3, "dropout_p", 0.0), arg(n, 4, "is_causal", False)
            mask = None
        elif kind == "efficient":
            mask = arg(n, 3, "attn_bias")
            dropout, causal = arg(n, 5, "dropout_p", 0.0), arg(n, 6, "is_causal", False)
        else:  # cudnn
            mask = arg(n, 3, "attn_bias")
            dropout, causal = arg(n, 5, "dropout_p", 0.0), arg(n, 6, "is_causal", False)
        scale = n.kwargs.get("scale")
        # A backend op receives K/V with fewer heads than Q only where SDPA was called with
        # enable_gqa and the backend groups heads itself (CUDA's flash / efficient / cuDNN):
        # query head h reads kv head h // (Hq / Hkv), as enable_gqa does.
        gqa = True
        users = list(n.users)
        outs = [u for u in users if is_call(u, operator.getitem) and u.args[1] == 0]
        others = [u for u in users if u not in outs]
        if len(outs) != 1:
            raise Skip("SDPA output not read exactly once")
        if others:
            raise Skip("SDPA's logsumexp/debug outputs are used")
        out = outs[0]
    if not (dropout == 0 or dropout == 0.0):
        raise Skip("SDPA with dropout_p > 0")
    if not isinstance(causal, bool):
        raise Skip("is_causal is not a constant bool")
    if scale is not None and _number(scale) is None:
        raise Skip("SDPA scale is not a constant")
    site = Site(pattern="sdpa", out=out, q=q, k=k, v=v,
                scale=None if scale is None else float(scale),
                causal_top_left=causal, enable_gqa=bool(gqa))
    if mask is not None:
        if dtype(mask) == torch.bool:
            site.bool_masks.append(mask)
        else:
            site.add_masks.append((mask, dtype(q)))  # SDPA adds attn_mask to q-dtype logits
    return site


# ---------------------------------------------------------------------------------------------
# GQA: un-repeat k/v
# ---------------------------------------------------------------------------------------------
def unrepeat(n: Node) -> tuple[Node, int, str | None]:
    """(src, n_rep, how) with n == src's heads each repeated n_rep times consecutively (head h
    reads src head h // n_rep, as single_prefill does for GQA); (n, 1, None) if no repeat."""
    x = strip_identity(n, allow_casts=False)
    s = shape(x)
    if s is None or len(s) != 4:
        return n, 1, None
    # repeat_kv: reshape(expand(unsqueeze(src, 2), [B, Hkv, r, S, D]), [B, Hkv*r, S, D])
    if is_call(x, *RESHAPE_OPS):
        e = x.args[0]
        while is_call(e, *COPY_OPS):
            e = e.args[0]
        if is_call(e, aten.expand.default) and rank(e) == 5:
            u = strip_identity(e.args[0], allow_casts=False)
            es = shape(e)
            if is_call(u, aten.unsqueeze.default) and u.args[1] % 5 == 2:
                src = u.args[0]
                ss = shape(src)
                r = static_int(es[2])
                if (ss is not None and len(ss) == 4 and r is not None and same_size(ss[0], es[0])
                        and same_size(ss[1], es[1]) and same_shape(ss[2:], es[3:])
                        and same_shape(s, (es[0], es[1] * es[2], es[3], es[4]))):
                    return src, r, "repeat_kv"
    if is_call(x, aten.repeat_interleave.self_int):
        src, r = x.args[0], x.args[1]
        dim = arg(x, 2, "dim")
        if isinstance(r, int) and dim is not None and dim % 4 == 1 \
                and arg(x, 3, "output_size") in (None, shape(x)[1]):
            return src, r, "repeat_interleave"
    if is_call(x, aten.expand.default):
        src = x.args[0]
        ss = shape(src)
        if ss is not None and len(ss) == 4 and static_int(ss[1]) == 1 \
                and same_shape(ss[:1] + ss[2:], s[:1] + s[2:]):
            r = static_int(s[1])
            if r is not None and r > 1:
                return src, r, "expand"
    return n, 1, None


# ---------------------------------------------------------------------------------------------
# Rewriting
# ---------------------------------------------------------------------------------------------
def _pack_bits(em: Emitter, mask3: Node) -> Node:
    """uint8 little-endian bits of a bool [B, Sq, Skv] node, flattened row-major (the packed
    custom-mask format of single_prefill). Traceable without reading sizes: append 7 zero
    bits, take non-overlapping windows of 8 (ceil(n / 8) of them), shift bit i left by i and
    sum.

    The weights are a shift (``bit << i``), not ``2 ** arange(8)``: Inductor lowers an integer
    ``pow.Scalar`` to an ATen fallback, and AOTInductor's C shim for it
    (``aoti_torch_<dev>_pow_Scalar(double self, ...)``) takes the base as a double, so the result
    is float32 while the generated code reads it as int32 (float bit patterns as weights: every
    packed byte wrong). torch 2.13; tests/test_fx_aoti.py pins it."""
    dev = val(mask3).device
    flat = em(aten.view.default, em(aten.clone.default, mask3,
                                    memory_format=torch.contiguous_format), [-1])
    bits = em.cast(flat, torch.int32)
    n = static_int(shape(flat)[0])
    if n is not None:  # static: pad to whole bytes, then rows of 8 bits
        bits = em(aten.constant_pad_nd.default, bits, [0, (-n) % 8], 0.0)
        win = em(aten.view.default, bits, [-1, 8])
    else:
        # Not constant_pad_nd: its meta specialises a symbolic length (2 * s0**2 became the
        # example's 288 + 7, with a guard nothing checks), so an AOTInductor package built
        # from a dynamic export packed a fixed-size mask and read bits past it as False
        # (tests/test_fx_aoti.py). cat keeps the length symbolic.
        seven = em(aten.full.default, [7], 0, dtype=torch.int32, device=dev)
        bits = em(aten.cat.default, [bits, seven])
        win = em(aten.unfold.default, bits, 0, 8, 8)  # [ceil(n/8), 8]
    shifted = em(aten.bitwise_left_shift.Tensor, win, em.arange(8, torch.int32, dev))
    byte = em(aten.sum.dim_IntList, shifted, [1])
    return em.cast(byte, torch.uint8)


def _bool_of(em: Emitter, m: Node, how: str) -> Node:
    """The visibility mask of one mask node, with its head axis reduced to size 1."""
    b = em(aten.eq.Scalar, m, 0) if how == "add" else \
        em(aten.logical_not.default, m) if how == "hide" else m
    hd = M.head_axis(b)
    if hd is not None and static_int(shape(b)[hd]) != 1:
        # head_invariant proved every head index holds the same values: keep index 0.
        b = em(aten.slice.Tensor, b, hd, 0, 1)
    return b


def _to_b_sq_skv(c: torch.Tensor) -> torch.Tensor:
    """A concrete head-invariant mask aligned to [B, H, Sq, Skv] from the right -> [b, Sq, Skv]."""
    if c.dim() == 4:
        c = c[:, 0]
    elif c.dim() == 3:
        c = c[0]
    while c.dim() < 3:
        c = c.unsqueeze(0)
    return c


def _transpose_last2(em: Emitter, x):
    if isinstance(x, tuple):
        return em(aten.permute.default, x[1], [0, 1, 3, 2])
    return x


def _check_kernel_head_dims(q, dqk: int | None, dvo: int | None) -> None:
    """Skip a site whose static head dims the kernel does not run (ops.contracts.
    KERNEL_HEAD_DIMS) where the op would run the kernel (q: the site's q value; a CUDA tensor,
    or a CPU one under TRITON_INTERPRET=1): left as written, it runs, where the op would raise.
    Symbolic head dims are specialised by the launch, which checks them then."""
    from compiled_attn.ops.contracts import _use_kernel, check_kernel_head_dims

    if dqk is None or dvo is None or not _use_kernel(q):
        return
    try:
        check_kernel_head_dims(dqk, dvo)
    except ValueError:
        raise Skip(f"head dims ({dqk}, {dvo}) have no kernel on {q.device.type}") from None


def _base(n):
    """The tensor n views (through view ops, by their schemas' alias annotations), or n."""
    while (isinstance(n, Node) and n.op == "call_function"
           and isinstance(n.target, torch._ops.OpOverload) and _aliasing_op(n.target)
           and n.args and isinstance(n.args[0], Node)):
        n = n.args[0]
    return n


def _written_after_scores(site: Site) -> bool:
    """Whether an in-place op (export's IR keeps them) between a matmul site's q @ k^T and its
    output writes q, k, a mask, a scale or the sinks, or a tensor one of them views: the
    rewrite's op, placed at the output, would read the written values where the original read
    the earlier ones."""
    if site.scores is None:
        return False
    read = [site.sinks, *site.bool_masks, *(m for m, _ in site.add_masks),
            *(h[1] if isinstance(h, tuple) else h for h in site.hide_masks),
            *(m for m, _ in site.scale_nodes)]
    for x in (site.q, site.k[1] if isinstance(site.k, tuple) else site.k, site.v):
        # and what the op is given instead: x before copies and casts, and before a repeat
        x0 = strip_identity(x, allow_casts=False)
        read += [x, x0, unrepeat(x0)[0]]
    bases = {_base(x) for x in read if isinstance(x, Node)}
    n = site.scores.next
    while n is not site.out and n.op != "root":
        t = n.target
        if n.op == "call_function" and isinstance(t, torch._ops.OpOverload) and \
                t._schema.is_mutable:
            for a, x in zip(t._schema.arguments, n.args):
                if a.alias_info is not None and a.alias_info.is_write and _base(x) in bases:
                    return True
        n = n.next
    return False


def rewrite_site(graph: Graph, site: Site, fake_mode, inductor: bool) -> str:
    """Replace one matched site. Returns the mask kind used; raises Skip before any change."""
    from compiled_attn.ops import MASK_CAUSAL, MASK_CUSTOM, MASK_NONE

    if _written_after_scores(site):
        raise Skip("q, k or a mask written in place between the scores and the output")

    q, v = strip_identity(site.q, allow_casts=False), strip_identity(site.v, allow_casts=False)
    k_in = site.k if isinstance(site.k, tuple) else strip_identity(site.k, allow_casts=False)
    qs, vs = shape(q), shape(v)
    if qs is None or vs is None or len(qs) != 4 or len(vs) != 4:
        raise Skip("q/v are not 4-D [B, H, S, D]")
    k_shape = shape(k_in[1])[:2] + (shape(k_in[1])[3], shape(k_in[1])[2]) \
        if isinstance(k_in, tuple) else shape(k_in)
    if k_shape is None or len(k_shape) != 4:
        raise Skip("k is not 4-D")
    bsz, hq, sq, dqk = qs
    skv = k_shape[2]
    # sizes the op takes as equal: (node, dim) pairs, k's by its own dims (a ("T", kt) k is
    # kt transposed); dims a trace made symbols each, not provably equal, are checked at run
    # time where the site is SDPA, whose own checks require them equal (a symbol is never 1,
    # so no broadcast hides there); elsewhere they are skipped
    k_node, k_dims = (k_in[1], (0, 1, 3, 2)) if isinstance(k_in, tuple) else (k_in, (0, 1, 2, 3))
    checks = []
    for (a, da), (b, db) in (((k_node, k_dims[0]), (q, 0)), ((v, 0), (q, 0)),
                             ((v, 2), (k_node, k_dims[2])), ((k_node, k_dims[3]), (q, 3))):
        sa, sb = shape(a)[da], shape(b)[db]
        if same_size(sa, sb):
            continue
        if site.scores is not None or static_int(sa) is not None or static_int(sb) is not None:
            raise Skip("q/k/v batch or length mismatch (broadcast batch)")
        checks.append(((a, da), (b, db)))
    if dtype(q) not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise Skip(f"q dtype {dtype(q)}")
    _check_kernel_head_dims(val(q), static_int(dqk), static_int(vs[3]))
    out_dtype = dtype(site.out)

    # GQA: the kernel maps query head h to kv head h // (Hq / Hkv).
    gqa_how = None
    k_src, v_src = k_in, v
    if site.enable_gqa and not (same_size(k_shape[1], hq) and same_size(vs[1], hq)):
        hkv = static_int(k_shape[1])
        if hkv is None or static_int(hq) is None or static_int(hq) % hkv:
            raise Skip("enable_gqa with heads that do not divide")
        if static_int(vs[1]) != hkv:
            raise Skip("enable_gqa with k and v head counts that differ")
        gqa_how = "enable_gqa"
    elif static_int(k_shape[1]) == 1 and static_int(vs[1]) == 1 and static_int(hq) != 1:
        gqa_how = "broadcast"  # one K/V head broadcast to every query head (MQA): a group of Hq
    elif not same_size(k_shape[1], hq) or not same_size(vs[1], hq):
        raise Skip("k/v heads differ from q heads without enable_gqa (broadcast heads)")
    elif not isinstance(k_in, tuple):
        ks, kr, khow = unrepeat(k_in)
        vsrc, vr, _ = unrepeat(v)
        if kr == vr and kr > 1:
            k_src, v_src, gqa_how = ks, vsrc, khow

    if site.sinks is not None and not same_size(shape(site.sinks)[1], hq):
        raise Skip("sinks are not one logit per query head")

    # Scale: SDPA default 1/sqrt(Dqk).
    scale = site.scale
    if scale is None:
        d = static_int(dqk)
        if d is None:
            raise Skip("symbolic head dim with the default scale")
        scale = 1.0 / math.sqrt(d)

    # Masks -> (mask_mode, window_left, bool mask nodes).
    finite_adds = inf_adds = 0
    for m, dt in site.add_masks:
        try:
            finite, inf = M.neg_kinds(m, dt)
        except M.NotProven as e:
            raise Skip(f"additive bias: {e}") from None
        finite_adds += finite
        inf_adds += inf
    if finite_adds > 1 or (finite_adds and site.hide_finite):
        # A key two finite masks both hide sums to -inf in eager (min + min overflows), one
        # they hide once stays finite: a fully masked row then averages v over the keys
        # hidden once, not over all keys (the patch below), and which keys those are is not
        # known here.
        raise Skip("two finite masks add up (a key hidden by both becomes -inf in eager)")
    finite_neg = bool(finite_adds) or site.hide_finite
    if finite_neg and (inf_adds or site.hide_inf or site.bool_masks or site.causal_top_left):
        # Likewise where -inf hides some keys beside a finite NEG (a bool or causal mask, a
        # -inf fill or bias): a fully masked row averages v over the keys -inf leaves.
        raise Skip("a finite-NEG mask beside -inf masking (a fully masked row's eager average "
                   "depends on which keys -inf hides)")
    hide_nodes = [h[1] if isinstance(h, tuple) else h for h in site.hide_masks]
    for m in site.bool_masks + [m for m, _ in site.add_masks] + hide_nodes:
        if isinstance(m, Node) and not M.head_invariant(m):
            raise Skip("head-dependent mask")
        mr = rank(m)
        if mr is None or mr > 4:
            raise Skip("mask rank > 4")

    sq_i, skv_i = static_int(sq), static_int(skv)
    mask_mode, window_left, kind = MASK_NONE, -1, "none"
    need_mask = bool(site.bool_masks or site.add_masks or site.hide_masks)
    # Every mask as (node, how): "bool" True = attend, "add" additive 0/NEG, "hide" True = masked.
    all_masks = [(m, "bool") for m in site.bool_masks] + [(m, "add") for m, _ in site.add_masks] + \
        [(h[1], "bool") if isinstance(h, tuple) else (h, "hide") for h in site.hide_masks]
    top_left = False
    if site.causal_top_left:
        if same_size(sq, skv) and not need_mask:  # top-left == bottom-right alignment
            mask_mode, kind = MASK_CAUSAL, "causal"
        else:  # built as a custom mask below, ANDed with the other masks (SDPA's is_causal
            need_mask = top_left = True  # with an attn_mask: both apply)
    if need_mask and sq_i is not None and skv_i is not None:
        # Constant masks (no input feeds them, static shapes) are classified at compile time.
        visible = None
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        with unset_fake_temporarily():  # the pass may run inside Inductor's fake mode
            consts = [M.evaluate(m) for m, _ in all_masks]
            if all(c is not None for c in consts) and (consts or top_left):
                for c, (_, how) in zip(consts, all_masks):
                    c = (c == 0) if how == "add" else (~c.to(torch.bool)) if how == "hide" \
                        else c.to(torch.bool)
                    c = _to_b_sq_skv(c)
                    visible = c if visible is None else (visible & c)
                if top_left:  # key j visible from row i where j <= i
                    tl = torch.ones(sq_i, skv_i, dtype=torch.bool).tril()[None]
                    visible = tl if visible is None else (visible & tl)
            cls, w = M.classify(visible, sq_i, skv_i) if visible is not None else ("", -1)
        if visible is not None:
            if cls == "none":
                need_mask, kind = False, "none"
            elif cls == "causal":
                need_mask, mask_mode, window_left = False, MASK_CAUSAL, w
                kind = "causal" if w < 0 else "causal_window"

    em = Emitter(graph, site.out, fake_mode, inductor)
    for (a, da), (b, db) in checks:
        em(aten._assert_scalar.default,
           em(operator.eq, em.size(a, da), em.size(b, db)),
           "scaled_dot_product_attention's q, k and v disagree in batch, key length or head "
           "dim")
    packed = None
    mask3 = None
    if need_mask:
        mask_mode, kind = MASK_CUSTOM, "custom"
        parts = [_bool_of(em, m, how) for m, how in all_masks]
        if top_left:
            dev = val(q).device
            i = em.arange(em.size(q, 2), torch.int64, dev)
            j = em.arange(em.size(v, 2), torch.int64, dev)
            parts.append(em(aten.le.Tensor, em(aten.unsqueeze.default, j, 0),
                            em(aten.unsqueeze.default, i, 1)))
        b = parts[0]
        for p in parts[1:]:
            b = em(aten.bitwise_and.Tensor, b, p)
        # [.., 1, Sq?, Skv?] (head axis already of size 1) -> [b?, Sq?, Skv?] -> [B, Sq, Skv]
        if rank(b) == 4:
            b = em(aten.select.int, b, 1, 0)
        elif rank(b) == 3:
            b = em(aten.select.int, b, 0, 0)
        while rank(b) < 3:
            b = em(aten.unsqueeze.default, b, 0)
        mask3 = em(aten.expand.default, b, [em.size(q, 0), em.size(q, 2), em.size(v, 2)])
        packed = _pack_bits(em, mask3)

    q_scaled = q
    for t, how in site.scale_nodes:
        # (q * t) @ k^T == t * (q @ k^T) for a 0-d t: the kernel's sm_scale keeps the constant
        # part. Same dtype as eager's product (a 0-d tensor does not promote q's dtype).
        q_scaled = em(aten.mul.Tensor if how == "mul" else aten.div.Tensor, q_scaled, t)
    qt = em(aten.permute.default, q_scaled, [0, 2, 1, 3])
    kk = _transpose_last2(em, k_src)
    kt = em(aten.permute.default, kk, [0, 2, 1, 3])
    vt = em(aten.permute.default, v_src, [0, 2, 1, 3])
    sinks = None
    if site.sinks is not None:  # [1, Hq, 1, 1] -> the op's float32 [Hq]
        sinks = em.cast(em(aten.reshape.default, site.sinks, [em.size(q, 1)]), torch.float32)
        sinks = em(aten.clone.default, sinks, memory_format=torch.contiguous_format)
    res = em.call_op("single_prefill", qt, kt, vt, packed, None, sinks,
                     mask_mode, window_left, 0, float(scale), float(site.soft_cap), 0, 1.0, 1e4,
                     1.0, out_dtype)
    out = em(aten.permute.default, em.getitem(res, 0), [0, 2, 1, 3])  # [B, Hq, Sq, Dvo]
    if mask3 is not None and finite_neg and sinks is None:
        # Eager softmax over a row whose keys all carry a finite NEG (float32/bf16 min swallows
        # any logit) gives uniform weights: the mean of v over all keys, not the kernel's 0.
        # (With sinks the row's weight goes to its sink, and the output is 0 as the kernel's.)
        seen = em(aten.any.dim, mask3, -1)  # [B, Sq]
        seen = em(aten.unsqueeze.default, em(aten.unsqueeze.default, seen, 1), 3)
        mean_v = em(aten.mean.dim, v, [2], True)  # [B, Hv, 1, Dvo]: Hq, or 1 broadcast (MQA)
        if gqa_how == "enable_gqa":  # Hkv: query head h reads kv head h // (Hq / Hkv)
            b_, hkv_, d_ = em.size(v, 0), static_int(vs[1]), em.size(v, 3)
            mean_v = em(aten.expand.default, em(aten.unsqueeze.default, mean_v, 2),
                        [b_, hkv_, static_int(hq) // hkv_, 1, d_])
            mean_v = em(aten.view.default,
                        em(aten.clone.default, mean_v, memory_format=torch.contiguous_format),
                        [b_, static_int(hq), 1, d_])
        mean_v = em.cast(mean_v, out_dtype)
        out = em(aten.where.self, seen, out, mean_v)
    ov = val(site.out)
    if tuple(val(out).stride()) != tuple(ov.stride()) and ov.is_contiguous():
        out = em(aten.clone.default, out, memory_format=torch.contiguous_format)
    site.out.replace_all_uses_with(out)
    if gqa_how is not None:
        counters[f"gqa:{gqa_how}"] += 1
    if site.soft_cap:
        counters["soft_cap"] += 1
    if site.scale_nodes:
        counters["scale:runtime"] += 1
    if sinks is not None:
        counters["sinks"] += 1
    return kind


def _functional_op(t) -> bool:
    """An aten op without mutation or side effects. Nondeterministic-seeded ops (SDPA,
    dropout) count as impure for FX's DCE, but a dead one can go: nothing reads its result."""
    from torch.fx.node import _side_effectful_functions

    return (isinstance(t, torch._ops.OpOverload) and t not in _side_effectful_functions
            and not t._schema.is_mutable)


def _erase_dead(graph: Graph) -> None:
    """DCE that also drops metadata asserts (export IR) hanging off dead nodes."""
    assert_ops = {aten._assert_tensor_metadata.default} if hasattr(
        aten, "_assert_tensor_metadata") else set()
    changed = True
    while changed:
        changed = False
        for n in reversed(list(graph.nodes)):
            if n.op != "call_function" or n.users:
                continue
            if n.target in assert_ops:
                src = n.args[0]
                if isinstance(src, Node) and len(src.users) == 1:
                    graph.erase_node(n)
                    changed = True
                continue
            if n.is_impure() and not _functional_op(n.target) and not (
                    n.target in _INPLACE_SCALES and _private_inplace(n)):
                continue
            graph.erase_node(n)
            changed = True


def _matmul_site_found(n: Node) -> bool:
    """A matmul-softmax site at n, matched or skipped with a reason (Skip: as the inference
    path counts it)."""
    try:
        return match_matmul_softmax(n) is not None
    except Skip:
        return True


def _is_training_graph(graph: Graph) -> bool:
    return any(n.op == "placeholder" and "tangents" in str(n.target) for n in graph.nodes)


def rewrite_graph(graph: Graph, inductor: bool = False) -> int:
    """Rewrite every attention site of an aten graph in place. Returns the number rewritten.

    inductor: the graph is Inductor's (post-decomposition; emit only directly-lowered ops)."""
    if _is_training_graph(graph):
        n_sites = sum(1 for n in graph.nodes if n.op == "call_function"
                      and (n.target in SDPA_OPS or _matmul_site_found(n)))
        if n_sites:
            counters["skipped:training graph (ops are inference-only)"] += n_sites
        return 0
    fake_mode = fake_mode_of(graph)
    done = 0
    skipped: set[Node] = set()
    for n in list(graph.nodes):
        if n.op != "call_function" or n.graph is not graph:
            continue
        try:
            site = match_sdpa(n) or match_matmul_softmax(n)
            if site is None:
                continue
            kind = rewrite_site(graph, site, fake_mode, inductor)
        except Skip as e:
            counters[f"skipped:{e}"] += 1
            skipped.add(n)
            continue
        counters["rewritten"] += 1
        counters[f"pattern:{site.pattern}"] += 1
        counters[f"mask:{kind}"] += 1
        done += 1
    if done:
        _erase_dead(graph)
        graph.lint()
    _count_unmatched(graph, skipped)
    return done


_MATMULS = (aten.matmul.default, aten.bmm.default, aten.mm.default)


def _count_unmatched(graph: Graph, skipped: set[Node]) -> None:
    """Count, as "unmatched:softmax @ v", each softmax left in the graph whose result reaches
    the left operand of a matmul (through reshapes, copies, casts, expands, where and slices):
    attention the pass neither rewrote nor skipped with a reason, which would otherwise leave
    no trace in the counters (e.g. Inductor's CPU decomposition of SDPA with broadcast heads,
    whose softmax is wrapped in a where that zeroes fully masked rows)."""
    through = RESHAPE_OPS | COPY_OPS | CAST_OPS | {aten.expand.default, aten.where.self,
                                                  aten.slice.Tensor}
    for n in graph.nodes:
        if n.op != "call_function" or match_softmax(n) is None:
            continue
        frontier, reached = [n], False
        for _ in range(8):
            nxt = []
            for x in frontier:
                for u in x.users:
                    if is_call(u, *_MATMULS) and u.args[0] is x:
                        reached |= u not in skipped and not (set(u.users) & skipped)
                    elif is_call(u, *through):
                        nxt.append(u)
            frontier = nxt
        if reached:
            counters["unmatched:softmax @ v"] += 1
