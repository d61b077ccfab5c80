"""Offline sm_90 compiles of the kernels' launches (no GPU: ptxas of the installed Triton),
shared by tests/test_mutation_analysis.py, tests/test_prefill_gluon.py and
dev/ptx_fingerprint.py.

- Triton: the op launchers' own launches (prefill_kernel.launch_*), called on CPU tensors with
  the launch recorded instead of run (``record``; the tests record through their monkeypatch
  fixture), then compiled with the JIT's own specialization of the recorded arguments
  (``compile_triton``).
- Gluon: ``gluon_source`` builds the Gluon kernel's compile for a tile, page size and layout as
  prefill_gluon.launch would launch it.
"""

from __future__ import annotations

import torch

from compiled_attn.ops import contracts as C
from compiled_attn.ops import launch as L
from compiled_attn.ops import prefill_kernel as K

from .helpers import indptr, make_paged, rand

F16 = torch.float16
TARGET = ("cuda", 90, 32)
QO = [17, 31]  # two requests' query rows (kernel arguments only: nothing runs)


def target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*TARGET)


class FakeDriver:
    """Triton's active driver as torch's analysis and the launchers ask it: an sm_90 target."""

    def get_current_target(self):
        return target()


# ---- the launchers' launches ----------------------------------------------------------------
def params(mask_mode=C.MASK_CAUSAL, d=64, **options):
    """An op's parameters (contracts._params) for head dim d, options overriding them."""
    p = dict(C._params(mask_mode, -1, 0, d ** -0.5, 0.0, C.POS_NONE, 1.0, 1e4, 1.0))
    p.update(options)
    return dict(p, out_dtype=F16)


def ragged(d=64):
    q, k, v = (rand(sum(QO), 2, d, seed=s, dtype=F16) for s in range(3))
    return q, k, v, indptr(QO)


def paged(qo=QO, d=64, page=4):
    """q, the K / V caches of a shuffled page table, and the plan's indptrs and page table."""
    (kc, vc), page_indptr, indices, last, _, _ = make_paged(qo, 2, d, d, page, fmt="4d",
                                                            dtype=F16)
    return rand(sum(qo), 2, d, dtype=F16), kc, vc, indptr(qo), page_indptr, indices, last


def single_launch():
    q, k, v = (rand(1, 40, 2, 64, seed=s, dtype=F16) for s in range(3))
    K.launch_single(q, k, v, None, None, None, **params())


def ragged_launch(split=False, d=64, block_m=64, packed_mask=False, sinks=None, **options):
    """A ragged launch (split: a split-KV plan and its merge; packed_mask: a custom mask of
    zeros; ALiBi slopes when options ask for ALiBi)."""
    q, k, v, qo = ragged(d)
    work = torch.zeros(6, 4 if split else 2, dtype=torch.int32)
    merge = torch.zeros(2, 4, dtype=torch.int32) if split else None
    mask = mask_indptr = None
    if packed_mask:
        mask = torch.zeros(64, dtype=torch.uint8)
        mask_indptr = torch.zeros(len(QO) + 1, dtype=torch.int32)
    alibi = (torch.ones(2, dtype=torch.float32)
             if options.get("pos_encoding_mode") == C.POS_ALIBI else None)
    K.launch_ragged(q, k, v, qo, qo, work, mask, mask_indptr, alibi, sinks, block_m, merge,
                    **params(d=d, **options))


def paged_launch(page=4, d=64, block_m=64, **options):
    work = torch.zeros(6, 2, dtype=torch.int32)
    K.launch_paged(*paged(d=d, page=page), work, None, None, None, None, block_m,
                   **params(d=d, **options))


def pod_launch():
    work = torch.zeros(6, 3, dtype=torch.int32)
    K.launch_pod(*paged(), *paged(qo=[1, 1]), work, None, None, None, 64, params(),
                 params(C.MASK_NONE))


def record(launch, patches=None):
    """The (kernel, args, kwargs) of each launch ``launch()`` makes, nothing run: Triton's
    driver an sm_90 target, the launch decision's device one of 132 SMs without tensor
    descriptors (as tests/test_mutation_analysis.py's fixture), choose's attributes ``patches``
    (name -> value, e.g. device_of) set meanwhile (the tests patch through their monkeypatch
    fixture instead)."""
    from triton.runtime.driver import driver

    from compiled_attn.ops import choose

    calls = []

    class _Rec:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((self.fn, a, kw))

    pat = [(K, "_ensure_allocator", lambda: None), (L, "_kernel", _Rec),
           (choose, "device_of", lambda device: choose.Device("cpu", 0, 132))]
    pat += [(choose, n, v) for n, v in (patches or {}).items()]
    saved = [(mod, n, getattr(mod, n)) for mod, n, _ in pat]
    old_active = driver._active
    try:
        driver._active = FakeDriver()
        for mod, n, v in pat:
            setattr(mod, n, v)
        launch()
    finally:
        for mod, n, v in reversed(saved):
            setattr(mod, n, v)
        driver._active = old_active
    return calls


def compile_triton(fn, args, kw):
    """A recorded launch compiled for sm_90 through ptxas: the signature by the JIT's own
    specialization of the arguments (integers equal to 1 become constexprs, 16-divisible
    integers and 16-byte aligned pointers carry tt.divisibility, as on a real launch),
    constexprs and launch options as given."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend
    from triton.compiler import ASTSource

    kwargs = dict(zip(fn.arg_names, args), **kw)
    sig, consts, attrs = {}, {}, {}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        a = kwargs[name] if name in kwargs else p.default
        if p.is_constexpr:
            sig[name] = "constexpr"
            consts[(i,)] = a
            continue
        ty, key = native_specialize_impl(BaseBackend, a, False, True, True)
        sig[name] = ty
        if ty == "constexpr":
            consts[(i,)] = key
        elif key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {k: v for k, v in kw.items() if k not in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=target(), options=opts)


# ---- the Gluon kernel ---------------------------------------------------------------------
def gluon_source(dense, page, block_m, d, causal, ws, pp, short, q_tma=True, q_rows=False,
                 tile=None):
    """The Gluon kernel's compile for sm_90 as launch() would set it up: tile TILES[block_m, d]
    (short: GATHER_SHORT_TILE) with ws / pp (warp-specialized, ping-pong) as given, page size
    page (0: contiguous K / V; dense: a dense batch), bf16. Returns (source, options, facts):
    facts holds what the launch derives (block_n, box, gather, persistent, regs, paged). q_tma
    False: a persistent launch takes Q through registers (GQA 4:1) instead of the load warp's
    TMA. q_rows: Q's rows through a row map (Schedule.Q_ROWS; Q through registers, as launch()
    takes it). tile: a prefill_gluon.Tile instead of TILES' (its swap too)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from compiled_attn.ops import prefill_gluon as G

    tile = tile or (G.GATHER_SHORT_TILE if short else G.TILES[block_m, d])
    block_n, warps, stages, p_smem = tile.block_n, tile.warps, tile.stages, tile.p_smem
    p_smem = p_smem or not (ws or pp)  # single-group 128-row tiles stage P (no longer TILES')
    fn = G._gluon_fwd
    # pages smaller than a tile: a box each, or gathered (page_gathered: no box, a producer warp
    # group)
    gather = G.page_gathered(page, block_n, d)
    box = block_n if gather or not page else min(page, block_n)
    layout = gl.NVMMASharedLayout.get_default_for([box, d], gl.bfloat16)
    desc = f"tensordesc<bf16[{box}, {d}],{layout}>"
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, d], gl.bfloat16)
    # persistent launches (as launch() picks them) take Q by the load warp's TMA here (one query
    # head per KV head)
    persistent = ws and (tile.persistent if tile.persistent is not None
                         else G.persistent_default(pp, block_n // box))
    paged_mode = (G.PAGED_GATHER.value if gather else G.PAGED_BOXES.value) if page else 0
    regs = G.partition_regs(gather)
    # (WIDE: the gather's int64 row offsets, a cache of 2^31 elements or more: page 3 compiles
    # them, page 1 the int32 ones)
    consts = dict(SOURCE=G.Source(PAGED=paged_mode, PAGE=page, BOXES=block_n // box,
                                  WIDE=page == 3),
                  SHAPE=G.Shape(GROUP=1 if persistent and q_tma and not q_rows and not tile.swap
                                else 4,
                                CAUSAL=causal,
                                BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages),
                  SCHEDULE=G.Schedule(DENSE=dense,
                                      Q_TMA=persistent and q_tma and not q_rows and not tile.swap,
                                      P_SMEM=p_smem, WS=ws, PERSISTENT=persistent, PINGPONG=pp,
                                      PRODUCER_REGS=regs[1], GROUP_REGS=regs[0],
                                      Q_ROWS=q_rows, SWAP=tile.swap),
                  num_warps=warps // 2 if pp else warps)
    # the bundles' field types as the launch's specialization names them (named tuples: the
    # kernel reads their fields by name); a page of one row: the launch specializes
    # page_rows == 1 as constexprs
    rows = "constexpr" if page == 1 else "i32"
    types = dict(work_ptr="*i32", q_ptr="*bf16", k_desc=desc, v_desc=desc, o_ptr="*bf16",
                 lse_ptr="*fp32", qo_indptr_ptr="*i32", kv_indptr_ptr="*i32",
                 page_idx_ptr="*i32", last_page_len_ptr="*i32", qk_scale="fp32",
                 sched_ptr="*i32", q_desc=f"tensordesc<bf16[{block_m}, {d}],{q_layout}>",
                 k_ptr="*bf16", v_ptr="*bf16", page_rows=G.PageRows(rows, rows),
                 row_strides=G.RowStrides(*["i32"] * 9), work_sizes=G.WorkSizes(*["i32"] * 7),
                 gather_strides=G.GatherStrides("i32", "i32"), q_rows_ptr="*i32")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    at = fn.arg_names.index
    constexprs = {(at(n),): v for n, v in consts.items()}
    if page == 1:
        constexprs.update({(at("page_rows"), 0): 1, (at("page_rows"), 1): 1})
    # 16-byte aligned pointers and row strides, as the launch's specialization finds them
    aligned = [(at("k_ptr"),), (at("v_ptr"),), (at("gather_strides"), 0),
               (at("gather_strides"), 1)]
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs,
                         attrs={path: [["tt.divisibility", 16]] for path in aligned})
    opts = dict(num_warps=consts["num_warps"])
    if ws:  # as launch() sets it
        opts["maxnreg"] = G.ws_maxnreg(warps)
    facts = dict(block_n=block_n, box=box, gather=gather, persistent=persistent, regs=regs,
                 paged=paged_mode)
    return src, opts, facts


def gluon_pod_source(page_p, page_d, causal=True, group=4, d=128, block_m=128, q_rows=False,
                     swap_d=False):
    """_gluon_pod_fwd's compile for sm_90 as prefill_gluon.launch_pod would set it up on the
    tile TILES[block_m, d], bf16: the prefill part's pages of page_p keys (0: the one-page
    cache, read as contiguous rows beside boxes, as one page beside gathers), the decodes' of
    page_d (gathered where prefill_gluon.page_gathered says: both parts then); q_rows: the
    decodes' Q rows through a row map (PodConfig.Q_ROWS_D); swap_d: the decodes' items on the
    swapped products (PodConfig.SWAP_D). Returns (source, options)."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from compiled_attn.ops import prefill_gluon as G

    tile = G.TILES[block_m, d]
    fn = G._gluon_pod_fwd

    gather = G.page_gathered(page_d, tile.block_n, d)
    if gather and not page_p:
        page_p = G.one_page_size(page_p)
    paged = G.PAGED_GATHER.value if gather else G.PAGED_BOXES.value

    def boxes(page):
        return 1 if gather else G.pod_boxes(page, tile.block_n)

    def desc(page):
        box = tile.block_n // boxes(page)
        layout = gl.NVMMASharedLayout.get_default_for([box, d], gl.bfloat16)
        return f"tensordesc<bf16[{box}, {d}],{layout}>", box

    (dp, _), (dd, _) = desc(page_p), desc(page_d)
    consts = dict(CONFIG=G.PodConfig(
                      SOURCE=G.Source(PAGED=paged if page_p else 0, PAGE=page_p,
                                      BOXES=boxes(page_p), WIDE=False),
                      SOURCE_D=G.Source(PAGED=paged, PAGE=page_d, BOXES=boxes(page_d),
                                        WIDE=False),
                      SHAPE=G.Shape(GROUP=group, CAUSAL=causal, BLOCK_M=block_m,
                                    BLOCK_N=tile.block_n, D=d, STAGES=tile.stages),
                      PINGPONG=tile.pingpong,
                      GROUP_REGS=G.partition_regs(gather)[0],
                      PRODUCER_REGS=G.partition_regs(gather)[1], Q_ROWS_D=q_rows,
                      SWAP_D=swap_d),
                  num_warps=tile.warps // 2 if tile.pingpong else tile.warps)
    # each part's scalars; lse [N, Hq]: its head stride 1 is specialised as a constexpr by the
    # launch
    scalars = G.PartScalars(*["i32"] * 7, "constexpr", "fp32", "i32", "i32")
    types = dict(work_ptr="*i32", sched_ptr="*i32", q_rows_ptr_d="*i32",
                 sizes=G.PodSizes("i32", "i32"))
    for sfx, dsc in (("", dp), ("_d", dd)):
        types.update({f"q_ptr{sfx}": "*bf16", f"o_ptr{sfx}": "*bf16", f"lse_ptr{sfx}": "*fp32",
                      f"k_desc{sfx}": dsc, f"v_desc{sfx}": dsc, f"qo_indptr_ptr{sfx}": "*i32",
                      f"kv_indptr_ptr{sfx}": "*i32", f"page_idx_ptr{sfx}": "*i32",
                      f"last_page_len_ptr{sfx}": "*i32", f"k_ptr{sfx}": "*bf16",
                      f"v_ptr{sfx}": "*bf16", f"scalars{sfx}": scalars})
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    at = fn.arg_names.index
    constexprs = {(at(n),): v for n, v in consts.items()}
    lh = G.PartScalars._fields.index("lh")
    constexprs.update({(at("scalars"), lh): 1, (at("scalars_d"), lh): 1})
    # 16-byte aligned cache pointers and row strides, as the launch's specialization finds them
    kr, vr = (G.PartScalars._fields.index(f) for f in ("stride_kr", "stride_vr"))
    aligned = [(at(n),) for n in ("k_ptr", "v_ptr", "k_ptr_d", "v_ptr_d")] + [
        (at(n), f) for n in ("scalars", "scalars_d") for f in (kr, vr)]
    src = GluonASTSource(fn=fn, signature=sig, constexprs=constexprs,
                         attrs={path: [["tt.divisibility", 16]] for path in aligned})
    return src, dict(num_warps=consts["num_warps"], maxnreg=G.ws_maxnreg(tile.warps))
