"""Which kernel a compiled_attn op runs inside a graph that torch.compile traces.

The ops are ``torch.library.triton_op`` (ops/contracts.py): torch.compile decomposes each call
into its Triton launch, which Inductor inlines and AOTInductor packages. Eager calls on a Hopper
GPU run the Gluon kernel (ops/prefill_gluon.py) instead wherever its scope allows, and on the
H100 that kernel runs a ragged D128 causal batch 1.2-1.3x faster than the inlined Triton one
(benchmarks/NOTES.md, 2026-11-23); wrap_triton cannot take a Gluon kernel, so inlined graphs
never reach it. This module keeps such calls opaque instead: in a torch.compile graph built for
the Python wrapper (not AOTInductor, not C++ wrapper code, not torch.export) on a Hopper GPU, a
call of single_prefill / batch_ragged_prefill / batch_paged_prefill that the eager launcher
would send to the Gluon kernel stays one op node, which Inductor runs as a fallback call of the
op: the eager launcher, Gluon included. Every other call decomposes into the Triton launch as
before (CPU calls decompose into the reference, which Inductor fuses). pod_prefill_decode follows
the same rule with its own eager decision (ops.choose.pod_gluon: one Gluon launch of both
parts); out of that scope it decomposes into the Triton kernel's POD launch.

Two entries, one rule (``keep_opaque``): the FunctionalTensorMode rule installed on each op
here (calls of the ops that torch.compile traces), and ``fx_passes`` (the attention rewrite's
``Emitter.call_op``, which otherwise inlines the op's implementation into Inductor's graph).

``eager_gluon`` asks the eager launcher's own decision, ops.choose.choose, with static=True:
the option and size rules (the size test where shapes are static) and the Gluon kernel's
scope: device, dtypes, head dims, options, tile height, page size, K/V layout where strides
are known. Not what only a launch can know (the pointers' alignment, a CUDA-graph capture): a
call it admits that the launcher then declines runs the Triton kernel from the fallback call,
with the same numbers and the eager call's host cost. tests/test_graph_dispatch.py checks it
against the launcher's own choice.

The launch policy's ``graph_gluon`` setting (ops.policy.POLICY) switches the rule off (every
traced call decomposes into its Triton launch). It is read when a graph is traced; AOTAutograd's
cache does not key on it, so turn the caches off (or start a new process) when comparing both
settings. compiled_attn imports this module on import, which installs the rule.
"""

from __future__ import annotations

import inspect

from torch.fx.experimental.symbolic_shapes import guard_int

from . import choose, contracts
from .policy import POLICY

__all__ = ["GLUON_OPS", "POD_OP", "ahead_of_time", "bind", "bind_pod", "eager_gluon",
           "keep_opaque"]

# The ops whose eager launch can take the Gluon kernel through choose.choose, and POD's, whose
# eager launch asks choose.pod_gluon.
GLUON_OPS = ("single_prefill", "batch_ragged_prefill", "batch_paged_prefill")
POD_OP = "pod_prefill_decode"

_SIGNATURES = {name: inspect.signature(contracts.IMPLEMENTATIONS[name])
               for name in (*GLUON_OPS, POD_OP)}


# Whether Inductor is compiling for AOTInductor or emitting C++ wrapper code: the package must
# run without Python, so our ops decompose into their Triton launches there.
ahead_of_time = choose.ahead_of_time


def bind(name: str, args: tuple, kwargs: dict | None = None) -> tuple[dict, dict]:
    """The call's arguments by name (defaults applied) and its contracts._params."""
    b = _SIGNATURES[name].bind(*args, **(kwargs or {}))
    b.apply_defaults()
    a = b.arguments
    return a, contracts._params(*(a[p] for p in (
        "mask_mode", "window_left", "chunk_size", "sm_scale", "logits_soft_cap",
        "pos_encoding_mode", "rope_scale", "rope_theta", "v_scale")))


def eager_gluon(name: str, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether an eager call of op ``name`` with these arguments (real, fake or functional
    tensors; the op's own argument order) would run the Gluon kernel, as far as its static
    properties tell: choose.choose(static=True) (module docstring)."""
    from . import prefill_kernel as pk

    if name == POD_OP:
        return _pod_gluon(args, kwargs)
    if name not in GLUON_OPS or not (POLICY.use_gluon and choose._gluon is not None
                                     and POLICY.host_tma):
        return False
    a, params = bind(name, args, kwargs)
    q = a["q"]
    paged = name == "batch_paged_prefill"
    k, v = (a["k_cache"], a["v_cache"]) if paged else (a["k"], a["v"])
    dev = choose.device_of(q.device)
    if not dev.gluon:  # a Hopper GPU (before any guard on the shapes)
        return False
    scalars, consts = pk._flags(q, a["alibi_slopes"], a["sinks"], **params,
                                row_max=a.get("row_max", False),
                                skip_softmax=a.get("skip_softmax", 0.0))
    # Head dims, heads, tile height and page size are constexprs of either kernel: a symbolic
    # one (torch.compile(dynamic=True)) is specialised here, as the Triton launch would.
    if name == "single_prefill":
        ask = dict(kv_mode=choose.KV_DENSE)
    else:
        work = a["work"]
        ask = dict(kv_mode=choose.KV_PAGED if paged else choose.KV_RAGGED,
                   block_m=guard_int(a["block_m"]), items=work.shape[0],
                   split=guard_int(work.shape[1]) != 2, requests=a["qo_indptr"].shape[0] - 1,
                   pages=a["kv_page_indices"].shape[0] if paged else None)
    kv_mode = ask.pop("kv_mode")
    launch = choose.choose(kv_mode, q, k, v, consts, scalars, a["out_dtype"] or q.dtype,
                           device=dev, static=True, **ask)
    return launch.kernel == "gluon"


def bind_pod(args: tuple, kwargs: dict | None = None) -> tuple[dict, dict, dict]:
    """A pod_prefill_decode call's arguments by name and each part's options as the op builds
    them (contracts.pod_part_params): (arguments, p_params, d_params)."""
    b = _SIGNATURES[POD_OP].bind(*args, **(kwargs or {}))
    b.apply_defaults()
    a = b.arguments
    p_params, d_params = contracts.pod_part_params(*(a[n] for n in (
        "mask_mode_p", "window_left_p", "sm_scale_p", "logits_soft_cap_p", "mask_mode_d",
        "window_left_d", "sm_scale_d", "logits_soft_cap_d", "pos_encoding_mode", "rope_scale",
        "rope_theta", "v_scale")), a["out_dtype"] or a["q_p"].dtype)
    return a, p_params, d_params


def _pod_gluon(args: tuple, kwargs: dict | None) -> bool:
    """eager_gluon for pod_prefill_decode: the POD launch's own decision
    (prefill_kernel.pod_choice), static."""
    from . import prefill_kernel as pk

    a, p_params, d_params = bind_pod(args, kwargs)
    dev = choose.device_of(a["q_p"].device)
    if not dev.gluon:  # a Hopper GPU (before any guard on the shapes)
        return False
    return pk.pod_choice(a["q_p"], a["k_cache_p"], a["v_cache_p"], a["kv_page_indices_p"],
                         a["q_d"], a["k_cache_d"], a["v_cache_d"], a["alibi_slopes"],
                         guard_int(a["block_m"]), p_params, d_params, static=True,
                         device=dev)[0]


def keep_opaque(name: str, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether a traced call of op ``name`` stays an opaque op node (its eager launcher runs it
    at run time) rather than decomposing into its Triton launch: graph_gluon, not ahead of
    time, and eager_gluon."""
    return POLICY.graph_gluon and not ahead_of_time() and eager_gluon(name, args, kwargs)


def _export_keeps_ops() -> bool:
    """Whether torch.export is tracing with triton_op's decomposition off (it keeps our ops as
    nodes of the exported program)."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:  # a torch without the switch decomposes everywhere
        return False
    return custom_triton_ops_decomposition_disabled()


def _install() -> bool:
    """Put keep_opaque in front of triton_op's decomposition of each GLUON_OPS op and POD_OP
    under FunctionalTensorMode (where torch.compile's AOTDispatcher decomposes it). Returns
    whether it is installed: not under TRITON_INTERPRET=1, where the ops are plain opaque
    custom ops."""
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    installed = True
    for name in (*GLUON_OPS, POD_OP):
        op = getattr(contracts, name)
        decompose = getattr(op, "_torch_dispatch_fns", {}).get(FunctionalTensorMode)
        if decompose is None:
            installed = False
            continue

        def rule(mode, func, types, args, kwargs, _name=name, _decompose=decompose):
            # torch.export keeps the op as a node by itself: ask nothing there (eager_gluon
            # specialises symbolic head dims, which an export's dynamic shapes must not see)
            if not _export_keeps_ops() and keep_opaque(_name, args, kwargs):
                return mode.__torch_dispatch__(func, types, args, kwargs)
            return _decompose(mode, func, types, args, kwargs)

        op.register_torch_dispatch(FunctionalTensorMode, rule)
    return installed


INSTALLED = _install()
