"""A decode program's K/V read rate on capped grids (dev probe, GPU): paged decode batches (one
row a request, Hq 32 / Hkv 8, D 128, bf16) through BatchPrefillWithPagedKVCacheWrapper with the
Gluon kernel's persistent grid capped by ``launch.programs_cap`` (as POD's decodes side by side
run it: one program a SM on the swapped products' SWAP_TILE), SWAP_TILE two or three K/V slots
deep, the pages shuffled over the whole cache (HBM) or drawn from 4096 keys' worth of pages that
stay in L2. With --tma-only the swapped products' consumer is replaced by one that releases
each K/V slot as soon as it lands (no math: the load path's own rate; outputs not checked).
With --clamped-pages the load warp reads a tile's page-table entries (pages smaller than a tile,
a TMA box each) with indices clamped to the request's last page under one predicate instead of
each masked under its own (_clamped_pages).
Timed as CUDA-graph replays, interleaved rounds, medians; TB/s of K/V read and GB/s a program.

    python -m dev.rate_probe [--tma-only] [--clamped-pages] [--rounds 3] [--out FILE.json]
        [--pages 16,128] [--caps 0,33,66,132] [--stages 2,3] [--where hbm,l2]

The filters keep the cases whose page size, cap, ring depth and page placement they list (all
by default).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics

import torch

HQ, HKV, D = 32, 8, 128
CASES = [(128, 4096, 16), (128, 4096, 128), (32, 4096, 16)]  # (requests, keys, page size)
CAPS = (0, 33, 66, 132)  # 0: the launch's own grid
STAGES = (2, 3)


def _tma_only():
    """prefill_gluon._consume_swap replaced by a consumer that waits for each K / V slot and
    releases it unread (the kernel's JIT resolves the name when it compiles, so this must come
    before the first swap launch of the process)."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from compiled_attn.ops import prefill_gluon as g

    @gluon.jit
    def consume(q, q_smem, p_row, ring, keys, item, it, PAGED: gl.constexpr,
                CAUSAL: gl.constexpr, ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                D: gl.constexpr, STAGES: gl.constexpr, NW: gl.constexpr):
        mma: gl.constexpr = g._mma_layout(ROWS, NW)
        for t in range(item.n_tiles):
            g._wait_kv(ring.k_bar, it + t, STAGES, PAGED)
            g._arrive_slot(ring.k_empty, it + t, STAGES)
            g._wait_kv(ring.v_bar, it + t, STAGES, PAGED)
            g._arrive_slot(ring.v_empty, it + t, STAGES)
        col: gl.constexpr = gl.SliceLayout(0, mma)
        return (gl.zeros([D, ROWS], gl.float32, layout=mma),
                gl.zeros([ROWS], gl.float32, layout=col),
                gl.full([ROWS], 1.0, gl.float32, layout=col))

    g._consume_swap = consume


def _clamped_pages():
    """prefill_gluon._tile_pages / _fill_slot replaced (before the first launch, as _tma_only)
    by a form whose box pages are read as a tuple, each index clamped to the request's last
    page (boxes past its pages re-read it: rows past kv_len, masked, V's zeroed) under one
    predicate. The kernel's form masks each read (b < the pages left), and a masked read's value
    is moved to a uniform register under its predicate; the boxes' predicates share one
    register, so ptxas serializes the reads (SASS: LDG, then R2UR, eight times a tile). Here
    the eight LDGs issue back to back."""
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    from compiled_attn.ops import prefill_gluon as g

    @gluon.jit
    def tile_pages(page_idx_ptr, page_base, npages, t, PAGED: gl.constexpr,
                   PAGE: gl.constexpr, BLOCK_N: gl.constexpr, BOXES: gl.constexpr):
        if BOXES == 1:
            page = g._page_of(page_idx_ptr, page_base, npages, t, PAGED, PAGE, BLOCK_N)
            pages = page
        else:
            table = page_idx_ptr + page_base
            last = npages - 1
            pages = ()
            for b in gl.static_range(BOXES):
                j = gl.minimum(t * BOXES + b, last)
                pages = pages + (gl.load(table + j, mask=last >= 0, other=0),)
            page = 0
        return page, pages

    kernel_fill = g._fill_slot  # one box: the kernel's own

    @gluon.jit
    def fill_slot(src, buf, bar, t, kv_start, hkv, page, pages, stride_p, pred,
                  PAGED: gl.constexpr, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                  D: gl.constexpr, BOXES: gl.constexpr):
        if BOXES == 1:
            kernel_fill(src, buf, bar, t, kv_start, hkv, page, pages, stride_p, pred, PAGED,
                        PAGE, BLOCK_N, D, BOXES)
        else:
            g.mbarrier.expect(bar, BLOCK_N * D * src.dtype.primitive_bitwidth // 8, pred=pred)
            for b in gl.static_range(BOXES):
                g._tma_load(src, [pages[b] * stride_p, hkv * D], bar,
                            buf.slice(b * PAGE, PAGE))

    g._tile_pages, g._fill_slot = tile_pages, fill_slot


def inputs(b: int, kv: int, page: int, l2: bool, dev) -> dict:
    """q [b, HQ, D] and a paged cache of b requests of kv keys, pages shuffled (l2: each
    request's pages drawn from a pool of 4096 keys' worth, which L2 keeps)."""
    n = kv // page
    pool = 4096 // page if l2 else b * n
    kc = torch.randn(pool, page, HKV, D, dtype=torch.bfloat16, device=dev)
    if l2:
        idx = torch.cat([torch.randperm(pool, device=dev)[:n] if n <= pool
                         else torch.randint(0, pool, (n,), device=dev) for _ in range(b)])
    else:
        idx = torch.randperm(b * n, device=dev)
    i32 = dict(dtype=torch.int32, device=dev)
    return dict(q=torch.randn(b, HQ, D, dtype=torch.bfloat16, device=dev),
                cache=(kc, torch.randn_like(kc)), idx=idx.to(torch.int32),
                indptr=torch.arange(0, b * n + 1, n, **i32), qo=torch.arange(b + 1, **i32),
                last=torch.full((b,), page, **i32), page=page)


@contextlib.contextmanager
def swap_stages(stages: int):
    """SWAP_TILE ``stages`` K / V slots deep for the launches made inside."""
    from compiled_attn.ops import policy
    from compiled_attn.ops import prefill_gluon as g

    saved = g.SWAP_TILE
    g.SWAP_TILE = saved._replace(stages=stages)
    policy.touch()
    try:
        yield
    finally:
        g.SWAP_TILE = saved
        policy.touch()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tma-only", action="store_true")
    ap.add_argument("--clamped-pages", action="store_true")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--pages", default=None, help="page sizes, comma-separated")
    ap.add_argument("--caps", default=",".join(map(str, CAPS)))
    ap.add_argument("--stages", default=",".join(map(str, STAGES)))
    ap.add_argument("--where", default="hbm,l2", help="hbm, l2 or both")
    args = ap.parse_args(argv)
    caps = [int(c) for c in args.caps.split(",")]
    stages = [int(s) for s in args.stages.split(",")]
    pages = {int(p) for p in args.pages.split(",")} if args.pages else {c[2] for c in CASES}
    where = [w == "l2" for w in args.where.split(",")]
    if args.tma_only:
        _tma_only()
    if args.clamped_pages:
        _clamped_pages()
    import compiled_attn as ca
    from compiled_attn.ops import launch
    from dev.pod_order import _time
    from tests.kernel_cases import capture_graph

    dev = torch.device("cuda")
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    rows = []
    for b, kv, page in [c for c in CASES if c[2] in pages]:
        for l2 in where:
            torch.manual_seed(0)
            x = inputs(b, kv, page, l2, dev)
            replays, keep, ref = {}, [], None
            for cap in caps:
                for st in stages:
                    with swap_stages(st), launch.programs_cap(cap):
                        w = ca.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
                        w.plan(x["qo"], x["indptr"], x["idx"], x["last"], HQ, HKV, D, page,
                               causal=False, q_data_type=torch.bfloat16,
                               kv_data_type=torch.bfloat16)
                        out = w.run(x["q"], x["cache"])
                        graph, _ = capture_graph(lambda: w.run(x["q"], x["cache"]))
                    keep.append(w)
                    if not args.tma_only:
                        ref = out.float() if ref is None else ref
                        diff = (out.float() - ref).abs().max().item()
                        if not diff <= 2e-2:  # (NaN fails too)
                            raise RuntimeError(f"cap {cap}, {st} slots: off by {diff}")
                    replays[cap, st] = graph.replay
            times = {k: [] for k in replays}
            for _ in range(args.rounds):
                for k, r in replays.items():
                    times[k].append(_time(r, 10))
            gb = b * kv * HKV * D * 2 * 2 / 1e9
            for (cap, st), v in times.items():
                us = statistics.median(v)
                programs = min(cap, b * HKV) or min(b * HKV, 2 * 132)
                rate = gb / us * 1e6  # GB/s
                rows.append(dict(requests=b, kv=kv, page=page, l2=l2, cap=cap, stages=st, us=us,
                                 tb_s=rate / 1e3, gb_s_program=rate / programs,
                                 tma_only=args.tma_only, clamped_pages=args.clamped_pages))
                print(f"{b} x {kv} page {page} {'L2 ' if l2 else 'HBM'} cap {cap:3} "
                      f"{st} slots: {us:8.1f} us {rate / 1e3:5.2f} TB/s "
                      f"{rate / programs:6.1f} GB/s a program", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
