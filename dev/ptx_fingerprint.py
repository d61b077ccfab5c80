"""PTX fingerprints of the kernels (dev tool): compiles the Triton kernel family in its main
launch configurations and the Gluon kernel (its POD launch too) in a few tiles for sm_90,
offline (no GPU: ptxas of the installed Triton), and prints one hash per configuration with
debug info, comments and labels canonicalised. A refactor of the kernels' sources that must
not change the compiled code keeps every hash.

    .venv/bin/python -m dev.ptx_fingerprint [--only NAME,...] [--dump DIR]

The hashes depend on the installed Triton: compare before and after under one version. To
check a refactor under the GPU machines' Triton as well (3.6, where the project's venv has
3.9), a second environment works, on CPU too:

    python3 -m venv /tmp/t36 && /tmp/t36/bin/pip install torch==2.13.0 triton==3.6.0 pytest
    PYTHONPATH=. /tmp/t36/bin/python -m dev.ptx_fingerprint

The launches and compiles are tests/sm90.py's: the Triton launches the op launchers' own
(prefill_kernel.launch_*) on CPU tensors, recorded instead of run and compiled with the JIT's
specialization of their arguments; the Gluon kernel as prefill_gluon.launch would set it up.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import sys

import torch

from compiled_attn.ops import choose
from compiled_attn.ops import contracts as C
from tests import sm90


TRITON = {
    "single dense": (sm90.single_launch, {}),
    "single persistent": (sm90.single_launch, {"device_of": lambda device: choose.H100}),
    "ragged": (sm90.ragged_launch, {}),
    "ragged split+merge": (lambda: sm90.ragged_launch(True), {}),
    "ragged split row-max skip": (
        lambda: sm90.ragged_launch(True, row_max=True, skip_softmax=2.0), {}),
    # every logit transform and mask option the kernel has, on one launch
    "ragged custom mask alibi cap window sinks": (
        lambda: sm90.ragged_launch(packed_mask=True, mask_mode=C.MASK_CUSTOM,
                                   pos_encoding_mode=C.POS_ALIBI, logits_soft_cap=30.0,
                                   window_left=16, sinks=torch.zeros(2)), {}),
    "ragged rope chunk": (lambda: sm90.ragged_launch(pos_encoding_mode=C.POS_ROPE_LLAMA,
                                                     chunk_size=16), {}),
    "ragged D128 128-row": (lambda: sm90.ragged_launch(d=128, block_m=128), {}),
    "paged page 16": (lambda: sm90.paged_launch(16, 128), {}),
    "paged page 1 D128": (lambda: sm90.paged_launch(1, 128, 128), {}),
    "pod": (sm90.pod_launch, {}),
}

# (dense, page, block_m, d, causal, ws, pingpong, short): sm90.gluon_source
GLUON = {
    "gluon ragged 64-row ws": (False, 0, 64, 128, True, True, False, False),
    "gluon dense 128-row pingpong": (True, 0, 128, 128, True, True, True, False),
    "gluon ragged 128-row single group": (False, 0, 128, 128, True, False, False, False),
    "gluon paged boxes page 16 pingpong": (False, 16, 128, 128, True, True, True, False),
    "gluon paged boxes page 8 ws": (False, 8, 64, 128, True, True, False, False),
    "gluon paged gather page 1 pingpong": (False, 1, 128, 128, True, True, True, False),
    "gluon paged gather page 2 short": (False, 2, 128, 128, True, True, True, True),
    "gluon paged page 64 no ws": (False, 64, 64, 128, True, False, False, False),
    "gluon dense D64 ws": (True, 0, 64, 64, False, True, False, False),
    # (a ninth entry: gluon_source's keywords, a tile named by its prefill_gluon attribute)
    "gluon paged boxes page 16 swap": (False, 16, 64, 128, False, True, False, False,
                                       {"tile": "SWAP_TILE"}),
    "gluon paged gather page 1 swap": (False, 1, 64, 128, True, True, False, False,
                                       {"tile": "SWAP_TILE"}),
}
# (page_p, page_d, causal, group, d, block_m): sm90.gluon_pod_source (both POD tiles)
GLUON_POD = {
    "gluon pod one-page prefill 128-row": (0, 16, True, 4, 128, 128),
    "gluon pod paged prefill 128-row": (16, 16, False, 4, 128, 128),
    "gluon pod one-page prefill 64-row": (0, 16, True, 4, 128, 64),
    "gluon pod paged prefill page 8 64-row": (16, 8, True, 4, 128, 64),
}
# (the same, and PodConfig.SWAP_D: the decodes' items on the swapped products)
GLUON_POD_SWAP = {
    "gluon pod one-page prefill 64-row swapped decodes": (0, 16, True, 4, 128, 64),
    "gluon pod paged prefill page 8 64-row swapped decodes": (16, 8, True, 4, 128, 64),
}


def _compile_gluon(case, pod=False, swap_d=False):
    import triton

    if pod:
        src, opts = sm90.gluon_pod_source(*case[:3], group=case[3], d=case[4], block_m=case[5],
                                          swap_d=swap_d)
    else:
        from compiled_attn.ops import prefill_gluon

        kw = dict(case[8]) if len(case) > 8 else {}
        if "tile" in kw:
            kw["tile"] = getattr(prefill_gluon, kw["tile"])
        src, opts, _ = sm90.gluon_source(*case[:8], **kw)
    return triton.compile(src, target=sm90.target(), options=opts).asm["ptx"]


def canonical(ptx: str) -> str:
    """PTX without debug info, comments, blank lines and labels nothing branches to, the other
    labels renumbered in order of first appearance (the function names of inlined helpers and
    source lines vanish with .loc). Idempotent: a --dump file hashes as its source did."""
    ptx = re.sub(r"\.section\s+\.debug\w*\s*\{.*?\n\s*\}", "", ptx, flags=re.S)
    lines = []
    for line in ptx.splitlines():
        line = line.split("//")[0].rstrip()
        s = line.strip()
        if not s or s.startswith((".loc", ".file")):
            continue
        lines.append(line)
    text = "\n".join(lines)
    # labels nothing branches to (debug-info anchors, whose section is gone) say nothing
    used = re.findall(r"\$L\w+", "\n".join(x for x in lines if not re.match(r"\s*\$L\w+:$", x)))
    text = "\n".join(x for x in lines
                     if not (re.match(r"\s*\$L\w+:$", x) and x.strip()[:-1] not in used))
    names: dict = {}
    return re.sub(r"\$L\w+", lambda m: names.setdefault(m.group(0), f"$L{len(names)}"), text)


def fingerprint(ptx: str) -> str:
    return hashlib.sha256(canonical(ptx).encode()).hexdigest()[:16]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated configuration names")
    ap.add_argument("--dump", default="", help="a folder to write each canonical PTX to")
    ap.add_argument("--rehash", default="", help="only print the hashes of a --dump folder's files")
    a = ap.parse_args(argv)
    only = {s.strip() for s in a.only.split(",") if s.strip()}
    if a.rehash:
        for fname in sorted(os.listdir(a.rehash)):
            with open(os.path.join(a.rehash, fname)) as f:
                print(f"{fingerprint(f.read())}  {fname}")
        return
    import triton

    from compiled_attn.ops import prefill_gluon

    # the kernels compiled are the imported package's: an editable install imports its own
    # tree whatever the working directory (a second worktree compiles the first one's source)
    src = os.path.dirname(os.path.abspath(prefill_gluon.__file__))
    print(f"# triton {triton.__version__}, torch {torch.__version__}, target {sm90.TARGET}, "
          f"kernels from {src}")
    if not os.path.abspath(os.getcwd()).startswith(os.path.dirname(src)):
        print(f"# note: the working directory {os.getcwd()} is not the compiled tree's",
              file=sys.stderr)
    results = []
    for name, (launch, patches) in TRITON.items():
        if only and name not in only:
            continue
        for fn, args, kw in sm90.record(launch, patches):
            ptx = sm90.compile_triton(fn, args, kw).asm["ptx"]
            results.append((f"{name} [{fn.fn.__name__}]", ptx))
            print(f"{fingerprint(results[-1][1])}  {results[-1][0]}", flush=True)
    for name, case, pod, swap in ([(n, c, False, False) for n, c in GLUON.items()]
                                  + [(n, c, True, False) for n, c in GLUON_POD.items()]
                                  + [(n, c, True, True) for n, c in GLUON_POD_SWAP.items()]):
        if only and name not in only:
            continue
        results.append((name, _compile_gluon(case, pod, swap)))
        print(f"{fingerprint(results[-1][1])}  {name}", flush=True)
    if a.dump:
        os.makedirs(a.dump, exist_ok=True)
        for name, ptx in results:
            fname = re.sub(r"[^\w]+", "_", name).strip("_") + ".ptx"
            with open(os.path.join(a.dump, fname), "w") as f:
                f.write(canonical(ptx))


if __name__ == "__main__":
    sys.exit(main())
