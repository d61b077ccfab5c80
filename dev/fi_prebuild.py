"""Build FlashInfer's JIT modules that the pod suite uses, several at once, on the GPU machine.

FlashInfer compiles each kernel variant with nvcc on first use (POD about 230 s, BatchPOD 130 s,
the sm90 paged prefill 90 s: benchmarks/NOTES.md), one after the other when the suite meets them.
Here each variant gets a process of its own, which calls it once on tiny inputs with the suite's
settings (bf16, D 128, NHD, causal prefill), so the builds overlap and the suite then finds them
built. --pack DIR then writes every built module as DIR/fi_aot.txz.part.* (an xz tar of
aot/<module>/<module>.so in parts under 16 MiB), which dev/gpu_setup.sh unpacks into FlashInfer's
AOT folder on a later machine (carried as .ficache/), where the modules load without a build.

    python -m dev.fi_prebuild [--only pod,batch_pod,single,decode,paged] [--pack $OUT]
    python -m dev.fi_prebuild --only "" --pack $OUT    # pack what is built, build nothing

The FlashInfer wheel (62 MB) and the packed modules (37.9 MB for the pod suite's six, stripped) do
not travel together within the run tool's 64 MiB. On the CPU machine, --slim-wheel SRC DST rewrites
the wheel without the kernel sources of features the suites never build (31 MB; builds still work),
or with --no-sources without the headers too (18 MB; then only carried modules load). That wheel,
apache-tvm-ffi's (3.3 MB), the stripped modules and the repository travel together: 66.7 of the
67.1 MB on 2026-11-30 (carry [".whl", ".ficache"]).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

PARTS = ("pod", "batch_pod", "single", "decode", "paged")


def build(part: str) -> None:
    """Call FlashInfer's entry point behind ``part`` once, as benchmarks.pod calls it."""
    import flashinfer
    import torch

    dev, dt = torch.device("cuda"), torch.bfloat16
    hq, hkv, d, page, n = 32, 8, 128, 16, 4
    kw = dict(q_data_type=dt, kv_data_type=dt)

    def ws():
        return torch.empty(64 << 20, dtype=torch.uint8, device=dev)

    def rand(*shape):
        return torch.randn(*shape, dtype=dt, device=dev)

    cache = rand(4 * n, 2, page, hkv, d)
    indptr = torch.arange(0, 4 * n + 1, 4, dtype=torch.int32, device=dev)
    indices = torch.arange(4 * n, dtype=torch.int32, device=dev)
    last = torch.full((n,), page, dtype=torch.int32, device=dev)
    q_d = rand(n, hq, d)
    if part == "pod":
        w = flashinfer.PODWithPagedKVCacheWrapper(ws(), "NHD")
        w.plan(indptr, indices, last, hq, hkv, d, page, **kw)
        w.run(rand(64, hq, d), rand(64, hkv, d), rand(64, hkv, d), q_d, cache, causal_p=True)
    elif part == "single":
        flashinfer.single_prefill_with_kv_cache(rand(64, hq, d), rand(64, hkv, d),
                                                rand(64, hkv, d), causal=True)
    elif part == "decode":
        w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws(), "NHD")
        w.plan(indptr, indices, last, hq, hkv, d, page, **kw)
        w.run(q_d, cache)
    else:
        qo = torch.arange(0, 64 * n + 1, 64, dtype=torch.int32, device=dev)
        q_p = rand(64 * n, hq, d)
        if part == "paged":
            w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD")
            w.plan(qo, indptr, indices, last, hq, hkv, d, page, causal=True, **kw)
            w.run(q_p, cache)
        else:
            qo_d = torch.arange(n + 1, dtype=torch.int32, device=dev)
            w = flashinfer.BatchPODWithPagedKVCacheWrapper(ws(), "NHD")
            w.plan(qo, indptr, indices, last, qo_d, indptr, indices, last, hq, hkv, d, page,
                   **kw)
            w.run(q_p, cache, q_d, cache, causal_p=True)
    torch.cuda.synchronize()


def pack(out: str) -> None:
    """Write the modules built under FLASHINFER_WORKSPACE_BASE as out/fi_aot.txz.part.*, each
    stripped of its symbol tables where ``strip`` is installed (they load alike: the six of the
    pod suite then pack into 37.9 MB at xz -9e, not 38.7, which is what lets them travel with
    the no-sources wheel and the repository within 64 MiB)."""
    import glob
    import shutil
    import tempfile

    base = os.environ.get("FLASHINFER_WORKSPACE_BASE", os.path.expanduser("~"))
    with tempfile.TemporaryDirectory() as tmp:
        for so in glob.glob(f"{base}/.cache/flashinfer/*/*/cached_ops/*/*.so"):
            name = os.path.basename(os.path.dirname(so))
            if os.path.basename(so) == f"{name}.so":
                os.makedirs(f"{tmp}/aot/{name}")
                shutil.copy(so, f"{tmp}/aot/{name}/")
                if shutil.which("strip"):
                    subprocess.run(["strip", "--strip-unneeded", f"{tmp}/aot/{name}/{name}.so"],
                                   check=True)
                print(f"fi_prebuild: packing {name}", flush=True)
        subprocess.run(f"tar cf - -C {tmp} aot | xz -9e -T0 | split -b 15M - "
                       f"{out}/fi_aot.txz.part.", shell=True, check=True)


def slim_wheel(src: str, dst: str, no_sources: bool = False) -> None:
    """Write the wheel src as dst without flashinfer/data/csrc's feature folders, and with
    no_sources without the headers either (csrc's own files stay: FlashInfer renders their
    templates before it looks for a built module), RECORD to match."""
    import zipfile

    def drop(path: str) -> bool:
        if not path.startswith("flashinfer/data/"):
            return False
        if not path.startswith("flashinfer/data/csrc/"):  # headers: cutlass, cccl, include
            return no_sources
        rest = path[len("flashinfer/data/csrc/"):]
        return "/" in rest and not rest.startswith("generated/")

    with zipfile.ZipFile(src) as zin, \
            zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
        for info in zin.infolist():
            if drop(info.filename):
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                data = "".join(line + "\n" for line in data.decode().splitlines()
                               if not drop(line.split(",")[0])).encode()
            zout.writestr(info, data)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(PARTS), help="comma-separated parts to build")
    ap.add_argument("--pack", default=None, metavar="DIR", help="afterwards, write the built "
                    "modules as DIR/fi_aot.txz.part.*")
    ap.add_argument("--slim-wheel", nargs=2, metavar=("SRC", "DST"), default=None,
                    help="rewrite FlashInfer's wheel smaller (CPU machine) and exit")
    ap.add_argument("--no-sources", action="store_true", help="with --slim-wheel: drop every "
                    "kernel source (only carried modules will load)")
    ap.add_argument("--part", default=None, help=argparse.SUPPRESS)  # one child's work
    args = ap.parse_args(argv)
    if args.slim_wheel:
        slim_wheel(*args.slim_wheel, no_sources=args.no_sources)
        return 0
    if args.part:
        build(args.part)
        return 0
    t0 = time.time()
    procs = {p: subprocess.Popen([sys.executable, "-m", "dev.fi_prebuild", "--part", p])
             for p in filter(None, args.only.split(","))}
    bad = 0
    for p, proc in procs.items():
        rc = proc.wait()
        bad += rc != 0
        print(f"fi_prebuild: {p} rc={rc} after {time.time() - t0:.0f} s", flush=True)
    if args.pack:
        pack(args.pack)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
