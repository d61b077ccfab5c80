"""Dev probe: where the host time of one bound eager call goes, entry point by entry point.

The host suite (benchmarks/host.py) times whole calls. This probe takes each of our calls in it
(single prefill, ragged / paged run(), POD and BatchPOD run()) apart, with the same tiny inputs
and the same timing (calls queued behind a sleeping GPU, interleaved rounds, medians):

- ``call``: the whole eager call (a bound launch replayed);
- ``key``: the memo's key of the call's arguments (``Memo.eager_key``); ``light``: its
  light key (``Memo._light_key``, replay_fast's); ``find``: the lookup chain with its replay;
- ``lookup``: the key's lookup and the replay (outputs allocated, scratch, launches);
- ``lookup+alloc``: the same with the outputs the caller drops (an LSE not asked for)
  allocated at each replay instead of written into the tensor the bound call keeps;
- ``alloc``: the replay's output allocations alone;
- ``launch``: the replay's launches alone (outputs allocated once, outside the timing);
- ``launcher``: Triton's C launchers alone, with the arguments a replay passes them;
- ``front``: what is left (call - find): the entry point's own Python before its lookup.

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


# GPU cycles a timing waits behind (~50 ms: longer than 200 calls of a few hundred us take to
# issue; the host suite's 0.8 s would take a run of every part past ten minutes)
SLEEP = 100_000_000


def _captured(fn):
    """(memo, values, extra, key, tensors, ptrs, bound) of fn's next call (a bound replay)."""
    seen = {}
    find = launch.Memo.find

    def hooked(self, values, extra=()):
        out = find(self, values, extra)
        if "memo" not in seen and out[0] is not None:
            key, tensors, ptrs, _light = self.eager_key(values, extra)
            seen.update(memo=self, values=values, extra=extra, key=key, tensors=tensors,
                        ptrs=ptrs, bound=self._bound[key])
        return out

    launch.Memo.find = hooked
    try:
        fn()
    finally:
        launch.Memo.find = find
    return seen or None


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
    stream = torch._C._cuda_getCurrentRawStream(dev.index)
    tmps, addrs = bound.scratch_pointers(stream)
    pools = launch.pointers(tensors, outs, addrs)
    # (pools holds pointers only: the closure keeps the outputs and scratch alive)
    return lambda keep=(outs, tmps): bound.launch(pools, stream)


def _launcher_only(bound, tensors):
    """The C launchers of bound's launches alone, with the arguments a replay passes them
    (Triton's own cost: argument parsing and cuLaunchKernelEx), or None where a launch is not
    direct (launch._Direct)."""
    run = _launches_only(bound, tensors)
    calls = []
    for *_, direct in bound.launches:
        if direct is None:
            return None
        real = direct.launcher
        direct.launcher = lambda *a, real=real: calls.append((real, a))
        try:
            run()
        finally:
            direct.launcher = real
    torch.cuda.synchronize()

    def go(keep=run):
        for real, a in calls:
            real(*a)
    return go


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
        timed[case, prov, "light"] = lambda m=m, s=seen: m._light_key(s["values"], s["extra"])
        timed[case, prov, "find"] = lambda m=m, s=seen: m.find(s["values"], s["extra"])
        timed[case, prov, "lookup"] = lambda m=m, s=seen: m.lookup(s["key"], s["tensors"],
                                                                    s["ptrs"])
        timed[case, prov, "lookup+alloc"] = lambda m=m, s=seen, b=b: _unheld(m, s, b)
        timed[case, prov, "alloc"] = lambda b=b: [
            proto.new_empty_strided(s, st) for _j, proto, s, st in b._alloc]
        timed[case, prov, "launch"] = _launches_only(b, seen["tensors"])
        raw = _launcher_only(b, seen["tensors"])
        if raw is not None:
            timed[case, prov, "launcher"] = raw
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
            times[k].append(host.host_us(fn, args.calls, SLEEP))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"host us a call, median of {args.rounds} rounds x {args.calls} calls "
          f"(CPU {host._cpu_model()})")
    print(f"{'case':16s} {'provider':14s} {'part':14s} {'us':>7s} {'best':>7s}")
    for (case, prov, part), v in med.items():
        print(f"{case:16s} {prov:14s} {part:14s} {v:7.2f} {min(times[case, prov, part]):7.2f}")
        if part == "find":
            front = med[case, prov, "call"] - v
            print(f"{case:16s} {prov:14s} {'front':14s} {front:7.2f}")


if __name__ == "__main__":
    main()
