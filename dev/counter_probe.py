"""What the persistent launch's zeroed work counter costs a CUDA-graph replay (dev probe, GPU).

A persistent Gluon launch leaves its work counter 0, so a CUDA graph capturing it takes a
slot zeroed once (launch.counter(resets=True)). This probe times replays of small decode
batches and POD calls (the pod suite's inputs) captured that way ("slot") and with a fresh
zeroed counter per launch as before ("memset": the graph holds a memset before the kernel),
each replay checked against the eager call after three replays; a sweep of
key lengths at 16 requests gives the decode launch's fixed cost (time = fixed + bytes / rate),
with the kernel's own time from torch.profiler; a one-element add alone and behind a
memset gives the node's cost on its own.

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


def _tensors(out):
    if isinstance(out, torch.Tensor):
        return [out]
    res = []
    for o in out:
        res += _tensors(o) if o is not None else []
    return res


def graph_of(fn):
    """(replay, check): a CUDA graph of one call of fn, and a check that one replay rewrites
    the captured outputs (poisoned first) with the eager call's values."""
    from benchmarks.pod import capture

    g = torch.cuda.CUDAGraph()
    holder = {}

    def call():
        holder["out"] = fn()
        return holder["out"]
    capture(call, graph=g)
    outs = _tensors(holder["out"])

    def check():
        ref = [t.clone() for t in _tensors(fn())]
        for _ in range(3):
            g.replay()
        for t in outs:
            t.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        return max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs, ref))
    return g.replay, check


def kernel_us(replay, n: int = 30) -> list:
    """[(kernel name, us per replay)] of n replays (torch.profiler)."""
    import collections

    for _ in range(3):
        replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            replay()
        torch.cuda.synchronize()
    tot = collections.defaultdict(float)
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name[:40]] += e.device_time / n
    return sorted(tot.items(), key=lambda kv: -kv[1])


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

    dev = torch.device("cuda")
    calls, notes = {}, []
    keep = []  # what each graph reads (wrappers, plans, inputs) stays alive while it replays
    # the memset node alone: a one-element add, alone and behind a memset
    x1 = torch.zeros(1, device=dev)
    calls["add"] = graph_of(lambda: x1.add_(1))[0]
    calls["memset+add"] = graph_of(lambda: (torch.zeros(1, dtype=torch.int32, device=dev),
                                            x1.add_(1))[1])[0]
    for case in pod.pick(pod.case_list(), a.cases):
        x = pod.make_inputs(case, dev)
        for variant in ("memset", "slot"):
            ctx = fresh_zeros() if variant == "memset" else contextlib.nullcontext()
            with ctx:
                ours = pod._calls(ca, case, x, dev, False)
                keep.append(ours)
                for form in ("decode", "pod"):
                    name = f"{case.name} | {form} | {variant}"
                    try:
                        replay, check = graph_of(ours[form])
                        err = check()
                    except Exception as e:  # noqa: BLE001
                        notes.append(f"{name}: {type(e).__name__}: {str(e)[:150]}")
                        continue
                    ok = err == err and err < 0.05
                    notes.append(f"{name}: replay vs eager max abs {err:.4f} "
                                 f"({'ok' if ok else 'WRONG'}); kernels "
                                 + ", ".join(f"{k} {v:.1f}" for k, v in kernel_us(replay)))
                    if ok:
                        calls[name] = replay
    # the decode launch's fixed cost: 16 requests at several key lengths (page 16, GQA 32/8)
    sweep = {}
    for kv in () if a.no_sweep else (64, 256, 1024, 4096):
        case = (16, kv, 16, 32, 8)
        xin = dp._inputs(case, dev)
        for variant in ("memset", "slot"):
            ctx = fresh_zeros() if variant == "memset" else contextlib.nullcontext()
            with ctx:
                fn, _out, _info = dp._ours(case, xin, {})
                keep.append((fn, xin))
                name = f"sweep 16x{kv} page16 | decode | {variant}"
                replay, check = graph_of(fn)
                err = check()
                ks = kernel_us(replay)
                notes.append(f"{name}: replay vs eager {err:.4f}; kernels "
                             + ", ".join(f"{k} {v:.1f}" for k, v in ks))
                calls[name] = replay
                sweep[name] = (xin["nbytes"], ks)
        src, dst = xin["src"], xin["dst"]
        calls[f"sweep 16x{kv} page16 | copy"] = graph_of(lambda s=src, d=dst: d.copy_(s))[0]
    res = medians_us(calls, rounds=a.rounds)
    print("\n".join(notes))
    print(f"\n{'call':64s} {'us':>8s}")
    for k, v in res.items():
        print(f"{k:64s} {v:8.1f}")


if __name__ == "__main__":
    main()
