"""What a small decode launch costs before and after its keys (dev probe, GPU).

A decode batch of 16 requests reads its K/V at 0.66-0.93 of the copy's rate; a line through
its kernel times at 1k and 4k keys gives ~6 us a launch beside the copy's ~1.6
(benchmarks/NOTES.md, 2026-11-30). This probe takes that fixed cost apart with the product's
own launches: the paged wrapper's decode batch (page 16, GQA 32/8, D 128, bf16, shuffled
pages) at 0 keys a request (every item takes the no-key path: its rows stored as 0 / -inf, no
K/V tile), 1 and 16 keys (one partial tile), 64 (one full tile) and 1024 / 4096, for B
requests; beside them a one-program Triton kernel that stores one value (the floor of a
launch the profiler times). Each is a CUDA graph of one call, timed by torch.profiler over
``--replays`` replays (the Gluon kernel's own time) and by events (the replay's).

    python -m dev.fixed_cost_probe [--batches 16,128] [--replays 100]
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

D, PAGE, HQ, HKV = 128, 16, 32, 8


@triton.jit
def _one_store(x_ptr):
    tl.store(x_ptr, 1.0)


def decode_call(b: int, kv: int, dev):
    """(run, what it reads) of the paged wrapper's decode batch of b requests at kv keys each
    (page 16, GQA 32/8, D 128, bf16, shuffled pages; requests of no key at kv 0): run() is
    one eager call of it (dev.launch_timeline takes it too)."""
    import compiled_attn as ca

    npg = -(-kv // PAGE)
    g = torch.Generator().manual_seed(0)
    cache = torch.randn(max(b * npg, 1), 2, PAGE, HKV, D, generator=g).to(dev, torch.bfloat16)
    idx = torch.randperm(b * npg, generator=g).to(torch.int32).to(dev)
    indptr = (torch.arange(b + 1, dtype=torch.int32) * npg).to(dev)
    last = torch.full((b,), kv - (npg - 1) * PAGE if npg else 0, dtype=torch.int32, device=dev)
    q = torch.randn(b, HQ, D, generator=g).to(dev, torch.bfloat16)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device=dev), "NHD")
    w.plan(torch.arange(b + 1, dtype=torch.int32, device=dev), indptr, idx, last, HQ, HKV, D,
           PAGE, causal=True, q_data_type=torch.bfloat16)
    return (lambda: w.run(q, cache)), (w, q, cache)


def _decode(b: int, kv: int, dev, replays: int):
    """(replay us, kernel_times) of decode_call's batch (a CUDA graph of one run()), and what
    the graph reads (kept alive by the caller)."""
    from dev.kernel_split_probe import _kernels

    fn, held = decode_call(b, kv, dev)
    assert not fn().isnan().any()
    return _kernels(fn, replays), held


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="16,128")
    ap.add_argument("--keys", default="0,1,16,64,1024,4096")
    ap.add_argument("--replays", type=int, default=100)
    a = ap.parse_args(argv)
    from dev.kernel_split_probe import _kernels

    dev = torch.device("cuda")
    x = torch.zeros(1, device=dev)
    wall, rows = _kernels(lambda: _one_store[(1,)](x), a.replays)
    print(f"{'launch':34s} {'replay us':>9s} {'kernel us':>9s}  kernels")
    print(f"{'one-store Triton kernel':34s} {wall:9.1f} {sum(t for _, t, _ in rows):9.1f}")
    keep = []
    for b in (int(s) for s in a.batches.split(",")):
        for kv in (int(s) for s in a.keys.split(",")):
            (wall, rows), held = _decode(b, kv, dev, a.replays)
            keep.append(held)
            kern = sum(t for _, t, _ in rows)
            names = ", ".join(f"{n[:24]} {t:.1f}" for n, t, _ in rows)
            print(f"{f'decode {b} x {kv} keys':34s} {wall:9.1f} {kern:9.1f}  {names}", flush=True)


if __name__ == "__main__":
    main()
