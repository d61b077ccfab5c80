"""POD's work-list order (dev probe, GPU): the pod suite's cases through
PODWithPagedKVCacheWrapper with compiled_attn.pod._pod_work replaced by each order below (the
prefill's rows first, the default; the decodes' first; the parts interleaved in proportion),
beside the two parts as two launches (apart), timed as CUDA graph replays, interleaved rounds,
medians in microseconds.

    python -m dev.pod_order [--rounds 5] [--only NAMES]   (NAMES: as benchmarks.pod --only)
"""

from __future__ import annotations

import argparse
import statistics

import torch

import compiled_attn
from benchmarks import pod as suite
from compiled_attn import pod as pod_mod
from compiled_attn.ops.policy import POD_APART, POD_FUSED

CASES = [suite.PodCase("pod", (2048,), 128, 4096, 32, 8, 16),
         suite.PodCase("pod", (8192,), 16, 1024, 32, 8, 16),
         suite.PodCase("pod", (256,), 128, 32768, 32, 8, 16),
         suite.PodCase("pod", (1024,), 64, 2048, 32, 8, 16)]


def _concat(first_decode: bool):
    def order(prefill, decode):
        part_p = torch.zeros_like(prefill[:, :1])
        part_d = torch.ones_like(decode[:, :1])
        rows = [torch.cat([part_p, prefill], 1), torch.cat([part_d, decode], 1)]
        return torch.cat(rows[::-1] if first_decode else rows, 0)
    return order


def _interleave(prefill, decode):
    """Row i of a part of n rows at (i + 1/2) / n, prefill first on ties."""
    rows = _concat(False)(prefill, decode)
    at = torch.cat([(torch.arange(prefill.shape[0], device=rows.device) + 0.5) / prefill.shape[0],
                    (torch.arange(decode.shape[0], device=rows.device) + 0.5) / decode.shape[0]])
    return rows[torch.argsort(at, stable=True)]


ORDERS = {"prefill_first": pod_mod._pod_work, "decode_first": _concat(True),
          "interleave": _interleave}


def _replay(case, x, order, **policy):
    """A CUDA graph of the case's POD call with work order ``order``, captured under the
    launch policy's ``policy`` settings."""
    from compiled_attn.ops.policy import override

    pod_mod._pod_work = order
    try:
        w = compiled_attn.PODWithPagedKVCacheWrapper(
            torch.empty(1, device="cuda"), "NHD")
        di, dx, dl = x["dec"]
        w.plan(di, dx, dl, case.hq, case.hkv, suite.D, case.page, q_data_type=torch.bfloat16)
        fn = lambda: w.run(x["q_p"], x["k_p"], x["v_p"], x["q_d"], x["cache"],  # noqa: E731
                           causal_p=True)
        with override(**policy):
            return suite._graph(fn)
    finally:
        pod_mod._pod_work = ORDERS["prefill_first"]


def _time(replay, n=20):
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    s.record()
    for _ in range(n):
        replay()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) * 1e3 / n


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (median kept)")
    ap.add_argument("--only", default=None, help="the pod suite's cases to run instead "
                    "(benchmarks.pod --only's comma-separated names)")
    args = ap.parse_args(argv)
    cases = CASES if args.only is None else suite.pick(suite.case_list(), args.only)
    names = [*ORDERS, "apart"]
    print(f"{'case':40} " + " ".join(f"{k:>14}" for k in names), flush=True)
    for case in cases:
        x = suite.make_inputs(case, torch.device("cuda"))
        replays = {k: _replay(case, x, o, **POD_FUSED) for k, o in ORDERS.items()}
        replays["apart"] = _replay(case, x, ORDERS["prefill_first"], **POD_APART)
        times = {k: [] for k in names}
        for _ in range(args.rounds):
            for k, r in replays.items():
                times[k].append(_time(r))
        print(f"{case.name:40} " + " ".join(f"{statistics.median(times[k]):14.1f}"
                                            for k in names), flush=True)


if __name__ == "__main__":
    main()
