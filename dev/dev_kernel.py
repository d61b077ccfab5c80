"""Kernel tuning sweep (dev tool): our single/ragged/paged ops under several tile configs
against SDPA's flash and cuDNN backends, on the FA3-paper sizing (B*S = 16k, H*D = 2048), in one
process. Prints a table; the full benchmark suite is benchmarks/run.py."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from compiled_attn.ops import choose
from compiled_attn import ops
from compiled_attn.ops.schedule import build_work

from .kv_paths import forced_kv_path, forced_tile
from benchmarks.providers import scatter_pages, time_ms


def tflops(b, s, h, d, causal, ms):
    f = 4 * b * s * s * h * d * (0.5 if causal else 1.0)
    return f / ms / 1e9


def bench(fn):
    # >= 100 ms of settling and 400 ms of timed calls: a 20 ms call still gets 20 samples
    return time_ms(fn, warmup_ms=100, rep_ms=400)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="128:4096:1,128:16384:1,128:16384:0,64:4096:1,256:8192:1")
    ap.add_argument("--configs", default="128:64:8:3,64:64:4:3,128:128:8:3,128:64:4:3",
                    help="BLOCK_M:BLOCK_N:warps:stages tiles, or prod (the production policy)")
    ap.add_argument("--groups", default="auto",
                    help="dense launch order: (batch entry, KV head) pairs per group, auto (the "
                         "production rule, choose._dense_group) or an int (1: one pair "
                         "at a time)")
    ap.add_argument("--paged", action="store_true")
    ap.add_argument("--heads", type=int, default=0, help="heads (default: 2048 // D)")
    ap.add_argument("--tokens", type=int, default=16384, help="B * S (B at least 1)")
    ap.add_argument("--no-peers", action="store_true", help="skip SDPA flash / cuDNN")
    ap.add_argument("--tma", default="2,3,1,0",
                    help="K/V through host-built descriptors (2), descriptors built once per "
                         "persistent program (3), per work item (1), or pointer loads (0): "
                         "the paths of choose.KV_PATHS, forced at any size")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    rows = []
    orig_bm, orig_group = choose.tile, choose._dense_group
    # the K/V path of each --tma value (choose.KV_PATHS)
    paths = {str(t): name for name, (t, _) in choose.KV_PATHS.items()}
    for case in a.cases.split(","):
        d, s, causal = (int(x) for x in case.split(":"))
        h, b = a.heads or 2048 // d, max(1, a.tokens // s)
        q = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        ref = torch.nn.functional.scaled_dot_product_attention(qt, kt, vt, is_causal=bool(causal))
        peers = {}
        for name, be in (() if a.no_peers else (("sdpa_flash", SDPBackend.FLASH_ATTENTION),
                                                 ("sdpa_cudnn", SDPBackend.CUDNN_ATTENTION))):
            try:
                with sdpa_kernel(be):
                    ms = bench(lambda: torch.nn.functional.scaled_dot_product_attention(
                        qt, kt, vt, is_causal=bool(causal)))
                peers[name] = tflops(b, s, h, d, causal, ms)
            except Exception as e:  # a backend that refuses the case is reported, not hidden
                peers[name] = f"n/a: {type(e).__name__}"
        mm = ops.MASK_CAUSAL if causal else ops.MASK_NONE
        tail = (mm, -1, 0, d ** -0.5, 0.0, 0, 1.0, 1e4, 1.0, None)
        qf, kr, vr = (x.reshape(b * s, h, d) for x in (q, k, v))
        qi = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s

        def ragged_tflops(bm_):
            """Our ragged op on this case with tile height bm_ (the launch config is whatever
            choose.config says now)."""
            work_ = build_work([s] * b, 1, bm_, "cuda", kv_lens=[s] * b)
            return tflops(b, s, h, d, causal, bench(lambda: ops.batch_ragged_prefill(
                qf, kr, vr, qi, qi, work_, None, None, None, None, bm_, *tail)))

        if a.paged:
            # our ragged op with the production tile policy: the paged/ragged denominator
            peers["ragged_prod"] = ragged_tflops(orig_bm(d, d, 1, s, bool(causal), False))
        for cfg, tma, grp in ((c, t, g) for c in a.configs.split(",") for t in a.tma.split(",")
                              for g in a.groups.split(",")):
            tile = None if cfg == "prod" else [int(x) for x in cfg.split(":")]
            # prod: the production policy (for --paged, its page-16 tile on both page sizes)
            bm = orig_bm(d, d, 1, s, bool(causal), a.paged) if tile is None else tile[0]
            with forced_kv_path(paths[tma]), (contextlib.nullcontext() if tile is None
                                              else forced_tile(*tile)):
                choose._dense_group = orig_group if grp == "auto" else (lambda *_a, g=int(grp): g)
                try:
                    fn = lambda: ops.single_prefill(q, k, v, None, None, None, *tail)
                    out, _ = fn()
                    err = (out.transpose(1, 2).float() - ref.float()).abs().max().item()
                    # --paged compares paged with ragged: the dense op is only its reference there
                    ms = float("nan") if a.paged else bench(fn)
                    row = dict(d=d, s=s, causal=causal, cfg=cfg, tma=int(tma), group=grp,
                               kind="single", tflops=tflops(b, s, h, d, causal, ms), err=err,
                               **peers)
                    if a.paged:
                        work = build_work([s] * b, 1, bm, "cuda", kv_lens=[s] * b)
                        for page in (16, 1):
                            kc, vc, pi, perm, last = scatter_pages(kr, vr, [s] * b, page)
                            fp = lambda: ops.batch_paged_prefill(
                                qf, kc, vc, qi, pi, perm, last, work, None, None, None, None, bm,
                                *tail)
                            o2, _ = fp()
                            perr = (o2.reshape(b, s, h, d).float() - out.float()).abs().max().item()
                            row[f"paged{page}"] = tflops(b, s, h, d, causal, bench(fp))
                            row[f"paged{page}_err"] = perr
                        row["ragged"] = ragged_tflops(bm)  # same tile and config as the paged rows
                except Exception as e:
                    row = dict(d=d, s=s, causal=causal, cfg=cfg, tma=int(tma), group=grp,
                               error=f"{type(e).__name__}: {e}"[:300])
            rows.append(row)
            print(json.dumps(row), flush=True)
    choose._dense_group = orig_group
    with open(os.path.join(a.out, "dev_kernel.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n d    S     c  cfg          tma grp   ours   flash  cudnn  paged16 paged1 ragged "
          "ragged_prod")
    for r in rows:
        if "error" in r:
            print(f"{r['d']:4} {r['s']:6} {r['causal']} {r['cfg']:12} {r['tma']:d} "
                  f"{r['group']:4} ERROR {r['error'][:80]}")
            continue
        f = lambda x: f"{x:6.0f}" if isinstance(x, float) else "   n/a"
        print(f"{r['d']:4} {r['s']:6} {r['causal']}  {r['cfg']:12} {r['tma']:d} {r['group']:4} "
              f"{f(r['tflops'])} "
              f"{f(r.get('sdpa_flash'))} {f(r.get('sdpa_cudnn'))} {f(r.get('paged16'))} "
              f"{f(r.get('paged1'))} {f(r.get('ragged'))} {f(r.get('ragged_prod'))}  "
              f"err {r['err']:.2e}")


if __name__ == "__main__":
    sys.exit(main())
