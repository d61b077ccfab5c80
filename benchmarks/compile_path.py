"""Our ops called eagerly and inside torch.compile, timed side by side in one process.

Four providers per case, the same inputs:
- ``eager``: the op called directly (the Gluon kernel on a Hopper GPU where its scope allows).
- ``compiled``: the same call inside ``torch.compile(fullgraph=True, dynamic=False)`` as
  shipped: compiled_attn.ops.dispatch keeps a call the Gluon kernel would take as one opaque
  op node, which Inductor runs through the eager launcher.
- ``compiled_triton``: the same, traced with ``POLICY.graph_gluon = False``: the op
  decomposed into the Triton kernel that Inductor inlines (what every compiled graph ran
  before 2026-11-23, and what AOTInductor packages).
- ``compiled_cudagraphs``: ``compiled`` under ``mode="reduce-overhead"`` (CUDA graphs replay
  the opaque call's launch; the inputs marked static, so no copy per call): the kernel without
  the host's cost.

Each compiled provider's generated code is checked (an opaque op call in ``compiled`` where
eager_gluon admits the call, none in ``compiled_triton``), ``compiled`` must equal ``eager``
bit for bit where it calls the op (the same launch), and every output is compared with the
eager one. Timing: benchmarks.providers.bench (interleaved slices, CUDA-event medians, host
time per call). Cases: the FlashInfer Hopper sweep (ragged, H 32/32, D128 causal), page 16 on
its S 4k lengths, and dense FA3-sweep rows (D128 causal S 4k / 16k, non-causal 4k, D64 causal
4k). Writes benchmarks/results/compile_path_<gpu>.json and prints a table.

Run on the GPU machine from the repository root: ``python3 -m benchmarks.compile_path``
(about 4 minutes: three Inductor compiles per case).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
import types
from pathlib import Path

import torch
from compiled_attn.ops.policy import POLICY

PROVIDERS = ("eager", "compiled", "compiled_triton", "compiled_cudagraphs")


def select_cases(quick: bool):
    from benchmarks import cases as C

    out = list(C.flashinfer_cases(quick))
    out += [c for c in C.paged_cases(quick) if c.layout == "paged" and c.page_size == 16
            and c.seq_len == 4096]
    wanted = {"D128 S4096 causal", "D128 S16384 causal", "D128 S4096", "D64 S4096 causal"}
    out += [c for c in C.fa3_cases(False) if c.name in wanted]
    return out


def _fresh(fn, name: str):
    """fn under its own code object: Dynamo caches compiled code per code object, so the two
    compiled providers of one case must not share one."""
    return types.FunctionType(fn.__code__.replace(co_name=name), fn.__globals__, name,
                              fn.__defaults__, fn.__closure__)


@contextlib.contextmanager
def caches_off():
    """Inductor's FX graph cache and AOTAutograd's cache off: every compile inside traces and
    runs the passes (the rewrite's counters count, graph_gluon's setting takes effect), where a
    warm cache from an earlier process would serve an earlier compile's graph."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield


def _compile(fn, tensors, graph_gluon: bool, mode: str | None = None):
    """torch.compile fn (mode as given) with graph_gluon as given while it traces (caches off,
    so nothing traced under the other setting is reused); returns (compiled fn, its output,
    code)."""
    from unittest import mock

    from torch._inductor.graph import GraphLowering

    compiled = torch.compile(fn, fullgraph=True, dynamic=False, mode=mode)
    saved = POLICY.graph_gluon
    POLICY.graph_gluon = graph_gluon
    code: list[str] = []
    # Inductor's output code, captured as run_and_get_code does but without its
    # torch._dynamo.reset(): that would drop the providers compiled before this one, which
    # would then re-trace while timed, under the shipped graph_gluon rather than theirs
    try:
        with caches_off(), mock.patch.object(GraphLowering, "save_output_code", code.append):
            out = compiled(*tensors)
    finally:
        POLICY.graph_gluon = saved
    return compiled, out, "\n".join(code)


def _gluon_launches(fn) -> int:
    """How many Gluon kernel launches one call of fn makes."""
    from compiled_attn.ops import prefill_kernel as pk

    if pk._gluon is None:
        return 0
    real, count = pk._gluon.launch, [0]

    def counted(*a, **kw):
        count[0] += 1
        return real(*a, **kw)

    pk._gluon.launch = counted
    try:
        fn()
        torch.cuda.synchronize()
    finally:
        pk._gluon.launch = real
    return count[0]


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def run_case(case, args) -> list[dict]:
    from benchmarks import providers as P

    from compiled_attn.ops import dispatch

    torch._dynamo.reset()
    inp = P.make_inputs(case, "cuda", torch.bfloat16)
    name, tensors, full, _ = P.op_call(case, inp)
    op = getattr(torch.ops.compiled_attn, name)

    def call(*ts):
        return op(*full(*ts))

    opaque_expected = dispatch.eager_gluon(name, full(*tensors))
    eager_fn = lambda: call(*tensors)  # noqa: E731
    eager_out = eager_fn()[0].clone()
    fns = {"eager": eager_fn}
    info = {"eager": dict(gluon_launches=_gluon_launches(eager_fn))}
    for prov, gg, mode in (("compiled", True, None), ("compiled_triton", False, None),
                           ("compiled_cudagraphs", True, "reduce-overhead")):
        ts = tensors
        if mode == "reduce-overhead":
            # CUDA graphs replay from these tensors (copies marked static: no copy into static
            # inputs per call, and the other providers' guards never see the mark)
            ts = [t.clone() for t in tensors]
            for t in ts:
                torch._dynamo.mark_static_address(t)
        t0 = time.perf_counter()
        compiled, out, code = _compile(_fresh(call, prov), ts, gg, mode)
        opaque = f"torch.ops.compiled_attn.{name}.default(" in code
        fn = (lambda c=compiled, ts=ts: c(*ts))
        # Gluon launches made from Python: under CUDA graphs those of the warm-up and the
        # capture (replays launch nothing from Python)
        launches = sum(_gluon_launches(fn) for _ in range(3 if mode else 1))
        out = fn()  # a replay under CUDA graphs
        info[prov] = dict(compile_s=round(time.perf_counter() - t0, 1), opaque_op=opaque,
                          gluon_launches=launches, rel_err_vs_eager=rel_err(out[0], eager_out))
        if opaque != (gg and opaque_expected):
            raise RuntimeError(f"{case.name} {prov}: opaque op call {opaque}, expected "
                               f"{gg and opaque_expected}")
        if opaque and not torch.equal(out[0], eager_out):
            raise RuntimeError(f"{case.name} {prov}: the opaque call differs from eager")
        fns[prov] = fn
    timings = P.bench([([fns[p]], lambda: torch.no_grad()) for p in PROVIDERS],
                      args.warmup_ms, args.rep_ms, cuda=True, rounds=args.rounds)
    # what each compiled provider launches after its timing (a re-trace would change it)
    for prov in ("compiled", "compiled_triton"):
        if _gluon_launches(fns[prov]) != info[prov]["gluon_launches"]:
            raise RuntimeError(f"{case.name} {prov}: launches changed while timed (re-traced)")
    rows = []
    for prov, t in zip(PROVIDERS, timings):
        if t.error is not None:
            raise t.error
        rows.append({"suite": "compile_path", "case": f"{case.suite} {case.name}",
                     "provider": prov, "op": name, "median_ms": t.median_ms,
                     "tflops": case.flops / (t.median_ms * 1e-3) / 1e12,
                     "host_ms": t.host_ms, "iters": t.iters, **case.row_fields(),
                     **info[prov], "status": "ok"})
    by = {r["provider"]: r for r in rows}
    for r in rows:
        r["ratio_vs_eager"] = by["eager"]["median_ms"] / r["median_ms"]
        r["ratio_vs_compiled_triton"] = by["compiled_triton"]["median_ms"] / r["median_ms"]
    return rows


def plot(doc: dict, path: Path) -> Path:
    """A bar chart of TFLOP/s per case, one bar per provider, beside the JSON."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys(r["case"] for r in doc["rows"]))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(cases)), 4.2))
    width = 0.8 / len(PROVIDERS)
    for j, prov in enumerate(PROVIDERS):
        tf = {r["case"]: r["tflops"] for r in doc["rows"] if r["provider"] == prov}
        ax.bar([i + (j - (len(PROVIDERS) - 1) / 2) * width for i in range(len(cases))],
               [tf.get(c, 0) for c in cases], width, label=prov)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([c.replace(" ", "\n") for c in cases], fontsize=7)
    ax.set_ylabel("TFLOP/s")
    ax.set_title(f"compiled_attn ops eager vs torch.compile ({doc['gpu']}, torch {doc['torch']}, "
                 f"triton {doc['triton']})", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="the two-case FlashInfer sweep")
    ap.add_argument("--cases", default=None, help="regex over '<suite> <case name>'")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup-ms", type=float, default=100)
    ap.add_argument("--rep-ms", type=float, default=300)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None, metavar="JSON",
                    help="only plot this results file (PNG beside it), no run")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(json.loads(Path(args.plot).read_text()), Path(args.plot).with_suffix(".png")))
        return 0
    if not torch.cuda.is_available():
        print("compile_path: needs a CUDA GPU", file=sys.stderr)
        return 2
    import re

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.results import environment, kernel_fingerprint

    cases = select_cases(args.quick)
    if args.cases:
        cases = [c for c in cases if re.search(args.cases, f"{c.suite} {c.name}")]
    rows = []
    with torch.no_grad():
        for case in cases:
            rows += run_case(case, args)
            by = {r["provider"]: r for r in rows[-len(PROVIDERS):]}
            print(f"{case.suite:10s} {case.name:20s} " + "  ".join(
                f"{p} {by[p]['tflops']:6.1f}" for p in PROVIDERS)
                + f"  compiled/triton {by['compiled']['ratio_vs_compiled_triton']:.3f}"
                + f"  compiled/eager {by['compiled']['ratio_vs_eager']:.3f}"
                + f"  cudagraphs/eager {by['compiled_cudagraphs']['ratio_vs_eager']:.3f}",
                flush=True)
    env = environment()
    src = kernel_fingerprint()
    for r in rows:
        r["kernel_src"] = src
    gpu = "h100" if "H100" in env["gpu"] else env["gpu"].replace(" ", "_").lower()
    out = Path(args.out) if args.out else (
        Path(__file__).resolve().parent / "results" / f"compile_path_{gpu}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**env, "rows": rows}, indent=1) + "\n")
    plot({**env, "rows": rows}, out.with_suffix(".png"))
    print(f"compile_path ({env['gpu']}, torch {env['torch']}, triton {env['triton']}): "
          f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
