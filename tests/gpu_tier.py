"""Runs the GPU tier (``pytest -m gpu``) as several pytest processes at once on the device
machine, so one device call covers it: most of the tier's time is Triton and Gluon compiling
kernels on the host's CPUs, which one process does one at a time. The collected test ids are
dealt round-robin to SHARDS processes (each its own CUDA context on the one GPU; Triton's cache
is shared and written atomically); each shard's log goes to $OUT (or the current folder), and a
table of passed / failed / error counts per shard is printed last. Exit status 0 only when every
shard passed. Tests marked ``gpu_solo`` (they need most of the GPU's memory) run after the
shards, in one process of their own. Tests never time anything, so sharing the GPU changes no
result.

    python3 tests/gpu_tier.py [--shards 8] [pytest selection args, default: tests]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time


def _collect(selection: list[str], marks: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "--collect-only", "-m", marks, *selection],
        capture_output=True, text=True, check=False)
    return [line.strip() for line in out.stdout.splitlines() if "::" in line]


def _counts(log: str) -> dict[str, int]:
    tail = log.strip().splitlines()[-1] if log.strip() else ""
    found = re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed)", tail)
    return {k: int(n) for n, k in found}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("selection", nargs="*", default=["tests"])
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", ".")
    ids = _collect(args.selection, "gpu and not gpu_solo")
    solo = _collect(args.selection, "gpu and gpu_solo")
    if not ids and not solo:
        raise SystemExit(f"gpu_tier: nothing collected from {args.selection}")
    shards = [ids[i::args.shards] for i in range(args.shards) if ids[i::args.shards]]
    print(f"gpu_tier: {len(ids)} tests in {len(shards)} shards, then {len(solo)} alone",
          flush=True)
    t0 = time.time()

    def start(i, shard):
        log = open(os.path.join(out_dir, f"gpu_tier_{i}.log"), "w")
        return (subprocess.Popen(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu", *shard],
            stdout=log, stderr=subprocess.STDOUT), log, len(shard))

    procs = [start(i, shard) for i, shard in enumerate(shards)]
    if solo:  # tests that need the GPU's memory to themselves (gpu_solo): after the shards
        for p, _, _ in procs:
            p.wait()
        procs.append(start(len(shards), solo))
    ok = True
    print(f"{'shard':>5} {'tests':>5} {'rc':>3}  counts")
    for i, (p, log, n) in enumerate(procs):
        rc = p.wait()
        log.close()
        text = open(log.name).read()
        counts = _counts(text)
        ok &= rc == 0 and counts.get("passed", 0) + counts.get("xfailed", 0) + counts.get(
            "skipped", 0) == n
        print(f"{i:>5} {n:>5} {rc:>3}  {counts}")
        if rc != 0:
            print("\n".join(line for line in text.splitlines()
                            if line.startswith(("FAILED", "ERROR")))[:4000])
    print(f"gpu_tier: {'all passed' if ok else 'FAILURES'} in {time.time() - t0:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
