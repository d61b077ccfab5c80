"""python -m benchmarks.floors [--suite ...]: the two lower bounds of each case's time on the H100
(benchmarks/NOTES.md): the FLOP floor at ~800 TFLOP/s dense bf16 (the practical tensor-core
rate; the datasheet's 989 is not reached by any attention kernel) and the byte floor at ~3 TB/s
(HBM3: q, k, v read once, out written once, bf16). Prints a markdown table."""

from __future__ import annotations

import argparse

from .cases import SUITES, cases_for

PEAK_FLOPS = 800e12
PEAK_BYTES = 3e12


def floors(case, elem_bytes: int = 2) -> dict:
    d = case.head_dim
    nbytes = elem_bytes * d * (2 * case.tokens * case.num_qo_heads
                               + 2 * case.kv_tokens * case.num_kv_heads)
    t_flop = case.flops / PEAK_FLOPS * 1e3
    t_byte = nbytes / PEAK_BYTES * 1e3
    return {"gflop": case.flops / 1e9, "mbytes": nbytes / 1e6, "flop_ms": t_flop,
            "byte_ms": t_byte, "bound": "FLOP" if t_flop >= t_byte else "bytes",
            "intensity": case.flops / nbytes}


def table(cases) -> str:
    out = ["| suite | case | GFLOP | MB moved | FLOP floor ms | byte floor ms | FLOP/byte |",
           "|---|---|---|---|---|---|---|"]
    for c in cases:
        f = floors(c)
        out.append(f"| {c.suite} | {c.name} | {f['gflop']:.0f} | {f['mbytes']:.0f} | "
                   f"{f['flop_ms']:.3f} | {f['byte_ms']:.3f} | {f['intensity']:.0f} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.floors", description=__doc__)
    ap.add_argument("--suite", default="all")
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args(argv)
    suites = list(SUITES) if a.suite == "all" else a.suite.split(",")
    print(table(cases_for(suites, a.quick)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
