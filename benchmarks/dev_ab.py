"""Ragged A/B (dev tool): our ragged op on B equal causal requests under several variants
(tile height, K/V path), timed interleaved in one process (providers.bench: rounds
of slices in a fresh order, each slice settled first) beside SDPA flash, so that clock drift
cannot tilt the ratios the way it tilts back-to-back do_bench calls (whichever variant ran
first read up to 10% faster there). A variant is BM:PATH: tile height (64, 128 or prod,
block_m_for's choice) and K/V path (a key of prefill_kernel.KV_PATHS: host, persistent,
device, pointers). List a variant twice for an A/A control: its spread is the noise floor.

    python3 -m benchmarks.dev_ab --cases 4096,8192 --variants prod:host,prod:host,128:persistent
"""

from __future__ import annotations

import argparse
import json
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from compiled_attn import ops
from compiled_attn.ops import prefill_kernel as K
from compiled_attn.plan import build_work

from .kv_paths import forced_kv_path
from .providers import bench


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1024,2048,4096,8192", help="sequence lengths S")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=131072, help="B * S")
    ap.add_argument("--variants", default="prod:host,prod:host,prod:persistent",
                    help="BM:PATH, comma-separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=float, default=1500.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    h, d, rows = a.heads, a.dim, []
    tail = (ops.MASK_CAUSAL, -1, 0, d ** -0.5, 0.0, 0, 1.0, 1e4, 1.0, None)
    for s in (int(x) for x in a.cases.split(",")):
        b = max(1, a.tokens // s)
        q, k, v = (torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        qi = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
        variants = a.variants.split(",")
        runners, outs = [], []
        for var in variants:
            bm_s, path = var.split(":")
            bm = K.block_m_for(d, d, 1, s, True, False) if bm_s == "prod" else int(bm_s)
            w = build_work([s] * b, 1, bm, "cuda", kv_lens=[s] * b)
            fn = (lambda w=w, bm=bm: ops.batch_ragged_prefill(q, k, v, qi, qi, w, None, None,
                                                              None, None, bm, *tail))
            ctx = (lambda path=path: forced_kv_path(path))
            with ctx():
                outs.append(fn()[0].float())
            runners.append(([fn], ctx))
        qt, kt, vt = (x.reshape(b, s, h, d).transpose(1, 2) for x in (q, k, v))
        sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            qt, kt, vt, is_causal=True)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            ref = sdpa().transpose(1, 2).reshape(b * s, h, d).float()
        # the variants differ from SDPA flash by rounding only; NaN means a broken variant
        errs = [(o - ref).abs().max().item() for o in outs]
        if any(e != e for e in errs):
            raise RuntimeError(f"S {s}: NaN in the output of {variants}: {errs}")
        runners.append(([sdpa], lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)))
        times = bench(runners, warmup_ms=50, rep_ms=a.rep_ms, cuda=True, rounds=a.rounds)
        flop = 2 * b * s * s * h * d  # causal: half of 4 * S * S * H * D per request
        row = dict(s=s, b=b, h=h, d=d, max_err_vs_sdpa_flash=max(errs))
        for name, t in zip([f"{i}:{v}" for i, v in enumerate(variants)] + ["sdpa_flash"], times):
            row[name] = flop / t.median_ms / 1e9 if t.error is None else repr(t.error)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(a.out, "dev_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n    S    B  variant                  TFLOP/s  / first  / flash")
    for r in rows:
        keys = [k for k in r if ":" in k]
        for kk in keys:
            x, x0, fl = r[kk], r[keys[0]], r["sdpa_flash"]
            if not all(isinstance(y, float) for y in (x, x0, fl)):
                print(f"{r['s']:5} {r['b']:4}  {kk:24} {x}")
                continue
            print(f"{r['s']:5} {r['b']:4}  {kk:24} {x:7.0f} {x / x0:8.3f} {x / fl:7.3f}")


if __name__ == "__main__":
    main()
