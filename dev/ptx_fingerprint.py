"""PTX fingerprints of the kernels (dev tool): compiles the Triton kernel family in its main
launch configurations and the Gluon kernel in a few tiles for sm_90, offline (no GPU: ptxas of
the installed Triton), and prints one hash per configuration with debug info, comments and
labels canonicalised. A refactor of the kernels' sources that must not change the compiled
code keeps every hash.

    .venv/bin/python -m dev.ptx_fingerprint [--only NAME,...] [--dump DIR]

The Triton launches are the op launchers' own (prefill_kernel.launch_*), called on CPU tensors
with the launch recorded instead of run; the Gluon launches are built as
tests/test_prefill_gluon.py builds them.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

import torch

from compiled_attn.ops import contracts as C
from compiled_attn.ops import launch as L
from compiled_attn.ops import prefill_kernel as K

F16 = torch.float16
TARGET = ("cuda", 90, 32)


def _target():
    from triton.backends.compiler import GPUTarget

    return GPUTarget(*TARGET)


class _FakeDriver:
    def get_current_target(self):
        return _target()


def _params(mask_mode=C.MASK_CAUSAL, d=64, **kw):
    p = dict(mask_mode=mask_mode, window_left=-1, chunk_size=0, sm_scale=d ** -0.5,
             logits_soft_cap=0.0, pos_encoding_mode=C.POS_NONE, rope_scale=1.0, rope_theta=1e4,
             v_scale=1.0)
    p.update(kw)
    return dict(p, out_dtype=F16)


def _rand(*shape, seed=0, dtype=F16):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _indptr(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


QO = [17, 31]


def _paged(qo=QO, d=64, page=4):
    npages = [(n + page - 1) // page for n in qo]
    total = sum(npages) + 3
    kc, vc = (_rand(total, page, 2, d, seed=s) for s in (1, 2))
    last = torch.tensor([(n - 1) % page + 1 for n in qo], dtype=torch.int32)
    table = torch.randperm(total, generator=torch.Generator().manual_seed(0))[:sum(npages)]
    return (_rand(sum(qo), 2, d), kc, vc, _indptr(qo), _indptr(npages), table.to(torch.int32),
            last)


def _ragged_launch(split=False, d=64, block_m=64, packed_mask=False, **options):
    q, k, v = (_rand(sum(QO), 2, d, seed=s) for s in range(3))
    qo = _indptr(QO)
    work = torch.zeros(6, 4 if split else 2, dtype=torch.int32)
    merge = torch.zeros(2, 4, dtype=torch.int32) if split else None
    mask = mask_indptr = None
    if packed_mask:
        mask = torch.zeros(64, dtype=torch.uint8)
        mask_indptr = torch.zeros(len(QO) + 1, dtype=torch.int32)
    alibi = torch.ones(2, dtype=torch.float32) if options.get("pos_encoding_mode") == \
        C.POS_ALIBI else None
    sinks = options.pop("sinks", None)
    K.launch_ragged(q, k, v, qo, qo, work, mask, mask_indptr, alibi, sinks, block_m, merge,
                    **_params(d=d, **options))


def _single(persistent=False):
    q, k, v = (_rand(1, 40, 2, 64, seed=s) for s in range(3))
    K.launch_single(q, k, v, None, None, None, **_params())


def _paged_launch(page=4, d=64, block_m=64, **options):
    work = torch.zeros(6, 2, dtype=torch.int32)
    K.launch_paged(*_paged(d=d, page=page), work, None, None, None, None, block_m,
                   **_params(d=d, **options))


def _pod_launch():
    work = torch.zeros(6, 3, dtype=torch.int32)
    K.launch_pod(*_paged(), *_paged(qo=[1, 1]), work, None, None, None, 64, _params(),
                 _params(C.MASK_NONE))


TRITON = {
    "single dense": (_single, {}),
    "single persistent": (_single, {"_tma_hardware": lambda device: True}),
    "ragged": (_ragged_launch, {}),
    "ragged split+merge": (lambda: _ragged_launch(True), {}),
    "ragged split row-max skip": (lambda: _ragged_launch(True, row_max=True, skip_softmax=2.0),
                                  {}),
    # every logit transform and mask option the kernel has, on one launch
    "ragged custom mask alibi cap window sinks": (
        lambda: _ragged_launch(packed_mask=True, mask_mode=C.MASK_CUSTOM,
                               pos_encoding_mode=C.POS_ALIBI, logits_soft_cap=30.0,
                               window_left=16, sinks=torch.zeros(2)), {}),
    "ragged rope chunk": (lambda: _ragged_launch(pos_encoding_mode=C.POS_ROPE_LLAMA,
                                                 chunk_size=16), {}),
    "ragged D128 128-row": (lambda: _ragged_launch(d=128, block_m=128), {}),
    "paged page 16": (lambda: _paged_launch(16, 128), {}),
    "paged page 1 D128": (lambda: _paged_launch(1, 128, 128), {}),
    "pod": (_pod_launch, {}),
}


def _record(launch, patches):
    """The (kernel, args, kwargs) of each launch the launcher makes, nothing run."""
    from triton.runtime.driver import driver

    calls, saved = [], []

    class _Rec:
        def __init__(self, fn):
            self.fn = fn

        def __getitem__(self, grid):
            return lambda *a, **kw: calls.append((self.fn, a, kw))

    pat = {"_ensure_allocator": lambda: None, "sm_count": lambda index=None: 132, **patches}
    saved = [(K, n, getattr(K, n)) for n in pat] + [(L, "_kernel", L._kernel)]
    old_active = driver._active
    try:
        driver._active = _FakeDriver()
        for n, v in pat.items():
            setattr(K, n, v)
        L._kernel = _Rec
        launch()
    finally:
        for mod, n, v in saved:
            setattr(mod, n, v)
        driver._active = old_active
    return calls


def _compile_triton(fn, args, kw):
    import triton
    from triton.compiler import ASTSource

    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend

    kwargs = dict(zip(fn.arg_names, args), **kw)
    sig, consts, attrs = {}, {}, {}
    for i, (name, p) in enumerate(zip(fn.arg_names, fn.params)):
        a = kwargs[name] if name in kwargs else p.default
        if p.is_constexpr:
            sig[name] = "constexpr"
            consts[(i,)] = a
            continue
        # the JIT's own specialization: integers equal to 1 become constexprs, 16-divisible
        # integers and 16-byte aligned pointers carry tt.divisibility (as on a real launch)
        ty, key = native_specialize_impl(BaseBackend, a, False, True, True)
        sig[name] = ty
        if ty == "constexpr":
            consts[(i,)] = key
        elif key == "D":
            attrs[(i,)] = [["tt.divisibility", 16]]
    opts = {k: v for k, v in kw.items() if k not in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=_target(), options=opts).asm["ptx"]


# (dense, page, block_m, d, causal, ws, pingpong, short): tests/test_prefill_gluon.py's grid
GLUON = {
    "gluon ragged 64-row ws": (False, 0, 64, 128, True, True, False, False),
    "gluon dense 128-row pingpong": (True, 0, 128, 128, True, True, True, False),
    "gluon ragged 128-row single group": (False, 0, 128, 128, True, False, False, False),
    "gluon paged boxes page 16 pingpong": (False, 16, 128, 128, True, True, True, False),
    "gluon paged boxes page 8 ws": (False, 8, 64, 128, True, True, False, False),
    "gluon paged gather page 1 pingpong": (False, 1, 128, 128, True, True, True, False),
    "gluon paged gather page 2 short": (False, 2, 128, 128, True, True, True, True),
    "gluon paged page 64 no ws": (False, 64, 64, 128, True, False, False, False),
    "gluon dense D64 ws": (True, 0, 64, 64, False, True, False, False),
}


def _compile_gluon(dense, page, block_m, d, causal, ws, pp, short):
    import triton
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon._runtime import GluonASTSource

    from compiled_attn.ops import prefill_gluon as G

    tile = G.GATHER_SHORT_TILE if short else G.TILES[block_m, d]
    block_n, warps, stages, p_smem = tile[:4]
    p_smem = p_smem or not (ws or pp)
    fn = G._gluon_fwd
    gather = G.page_gathered(page, block_n, d)
    box = block_n if gather or not page else min(page, block_n)
    layout = gl.NVMMASharedLayout.get_default_for([box, d], gl.bfloat16)
    desc = f"tensordesc<bf16[{box}, {d}],{layout}>"
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, d], gl.bfloat16)
    persistent = ws and (tile.persistent if tile.persistent is not None
                         else G.persistent_default(pp, block_n // box))
    paged = (G.PAGED_GATHER.value if gather else G.PAGED_BOXES.value) if page else 0
    regs = G.GATHER_REGS if gather else (G.PINGPONG_REGS, 24)
    consts = dict(DENSE=dense, Q_TMA=persistent, PAGED=paged, PAGE=page,
                  GROUP=1 if persistent else 4, CAUSAL=causal, PERSISTENT=persistent,
                  BLOCK_M=block_m, BLOCK_N=block_n, D=d, STAGES=stages, P_SMEM=p_smem,
                  WS=ws, BOXES=block_n // box, WIDE=page == 3, PRODUCER_REGS=regs[1],
                  PINGPONG=pp, GROUP_REGS=regs[0], num_warps=warps // 2 if pp else warps)
    if page == 1:
        consts.update(k_page_rows=1, v_page_rows=1)
    types = dict(work_ptr="*i32", q_ptr="*bf16", k_desc=desc, v_desc=desc, o_ptr="*bf16",
                 lse_ptr="*fp32", qo_indptr_ptr="*i32", kv_indptr_ptr="*i32",
                 page_idx_ptr="*i32", last_page_len_ptr="*i32", qk_scale="fp32",
                 sched_ptr="*i32", q_desc=f"tensordesc<bf16[{block_m}, {d}],{q_layout}>",
                 k_ptr="*bf16", v_ptr="*bf16")
    sig = {n: "constexpr" if n in consts else types.get(n, "i32") for n in fn.arg_names}
    aligned = ("k_ptr", "v_ptr", "stride_kr", "stride_vr")
    src = GluonASTSource(fn=fn, signature=sig,
                         constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()},
                         attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]]
                                for n in aligned})
    opts = dict(num_warps=consts["num_warps"])
    if ws:
        opts["maxnreg"] = G.ws_maxnreg(warps)
    return triton.compile(src, target=_target(), options=opts).asm["ptx"]


def canonical(ptx: str) -> str:
    """PTX without debug info, comments, blank lines and labels nothing branches to, the other
    labels renumbered in order of first appearance (the function names of inlined helpers and
    source lines vanish with .loc). Idempotent: a --dump file hashes as its source did."""
    ptx = re.sub(r"\.section\s+\.debug\w*\s*\{.*?\n\s*\}", "", ptx, flags=re.S)
    lines = []
    for line in ptx.splitlines():
        line = line.split("//")[0].rstrip()
        s = line.strip()
        if not s or s.startswith((".loc", ".file")):
            continue
        lines.append(line)
    text = "\n".join(lines)
    # labels nothing branches to (debug-info anchors, whose section is gone) say nothing
    used = re.findall(r"\$L\w+", "\n".join(x for x in lines if not re.match(r"\s*\$L\w+:$", x)))
    text = "\n".join(x for x in lines
                     if not (re.match(r"\s*\$L\w+:$", x) and x.strip()[:-1] not in used))
    names: dict = {}
    return re.sub(r"\$L\w+", lambda m: names.setdefault(m.group(0), f"$L{len(names)}"), text)


def fingerprint(ptx: str) -> str:
    return hashlib.sha256(canonical(ptx).encode()).hexdigest()[:16]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--dump", default="", help="a folder to write each canonical PTX to")
    ap.add_argument("--rehash", default="", help="only print the hashes of a --dump folder's files")
    a = ap.parse_args(argv)
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    if a.rehash:
        for fname in sorted(os.listdir(a.rehash)):
            with open(os.path.join(a.rehash, fname)) as f:
                print(f"{fingerprint(f.read())}  {fname}")
        return
    import triton

    print(f"# triton {triton.__version__}, torch {torch.__version__}, target {TARGET}")
    results = []
    for name, (launch, patches) in TRITON.items():
        if only and name not in only:
            continue
        for i, (fn, args, kw) in enumerate(_record(launch, patches)):
            results.append((f"{name} [{fn.fn.__name__}]", _compile_triton(fn, args, kw)))
            print(f"{fingerprint(results[-1][1])}  {results[-1][0]}", flush=True)
    for name, case in GLUON.items():
        if only and name not in only:
            continue
        results.append((name, _compile_gluon(*case)))
        print(f"{fingerprint(results[-1][1])}  {name}", flush=True)
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for name, ptx in results:
            fname = re.sub(r"[^\w]+", "_", name).strip("_") + ".ptx"
            with open(os.path.join(a.dump, fname), "w") as f:
                f.write(canonical(ptx))


if __name__ == "__main__":
    sys.exit(main())
