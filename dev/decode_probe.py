"""Decode rows against the copy ceiling (dev probe, GPU): batches of one-row requests through
BatchPrefillWithPagedKVCacheWrapper (NHD pages, shuffled), beside a device copy of the same K/V
bytes and FlashInfer's BatchDecodeWithPagedKVCacheWrapper (CUDA cores and tensor cores) where it
imports; and, on the first cases, the Gluon kernel's tile variants (prefill_gluon.TILES replaced
for the plan and the launch); on every case CUDA-graph plans (use_cuda_graph=True) with the
launch policy's graph_decode_tile off and on; with --variants "no chunks" / "chunks 1024", the
plan's decode key chunks (POLICY.decode_chunks: few requests' pages cut into one-row chunk
requests on the Gluon kernel, then a merge) off, or with chunks of at least 1024 keys. Timed as
CUDA graph replays of one call (the copy eagerly) by benchmarks.providers.bench, interleaved
rounds, medians in microseconds; decode/copy is K/V bytes read per second over the copy's
(read + write) bytes per second.

    python -m dev.decode_probe [--rounds 5] [--variants-only] [--out FILE.json]
    python -m dev.decode_probe --plot FILE.json     (a PNG beside it; no GPU needed)
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import time

import torch

from benchmarks.providers import medians_us
from tests.kernel_cases import capture_graph

D = 128
# (requests, kv, page, Hq, Hkv): the grid in miniature
CASES = [(128, 4096, 16, 32, 8), (128, 32768, 16, 32, 8), (16, 1024, 16, 32, 8),
         (256, 4096, 16, 32, 8), (1, 32768, 16, 32, 8), (32, 512, 16, 32, 8),
         (128, 4096, 1, 32, 8), (128, 4096, 16, 64, 8), (128, 4096, 16, 8, 8),
         (128, 32768, 1, 32, 8), (16, 1024, 1, 32, 8), (128, 4096, 4, 32, 8),
         (32, 16384, 3, 32, 8), (8, 4096, 16, 32, 8), (48, 1024, 16, 32, 8),
         # few requests (decode key chunks): page 1, GQA 1, short keys
         (1, 32768, 1, 32, 8), (4, 16384, 16, 32, 8), (1, 4096, 16, 32, 8),
         (2, 32768, 16, 8, 8), (1, 2048, 16, 32, 8), (8, 8192, 1, 32, 8),
         # a program a SM or fewer (16 x 4k), and short keys over several waves (128 x 1k)
         (16, 4096, 16, 32, 8), (16, 4096, 1, 32, 8), (16, 4096, 16, 64, 8),
         (128, 1024, 16, 32, 8), (128, 1024, 16, 64, 8),
         # short keys over several waves, the grid's rows below 0.95 of the copy
         (128, 1024, 1, 32, 8), (256, 1024, 16, 32, 8), (256, 1024, 1, 32, 8)]
VARIANT_CASES = 2  # the first cases also run the tile variants


def _variants():
    from compiled_attn.ops import prefill_gluon as g

    t = g.TILES[128, 128]
    return {
        "default": {},
        "tile128": "tile128",  # decode rows on the 128-row ping-pong tile (before 2026-11-28)
        "tile128 st3": ("tile128", {(128, 128): t._replace(stages=3)}),
        "tile64 st3": {(64, 128): g.TILES[64, 128]._replace(stages=3)},
        # deeper K / V rings on the 64-row tile (one program a SM fits their shared memory)
        "tile64 st4": {(64, 128): g.TILES[64, 128]._replace(stages=4)},
        "tile64 n128": {(64, 128): g.TILES[64, 128]._replace(block_n=128)},
        "tile64 n128 st3": {(64, 128): g.TILES[64, 128]._replace(block_n=128, stages=3)},
        # use_cuda_graph=True plans, with the launch policy's graph_decode_tile off / on
        "graph plan": ("graph", False),
        "graph plan decode tile": ("graph", True),
        "graph plan no chunks": ("graph", True, dict(decode_chunks="off")),
        # split-KV for small batches: chunks of at least this many keys (plan default 1024),
        # counting this many resident programs a SM (chunks_wanted counts one)
        "split256 x2": ("split", 256, 2),
        "split128 x2": ("split", 128, 2),
        "split256 x4": ("split", 256, 4),
        # the plan's decode key chunks (POLICY.decode_chunks) off, or of at least 1024 keys
        "no chunks": ("policy", dict(decode_chunks="off")),
        "chunks 1024": ("policy", dict(decode_chunk_min_keys=1024)),
        # ...and for batches filling more of a wave (the policy's 0.25): 16 x 4k's 128 programs
        # fill 0.48 of a wave of two a SM
        "chunks fill 0.5": ("policy", dict(decode_chunk_fill=0.5)),
        "chunks fill 1.0": ("policy", dict(decode_chunk_fill=1.0)),
        # few requests' programs on the tile's own two K / V slots (POLICY.few_programs_stages,
        # and no swapped products)
        "ring off": ("policy", dict(few_programs_stages=0, decode_swap=False)),
        # ...on the 64-row tile's deeper ring, not the swapped products (POLICY.decode_swap)
        "swap off": ("policy", dict(decode_swap=False)),
        # up to this many key chunks a request (schedule.MAX_CHUNKS, 16), and the merge
        # launch's warps (decode_chunks.MERGE_WARPS, 4)
        "chunks max 32": ("module", dict(max_chunks=32)),
        "graph plan chunks max 32": ("graph", True, {}, dict(max_chunks=32)),
        "merge warps 1": ("module", dict(merge_warps=1)),
        "merge warps 2": ("module", dict(merge_warps=2)),
        # the merge launch as a launch of its own, not a programmatic dependent of the paged one
        # (decode_chunks.MERGE_PDL)
        "merge no pdl": ("module", dict(merge_pdl=False)),
        "graph plan merge no pdl": ("graph", True, {}, dict(merge_pdl=False)),
        # the chunk rows' query rows gathered by a launch of their own before the paged one
        # (as before the ops' row map: decode_chunks.gather_rows), not read in place
        "gathered": ("module", dict(gathered=True)),
        # decode rows on the swapped products however many programs they fill (choose's
        # few_programs without its one-program-a-SM bound: SWAP_TILE's persistent grid, one
        # program a SM, takes the items in turn)
        "swap any count": ("module", dict(swap_any=True)),
        "graph plan gathered": ("graph", True, {}, dict(gathered=True)),
    }


@contextlib.contextmanager
def gathered_rows():
    """The ops' row maps (batch_paged_prefill's q_rows, pod_prefill_decode's q_rows_d) replaced
    by the mapped rows gathered first by a launch of their own (decode_chunks.gather_rows), as
    decode key chunks ran before the map: prefill_kernel.launch_paged / launch_pod wrapped (the
    ops call them with every argument by position)."""
    from compiled_attn.ops import decode_chunks
    from compiled_attn.ops import prefill_kernel as pk

    def gathering(launch, q_at: int, map_at: int):
        @functools.wraps(launch)
        def run(*args, **kwargs):
            args = list(args)
            if len(args) > map_at and args[map_at] is not None:
                args[q_at] = decode_chunks.gather_rows(args[q_at], args[map_at])
                args[map_at] = None
            return launch(*args, **kwargs)
        return run

    saved = pk.launch_paged, pk.launch_pod
    pk.launch_paged = gathering(saved[0], 0, 14)  # (q, ..., merge, q_rows)
    pk.launch_pod = gathering(saved[1], 7, 21)  # (q_p, ..., q_d at 7, ..., q_rows_d)
    try:
        yield
    finally:
        pk.launch_paged, pk.launch_pod = saved


@contextlib.contextmanager
def _variant(v):
    from compiled_attn.ops import choose, policy
    from compiled_attn.ops import prefill_gluon as g

    saved_tiles, saved_rows = dict(g.TILES), choose.DECODE_ROWS
    from compiled_attn import prefill
    from compiled_attn.ops import schedule

    from compiled_attn.ops import decode_chunks

    saved_split, saved_wanted = prefill.build_split_work, schedule.chunks_wanted
    saved_module = (schedule.MAX_CHUNKS, decode_chunks.MERGE_WARPS, decode_chunks.MERGE_PDL,
                    choose.few_programs)
    stack = contextlib.ExitStack()
    split = isinstance(v, tuple) and v[0] == "split"
    graph = isinstance(v, tuple) and v[0] == "graph"
    settings = (v[1] if isinstance(v, tuple) and v[0] == "policy" else
                v[2] if graph and len(v) > 2 else {})
    module = (v[1] if isinstance(v, tuple) and v[0] == "module" else
              v[3] if graph and len(v) > 3 else {})
    tiles = v if isinstance(v, dict) else (v[1] if isinstance(v, tuple) and v[0] not in (
        "graph", "split", "policy", "module") else {})
    try:
        g.TILES.update(tiles)
        schedule.MAX_CHUNKS = module.get("max_chunks", schedule.MAX_CHUNKS)
        decode_chunks.MERGE_WARPS = module.get("merge_warps", decode_chunks.MERGE_WARPS)
        decode_chunks.MERGE_PDL = module.get("merge_pdl", decode_chunks.MERGE_PDL)
        if module.get("gathered"):
            stack.enter_context(gathered_rows())
        if module.get("swap_any"):
            def few_programs(block_m, d, items, hkv, requests, dev=None):
                return (choose._one_a_sm_tile(block_m, d) and requests is not None
                        and choose.known(items <= requests))
            choose.few_programs = few_programs
        if split:
            min_keys, slots = v[1], v[2]

            def wanted(programs, num_sms):
                return saved_wanted(programs, None if num_sms is None else slots * num_sms)
            schedule.chunks_wanted = wanted
            prefill.build_split_work = functools.partial(saved_split, min_keys_per_chunk=min_keys)
        policy.touch()
        if v == "tile128" or (isinstance(v, tuple) and v[0] == "tile128"):
            choose.DECODE_ROWS = 0
        with policy.override(graph_decode_tile=graph and bool(v[1]), **settings):
            yield
    finally:
        prefill.build_split_work, schedule.chunks_wanted = saved_split, saved_wanted
        (schedule.MAX_CHUNKS, decode_chunks.MERGE_WARPS, decode_chunks.MERGE_PDL,
         choose.few_programs) = saved_module
        stack.close()
        g.TILES.clear()
        g.TILES.update(saved_tiles)
        choose.DECODE_ROWS = saved_rows
        policy.touch()


def _inputs(case, dev):
    b, kv, page, hq, hkv = case
    npg = -(-kv // page)
    gcpu = torch.Generator().manual_seed(0)
    cache = torch.randn(b * npg, 2, page, hkv, D, device=dev, dtype=torch.bfloat16)
    idx = torch.randperm(b * npg, generator=gcpu).to(torch.int32).to(dev)
    indptr = (torch.arange(b + 1, dtype=torch.int32) * npg).to(dev)
    last = torch.full((b,), kv - (npg - 1) * page, dtype=torch.int32, device=dev)
    q = torch.randn(b, hq, D, device=dev, dtype=torch.bfloat16)
    qo = torch.arange(b + 1, dtype=torch.int32, device=dev)
    nbytes = b * npg * page * hkv * D * 2 * 2
    n = min(nbytes, 8 << 30) // 2
    src = cache.view(-1)[:n]
    return dict(cache=cache, idx=idx, indptr=indptr, last=last, q=q, qo=qo, nbytes=nbytes,
                src=src, dst=torch.empty_like(src))


def _ours(case, x, variant):
    import compiled_attn as ca

    b, kv, page, hq, hkv = case
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=x["q"].device)
    with _variant(variant):
        if isinstance(variant, tuple) and variant[0] == "graph":
            i32 = dict(dtype=torch.int32, device=x["q"].device)
            w = ca.BatchPrefillWithPagedKVCacheWrapper(
                ws, "NHD", use_cuda_graph=True, qo_indptr_buf=torch.empty(b + 1, **i32),
                paged_kv_indptr_buf=torch.empty(b + 1, **i32),
                paged_kv_indices_buf=torch.empty(x["idx"].numel(), **i32),
                paged_kv_last_page_len_buf=torch.empty(b, **i32))
        else:
            w = ca.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(x["qo"], x["indptr"], x["idx"], x["last"], hq, hkv, D, page, causal=False,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
        out = w.run(x["q"], x["cache"])
        torch.cuda.synchronize()
        p = w._plan
        merge = getattr(p, "merge", None)
        info = f"block_m {p.block_m}, work rows {p.work.shape[0]}" + (
            f", merge rows {merge.shape[0]}" if merge is not None else "")
        if getattr(p, "chunk_work", None) is not None:
            info += f"; chunks: work rows {p.chunk_work.shape[0]}"
        return (lambda: w.run(x["q"], x["cache"])), out, info


def _fi(case, x, tensor_cores):
    import flashinfer

    b, kv, page, hq, hkv = case
    ws = torch.empty(256 << 20, dtype=torch.uint8, device=x["q"].device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tensor_cores)
    w.plan(x["indptr"], x["idx"], x["last"], hq, hkv, D, page, q_data_type=torch.bfloat16,
           kv_data_type=torch.bfloat16)
    out = w.run(x["q"], x["cache"])
    torch.cuda.synchronize()
    return (lambda: w.run(x["q"], x["cache"])), out


def plot(path: str) -> str:
    """Bars of decode/copy per case for each provider of a results JSON; returns the PNG's
    path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.load(open(path))
    rows = [r for r in doc["rows"] if r.get("over_copy")]
    cases = list(dict.fromkeys(tuple(r["case"]) for r in rows))
    provs = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(11, 4.5))
    w = 0.8 / len(provs)
    for j, prov in enumerate(provs):
        ys = [next((r["over_copy"] for r in rows if tuple(r["case"]) == c
                    and r["provider"] == prov), 0.0) for c in cases]
        ax.bar([i + j * w for i in range(len(cases))], ys, w, label=prov)
    ax.axhline(0.95, color="k", lw=0.8, ls="--")
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(cases))])
    ax.set_xticklabels([f"B{b} kv{kv}\npage{pg} g{hq}/{hkv}" for b, kv, pg, hq, hkv in cases],
                       fontsize=7)
    ax.set_ylabel("K/V bytes/s over the copy's")
    ax.set_title(f"Decode rows against a device copy ({doc['gpu']}, torch {doc['torch']})")
    ax.legend(fontsize=7)
    out = str(path).rsplit(".", 1)[0] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants-only", action="store_true")
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--fi-tc", action="store_true", help="also FlashInfer's tensor-core decode "
                    "(a JIT build on a cold machine)")
    ap.add_argument("--budget-s", type=float, default=500.0)
    ap.add_argument("--out", default=None)
    ap.add_argument("--variants", default=None, help="comma-separated variant names (default: "
                    "all on the first cases); a fault in one kernel poisons the process, so a "
                    "driver may run each in its own")
    ap.add_argument("--cases", default=None, help="comma-separated indices into CASES")
    ap.add_argument("--plot", default=None, help="plot this results JSON and exit")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return
    dev = torch.device("cuda")
    t0 = time.time()
    rows = []
    idx = ([int(i) for i in args.cases.split(",")] if args.cases
           else range(VARIANT_CASES if args.variants_only else len(CASES)))
    for ci, case in ((i, CASES[i]) for i in idx):
        if time.time() - t0 > args.budget_s:
            print(f"budget spent; not run: {case}", flush=True)
            continue
        print(f"[{time.time() - t0:.0f} s] case {case}", flush=True)
        x = _inputs(case, dev)
        replays, notes, outs, keep = {}, {}, {}, []
        variants = _variants()
        if ci >= VARIANT_CASES:
            variants = {k: variants[k] for k in ("default", "tile128", "graph plan",
                                                 "graph plan decode tile")}
        if args.variants:
            variants = {k: v for k, v in _variants().items() if k in args.variants.split(",")}
        for name, v in variants.items():
            try:
                fn, out, info = _ours(case, x, v)
                outs[name] = out
                notes[name] = info
                keep.append(fn)  # a graph's replay does not keep the plan's tensors alive
                with _variant(v):
                    replays["ours " + name] = capture_graph(fn)[0].replay
            except Exception as e:  # noqa: BLE001
                notes[name] = f"{type(e).__name__}: {str(e)[:160]}"
        if not args.no_flashinfer:
            for tc in ((False, True) if args.fi_tc else (False,)):
                name = f"fi decode{' tc' if tc else ''}"
                try:
                    fn, out = _fi(case, x, tc)
                    outs[name] = out
                    keep.append(fn)
                    replays[name] = capture_graph(fn)[0].replay
                except Exception as e:  # noqa: BLE001
                    notes[name] = f"{type(e).__name__}: {str(e)[:160]}"
        src, dst = x["src"], x["dst"]
        # eager: a captured copy replays ~1.5x slower than the eager call (H200, 2026-11-28)
        replays["copy"] = lambda: dst.copy_(src)
        for k, f in list(replays.items()):  # a faulting replay stops here, named
            f()
            torch.cuda.synchronize()
            print(f"  replayed {k}", flush=True)
        med = medians_us(replays, args.rounds)
        ref = outs.get("default")
        copy_rate = 2 * x["src"].numel() * 2 / (med["copy"] * 1e-6)
        for k, us in med.items():
            name = k[5:] if k.startswith("ours ") else k
            row = dict(case=list(case), provider=k, us=us, note=notes.get(name, ""))
            if k != "copy":
                rate = x["nbytes"] / (us * 1e-6)
                row.update(tbs=rate / 1e12, over_copy=rate / copy_rate)
                o = outs.get(name)
                if ref is not None and o is not None:
                    row["max_diff_vs_default"] = float((o.float() - ref.float()).abs().max())
            rows.append(row)
        for name, why in notes.items():
            if "Error" in why:
                rows.append(dict(case=list(case), provider=name, us=None, note=why))
        del x, replays, outs, keep
        torch.cuda.empty_cache()
        if args.out:
            with open(args.out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                               rows=rows), f, indent=1)
    print(f"{'case (B, kv, page, Hq, Hkv)':<28} {'provider':<18} {'us':>9} {'TB/s':>6} "
          f"{'/copy':>6} {'diff':>8}  note")
    for r in rows:
        us = "-" if r["us"] is None else f"{r['us']:.1f}"
        print(f"{str(tuple(r['case'])):<28} {r['provider']:<18} {us:>9} "
              f"{r.get('tbs', 0):6.2f} {r.get('over_copy', 0):6.3f} "
              f"{r.get('max_diff_vs_default', float('nan')):8.1e}  {r['note']}")


if __name__ == "__main__":
    main()
