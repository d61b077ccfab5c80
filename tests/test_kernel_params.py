"""The parameter-count rule and the kernels' named argument bundles.

No function of the package takes more than 30 parameters, but for the public FlashInfer
signatures (public names), the op implementations (their torch.library schemas are flat) and
the launched Triton kernels, whose flat signatures torch's wrap_triton and its mutation analysis
bind argument by argument (Dynamo refuses tuple arguments to a Triton kernel): those gather
their arguments into tuples at once, and the functions below them take the bundles and read
their fields by prefill_kernel's tl.constexpr indices (P_, ST_, SC_, O_, R_, KEY_ + the field's
name). The launch arguments are assembled by name, in the kernels' parameter order. The Gluon
kernels, launched eagerly only, take their scalars and constexprs in named tuples
(prefill_gluon's PageRows, RowStrides, WorkSizes, GatherStrides, PartScalars, Source, Shape,
Schedule) and keep to the rule; the bound-launch replay passes those tuples as they are.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil

import pytest
import torch
import triton.language as tl

import compiled_attn
import compiled_attn.fx_passes
import compiled_attn.ops
from compiled_attn.ops import prefill_kernel as K

MAX_PARAMS = 30
# The Triton kernels launched from the host (flat signatures, see the module docstring).
LAUNCHED = {"_prefill_fwd", "_pod_fwd"}
# Implementations of an op schema (contracts.py), real and fake.
OP_SCHEMAS = {"_pod_prefill_decode", "_pod_prefill_decode_fake"}


def _modules():
    names = set()
    for pkg in (compiled_attn, compiled_attn.ops, compiled_attn.fx_passes):
        names.add(pkg.__name__)
        names.update(m.name for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + "."))
    for name in sorted(names):
        try:
            yield importlib.import_module(name)
        except ImportError:  # (a module this Triton lacks, e.g. the Gluon kernel)
            continue


def _functions(mod):
    """(qualified name, Python function) of every function and method mod defines, jit
    functions by their Python source function."""
    for name, obj in vars(mod).items():
        fn = getattr(obj, "fn", None)
        if inspect.isfunction(fn) and hasattr(obj, "arg_names"):  # a (Gluon) jit function
            obj = fn
        if inspect.isfunction(obj) and obj.__module__ == mod.__name__:
            yield name, obj
        elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
            for attr, member in vars(obj).items():
                if inspect.isfunction(member):
                    yield f"{name}.{attr}", member


def test_no_private_function_takes_more_than_30_parameters():
    over = []
    for mod in _modules():
        for name, fn in _functions(mod):
            count = len(inspect.signature(fn).parameters)
            public = not name.split(".")[-1].startswith("_")
            if count > MAX_PARAMS and not public and name not in LAUNCHED | OP_SCHEMAS:
                over.append(f"{mod.__name__}.{name}: {count}")
    assert not over, over


def test_the_launched_kernels_are_the_flat_ones():
    # every name in LAUNCHED exists and is flat indeed (a stale entry would exempt nothing)
    kernels = [K._prefill_fwd, K._pod_fwd]
    assert {k.fn.__name__ for k in kernels} == LAUNCHED
    assert all(len(k.arg_names) > MAX_PARAMS for k in kernels)


# _gluon_fwd's and _gluon_pod_fwd's runtime parameters before their bundles, in order: the
# bundles' fields flattened in place must give them back (the compiled parameters' order)
G_SCALARS = ("k_page_rows", "v_page_rows", "qt", "qh", "ot", "oh", "lt", "lh", "qk_scale",
             "stride_kr", "stride_vr")  # PartScalars' fields (unsuffixed in both parts)
GLUON_FLAT = (
    "work_ptr q_ptr k_desc v_desc o_ptr lse_ptr qo_indptr_ptr kv_indptr_ptr page_idx_ptr "
    "last_page_len_ptr k_page_rows v_page_rows qb qt qh ob ot oh lb lt lh qk_scale n_items "
    "n_req n_hkv dense_tiles dense_group dense_qo_len dense_kv_len sched_ptr q_desc q_req_rows "
    "k_ptr v_ptr stride_kr stride_vr q_rows_ptr").split()
_PART = ("q_ptr k_desc v_desc o_ptr lse_ptr qo_indptr_ptr kv_indptr_ptr page_idx_ptr "
         "last_page_len_ptr k_ptr v_ptr k_page_rows v_page_rows qt qh ot oh lt lh qk_scale "
         "stride_kr stride_vr").split()
GLUON_POD_FLAT = ["work_ptr", "n_items", "n_hkv", "sched_ptr", *_PART,
                  *[n if n in G_SCALARS else n + "_d" for n in _PART], "q_rows_ptr_d"]


def test_gluon_bundles_flatten_to_the_flat_order():
    G = pytest.importorskip("compiled_attn.ops.prefill_gluon", exc_type=ImportError)
    bundles = {"page_rows": G.PageRows, "row_strides": G.RowStrides, "sizes": G.PodSizes,
               "work_sizes": G.WorkSizes, "gather_strides": G.GatherStrides,
               "scalars": G.PartScalars, "scalars_d": G.PartScalars}
    for kernel, flat in ((G._gluon_fwd, GLUON_FLAT), (G._gluon_pod_fwd, GLUON_POD_FLAT)):
        assert len(kernel.arg_names) <= MAX_PARAMS
        runtime = [p.name for p in kernel.params if not p.is_constexpr]
        fields = [f for n in runtime for f in (bundles[n]._fields if n in bundles else [n])]
        assert fields == flat, kernel.fn.__name__
    # the constexpr bundles name the constexprs the kernels unpack (ALL_CAPS, one each)
    for t in (G.Source, G.Shape, G.Schedule, G.PodConfig):
        assert all(f.isupper() for f in t._fields)


def test_bound_launch_takes_constant_bundles():
    """A tuple of constants (a bundle) is a constant launch argument; one holding a tensor is
    not (its launch is never bound)."""
    G = pytest.importorskip("compiled_attn.ops.prefill_gluon", exc_type=ImportError)
    from compiled_attn.ops import launch

    assert launch._is_constant(G.RowStrides(*range(9)))
    assert launch._is_constant(G.Shape(4, True, 128, 64, 128, 2))
    assert launch._is_constant(((1, 2.5), (None, torch.float16)))
    assert not launch._is_constant((1, torch.zeros(1)))
    assert not launch._is_constant(((1,), [2]))


def _bundle(prefix: str) -> list[str]:
    """A kernel bundle's field names in order: prefill_kernel's tl.constexpr indices named
    prefix + FIELD, which must number the fields 0, 1, ... without a gap or a repeat."""
    found = sorted((v.value, n[len(prefix):]) for n, v in vars(K).items()
                   if n.startswith(prefix) and isinstance(v, tl.constexpr))
    assert [i for i, _ in found] == list(range(len(found))), (prefix, found)
    return [f for _, f in found]


def test_bundle_fields_match_the_kernel_parameters():
    names = K._prefill_fwd.arg_names
    first = names.index("q_ptr")
    tensors = [f"{f.lower()}_ptr" for f in _bundle("P_")]
    strides = [f"stride_{f.lower()}" for f in _bundle("ST_")]
    # the pointer fields are the pointer parameters but K and V, the stride fields the stride
    # parameters, the scalar fields the runtime scalars, in order; STRIDE_FIELDS spells the
    # same strides
    ptrs = [n for n in names[first:] if n.endswith("_ptr") and n not in ("k_ptr", "v_ptr")]
    assert ptrs == tensors
    assert [n for n in names if n.startswith("stride_")] == strides
    assert strides == [f"stride_{x}{f}" for x, fs in K.STRIDE_FIELDS.items() for f in fs]
    scalars = [f.lower() for f in _bundle("SC_")]
    assert names[names.index("stride_lh") + 1:names.index("KV_MODE")] == scalars
    # the option fields are the constexpr parameters in order, ROW (derived from SPLIT) after
    # SPLIT
    consts = [p.name for p in K._prefill_fwd.params if p.is_constexpr]
    options = _bundle("O_")
    assert options == consts[:consts.index("SPLIT") + 1] + ["ROW"] + \
        consts[consts.index("SPLIT") + 1:]
    # rows and keys: _program builds them of its locals of the fields' names
    for prefix in ("R_", "KEY_"):
        built = "(" + ", ".join(f.lower() for f in _bundle(prefix)) + ")"
        assert built in " ".join(K._program.src.split()), (prefix, built)


def test_program_args_are_named_in_parameter_order():
    """_program_args' runtime arguments are _prefill_fwd's parameters from q_ptr on, by name
    and in order (the launch passes them by position)."""
    q = torch.randn(9, 4, 64, dtype=torch.float16)
    k = v = torch.randn(12, 2, 64, dtype=torch.float16)
    indptr = torch.tensor([0, 9], dtype=torch.int32)
    params = dict(mask_mode=1, window_left=-1, chunk_size=0, sm_scale=0.125,
                  logits_soft_cap=0.0, pos_encoding_mode=0, rope_scale=1.0, rope_theta=1e4,
                  v_scale=1.0)
    _, _, built = K._ragged_args(q, k, v, indptr, indptr, None, None, None, None, 64,
                                 torch.float16, params, torch.zeros(2, 2, dtype=torch.int32))
    assert isinstance(built, K.ProgramArgs)
    names = K._prefill_fwd.arg_names
    first = names.index("q_ptr")
    assert list(built.args) == list(names[first:first + len(built.args)])
    assert names[first + len(built.args)] == "KV_MODE"  # every runtime argument is there
    assert built.args["qo_indptr_ptr"] is indptr and built.args["q_ptr"] is q
    # POD: each part's names suffixed, in the same order
    pod = K._pod_fwd.arg_names
    for sfx in ("_p", "_d"):
        i = pod.index("q_ptr" + sfx)
        assert pod[i:i + len(built.args)] == [n + sfx for n in built.args]


def test_direct_launch_passes_bundles_as_they_are():
    """launch._Direct (triton 3.6's C launcher called with its descriptors expanded ahead): a
    bundle keeps its place as one argument, which that launcher parses in place; descriptors
    expand, and a patched pointer lands on its own position after them."""
    from types import SimpleNamespace

    from compiled_attn.ops import launch

    @dataclasses.dataclass
    class Desc:
        base: object
        block_shape: list

    calls = []
    nvd = SimpleNamespace(make_tensordesc_arg=lambda d, meta: [("map", d.base.data_ptr()), 7, 1])
    L = SimpleNamespace(launch_cooperative_grid=False, launch_pdl=False)
    t = torch.zeros(4)
    rows = (16, 1)
    template = [t.data_ptr(), Desc(t, [64, 128]), rows, 0.5, tl.constexpr(3)]
    patches = [(0, False, ("in", 0, 0, None)), (1, True, ("in", 1, 0, None))]
    direct = launch._Direct(L, lambda *a: calls.append(a), {1}, [None], nvd, template, patches,
                            2)
    u = torch.zeros(4)
    direct((2, 1, 1), 0, SimpleNamespace(function=0, packed_metadata=()),
           [u.data_ptr(), u.data_ptr()])
    (args,) = calls
    assert list(args[13:]) == [u.data_ptr(), ("map", u.data_ptr()), 7, 1, rows, 0.5,
                               template[4]]
