"""What a plan's small copies cost on the GPU host, each kind timed alone (benchmarks/NOTES.md,
2026-12-01 03-04 UTC): device-to-host reads one by one and gathered in one copy, host-to-device
writes from int32 and int64 host tensors, one buffer written from a Python list or from slices,
device clones and views. Host microseconds a call, medians of 5 rounds.

    python -m dev.copy_probe
"""

from __future__ import annotations

import statistics
import time

import torch


def _us(fn, calls: int = 2000) -> float:
    for _ in range(50):
        fn()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    torch.cuda.synchronize()
    return statistics.median(rounds)


def cases() -> dict:
    """{what: zero-argument call}: the copies a plan of four requests makes."""
    dev = torch.device("cuda")
    a, b, c, d = (torch.arange(n, dtype=torch.int32, device=dev) for n in (5, 17, 4, 5))
    l5, l64 = list(range(5)), list(range(64))
    h32 = torch.tensor(l64, dtype=torch.int32)
    h64 = torch.tensor(l64)

    def buffer_from_list():
        g = torch.tensor(l64 * 6, dtype=torch.int32).to(dev, non_blocking=True)
        return [g[i * 64:(i + 1) * 64] for i in range(6)]

    def buffer_from_slices():
        buf = torch.empty(384, dtype=torch.int32)
        for i in range(6):
            buf[i * 64:(i + 1) * 64].copy_(h64)
        g = buf.to(dev, non_blocking=True)
        return [g[i * 64:(i + 1) * 64] for i in range(6)]

    return {
        "d2h int32[5]": lambda: a.to("cpu"),
        "d2h int32[5] to int64": lambda: a.to("cpu", torch.int64),
        "d2h 4 arrays one by one": lambda: [x.to("cpu", torch.int64) for x in (a, b, c, d)],
        "d2h 4 arrays, one cat and copy": lambda: torch.cat((a, b, c, d)).to("cpu"),
        "h2d tensor(list of 5)": lambda: torch.tensor(l5, dtype=torch.int32).to(
            dev, non_blocking=True),
        "h2d int32[64]": lambda: h32.to(dev, non_blocking=True),
        "h2d int64[64] to int32": lambda: h64.to(dev, torch.int32, non_blocking=True),
        "h2d int32[64] blocking": lambda: h32.to(dev),
        "h2d 6 x int32[64]": lambda: [h32.to(dev, non_blocking=True) for _ in range(6)],
        "h2d 6 x 64 as one list-built buffer": buffer_from_list,
        "h2d 6 x 64 as one buffer of slices": buffer_from_slices,
        "device clone int32[17]": lambda: b.clone(),
        "torch.tensor(list of 64)": lambda: torch.tensor(l64, dtype=torch.int32),
        "6 views of a device tensor": lambda: [b[i:i + 2] for i in range(6)],
    }


def main() -> None:
    for what, fn in cases().items():
        print(f"{what:40s} {_us(fn):7.2f} us")


if __name__ == "__main__":
    main()
