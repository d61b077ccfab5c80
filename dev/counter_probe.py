"""What the persistent launch's zeroed work counter costs a CUDA-graph replay (dev probe, GPU).

A persistent Gluon launch leaves its work counter 0, so a CUDA graph capturing it takes a
slot zeroed once (launch.counter(resets=True)). This probe times replays of small decode
batches and POD calls (the pod suite's inputs) captured that way ("slot") and with a fresh
zeroed counter per launch as before ("memset": the graph holds a memset before the kernel),
each graph checked against the eager call (benchmarks.pod.checked_graph, four replays); a
sweep of key lengths at 16 requests gives the decode launch's fixed cost (time = fixed +
bytes / rate), with the kernel's own time from torch.profiler; a one-element add alone and
behind a memset gives the node's cost on its own.

    python -m dev.counter_probe [--rounds 5] [--cases "pod p256 d16x1024 g32/8 page1,..."]
        [--no-sweep]
"""

from __future__ import annotations

import argparse
import contextlib

import torch


@contextlib.contextmanager
def fresh_zeros():
    """launch.counter as before self-resetting counters: a capture takes a fresh zeroed tensor
    for every launch (the graph then holds a memset before the kernel)."""
    from compiled_attn.ops import launch

    orig = launch.counter
    launch.counter = lambda dev, resets=False: orig(dev)
    try:
        yield
    finally:
        launch.counter = orig


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--no-sweep", action="store_true", help="the listed cases only")
    ap.add_argument("--cases", default="pod p256 d16x1024 g32/8 page16,pod p256 d16x1024 g32/8 "
                    "page1,pod p256 d16x4096 g32/8 page16,pod p256 d16x1024 g64/8 page16,"
                    "pod p2048 d16x1024 g32/8 page16")
    a = ap.parse_args(argv)
    import compiled_attn as ca
    from benchmarks import pod
    from benchmarks.providers import medians_us
    from dev import decode_probe as dp
    from dev.kernel_split_probe import kernel_times

    dev = torch.device("cuda")
    calls, notes = {}, []
    keep = []  # what each graph reads (wrappers, plans, inputs) stays alive while it replays

    def checked(name, fn):  # a graph of fn, its replays checked against eager, then timed
        try:
            replay = pod.checked_graph(fn, replays=4)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{name}: {type(e).__name__}: {str(e)[:150]}")
            return
        notes.append(f"{name}: 4 replays match eager; kernels "
                     + ", ".join(f"{k[:40]} {us:.1f}" for k, us, _n in kernel_times(replay, 30)))
        calls[name] = replay

    # the memset node alone: a one-element add, alone and behind a memset
    x1 = torch.zeros(1, device=dev)
    calls["add"] = pod._graph(lambda: x1.add_(1))
    calls["memset+add"] = pod._graph(lambda: (torch.zeros(1, dtype=torch.int32, device=dev),
                                              x1.add_(1))[1])
    for case in pod.pick(pod.case_list(), a.cases):
        x = pod.make_inputs(case, dev)
        for variant in ("memset", "slot"):
            with fresh_zeros() if variant == "memset" else contextlib.nullcontext():
                ours = pod._calls(ca, case, x, dev, False)
                keep.append(ours)
                for form in ("decode", "pod"):
                    checked(f"{case.name} | {form} | {variant}", ours[form])
    # the decode launch's fixed cost: 16 requests at several key lengths (page 16, GQA 32/8)
    for kv in () if a.no_sweep else (64, 256, 1024, 4096):
        case = (16, kv, 16, 32, 8)
        xin = dp._inputs(case, dev)
        for variant in ("memset", "slot"):
            with fresh_zeros() if variant == "memset" else contextlib.nullcontext():
                fn, _out, _info = dp._ours(case, xin, {})
                keep.append((fn, xin))
                checked(f"sweep 16x{kv} page16 | decode | {variant}", fn)
        src, dst = xin["src"], xin["dst"]
        calls[f"sweep 16x{kv} page16 | copy"] = pod._graph(lambda s=src, d=dst: d.copy_(s))
    res = medians_us(calls, rounds=a.rounds)
    print("\n".join(notes))
    print(f"\n{'call':64s} {'us':>8s}")
    for k, v in res.items():
        print(f"{k:64s} {v:8.1f}")


if __name__ == "__main__":
    main()
