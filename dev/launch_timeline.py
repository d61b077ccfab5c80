"""Where a persistent Gluon launch's time goes, program by program (dev probe, GPU).

A small decode launch costs ~3-4 us with no key at all (dev.fixed_cost_probe); this probe
stamps the global timer (%globaltimer_lo, ns) at points of every program of _gluon_fwd and
prints when they pass, relative to the first program's start:

- the load partition: 0 start, 1 its first item decoded and handed over, 2 the first claim
  from the counter returned (after the first item's K / V copies were issued), 3 exit;
- the first compute group: 4 start, 5 its first item's record taken, 6 its first item done
  (rows stored), 7 exit.

The stamps come from a copy of ops/prefill_gluon.py patched in a temporary file (the product
is not changed) whose _gluon_fwd stands in for the module's; they are written through the
kernel's row-map pointer, which a launch without a map never reads (the probe hands it a
buffer). Each stamp waits for a value the point produced (an operand of the timer's read).

``--variants`` times copies changed further, for timing only (their outputs are not checked
and may be wrong): ``no-zero-tail`` without the V tail's zeroing before the last tile's P V,
``no-mask`` with every first tile's softmax unmasked.

    python -m dev.launch_timeline [--cases 16x0,16x64,16x4096,128x0,128x1024]
        [--variants stamps,no-zero-tail,no-mask]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import tempfile

import torch

STAMPS = 8
_HELPER = '''

@gluon.jit
def _stamp(ptr, k: gl.constexpr, dep):
    t = gl.inline_asm_elementwise("mov.u32 $0, %globaltimer_lo; // $1", "=r,r", [dep],
                                  dtype=gl.int32, is_pure=False, pack=1)
    gl.store(ptr + gl.program_id(0) * 8 + k, t)
'''
# (anchor, text inserted after it): the stamps' places in _ws_loader and _ws_group
_PATCHES = [
    ("            rec = _pack_item(lin, item, LOAD_WARPS)\n"
     "        _publish_item(h.items, h.item_full, h.item_empty, k, rec)\n",
     "        if k == 0:\n            _stamp(ctx.io.q_rows_ptr, 1, item.n_tiles)\n"),
    ("        k += 1\n        lin = _next_item(h.sched_ptr, total, LOAD_WARPS)\n",
     "        if k == 1:\n            _stamp(ctx.io.q_rows_ptr, 2, lin)\n"),
    ("    _publish_item(h.items, h.item_full, h.item_empty, k,\n"
     "                  gl.full([32], lin, gl.int32, layout=_lane_layout(LOAD_WARPS)))\n",
     "    _stamp(ctx.io.q_rows_ptr, 3, lin)\n"),
    ("    qk = 0  # items with keys so far: Q_TMA's slot qk % 2\n"
     "    rec = _take_item(h.items, h.item_full, h.item_empty, k, NW)\n",
     "    if WG == 0:\n        _stamp(ctx.io.q_rows_ptr, 5, _field(rec, 0))\n"),
    ("        it += item.n_tiles\n        k += 1\n"
     "        rec = _take_item(h.items, h.item_full, h.item_empty, k, NW)\n",
     "        if WG == 0:\n            if k == 1:\n"
     "                _stamp(ctx.io.q_rows_ptr, 6, it)\n"),
]


# the timing-only variants: (anchor, replacement)
_VARIANTS = {
    "stamps": [],
    "no-zero-tail": [("        _zero_tail(ring.v_ring, v_last, item.kv_len - last * BLOCK_N, D, "
                      "BLOCK_N, NW)\n", "        pass\n")],
    "no-mask": [("    if item.n_free > 0:\n        p, m_i, l_i, alpha = _softmax_tile(",
                 "    if True:\n        p, m_i, l_i, alpha = _softmax_tile(")],
}


def timed_module(variant: str = "stamps"):
    """ops/prefill_gluon.py with the stamps (and a variant's changes), loaded from a temporary
    file as a module of compiled_attn.ops (its relative imports resolve there)."""
    from compiled_attn.ops import prefill_gluon

    src = open(prefill_gluon.__file__).read()
    for anchor, text in _VARIANTS[variant]:
        assert src.count(anchor) == 1, anchor
        src = src.replace(anchor, text)
    start = "    lin = gl.program_id(0)\n    while lin < total:\n"
    assert src.count(start) == 1
    src = src.replace(start, "    lin = gl.program_id(0)\n    _stamp(ctx.io.q_rows_ptr, 0, lin)\n"
                      "    while lin < total:\n")
    for anchor, text in _PATCHES:
        assert src.count(anchor) == 1, anchor
        src = src.replace(anchor, anchor + text)
    group_start = ("    qk = 0  # items with keys so far: Q_TMA's slot qk % 2\n")
    src = src.replace(group_start, group_start
                      + "    if WG == 0:\n        _stamp(ctx.io.q_rows_ptr, 4, gl.program_id(0))\n")
    # the group's exit: after its loop, the function's last line
    loop_end = ("        rec = _take_item(h.items, h.item_full, h.item_empty, k, NW)\n"
                "        if WG == 0:\n            if k == 1:\n"
                "                _stamp(ctx.io.q_rows_ptr, 6, it)\n")
    assert src.count(loop_end) == 1
    src = src.replace(loop_end, loop_end + "    if WG == 0:\n"
                      "        _stamp(ctx.io.q_rows_ptr, 7, k)\n")
    src += _HELPER
    path = os.path.join(tempfile.mkdtemp(), f"_timed_prefill_gluon_{variant.replace('-', '_')}.py")
    with open(path, "w") as f:
        f.write(src)
    spec = importlib.util.spec_from_file_location(
        f"compiled_attn.ops._timed_prefill_gluon_{variant.replace('-', '_')}", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "compiled_attn.ops"
    spec.loader.exec_module(mod)
    return mod


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="16x0,16x64,16x4096,128x0,128x1024")
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--variants", default="stamps")
    a = ap.parse_args(argv)
    from compiled_attn.ops import launch, prefill_gluon
    from compiled_attn.ops.policy import override
    from dev.fixed_cost_probe import decode_call

    dev = torch.device("cuda")
    buf = torch.zeros(4096 * STAMPS, dtype=torch.int32, device=dev)
    grids = []
    orig_run = launch.run_direct
    timed = {v: timed_module(v) for v in a.variants.split(",")}
    kernels = {m._gluon_fwd for m in timed.values()}

    def run_direct(fn, grid, *args, **kw):  # the timed kernel, the stamps through the map ptr
        if fn in kernels:
            assert not kw["SCHEDULE"].Q_ROWS
            args = list(args)
            args[20] = buf
            grids.append(grid[0])
        return orig_run(fn, grid, *args, **kw)

    saved = prefill_gluon._gluon_fwd
    launch.run_direct = run_direct
    names = ["ld start", "ld item1", "ld claim1", "ld exit", "cg start", "cg rec1", "cg done1",
             "cg exit"]
    try:
        with override(bound_launches=False):
            for variant, name in ((v, c) for v in timed for c in a.cases.split(",")):
                prefill_gluon._gluon_fwd = timed[variant]._gluon_fwd
                b, kv = (int(s) for s in name.split("x"))
                fn, _held = decode_call(b, kv, dev)
                per = {n: [] for n in names}
                ends = []
                for _ in range(a.runs):
                    buf.zero_()
                    torch.cuda.synchronize()
                    fn()
                    torch.cuda.synchronize()
                    p = grids[-1]
                    st = buf[:p * STAMPS].view(p, STAMPS).to(torch.int64).cpu()
                    t0 = int(st[:, 0].min())
                    rel = (st - t0) % (1 << 32)  # (the timer's low word, wrapped)
                    for i, n in enumerate(names):
                        per[n].append(rel[:, i].double())
                    ends.append(float(torch.maximum(rel[:, 3], rel[:, 7]).max()))
                print(f"{variant}: decode {b} x {kv} keys: {grids[-1]} programs; ns after the "
                      f"first program's start, median over {a.runs} runs of (median / max "
                      f"over programs); last exit {statistics.median(ends):.0f}")
                for n in names:
                    med = statistics.median(float(x.median()) for x in per[n])
                    mx = statistics.median(float(x.max()) for x in per[n])
                    print(f"    {n:10s} {med:8.0f} {mx:8.0f}")
    finally:
        prefill_gluon._gluon_fwd = saved
        launch.run_direct = orig_run


if __name__ == "__main__":
    main()
