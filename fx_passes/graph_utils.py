"""Small FX helpers shared by the attention rewrite: reading node metadata, seeing through ops
that do not change values, and emitting new aten nodes with their FakeTensor metadata.

The rewrite runs on three flavours of aten graph: Inductor's joint/post-grad graph (bmm,
decomposed softmax, prims casts), torch.export's training IR (matmul, softmax.int, reshape,
transpose, to.dtype) and core ATen after run_decompositions. Helpers here accept all three.
Every node the rewrite emits gets ``meta["val"]`` computed by running its target on the
inputs' fake values, so Inductor lowering and ExportedProgram verification both see shapes.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

aten = torch.ops.aten
prims = torch.ops.prims


def val(n: Any):
    return n.meta.get("val") if isinstance(n, Node) else None


def shape(n: Any) -> tuple | None:
    v = val(n)
    return tuple(v.shape) if isinstance(v, torch.Tensor) else None


def dtype(n: Any) -> torch.dtype | None:
    v = val(n)
    return v.dtype if isinstance(v, torch.Tensor) else None


def rank(n: Any) -> int | None:
    s = shape(n)
    return None if s is None else len(s)


def is_call(n: Any, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def arg(n: Node, i: int, name: str, default=None):
    """Positional-or-keyword argument i/name of a call node."""
    if len(n.args) > i:
        return n.args[i]
    return n.kwargs.get(name, default)


def same_size(a, b) -> bool:
    """True when two sizes are provably equal (ints, or SymInts equal for every shape)."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        from torch.fx.experimental.symbolic_shapes import statically_known_true

        return bool(statically_known_true(a == b))
    except Exception:  # noqa: BLE001 - unknown relation counts as "not provably equal"
        return False


def same_shape(a: tuple | None, b: tuple | None) -> bool:
    return a is not None and b is not None and len(a) == len(b) and all(
        same_size(x, y) for x, y in zip(a, b))


def static_int(x) -> int | None:
    if isinstance(x, int):
        return x
    try:
        from torch.fx.experimental.symbolic_shapes import is_concrete_int

        if is_concrete_int(x):
            return int(x)
    except Exception:  # noqa: BLE001
        pass
    return None


# Casts: value kept, dtype maybe changed.
CAST_OPS = {
    aten._to_copy.default, prims.convert_element_type.default, aten.to.dtype,
    aten.to.dtype_layout, aten.to.device, aten.type_as.default,
}
# Copies that keep values, shape and dtype.
COPY_OPS = {aten.clone.default, aten.contiguous.default, aten.alias.default,
            aten.lift_fresh_copy.default, aten.detach.default}
RESHAPE_OPS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def is_noop_dropout(n: Node) -> bool:
    """aten.dropout with p == 0 or train=False (eval mode) returns its input."""
    if is_call(n, aten.dropout.default):
        p, train = arg(n, 1, "p", 0.0), arg(n, 2, "train", True)
        return p == 0 or train is False
    return False


def _float_to_float(n: Node, src: Node) -> bool:
    dn, ds = dtype(n), dtype(src)
    return dn is not None and ds is not None and dn.is_floating_point and ds.is_floating_point


def strip_identity(n: Node, allow_casts: bool = True) -> Node:
    """See through ops whose output equals their input elementwise (same shape): copies, no-op
    views/expands/slices, eval-mode dropout, and (when allow_casts) casts from one floating
    dtype to another (values kept up to rounding; a cast to bool or an integer is not)."""
    while isinstance(n, Node) and n.op == "call_function":
        t = n.target
        src = n.args[0] if n.args else None
        if not isinstance(src, Node):
            return n
        if t in COPY_OPS or is_noop_dropout(n) or (allow_casts and t in CAST_OPS
                                                   and _float_to_float(n, src)):
            n = src
        elif t in RESHAPE_OPS and not same_shape(shape(n), shape(src)):
            # A chain of reshapes back to an earlier shape is that earlier tensor (reshapes keep
            # the row-major order): functionalization writes an in-place op on a view of x as
            # view(op(view(x, s1)), s0) -> view(., shape(x)) (Falcon's `scores /= sqrt(d)`).
            m = src
            while is_call(m, *RESHAPE_OPS) and isinstance(m.args[0], Node):
                m = m.args[0]
                if same_shape(shape(n), shape(m)):
                    break
            else:
                return n
            n = m
        elif t in RESHAPE_OPS or t in (aten.expand.default, aten.slice.Tensor):
            if not same_shape(shape(n), shape(src)):
                return n
            if t is aten.slice.Tensor and arg(n, 4, "step", 1) != 1:
                return n
            n = src
        else:
            return n
    return n


def fake_mode_of(graph: Graph):
    from torch._guards import detect_fake_mode

    vals = [val(n) for n in graph.nodes if isinstance(val(n), torch.Tensor)]
    return detect_fake_mode(vals)


class Emitter:
    """Inserts call_function nodes before an anchor, with meta["val"] from fake execution."""

    def __init__(self, graph: Graph, anchor: Node, fake_mode, inductor: bool):
        self.graph, self.anchor, self.fake_mode = graph, anchor, fake_mode
        self.meta_from = anchor
        # Inductor's graph is past decomposition: emit only ops Inductor lowers directly
        # (prims casts and iota); export graphs get the plain aten spellings.
        self.inductor = inductor

    def __call__(self, target, *args, **kwargs) -> Node:
        with self.graph.inserting_before(self.anchor):
            node = self.graph.call_function(target, args, kwargs)
        fargs = map_arg(args, val)
        fkwargs = map_arg(kwargs, val)
        if self.fake_mode is not None:
            with self.fake_mode:
                node.meta["val"] = target(*fargs, **fkwargs)
        else:
            node.meta["val"] = target(*fargs, **fkwargs)
        for key in ("stack_trace", "nn_module_stack", "source_fn_stack", "from_node"):
            if key in self.meta_from.meta:
                node.meta[key] = self.meta_from.meta[key]
        return node

    def size(self, n: Node, dim: int):
        """Size dim of n: an int when static, else a sym_size node (traceable SymInt)."""
        s = shape(n)[dim]
        si = static_int(s)
        if si is not None:
            return si
        return self(aten.sym_size.int, n, dim)

    def getitem(self, n, i: int) -> Node:
        if isinstance(n, tuple):
            return n[i]
        return self(operator.getitem, n, i)

    def call_op(self, name: str, *args) -> Node:
        """Call the compiled_attn op ``name`` (e.g. "single_prefill") on args; returns the node
        of its output tuple (index it with getitem).

        In an export graph this is one op node (the ExportedProgram keeps the op; AOTInductor
        decomposes it later, as torch.compile does for ops it traces). Inductor's joint graph is
        past that decomposition, and a custom op left there becomes an opaque fallback call, so
        here the op's implementation (what triton_op's decomposition runs: the Triton launch
        through wrap_triton on GPU, the reference on CPU) is traced with make_fx and inlined.
        Under TRITON_INTERPRET=1 the op is opaque (ops/contracts.py) and stays a node, and so
        does a call that compiled_attn.ops.dispatch keeps for the Gluon kernel (a Hopper GPU,
        Python wrapper code, a call in that kernel's scope): Inductor runs it as a fallback
        call of the op, the eager launcher.
        """
        from compiled_attn.ops import contracts, dispatch

        if name not in contracts.IMPLEMENTATIONS:
            raise KeyError(f"no compiled_attn op named {name!r} (known: "
                           f"{sorted(contracts.IMPLEMENTATIONS)})")
        op = getattr(torch.ops.compiled_attn, name).default
        vals = tuple(map_arg(args, val))
        if not self.inductor or contracts.INTERPRET or dispatch.keep_opaque(name, vals):
            node = self(op, *args)
            if self.inductor:
                # Inductor's fallback call honours the op's exact-strides constraint only for
                # a node carrying eager_input_vals (else it takes a node a pass inserted as
                # free to take any layout): without it, a pointwise producer such as RoPE may
                # be laid out head-major, and the launcher then declines the Gluon kernel that
                # keep_opaque chose on the traced strides.
                node.meta["eager_input_vals"] = (vals, {})
            return node
        from torch._inductor.decomposition import select_decomp_table
        from torch.fx.experimental.proxy_tensor import make_fx

        impl = contracts.IMPLEMENTATIONS[name]
        tensor_pos = [i for i, a in enumerate(args) if isinstance(a, Node)]

        def fn(*tensors):
            full = list(args)
            for i, t in zip(tensor_pos, tensors):
                full[i] = t
            return tuple(impl(*full))

        fake_in = [vals[i] for i in tensor_pos]
        # Functionalized, so that the Triton launch (wrap_triton's in-place mutation of the
        # outputs it allocates) becomes triton_kernel_wrapper_functional, whose results feed
        # the graph: a mutation node with no users would be dead code to Inductor.
        with self.fake_mode:
            gm = make_fx(torch.func.functionalize(fn, remove="mutations_and_views"),
                         select_decomp_table(), tracing_mode="real")(*fake_in)
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        if any("triton_kernel_wrapper_mutation" in t for t in targets):
            raise RuntimeError(f"tracing compiled_attn::{name} left an in-place Triton launch in "
                               "the graph; it would be dropped as dead code")
        env: dict = {}
        phs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for ph, i in zip(phs, tensor_pos):
            env[ph] = args[i]
        outs = None
        for n in gm.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outs = map_arg(n.args[0], lambda x: env[x])
                break
            if n.op == "get_attr":
                owner = self.graph.owning_module
                if owner is None:
                    raise RuntimeError("traced op implementation holds a constant tensor and "
                                       "the graph has no owning module")
                name = f"_compiled_attn_const_{len(owner._buffers)}_{id(n)}"
                owner.register_buffer(name, getattr(gm, n.target))
                with self.graph.inserting_before(self.anchor):
                    new = self.graph.get_attr(name)
                new.meta.update(n.meta)
            else:
                with self.graph.inserting_before(self.anchor):
                    new = self.graph.node_copy(n, lambda x: env[x])
            env[n] = new
        # A tuple of nodes stands in for the op's output tuple; getitem() indexes it.
        return tuple(outs)

    def cast(self, n: Node, dt: torch.dtype) -> Node:
        if self.inductor:
            return self(prims.convert_element_type.default, n, dt)
        return self(aten._to_copy.default, n, dtype=dt)

    def arange(self, length, dt: torch.dtype, device) -> Node:
        if self.inductor:
            return self(prims.iota.default, length, start=0, step=1, dtype=dt, device=device,
                        requires_grad=False)
        return self(aten.arange.start_step, 0, length, dtype=dt, device=device)
