"""POD's fused launch against its parts apart, over mixes beside the pod suite's grid (dev
probe, GPU).

choose.pod_apart decides between one fused launch and two launches by the balance of the
decodes' bytes against the prefill's FLOPs. The suite's grid has few points near a balance;
this probe times any mix named as the suite names its cases ("pod pP dBxKV gHQ/HKV pageN",
"batch_pod pP1+P2+... dBxKV gHQ/HKV pageN"), through the suite's own inputs and wrappers
(benchmarks.pod), three ways: ``policy`` (the launch policy as is; its choice printed),
``fused`` (POD_FUSED) and ``apart`` (POD_APART); each as CUDA graph replays (``g``, interleaved
rounds) and eager calls (``e``, a block of rounds a setting: an override keys calls apart, so
eager calls under alternating settings would each record anew); medians in microseconds.
``p / d`` is the prefill counted as bytes (choose's pod_flop_per_byte) over the decodes'
bytes. The three outputs are checked against each other (max abs difference printed).

Each timing is 20 calls back to back: bursts, where the suite times 150 ms of calls a runner
after its clock settles. The two can disagree on a fused launch against its parts (on
2026-11-30 one mix read fused 298 / apart 305 us here, 336 / 324 in the suite on the same
machine: benchmarks/NOTES.md); the suite is the judge, this probe the map.

    python -m dev.pod_balance_probe [--rounds 5]
        --only "batch_pod p2048+1024+512+512 d16x4096 g64/8 page1,..."
"""

from __future__ import annotations

import argparse
import re
import statistics

import torch

import compiled_attn
from benchmarks import pod as suite
from compiled_attn.ops.policy import POD_APART, POD_FUSED, POLICY, override
from dev.pod_order import _time


def parse(name: str) -> suite.PodCase:
    m = re.fullmatch(r"(pod|batch_pod) p([\d+]+) d(\d+)x(\d+) g(\d+)/(\d+) page(\d+)",
                     name.strip())
    if m is None:
        raise SystemExit(f"not a case name: {name!r}")
    kind, pre, *rest = m.groups()
    d, kv, hq, hkv, page = map(int, rest)
    return suite.PodCase(kind, tuple(int(n) for n in pre.split("+")), d, kv, hq, hkv, page)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", required=True, help="comma-separated case names")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    names = ["policy g", "fused g", "apart g", "policy e", "fused e", "apart e"]
    print(f"{'case':52} {'p / d':>6} {'choice':>7} " + " ".join(f"{k:>9}" for k in names)
          + "  diff", flush=True)
    for case in (parse(n) for n in args.only.split(",")):
        x = suite.make_inputs(case, dev)
        choice = suite.launch_choice(case)
        settings = {"policy": {}, "fused": POD_FUSED, "apart": POD_APART}
        calls, outs = {}, {}
        for k, s in settings.items():
            pod = suite._calls(compiled_attn, case, x, dev, False)["pod"]
            with override(**s):
                outs[k] = [t.clone() for t in suite._tensors(pod())]
                calls[f"{k} g"] = suite._graph(pod)
            calls[f"{k} e"] = pod
        diff = max(float((a.float() - b.float()).abs().max())
                   for k in ("fused", "apart") for a, b in zip(outs["policy"], outs[k]))
        times = {k: [] for k in names}
        for _ in range(args.rounds):
            for k in settings:
                times[f"{k} g"].append(_time(calls[f"{k} g"]))
        for k, s in settings.items():  # (a setting's override keys calls apart: one block each)
            with override(**s):
                pod = calls[f"{k} e"]
                for _ in range(3):
                    pod()
                times[f"{k} e"] = [_time(pod) for _ in range(args.rounds)]
        share = case.flops("prefill") / POLICY.pod_flop_per_byte / case.decode_bytes()
        print(f"{case.name:52} {share:6.2f} {choice:>7} "
              + " ".join(f"{statistics.median(times[k]):9.1f}" for k in names)
              + f"  {diff:.1e}", flush=True)
        del x, calls, outs
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
