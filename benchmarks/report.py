"""python -m benchmarks.report benchmarks/results/h100.json: the performance ratios, printed and
written as markdown to <stem>_ratios.md beside the JSON.

1. ours over each peer, per case (same run: our TFLOP/s / the peer's);
2. paged over our ragged on the same lengths (page 16, page 1), FlashInfer fa3's beside it;
3. variable-length batches over our fixed-length rate at the same total tokens;
4. the performance targets with the worst measured ratio and how many rows pass.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from . import results

PEERS = ("flex", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient", "flashinfer_fa2",
         "flashinfer_fa3", "flashinfer_single_fa2", "flashinfer_single_fa3", "compiled_attn_twin")
OURS = "compiled_attn"


def _index(rows):
    return {(r["suite"], r["case"], r["provider"]): r for r in rows}


def _ok(r) -> bool:
    return r is not None and r.get("status", "ok") == "ok" and bool(r.get("tflops"))


def _f(x, nd=2) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


def _ratio(a, b):
    """a's TFLOP/s over b's when both ran and were timed in the same run (rows of one run share
    its run_date; a file merged from several runs may hold a case's providers from different
    ones, e.g. after `run --providers`), else None."""
    if not (_ok(a) and _ok(b)) or a.get("run_date") != b.get("run_date"):
        return None
    return a["tflops"] / b["tflops"]


def peer_ratios(rows):
    """[(suite, case, ours_row, {peer: ratio or None})] for every case with an ours row; a peer
    that does not run the case (status "unavailable", e.g. FlashInfer at D 64) is left out."""
    idx = _index(rows)
    out = []
    for r in rows:
        if r["provider"] != OURS:
            continue
        rat = {}
        for p in PEERS:
            pr = idx.get((r["suite"], r["case"], p))
            if pr is None or pr.get("status") == "unavailable":
                continue
            rat[p] = _ratio(r, pr)
        out.append((r["suite"], r["case"], r, rat))
    return out


def paged_ratios(rows):
    """[(group_key, page, ours paged/ragged, fa3 paged/ragged)]: the ragged row of the paged
    row's own timing group (same suite and group_key = same lengths, timed interleaved with it
    in the same run); None where that row did not run."""
    def ragged(provider, g, suite):
        return next((r for r in rows if r["suite"] == suite and r["provider"] == provider
                     and r.get("layout") == "ragged" and r.get("group_key") == g), None)

    out = []
    for r in rows:
        if r["provider"] != OURS or r.get("layout") != "paged":
            continue
        g = r.get("group_key", r["case"])
        ours = _ratio(r, ragged(OURS, g, r["suite"]))
        fr = next((x for x in rows if x["suite"] == r["suite"] and x["case"] == r["case"]
                   and x["provider"] == "flashinfer_fa3"), None)
        fa3 = _ratio(fr, ragged("flashinfer_fa3", g, r["suite"]))
        out.append((g, r.get("page_size"), ours, fa3))
    return out


def varlen_ratios(rows):
    """[(case, ours TFLOP/s, fixed case, its TFLOP/s, ratio)]."""
    idx = _index(rows)
    out = []
    for r in rows:
        if r["provider"] != OURS or not r.get("fixed_case"):
            continue
        fx = idx.get((r["suite"], r["fixed_case"], OURS))
        ratio = _ratio(r, fx)
        out.append((r["case"], r.get("tflops"), r["fixed_case"], fx.get("tflops") if fx else None,
                    ratio))
    return out


def targets(rows):
    """[(target text, threshold, [ratios, None where a side did not run])]."""
    pr = peer_ratios(rows)

    def sel(pred, peer):
        return [rat.get(peer) for suite, case, r, rat in pr
                if suite in ("fa3", "flashinfer") and pred(r) and peer in rat]

    big = lambda r: r.get("S", 0) >= 4096  # noqa: E731
    d128c = lambda r: r.get("D") == 128 and r.get("causal") and big(r)  # noqa: E731
    d128n = lambda r: r.get("D") == 128 and not r.get("causal") and big(r)  # noqa: E731
    d64_256 = lambda r: r.get("D") in (64, 256) and big(r)  # noqa: E731
    pg = paged_ratios(rows)
    return [
        ("D128 causal S>=4k: ours / FlexAttention >= 1.1", 1.1, sel(d128c, "flex")),
        ("D128 causal S>=4k: ours / SDPA flash >= 1.4", 1.4, sel(d128c, "sdpa_flash")),
        ("D128 non-causal S>=4k: ours / FlexAttention >= 1.0", 1.0, sel(d128n, "flex")),
        ("D64, D256 S>=4k: ours / SDPA flash >= 1.2", 1.2, sel(d64_256, "sdpa_flash")),
        ("paged page 16 / our ragged >= 0.95", 0.95, [o for g, p, o, _ in pg if p == 16]),
        ("paged page 1 / our ragged >= 0.9", 0.9, [o for g, p, o, _ in pg if p == 1]),
        ("varlen / our fixed-length >= 1.0", 1.0, [x[-1] for x in varlen_ratios(rows)]),
        ("goal: ours / SDPA cuDNN >= 1.0 (rows it runs)", 1.0,
         [rat.get("sdpa_cudnn") for *_, rat in pr if "sdpa_cudnn" in rat]),
        ("goal: ours / FlashInfer fa2 >= 1.0 (rows it runs)", 1.0,
         [rat.get("flashinfer_fa2") for *_, rat in pr if "flashinfer_fa2" in rat]),
        ("goal: ours / FlashInfer fa3 >= 1.0 (rows it runs)", 1.0,
         [rat.get("flashinfer_fa3") for *_, rat in pr if "flashinfer_fa3" in rat]),
    ]


def kernel_marks(rows, kernel_src: str) -> tuple[dict, str]:
    """{id(our row): mark} for our timed rows not timed on kernel_src ("*": another kernel
    source, "?": no fingerprint recorded) and the sentence that explains the marks."""
    ours = [r for r in rows if r["provider"] == OURS and _ok(r)]
    marks = {id(r): ("?" if r.get("kernel_src") is None else "*") for r in ours
             if r.get("kernel_src") != kernel_src}
    other = sum(m == "*" for m in marks.values())
    text = (f"Kernel source (results.kernel_fingerprint of ops/): this "
            f"checkout's is `{kernel_src}`. Of our {len(ours)} timed rows, "
            f"{len(ours) - len(marks)} were timed on it, {other} on another source (`*` below) "
            f"and {len(marks) - other} before rows recorded theirs (`?` below): a marked row "
            "may not be what this checkout runs.")
    return marks, text


def render(doc: dict, kernel_src: str | None = None) -> str:
    """The report's markdown. kernel_src: the fingerprint our rows are checked against (default:
    this checkout's)."""
    rows = doc["rows"]
    if kernel_src is None:
        kernel_src = results.kernel_fingerprint()
    marks, marks_text = kernel_marks(rows, kernel_src)
    L = [f"# Ratios: {doc['gpu']}, torch {doc['torch']}, triton {doc['triton']}, {doc['date']}",
         "", "Generated by `python -m benchmarks.report`; ratio = compiled_attn's TFLOP/s over "
         "the other's, same run. `-`: one side did not run (see the JSON row's error), or the "
         "two were timed in different runs. Goal rows count the rows where the peer runs the "
         "case.", ""]
    runs: dict[str, list[str]] = {}
    for r in rows:
        if r.get("run_date") and r["suite"] not in runs.setdefault(r["run_date"], []):
            runs[r["run_date"]].append(r["suite"])
    if len(runs) > 1:
        split = sorted({x for v in runs.values() for x in v
                        if sum(x in w for w in runs.values()) > 1})
        L += ["Suites from more than one run: " + "; ".join(
            f"{', '.join(v)} at {k}" for k, v in sorted(runs.items())) + "."
            + (f" {', '.join(split)}: re-timed in part (`run --cases`); each JSON row's "
               "run_date says which run it is from." if split else ""), ""]

    L += [marks_text, ""]
    L += ["## Performance targets", "", "| target | rows | worst | pass |", "|---|---|---|---|"]
    for text, thr, vals in targets(rows):
        got = [v for v in vals if v is not None]
        npass = sum(v >= thr for v in got)
        worst = min(got) if got else None
        L.append(f"| {text} | {len(vals)} ({len(vals) - len(got)} missing) | {_f(worst)} | "
                 f"{npass}/{len(vals)} |")

    pr = peer_ratios(rows)
    twin = [rat["compiled_attn_twin"] for *_, rat in pr if rat.get("compiled_attn_twin")]
    if twin:
        L += ["", f"A/A control (compiled_attn over compiled_attn_twin, the same op timed as a "
              f"peer): {len(twin)} rows, {_f(min(twin), 3)} to {_f(max(twin), 3)}. A ratio to "
              "a peer closer to its target than this spread is not resolved by this run."]
    peers = [p for p in PEERS if any(p in rat for *_, rat in pr)]
    L += ["", "## compiled_attn over each peer", "",
          "`(cpu)`: issuing one of our calls took about as long as the call (host_ms >= "
          f"{results.CPU_BOUND} x median_ms): the GPU waited on the host, and the row times our "
          "launch path rather than the kernel.", "",
          "| suite | case | ours TFLOP/s | " + " | ".join(peers) + " |",
          "|---|---|---|" + "---|" * len(peers)]
    for suite, case, r, rat in pr:
        ours = _f(r.get("tflops"), 0) if _ok(r) else r.get("status", "?").upper()
        if _ok(r) and r.get("cpu_bound"):
            ours += " (cpu)"
        if id(r) in marks:
            ours += f" {marks[id(r)]}"
        L.append(f"| {suite} | {case} | {ours} | "
                 + " | ".join(_f(rat.get(p)) for p in peers) + " |")

    pg = paged_ratios(rows)
    if pg:
        L += ["", "## Paged over ragged (same lengths)", "",
              "| lengths | page | ours paged / ours ragged | FlashInfer fa3 paged / its ragged |",
              "|---|---|---|---|"]
        # three places: a ratio of 0.899 is not the 0.9 target
        L += [f"| {g} | {p} | {_f(o, 3)} | {_f(f, 3)} |" for g, p, o, f in pg]

    vr = varlen_ratios(rows)
    if vr:
        L += ["", "## Variable lengths over our fixed-length rate (same total tokens)", "",
              "| case | ours TFLOP/s | fixed-length case | its TFLOP/s | ratio |",
              "|---|---|---|---|---|"]
        L += [f"| {c} | {_f(t, 0)} | {fc} | {_f(ft, 0)} | {_f(x)} |" for c, t, fc, ft, x in vr]

    bad = [r for r in rows if r.get("status") == "failed"]
    if bad:
        L += ["", "## Failed rows", ""]
        L += [f"- {r['suite']} / {r['case']} / {r['provider']}: {r.get('error', '')}" for r in bad]
    return "\n".join(L) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.report", description=__doc__)
    ap.add_argument("json", help="results file, e.g. benchmarks/results/h100.json")
    ap.add_argument("--md", default=None, help="markdown output (default <stem>_ratios.md)")
    a = ap.parse_args(argv)
    src = Path(a.json)
    text = render(results.load(src))
    md = Path(a.md) if a.md else src.with_name(f"{src.stem}_ratios.md")
    md.write_text(text)
    print(text)
    print(f"(written to {md})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
