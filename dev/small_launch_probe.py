"""Small-launch threshold A/B (dev tool): eager calls of the public prefill entry points at
sizes around POLICY.host_tma_min_flop, each under several values of that setting, timed
interleaved in one process (providers.bench: CUDA events around each call, so an eager call's
host time shows wherever it exceeds the kernel's). Below the threshold a launch takes the
Triton kernel's pointer loads (no whole-tensor descriptors, no Gluon kernel on contiguous
K/V); above it, what a CUDA-graph capture takes at any size. Run on the GPU machine:

    python3 -m dev.small_launch_probe [--thresholds 1e11,2e10,0] [--rounds 3]

Prints a table (us per call, and each threshold's ratio over the first one's) and writes
small_launch_probe.json under $OUT when set. ``--plot FILE.json`` draws a saved run instead
(FILE.png beside it: each threshold's time over the first threshold's, per case).
"""

from __future__ import annotations

import argparse
import json
import os

import torch

import compiled_attn
from compiled_attn.ops import choose
from compiled_attn.ops.policy import override

from benchmarks.providers import bench

HQ, HKV, D = 32, 8, 128
# (name, requests' lengths, causal): single prefill where one request, else the ragged wrapper
CASES = [
    ("single S256 causal", [256], True),
    ("single S512 causal", [512], True),
    ("single S1024 causal", [1024], True),
    ("single S1536 causal", [1536], True),
    ("single S2048 causal", [2048], True),
    ("single S4096 causal", [4096], True),
    ("single S512", [512], False),
    ("single S1024", [1024], False),
    ("ragged 4x512 causal", [512] * 4, True),
    ("ragged 4x1024 causal", [1024] * 4, True),
    ("ragged 8x2048 causal", [2048] * 8, True),
]


def _flop(lens, causal):
    """The launch's FLOPs as the small-launch rule counts them (choose.launch_flop)."""
    return choose.launch_flop(sum(lens), sum(lens) / len(lens), HQ, D, D, causal)


def _call(lens, causal):
    """A no-argument eager call of the entry point on fresh bf16 CUDA inputs."""
    dev, bf = "cuda", torch.bfloat16
    n = sum(lens)
    q = torch.randn(n, HQ, D, device=dev, dtype=bf)
    k, v = (torch.randn(n, HKV, D, device=dev, dtype=bf) for _ in range(2))
    if len(lens) == 1:
        return lambda: compiled_attn.single_prefill_with_kv_cache(q, k, v, causal=causal)
    indptr = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), device=dev,
                          dtype=torch.int32)
    w = compiled_attn.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1, device=dev), "NHD")
    w.plan(indptr, indptr, HQ, HKV, D, causal=causal, q_data_type=bf)
    return lambda: w.run(q, k, v)


def plot(path: str) -> str:
    """A saved run's ratios (the first threshold's time over each other's: above 1, faster)
    per case, as a bar chart beside the JSON; returns the PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(path) as f:
        doc = json.load(f)
    rows = doc["rows"]
    names = list(rows[0]["us"])
    fig, ax = plt.subplots(figsize=(10, 4))
    width = 0.8 / max(1, len(names) - 1)
    for j, name in enumerate(names[1:]):
        ys = [r["us"][names[0]] / r["us"][name] if r["us"][name] else 0 for r in rows]
        ax.bar([i + j * width for i in range(len(rows))], ys, width,
               label=f"host_tma_min_flop={name}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(rows))])
    ax.set_xticklabels([f"{r['case']}\n{r['gflop']:.1f} GFLOP" for r in rows], rotation=60,
                       ha="right", fontsize=7)
    ax.set_ylabel(f"eager time at {names[0]} / at this bound")
    ax.set_title(f"eager prefill calls by small-launch bound ({doc['gpu']}, torch {doc['torch']})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = os.path.splitext(path)[0] + ".png"
    fig.savefig(out, dpi=110)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--thresholds", default="1e11,2e10,0")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep-ms", type=float, default=40.0)
    ap.add_argument("--cases", default="", help="only the cases whose name contains this")
    ap.add_argument("--plot", default=None, help="draw this saved JSON instead of running")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return
    values = [float(t) for t in args.thresholds.split(",")]
    rows = []
    for name, lens, causal in CASES:
        if args.cases not in name:
            continue
        fn = _call(lens, causal)
        runners = [([fn], (lambda t=t: override(host_tma_min_flop=t))) for t in values]
        for _, ctx in runners:
            with ctx():
                fn()
        torch.cuda.synchronize()
        timings = bench(runners, warmup_ms=10.0, rep_ms=args.rep_ms, cuda=True,
                        rounds=args.rounds)
        us = [t.median_ms * 1e3 if t.error is None else None for t in timings]
        host = [t.host_ms * 1e3 if t.host_ms is not None else None for t in timings]
        rows.append(dict(case=name, gflop=_flop(lens, causal) / 1e9,
                         us=dict(zip(args.thresholds.split(","), us)),
                         host_us=dict(zip(args.thresholds.split(","), host)),
                         errors=[repr(t.error) for t in timings if t.error is not None]))
    gpu = torch.cuda.get_device_name()
    print(f"# {gpu}, torch {torch.__version__}")
    head = "  ".join(f"{t:>9}" for t in args.thresholds.split(","))
    print(f"{'case':24} {'GFLOP':>7}  {head}  ratios over {values[0]:g} | host us")
    for r in rows:
        us = list(r["us"].values())
        cells = "  ".join(f"{u:9.1f}" if u is not None else f"{'-':>9}" for u in us)
        ratios = " ".join(f"{us[0] / u:5.2f}" if u and us[0] else "  -  " for u in us[1:])
        host = " ".join(f"{h:6.1f}" if h is not None else "   -  " for h in r["host_us"].values())
        print(f"{r['case']:24} {r['gflop']:7.1f}  {cells}  {ratios} | {host}  "
              f"{' '.join(r['errors'])}")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "small_launch_probe.json"), "w") as f:
            json.dump(dict(gpu=gpu, torch=torch.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
