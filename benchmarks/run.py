"""python -m benchmarks.run --suite fa3|flashinfer|paged|gqa|varlen|all|smoke [--quick]
[--out PATH] [--providers a,b,...] [--no-flashinfer] [--cases REGEX] [--precise]

Times compiled_attn's ops and the peers in this one process on the same inputs (docs/benchmarks.md).
Per case: make the inputs (rotated copies when they would fit in L2), compute the reference (SDPA),
then per provider: set up (plan / compile / JIT, untimed), run once and compare with the reference
(a provider whose output is wrong is recorded as failed, not timed). Then every checked provider
of the case's timing group (the case alone, or the cases whose ratios compare: paged vs ragged on
the same lengths, a varlen batch and its fixed-length companion) is timed interleaved: median of
per-call CUDA-event timings, taken in rounds over all of them, each slice after settling calls of
its own. The results file is rewritten after every group, so a run cut short keeps what it
measured; rows of suites not run now are kept from the existing file (--fresh drops them).

The results file is named after the device (benchmarks/results/h100.json on an H100, cpu.json
on the CPU). Without --out a run will not write into a file that another device's run wrote.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time
from pathlib import Path

from tqdm import tqdm

from . import results
from .cases import SUITES, cases_for
from .flops import tflops

L2_BYTES = 50 * 1024 * 1024
RESULTS_DIR = Path(__file__).resolve().parent / "results"
VENDOR_WORDS = {"nvidia", "geforce", "tesla", "amd", "radeon", "instinct"}


def device_slug(name: str) -> str:
    """The results file's stem for a device name: 'NVIDIA H100 80GB HBM3' -> 'h100',
    'NVIDIA A100-SXM4-80GB' -> 'a100', 'NVIDIA GeForce RTX 4090' -> 'rtx4090', 'cpu' -> 'cpu'
    (the first word with a digit, after the vendor's words)."""
    words = [w for w in re.split(r"[\s_-]+", name.lower()) if w and w not in VENDOR_WORDS]
    for i, w in enumerate(words):
        if any(ch.isdigit() for ch in w):
            return (words[i - 1] + w) if w.isdigit() and i > 0 else w
    return "-".join(words) or "device"


def results_path(out: str | None, gpu: str) -> tuple[Path | None, str | None]:
    """(path, None) where this run may write, or (None, why) when the default file for this
    device holds another device's rows: only an explicit --out replaces or extends those."""
    if out is not None:
        return Path(out), None
    path = RESULTS_DIR / f"{device_slug(gpu)}.json"
    if path.exists():
        try:
            theirs = results.load(path)["gpu"]
        except Exception as e:  # noqa: BLE001  (a file we cannot read is not ours to replace)
            theirs = f"unreadable ({_err(e)})"
        if theirs != gpu:
            return None, (f"{path} holds results from {theirs}, and this run is on {gpu}: pass "
                          f"--out PATH (another file, or {path} itself to merge into it)")
    return path, None


def build_parser() -> argparse.ArgumentParser:
    from .providers import ALL_PROVIDERS, DEFAULT_PROVIDERS

    p = argparse.ArgumentParser(prog="python -m benchmarks.run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="all",
                   help=f"comma-separated of {', '.join(SUITES)}; all (those five, the default); "
                        "or smoke (tiny cases that also run on --device cpu, for the tests)")
    p.add_argument("--quick", action="store_true", help="reduced grid (a couple of minutes)")
    p.add_argument("--cases", default=None, metavar="REGEX",
                   help="only the cases whose name matches (re.search, e.g. 'D128 S(4096|8192)'), "
                        "with the rest of their timing groups (a paged case's ragged twin, a "
                        "varlen case's fixed-length companion); the results file keeps the "
                        "suite's other cases from its earlier run")
    p.add_argument("--out", default=None,
                   help="results JSON (default benchmarks/results/<device>.json, e.g. h100.json; "
                        "a run refuses a default file written on another device or the CPU "
                        "unless --out names it)")
    p.add_argument("--fresh", action="store_true",
                   help="drop the existing file's rows of other suites instead of keeping them")
    p.add_argument("--providers", default=",".join(DEFAULT_PROVIDERS),
                   help=f"comma-separated subset of {', '.join(ALL_PROVIDERS)} "
                        f"(default: {', '.join(DEFAULT_PROVIDERS)})")
    p.add_argument("--no-flashinfer", action="store_true",
                   help="skip FlashInfer (its first call JIT-builds: fa2 ~25 s, fa3 ~100 s)")
    p.add_argument("--flashinfer-dims", default="all",
                   help="head dims FlashInfer is built and timed for (default all: every head "
                        "dim of the cases run, so every row carries its fa2 / fa3 ratio; each "
                        "dim is one JIT build per backend, e.g. --flashinfer-dims 128 to save "
                        "the fa3 suite's two extra builds)")
    p.add_argument("--flex-dynamic", action="store_true",
                   help="torch.compile flex_attention with dynamic=True (fewer recompiles, "
                        "possibly slower kernels); default static shapes")
    p.add_argument("--warmup-ms", type=float, default=100.0,
                   help="untimed settling calls before each timed slice (default 100)")
    p.add_argument("--rep-ms", type=float, default=300.0,
                   help="timed calls per provider and case, in ms of calls, spread over the "
                        "rounds (at least 20 calls; default 300)")
    p.add_argument("--rounds", type=int, default=3,
                   help="timing rounds: each times a slice of every provider's calls of a case "
                        "group, interleaved, after --warmup-ms of settling calls (default 3; "
                        "1 = one provider after another)")
    p.add_argument("--precise", action="store_true",
                   help="--rounds 9 --warmup-ms 300 --rep-ms 900 (about 5x the timing time): "
                        "with the defaults, two copies of our op (provider compiled_attn_twin) "
                        "read up to 10%% apart on the 20 ms FlashInfer-sweep rows on the H100, "
                        "with these within 1%% (benchmarks/NOTES.md, 2026-11-22)")
    p.add_argument("--tol", type=float, default=2e-2,
                   help="max relative error (Frobenius) against the reference before a "
                        "provider is recorded as failed and not timed (default 2e-2)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"],
                   help="dtype of q, k, v and the output (default bfloat16)")
    p.add_argument("--device", default=None, help="default cuda (cpu only for --suite smoke)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the random inputs; input copy c uses seed + c (default 0)")
    p.add_argument("--policy", action="append", default=[], metavar="NAME=VALUE",
                   help="time our provider under this launch-policy setting "
                   "(compiled_attn.ops.policy; repeatable, e.g. host_tma_min_flop=2e10); each row "
                   "records it; needs --out (a variant's rows stay out of the committed results)")
    p.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    p.add_argument("--flex-on-cpu", action="store_true", help=argparse.SUPPRESS)
    return p


def parse_args(argv=None) -> argparse.Namespace:
    from .providers import ALL_PROVIDERS

    p = build_parser()
    a = p.parse_args(argv)

    if a.suite == "all":
        a.suites = list(SUITES)
    else:
        a.suites = [s.strip() for s in a.suite.split(",") if s.strip()]
        bad = [s for s in a.suites if s not in SUITES + ("smoke",)]
        if bad:
            p.error(f"unknown suite(s) {bad}; choose from {', '.join(SUITES)}, all or smoke")
    if a.precise:
        if any(getattr(a, k) != p.get_default(k) for k in ("rounds", "warmup_ms", "rep_ms")):
            p.error("--precise sets --rounds 9 --warmup-ms 300 --rep-ms 900: pass either "
                    "--precise or those three")
        a.rounds, a.warmup_ms, a.rep_ms = 9, 300.0, 900.0
    if a.rounds < 1:
        p.error(f"--rounds must be >= 1, got {a.rounds}")
    a.provider_list = [s.strip() for s in a.providers.split(",") if s.strip()]
    bad = [s for s in a.provider_list if s not in ALL_PROVIDERS]
    if bad:
        p.error(f"unknown provider(s) {bad}; choose from {', '.join(ALL_PROVIDERS)}")
    if "compiled_attn" in a.provider_list:  # ours first: its row carries the ratios
        a.provider_list.remove("compiled_attn")
        a.provider_list.insert(0, "compiled_attn")
    try:  # None: every head dim
        a.flashinfer_dims = None if a.flashinfer_dims.strip() == "all" else {
            int(x) for x in a.flashinfer_dims.split(",") if x.strip()}
    except ValueError:
        p.error(f"--flashinfer-dims wants 'all' or comma-separated ints, got "
                f"{a.flashinfer_dims!r}")
    return a


def rel_err(out, ref) -> float:
    o, r = out.float(), ref.float()
    if o.shape != r.shape:
        raise ValueError(f"output shape {tuple(o.shape)} != reference {tuple(r.shape)}")
    num = (o - r).norm().item()
    den = r.norm().item()
    return num / den if den > 0 else num


def _err(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"[:500]


def prepare_provider(name: str, case, inps, ref, args, cuda: bool):
    """(row, runner): the provider set up and its output checked against the reference, ready to
    time; runner None when it is unavailable, failed, or gave a wrong output (then not timed)."""
    import torch

    from .providers import SETUPS, Unavailable

    row = {"suite": case.suite, "case": case.name, "provider": name, "median_ms": None,
           "tflops": None, "status": "ok", **case.row_fields()}
    t0 = time.perf_counter()
    try:
        runner = SETUPS[name](case, inps, args)
        row.update(runner.extra)
        if runner.note:
            row["note"] = runner.note
        with runner.context():
            out = runner.canon(runner.fns[0]())
            if cuda:
                torch.cuda.synchronize()
            row["setup_s"] = round(time.perf_counter() - t0, 2)
            err = rel_err(out, ref)
            row["rel_err"] = err
            del out
        if not math.isfinite(err) or err > args.tol:
            row["status"] = "failed"
            row["error"] = f"wrong output: rel_err {err:.3g} > tol {args.tol:g} (not timed)"
            return row, None
        return row, runner
    except Unavailable as e:
        row["status"] = "unavailable"
        row["error"] = str(e)
    except Exception as e:  # noqa: BLE001  (recorded in the row: a crash is a result too)
        _record_failure(row, e, cuda)
    return row, None


def _record_failure(row: dict, e: BaseException, cuda: bool) -> None:
    import torch

    row["status"] = "failed"
    row["error"] = _err(e)
    if cuda and isinstance(e, torch.cuda.OutOfMemoryError):
        torch.cuda.empty_cache()


def add_ratios(rows: list[dict]) -> None:
    """On compiled_attn's row of a case: ratio_vs_<provider> = our TFLOP/s / theirs."""
    ours = [r for r in rows if r["provider"] == "compiled_attn" and r["status"] == "ok"]
    for o in ours:
        for r in rows:
            if r is not o and r["status"] == "ok" and r["tflops"]:
                o[f"ratio_vs_{r['provider']}"] = o["tflops"] / r["tflops"]


def run_group(cases, args, device, dtype, progress: tqdm) -> list[tuple[object, list[dict]]]:
    """[(case, rows)] for cases of one timing group (Case.timing_group): every provider of every
    case set up and checked first, then all of them timed together, interleaved (providers.bench),
    so the ratios within a case and across the group (paged vs ragged, varlen vs fixed) come
    from the same stretch of the run."""
    import torch

    from .providers import bench, make_inputs, reference

    cuda = device.type == "cuda"
    out, ready, refs = [], [], {}  # ready: (case, row, runner) to time; refs: by case name
    for case in cases:
        inps = [make_inputs(case, device, dtype, seed=args.seed)]
        copies = 1
        if inps[0].nbytes() < L2_BYTES:  # would stay in L2 across calls: rotate fresh copies
            copies = min(32, math.ceil(3 * L2_BYTES / max(1, inps[0].nbytes())))
            inps += [make_inputs(case, device, dtype, seed=args.seed + c)
                     for c in range(1, copies)]
        ref = reference(case, inps[0])
        rows = []
        for name in args.provider_list:
            progress.set_postfix_str(f"{case.suite} {case.name}: {name}"[:60], refresh=False)
            progress.update(1)
            row, runner = prepare_provider(name, case, inps, ref, args, cuda)
            row["input_copies"] = copies
            rows.append(row)
            if runner is not None:
                ready.append((case, row, runner))
        out.append((case, rows))
        refs[case.name] = ref
        del inps  # the runners keep what they call
    timings = bench([(runner.fns, runner.context) for _, _, runner in ready], args.warmup_ms,
                    args.rep_ms, cuda, rounds=args.rounds)
    for (case, row, _), t in zip(ready, timings):
        if t.error is not None:
            _record_failure(row, t.error, cuda)
            continue
        record_timing(row, case.flops, t, len(ready))
        row["timing"] = (f"rounds {args.rounds}, settle {args.warmup_ms:g} ms, "
                         f"rep {args.rep_ms:g} ms")
    for case, row, runner in ready:  # still right after the timed calls (replays included)?
        if row["status"] == "ok":
            recheck(row, runner, refs[case.name], args.tol, cuda)
    for _, rows in out:
        add_ratios(rows)
    del ready, timings, refs
    if cuda:
        torch.cuda.empty_cache()
    return out


def recheck(row: dict, runner, ref, tol: float, cuda: bool) -> None:
    """A timed row's output once more against the reference, after its timed calls: a provider
    whose calls stopped computing while it was timed (a bound launch replayed without its
    kernel once did) times nothing, so its row fails, with the error it then had."""
    import torch

    try:
        with runner.context():
            after = rel_err(runner.canon(runner.fns[0]()), ref)
            if cuda:
                torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001  (recorded in the row)
        _record_failure(row, e, cuda)
        return
    row["rel_err_after"] = after
    if not math.isfinite(after) or after > tol:
        row["status"] = "failed"
        row["error"] = (f"wrong output after the timed calls: rel_err {after:.3g} > tol "
                        f"{tol:g} (before them: {row.get('rel_err', float('nan')):.3g})")
        row["timed_ms"] = row["median_ms"]  # (kept aside: not a time of the computation)
        row["median_ms"] = row["tflops"] = None


def record_timing(row: dict, flops: float, t, timed_with: int) -> None:
    """Fill a timed row from bench's Timing t (no error): median, TFLOP/s, calls, GPU state,
    how many runners were timed together, and (CUDA) the host time per call and cpu_bound."""
    row.update(t.state)
    row["median_ms"] = t.median_ms
    row["tflops"] = tflops(flops, t.median_ms)
    row["iters"] = t.iters
    row["timed_with"] = timed_with
    if t.host_ms is not None:
        row["host_ms"] = t.host_ms
        row["cpu_bound"] = t.host_ms >= results.CPU_BOUND * t.median_ms


def _groups(cases) -> list[list]:
    """Consecutive cases of one timing group together (the suites list a group's cases next to
    each other)."""
    out: list[list] = []
    for c in cases:
        if out and out[-1][0].timing_group == c.timing_group:
            out[-1].append(c)
        else:
            out.append([c])
    return out


def summary_line(case, rows) -> str:
    def fmt(r):
        if r["status"] == "ok":
            clock = f" @{r['sm_clock_mhz']}MHz" if r.get("sm_clock_mhz") else ""
            return f"{r['provider']} {r['tflops']:.0f}{clock}"
        return f"{r['provider']} {'n/a' if r['status'] == 'unavailable' else 'FAILED'}"
    return f"{case.suite:10s} {case.name:28s} TFLOP/s: " + " | ".join(fmt(r) for r in rows)


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = cases_for(args.suites, args.quick)
    if args.cases is not None:
        try:
            pat = re.compile(args.cases)
        except re.error as e:
            print(f"--cases: not a regular expression ({e}): {args.cases!r}", file=sys.stderr)
            return 2
        # Whole timing groups: a paged case's ragged twin and a varlen case's fixed-length
        # companion are timed with it, so the report's pairs come from one run.
        groups = {c.timing_group for c in cases if pat.search(c.name)}
        cases = [c for c in cases if c.timing_group in groups]
        if not cases:
            print(f"--cases {args.cases!r} matches no case of {', '.join(args.suites)} "
                  "(--list prints their names)", file=sys.stderr)
            return 2
    settings = results.policy_settings(args.policy)
    if settings and args.out is None:
        print("--policy needs --out: a variant's rows stay out of the committed results",
              file=sys.stderr)
        return 2
    if args.list:
        for c in cases:
            print(f"{c.suite:10s} {c.name:32s} {c.layout:6s} B={c.batch:<4d} Hq/Hkv="
                  f"{c.num_qo_heads}/{c.num_kv_heads} D={c.head_dim} causal={c.causal} "
                  f"tokens={c.tokens} GFLOP={c.flops / 1e9:.1f}")
        print(f"{len(cases)} cases x {len(args.provider_list)} providers "
              f"({', '.join(args.provider_list)})")
        return 0

    import torch

    device = torch.device(args.device or "cuda")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # torch 2.11's set_device needs an index
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: the benchmarks run on the GPU machine (docs/benchmarks.md); "
              "--list prints the cases here", file=sys.stderr)
        return 2
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    env = results.environment()
    kernel_src = results.kernel_fingerprint()
    out, refused = results_path(args.out, env["gpu"])
    if out is None:
        print(f"not written: {refused}", file=sys.stderr)
        return 2
    old_rows = []
    if out.exists() and not args.fresh:
        try:
            old_rows = results.load(out)["rows"]
        except Exception as e:  # noqa: BLE001
            print(f"note: {out} unreadable ({_err(e)}); starting it afresh", file=sys.stderr)
    print(f"{env['gpu']} torch {env['torch']} triton {env['triton']}: {len(cases)} cases, "
          f"providers {', '.join(args.provider_list)} -> {out}", flush=True)
    progress = tqdm(total=len(cases) * len(args.provider_list), unit="run", dynamic_ncols=True,
                    file=sys.stderr, mininterval=0.5 if sys.stderr.isatty() else 15.0,
                    smoothing=0.1)
    new_rows: list[dict] = []
    t0 = time.perf_counter()
    from compiled_attn.ops.policy import override

    recorded = results.policy_record(settings)
    try:
        with torch.no_grad(), override(**settings):  # (no_grad, not inference_mode: flex)
            for group in _groups(cases):
                for case, rows in run_group(group, args, device, dtype, progress):
                    for r in rows:  # a merged file keeps each suite's rows with their run's
                        r["run_date"] = env["date"]  # date and kernel source
                        r["kernel_src"] = kernel_src
                        if settings:
                            r["policy"] = recorded
                    new_rows += rows
                    progress.write(summary_line(case, rows), file=sys.stdout)
                ran = None if args.cases is None else [(c.suite, c.name) for c in cases]
                results.write(out, env, results.merge_rows(old_rows, new_rows, args.suites, ran))
    finally:
        progress.close()
    failed = [r for r in new_rows if r["status"] == "failed"]
    print(f"done in {time.perf_counter() - t0:.0f} s: {len(new_rows)} rows, "
          f"{len(failed)} failed -> {out}", flush=True)
    for r in failed:
        print(f"  FAILED {r['suite']} {r['case']} {r['provider']}: {r['error']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
