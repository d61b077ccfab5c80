"""Where a POD call's CUDA-graph replay spends the time its eager calls do not (dev probe, GPU).

The pod suite times POD's CUDA-graph replays 2-3% slower than its eager calls on the same plan
(benchmarks/NOTES.md, 2026-11-29), where a paged call's replays match its eager calls. This
probe takes one quick-suite case (benchmarks.pod's inputs and calls) and prints, per provider:
eager calls back to back, one replay of a graph of one call, and one replay of a graph of ten
calls (per call), each a median over rounds of CUDA-event timings; and the kernel nodes each
one-call graph holds (CUDAGraph.debug_dump, read back as DOT).

    python -m dev.pod_graph_probe [--case "pod p2048 d128x4096 g32/8 page16"] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import tempfile


def _timed(fn, reps: int, rounds: int) -> float:
    """Median over rounds of the mean us a call of fn, reps calls a round."""
    import torch

    out = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(reps):
            fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(out)


def _graph(fn, calls: int, dump: str | None = None):
    """(replay, the DOT text of its debug dump) of a graph capturing ``calls`` calls of fn;
    dump: a path to keep the DOT file at."""
    import torch

    from benchmarks.pod import capture

    try:  # (the captured cudaGraph_t outlives instantiation only when kept: torch 2.10 on)
        g = torch.cuda.CUDAGraph(keep_graph=True)
    except TypeError:
        g = torch.cuda.CUDAGraph()
    g.enable_debug_mode()
    capture(fn, calls, g)
    path = dump or os.path.join(tempfile.mkdtemp(), "g.dot")
    g.debug_dump(path)
    if not os.path.exists(path):
        return g.replay, "(no dump written)"
    return g.replay, open(path).read()


def _nodes(dot: str) -> str:
    """The node kinds of a graph's DOT dump, counted, with its kernels' names."""
    kinds = {k: dot.count(k) for k in ("KERNEL", "MEMSET", "MEMCPY", "EVENT") if k in dot}
    names = re.findall(r"_Z\w+|triton_\w+|_(?:gluon|prefill|pod|merge)\w*", dot)
    short = sorted({n[:48] for n in names})
    return f"{kinds} {short}"


def main(argv=None) -> int:
    import torch

    from benchmarks import pod

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="pod p2048 d128x4096 g32/8 page16")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dump", default=None, help="a folder for the one-call graphs' DOT files")
    args = ap.parse_args(argv)
    case = next(c for c in pod.case_list(quick=True) + pod.case_list() if c.name == args.case)
    import compiled_attn as ca

    dev = torch.device("cuda")
    x = pod.make_inputs(case, dev)
    calls = pod._calls(ca, case, x, dev, False)
    print(f"{torch.cuda.get_device_name()} {case.name}")
    print(f"{'provider':10s} {'eager':>8s} {'graph x1':>9s} {'graph x10':>10s}  nodes")
    for name in ("pod", "prefill", "decode", "apart"):
        fn = calls[name]
        fn()
        torch.cuda.synchronize()
        eager = _timed(fn, 20, args.rounds)
        dump = os.path.join(args.dump, f"{name}.dot") if args.dump else None
        r1, dot = _graph(fn, 1, dump)
        r10, _ = _graph(fn, 10)
        g1 = _timed(r1, 20, args.rounds)
        g10 = _timed(r10, 2, args.rounds) / 10
        print(f"{name:10s} {eager:8.1f} {g1:9.1f} {g10:10.1f}  {_nodes(dot)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
