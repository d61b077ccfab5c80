"""Where a small decode batch's CUDA-graph replay spends its GPU time, kernel by kernel
(torch.profiler over graph replays): ours through BatchPrefillWithPagedKVCacheWrapper as the
launch policy has it and with its decode key chunks forced (decode_chunk_fill 1.0: the
chunked launch, merge; --no-chunked leaves it out), ours POD, FlashInfer's POD and BatchDecode
where it imports, and the pod suite's copy of the decode's K / V bytes (the decode rows'
ceiling: its kernel's time beside its replay's), on the pod suite's inputs of the cases named.

    python -m dev.kernel_split_probe [--only "pod p256 d16x1024 g32/8 page1,..."] [--replays 50]
        [--no-chunked]
"""

from __future__ import annotations

import argparse
import collections

import torch


def kernel_times(replay, replays: int) -> list:
    """[(kernel name, mean us per replay, launches per replay)] of ``replays`` calls of a CUDA
    graph's replay (torch.profiler; after 5 untimed), longest first."""
    for _ in range(5):
        replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            replay()
        torch.cuda.synchronize()
    tot, cnt = collections.defaultdict(float), collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            tot[e.name] += e.device_time
            cnt[e.name] += 1
    return sorted(((n[:70], t / replays, cnt[n] // replays) for n, t in tot.items()),
                  key=lambda r: -r[1])


def _kernels(fn, replays: int):
    """(us per replay, kernel_times) of fn's CUDA-graph replays."""
    from benchmarks.pod import capture

    g = capture(fn)
    rows = kernel_times(g.replay, replays)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(replays):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) * 1e3 / replays, rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="pod p256 d16x1024 g32/8 page1,pod p256 d16x1024 g32/8 page16")
    ap.add_argument("--replays", type=int, default=50)
    ap.add_argument("--no-chunked", action="store_true", help="without the forced-chunks form")
    a = ap.parse_args()
    import compiled_attn as ca
    from benchmarks import pod
    from compiled_attn.ops.policy import override

    dev = torch.device("cuda")
    try:
        import flashinfer
    except Exception:  # noqa: BLE001
        flashinfer = None
    for case in pod.pick(pod.case_list(), a.only):
        x = pod.make_inputs(case, dev)
        ours = pod._calls(ca, case, x, dev, False)
        forms = {"ours decode": ours["decode"], "ours pod": ours["pod"]}
        if not a.no_chunked:
            with override(decode_chunk_fill=1.0):
                chunked = pod._calls(ca, case, x, dev, False)["decode"]
                forms["ours decode, chunks fill 1.0"] = chunked
        # the decode rows' ceiling: a device copy of the decode's K / V bytes (read + write)
        forms["copy of the decode bytes"] = lambda: x["copy_dst"].copy_(x["copy_src"])
        if flashinfer is not None:
            fi = pod._calls(flashinfer, case, x, dev, True)
            forms["fi pod"], forms["fi decode"] = fi["pod"], fi["decode"]
        for name, fn in forms.items():
            try:
                if name.endswith("fill 1.0"):
                    with override(decode_chunk_fill=1.0):
                        wall, rows = _kernels(fn, a.replays)
                else:
                    wall, rows = _kernels(fn, a.replays)
            except Exception as e:  # noqa: BLE001
                print(f"{case.name} | {name}: {type(e).__name__}: {str(e)[:150]}")
                continue
            total = sum(t for _, t, _ in rows)
            print(f"{case.name} | {name}: replay {wall:.1f} us, kernels sum {total:.1f} us")
            for n, t, c in rows:
                print(f"    {t:7.1f} us  x{c}  {n}")


if __name__ == "__main__":
    main()
