"""POD's parts side by side on shares of the SMs (dev probe, GPU): how fast a decode batch reads
its K/V on fewer persistent programs (the Gluon kernel's grid capped, its K/V ring two to four
deep, 64- or 128-key slots), and the prefill and the capped decode launched at once on two
streams, beside the parts apart and POD's own launch. Two orders: "dec-first" launches the
decodes first on a high-priority stream (their programs take SMs of their own, one a SM where
the ring's shared memory leaves room for one), "pf-first" the prefill first (its tiles fill the
SMs; the decodes' programs, high priority, take each SM a prefill tile leaves). Each variant
timed as the eager call and as a CUDA-graph replay (captured with the cap in force), medians of
interleaved rounds in microseconds; the decode rows also in TB/s and GB/s a program.

    python -m dev.sm_share_probe [--rounds 3] [--only NAMES]   (NAMES: as benchmarks.pod --only)

With --launches: POD's call under each launch-fixing setting of the policy (fused, apart, side
by side: ops.policy.POD_FUSED / POD_APART / POD_SIDE) and under the policy's own choice, eager
and CUDA-graph replays, on LAUNCH_CASES (or --only); --out FILE.json keeps the rows, and
--plot FILE.json draws them (a PNG beside it; no GPU needed).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import statistics

import torch

from benchmarks import pod as suite
from dev.pod_order import _time

CASES = [suite.PodCase("pod", (8192,), 256, 4096, 32, 8, 16),
         suite.PodCase("pod", (8192,), 128, 4096, 32, 8, 16),
         suite.PodCase("pod", (2048,), 128, 4096, 32, 8, 16),
         suite.PodCase("pod", (8192,), 256, 4096, 64, 8, 16)]
# (persistent programs of the decode launch, K/V ring depth, keys a slot); None: the launch's
# own grid
DECODE_GRIDS = [(None, 2, 64), (132, 2, 64), (66, 2, 64), (96, 4, 64), (66, 4, 64), (44, 4, 64),
                (132, 3, 128), (66, 3, 128), (44, 3, 128)]
# (programs, ring depth, keys a slot, order)
CONCURRENT = [(96, 4, 64, "dec"), (66, 4, 64, "dec"), (88, 3, 128, "dec"), (88, 2, 64, "pf"),
              (120, 2, 64, "pf"), (176, 2, 64, "pf")]


# the pod suite's cases the policy runs side by side (132 SMs; GQA 64/8 p2048 + 128 x 1k before
# pod_side_min_prefill_bytes), then four it does not
LAUNCH_CASES = [suite.PodCase("pod", (8192,), n, kv, hq, 8, 16)
                for hq in (32, 64) for n, kv in ((16, 32768), (128, 1024), (128, 4096),
                                                 (256, 1024), (256, 4096))] + [
    suite.PodCase("pod", (2048,), 128, 1024, 64, 8, 16),
    suite.PodCase("pod", (4096,), 128, 4096, 32, 8, 16),
    suite.PodCase("pod", (2048,), 128, 4096, 32, 8, 16),
    suite.PodCase("pod", (8192,), 16, 4096, 32, 8, 16),
    suite.PodCase("pod", (8192,), 128, 32768, 32, 8, 16)]


def launches(cases, rounds: int, out: str | None = None, shares=(), swap: bool = False) -> None:
    """POD under each launch-fixing setting and the policy's choice (--launches); rows kept
    in ``out`` (JSON) after every case. shares: side by side again with the decodes' grid
    capped at each of these shares of the SMs (POLICY.pod_side_sms) instead of the policy's."""
    import triton

    from compiled_attn.ops.policy import POD_APART, POD_FUSED, POD_SIDE, override

    # (side by side with the decodes on the 64-row tile's four-deep ring, not the swapped
    # products: POLICY.decode_swap off)
    settings = {"fused": POD_FUSED, "apart": POD_APART, "side": POD_SIDE,
                "side no swap": {**POD_SIDE, "decode_swap": False}, "policy": {},
                **{f"side {f:g}": {**POD_SIDE, "pod_side_sms": f} for f in shares}}
    if swap:  # the fused launch with its decodes on the swapped products (pod_decode_swap)
        settings.update({"fused swap": {**POD_FUSED, "pod_decode_swap": True},
                         "policy swap": {"pod_decode_swap": True}})
    rows = []
    for case in cases:
        x = calls = graphs = None  # (the last case's inputs and graphs freed first)
        suite._free()
        x = suite.make_inputs(case, torch.device("cuda"))
        calls = _calls(case, x)
        graphs, eager = {}, {}
        for name, fixed in settings.items():
            with override(**fixed):  # (eager calls keyed by the policy's version: timed here)
                graphs[name] = suite._graph(calls["pod"])
                eager[name] = statistics.median(_time(calls["pod"], 10) for _ in range(rounds))
        times = {k: [] for k in graphs}
        for _ in range(rounds):
            for k, r in graphs.items():
                times[k].append(_time(r, 10))
        graph = {k: statistics.median(v) for k, v in times.items()}
        choice = suite.launch_plan(case)["launch"]
        print(f"{case.name} (policy: {choice})", flush=True)
        for mode, med in (("graph", graph), ("eager", eager)):
            best = min(med["fused"], med["apart"])
            print(f"  {mode:5} " + "  ".join(f"{k} {v:8.1f}" for k, v in med.items())
                  + f"  side over the better of fused / apart {best / med['side']:5.3f}x"
                  + (f"; fused swap over fused {med['fused'] / med['fused swap']:5.3f}x, over "
                     f"the better {best / med['fused swap']:5.3f}x" if swap else ""),
                  flush=True)
            rows += [dict(case=case.name, policy_launch=choice, setting=k, mode=mode, us=v)
                     for k, v in med.items()]
        if out:
            with open(out, "w") as f:
                json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                               triton=triton.__version__,
                               date=datetime.datetime.now(datetime.timezone.utc).isoformat(
                                   timespec="seconds"), rows=rows), f, indent=1)


def plot(path: str) -> str:
    """Bars of side by side's speed over the better of the fused launch and apart (graph and
    eager) per case of a --launches JSON, the policy's choice under each case; returns the
    PNG's path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.load(open(path))
    rows = doc["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    us = {(r["case"], r["setting"], r["mode"]): r["us"] for r in rows}
    choice = {r["case"]: r["policy_launch"] for r in rows}
    fig, ax = plt.subplots(figsize=(12, 4.8))
    # side by side at half the SMs, eager and graph; with --side-shares, each share and the
    # policy's own choice too (graph)
    shares = sorted({r["setting"] for r in rows if r["setting"].startswith("side ")
                     and r["setting"] != "side no swap"})
    series = [("side", "graph"), ("side", "eager")]
    if shares:
        series += [(k, "graph") for k in (*shares, "policy")]
    w = 0.8 / len(series)
    for j, (setting, mode) in enumerate(series):
        ys = [min(us[c, "fused", mode], us[c, "apart", mode]) / us[c, setting, mode]
              for c in cases]
        name = "side by side" if setting == "side" else setting
        ax.bar([i + j * w for i in range(len(cases))], ys, w, label=f"{name}, {mode}")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylim(0.6, 1.25)
    ax.set_ylabel("speed over the better of\nfused and apart")
    ax.set_xticks([i + w * (len(series) - 1) / 2 for i in range(len(cases))])
    ax.set_xticklabels(["\n".join(c.split()[1:4]) + f"\n({choice[c]})" for c in cases],
                       fontsize=7)
    pages = ", ".join(sorted({c.split()[-1].replace("page", "page ") for c in cases}))
    ax.set_title(f"POD's parts side by side, {pages} ({doc['gpu']}, torch {doc['torch']}, "
                 f"triton {doc['triton']}, {doc['date'][:10]}; policy's choice in brackets)",
                 fontsize=9)
    ax.legend(fontsize=7)
    out = str(path).rsplit(".", 1)[0] + ".png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    return out


@contextlib.contextmanager
def decode_grid(programs, stages, block_n=64):
    """The Gluon launches' persistent grids capped at ``programs`` (launch.programs_cap, as
    POD's parts side by side cap them; None: the launch's own grid) and the 64-row D 128 tile
    ``stages`` deep in slots of block_n keys (TILES replaced; the cap's own ring depth,
    POLICY.pod_side_stages, off), for calls made and captured inside."""
    from compiled_attn.ops import launch, policy
    from compiled_attn.ops import prefill_gluon as g

    saved_tile = g.TILES[64, 128]
    g.TILES[64, 128] = saved_tile._replace(stages=stages, block_n=block_n)
    try:
        with policy.override(pod_side_stages=0), launch.programs_cap(programs or 0):
            yield
    finally:
        g.TILES[64, 128] = saved_tile
        policy.touch()


def _calls(case, x):
    return suite._calls(__import__("compiled_attn"), case, x, torch.device("cuda"), fi=False)


def _side_by_side(pre, dec, order: str, hi: torch.cuda.Stream, lo: torch.cuda.Stream):
    """The prefill on stream lo and the decodes on hi, forked from and joined to the current
    stream; order "dec" launches the decodes first, "pf" the prefill."""
    def call():
        cur = torch.cuda.current_stream()
        hi.wait_stream(cur)
        lo.wait_stream(cur)
        out = {}
        for part in (("d", "p") if order == "dec" else ("p", "d")):
            with torch.cuda.stream(hi if part == "d" else lo):
                out[part] = dec() if part == "d" else pre()
        cur.wait_stream(hi)
        cur.wait_stream(lo)
        return out["p"], out["d"]
    return call


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--only", default=None)
    ap.add_argument("--launches", action="store_true")
    ap.add_argument("--out", default=None, help="--launches: the rows as JSON")
    ap.add_argument("--plot", default=None, help="plot this --launches JSON and exit")
    ap.add_argument("--side-shares", default="", help="--launches: comma-separated shares of "
                    "the SMs for the decodes side by side, each a setting of its own")
    ap.add_argument("--decode-swap", action="store_true", help="--launches: also the fused "
                    "launch (and the policy's choice) with the decodes' items on the swapped "
                    "products (POLICY.pod_decode_swap)")
    args = ap.parse_args(argv)
    if args.plot:
        print(plot(args.plot))
        return None
    if args.launches:
        return launches(LAUNCH_CASES if args.only is None
                        else suite.pick(suite.case_list(), args.only), args.rounds, args.out,
                        [float(f) for f in args.side_shares.split(",") if f],
                        args.decode_swap)
    cases = CASES if args.only is None else suite.pick(suite.case_list(), args.only)
    hi = torch.cuda.Stream(priority=-1)
    lo = torch.cuda.Stream(priority=0)
    for case in cases:
        x = suite.make_inputs(case, torch.device("cuda"))
        calls = _calls(case, x)
        keep = [calls]  # the wrappers (their plans' device tensors) the graphs read
        eager, graph = {}, {}
        for k in ("prefill", "apart", "pod"):
            eager[k], graph[k] = calls[k], suite._graph(calls[k])
        ref = calls["decode"]().clone()
        for p, st, bn in DECODE_GRIDS:
            with decode_grid(p, st, bn):
                c = _calls(case, x)
                keep.append(c)
                graph[f"dec {p or 'own'} x{st} n{bn}"] = suite._graph(c["decode"])
        timed = {}
        for p, st, bn, order in CONCURRENT:
            name = f"{order}-first {p} x{st} n{bn}"
            with decode_grid(p, st, bn):  # (eager calls keyed by the policy's version: timed here)
                c = _calls(case, x)
                keep.append(c)
                fn = _side_by_side(c["prefill"], c["decode"], order, hi, lo)
                diff = (fn()[1].float() - ref.float()).abs().max().item()
                if not diff <= 1e-3:  # (slots of 128 keys sum in another order)
                    raise RuntimeError(f"{name}: decodes differ from their own launch by {diff}")
                graph[name] = suite._graph(fn)
                timed[name + " eager"] = statistics.median(_time(fn, 10)
                                                           for _ in range(args.rounds))
        times = {k: [] for k in [*graph, *eager]}
        for _ in range(args.rounds):
            for k, r in graph.items():
                times[k].append(_time(r, 10))
            for k, r in eager.items():
                times[k + " eager"] = times.get(k + " eager", []) + [_time(r, 10)]
        med = {k: statistics.median(v) for k, v in times.items() if v}
        med.update(timed)
        pre, dec = med["prefill"], med["dec own x2 n64"]
        bound = max(pre, dec) + 0.25 * min(pre, dec)
        print(f"{case.name}: bound {bound:.1f} (graph: prefill {pre:.1f}, decode {dec:.1f})",
              flush=True)
        gb = case.decode_bytes() / 1e9
        for k, v in med.items():
            if k.startswith("dec "):
                programs = 264 if k.split()[1] == "own" else int(k.split()[1])
                rate = gb / (v * 1e-6)  # GB/s
                extra = f"{rate / 1e3:5.2f} TB/s, {rate / programs:5.1f} GB/s a program"
            else:
                base = med["apart eager" if k.endswith("eager") else "apart"]
                pod = med["pod eager" if k.endswith("eager") else "pod"]
                extra = f"{v / bound:6.3f} of bound, {base / v:5.3f}x apart, {pod / v:5.3f}x pod"
            print(f"  {k:28} {v:9.1f}  {extra}", flush=True)


if __name__ == "__main__":
    main()
