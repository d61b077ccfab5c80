"""Dev probe: where the host time of one bound eager call goes, entry point by entry point.

The host suite (benchmarks/host.py) times whole calls. This probe takes each of our calls in it
(single prefill, ragged / paged run(), POD and BatchPOD run()) apart, with the same tiny inputs
and the same timing (calls queued behind a sleeping GPU, interleaved rounds, medians):

- ``call``: the whole eager call (a bound launch replayed);
- ``key``: the memo's key of the call's arguments (``Memo.eager_key``);
- ``lookup``: the key's lookup and the replay (outputs allocated, scratch, launches);
- ``lookup+alloc``: the same with the outputs the caller drops (an LSE not asked for)
  allocated at each replay instead of written into the tensor the bound call keeps;
- ``alloc``: the replay's output allocations alone;
- ``launch``: the replay's launches alone (outputs allocated once, outside the timing);
- ``front``: what is left (call - key - lookup): the entry point's own Python before its key.

And three torch calls for scale: one ``empty_strided`` of an output's size, the capture check
and the raw stream. FlashInfer's call of the same entry point is timed beside ours where it is
installed. Run on the GPU machine: ``python -m dev.host_parts_probe [--rounds 7]``.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from benchmarks import host
from compiled_attn.ops import launch


def _captured(fn):
    """(memo, values, extra, key, tensors, ptrs, bound) of fn's next call (a bound replay)."""
    seen = {}
    ek, lk = launch.Memo.eager_key, launch.Memo.lookup

    def eager_key(self, values, extra=()):
        kt = ek(self, values, extra)
        if kt is not None and "memo" not in seen:
            seen.update(memo=self, values=values, extra=extra, key=kt[0], tensors=kt[1],
                        ptrs=kt[2])
        return kt

    def lookup(self, key, tensors, ptrs=None):
        out = lk(self, key, tensors, ptrs)
        if out is not None and "bound" not in seen and self is seen.get("memo"):
            seen["bound"] = self._bound[key]
        return out

    launch.Memo.eager_key, launch.Memo.lookup = eager_key, lookup
    try:
        fn()
    finally:
        launch.Memo.eager_key, launch.Memo.lookup = ek, lk
    if "bound" not in seen:
        return None
    return seen


def _unheld(memo, seen, bound):
    """lookup with the bound call's held outputs (the dropped LSEs) allocated afresh, as
    before Bound.held: the A/B of that change in one process."""
    held, bound.held = bound.held, {}
    try:
        return memo.lookup(seen["key"], seen["tensors"], seen["ptrs"])
    finally:
        bound.held = held


def _launches_only(bound, tensors):
    """bound's launches with fixed outputs and scratch (Bound.replay without allocations)."""
    dev = bound.device
    outs = [torch.empty_strided(s, st, dtype=dt, device=dev) for s, st, dt in bound.outputs]
    tmps = [launch._pool_ptr(dev) if kind == "zeros" else torch.empty(s, dtype=dt, device=dev)
            for kind, s, dt in bound.scratch]
    pools = launch.pointers(tensors, outs, tmps)
    stream = torch._C._cuda_getCurrentRawStream(dev.index)
    # (pools holds pointers only: the closure keeps the outputs and scratch alive)
    return lambda keep=(outs, tmps): bound.launch(pools, stream)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--no-flashinfer", action="store_true")
    args = ap.parse_args(argv)
    provs = host.providers(argparse.Namespace(no_flashinfer=args.no_flashinfer, no_fi_pod=False,
                                              fi_single_backend="auto"))
    timed: dict = {}
    for (case, prov), fn in provs.items():
        if not callable(fn) or case.startswith("compiled") or case.endswith("torch_ops"):
            continue
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        if prov != "compiled_attn":
            timed[case, prov, "call"] = fn
            continue
        seen = _captured(fn)
        timed[case, prov, "call"] = fn
        if seen is None:
            print(f"{case}: no bound replay captured")
            continue
        m, b = seen["memo"], seen["bound"]
        timed[case, prov, "key"] = lambda m=m, s=seen: m.eager_key(s["values"], s["extra"])
        timed[case, prov, "lookup"] = lambda m=m, s=seen: m.lookup(s["key"], s["tensors"],
                                                                    s["ptrs"])
        timed[case, prov, "lookup+alloc"] = lambda m=m, s=seen, b=b: _unheld(m, s, b)
        timed[case, prov, "alloc"] = lambda b=b: [
            torch.empty_strided(s, st, dtype=dt, device=b.device) for s, st, dt in b.outputs]
        timed[case, prov, "launch"] = _launches_only(b, seen["tensors"])
        if ("torch", "-", "empty_strided") not in timed:
            s, st, dt = b.outputs[0]
            timed["torch", "-", "empty_strided"] = lambda: torch.empty_strided(
                s, st, dtype=dt, device="cuda")
            timed["torch", "-", "capturing"] = torch.cuda.is_current_stream_capturing
            timed["torch", "-", "raw_stream"] = lambda: torch._C._cuda_getCurrentRawStream(0)
        print(f"{case}: {len(b.launches)} launches, {len(b.outputs)} outputs, "
              f"{len(b.scratch)} scratch, direct {[d is not None for *_, d in b.launches]}")
    times = {k: [] for k in timed}
    for _ in range(args.rounds):
        for k, fn in timed.items():
            times[k].append(host.host_us(fn, args.calls))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"host us a call, median of {args.rounds} rounds x {args.calls} calls "
          f"(CPU {host._cpu_model()})")
    print(f"{'case':16s} {'provider':14s} {'part':14s} {'us':>7s} {'best':>7s}")
    for (case, prov, part), v in med.items():
        print(f"{case:16s} {prov:14s} {part:14s} {v:7.2f} {min(times[case, prov, part]):7.2f}")
        if part == "lookup":
            front = med[case, prov, "call"] - med[case, prov, "key"] - v
            print(f"{case:16s} {prov:14s} {'front':14s} {front:7.2f}")


if __name__ == "__main__":
    main()
