"""POD's launch against its parts on their own tiles (dev probe, GPU): the pod suite's cases
through PODWithPagedKVCacheWrapper fused on the plan's tile (choose.pod_tile), as two
launches (pod_apart), the parts alone (the decodes through BatchPrefillWithPagedKVCacheWrapper,
which tiles decode rows by 64), and with --fused64 the fused launch forced onto the 64-row tile
(the POD plan's tile and choose.pod_gluon's height check replaced; how the 64-row POD was
first timed, while plans took 128-row tiles; run it in a process of its own). CUDA graph
replays timed by benchmarks.providers.bench (interleaved rounds, medians in microseconds); diff:
max abs difference of each call's outputs from the parts alone.

    python -m dev.pod_tile_probe [--cases 0,1] [--fused64] [--rounds 5]
"""

from __future__ import annotations

import argparse
import contextlib

import torch

from benchmarks import pod as suite
from compiled_attn.ops.policy import POD_APART, POD_FUSED
from benchmarks.providers import medians_us
from tests.kernel_cases import capture_graph

CASES = [suite.PodCase("pod", (2048,), 128, 4096, 32, 8, 16),
         suite.PodCase("pod", (256,), 128, 32768, 32, 8, 16),
         suite.PodCase("pod", (2048,), 128, 4096, 64, 8, 16),
         suite.PodCase("pod", (8192,), 16, 1024, 32, 8, 16),
         suite.PodCase("pod", (1024,), 64, 2048, 32, 8, 16),
         suite.PodCase("pod", (8192,), 128, 4096, 32, 8, 16)]


@contextlib.contextmanager
def _fused64():
    from compiled_attn import pod
    from compiled_attn.ops import choose, policy

    saved_bm, saved_pg = pod.block_m_for, choose.pod_gluon

    def pod_gluon(*args, **kw):
        args = list(args)
        ok = args[11] == 64
        args[11] = 128
        return ok and saved_pg(*args, **kw)

    try:
        pod.block_m_for = lambda *a, **k: 64
        choose.pod_gluon = pod_gluon
        policy.touch()
        yield
    finally:
        pod.block_m_for, choose.pod_gluon = saved_bm, saved_pg
        policy.touch()


def main(argv=None) -> None:
    import compiled_attn as ca
    from compiled_attn.ops.policy import override

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default=None)
    ap.add_argument("--fused64", action="store_true")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    idx = [int(i) for i in args.cases.split(",")] if args.cases else range(len(CASES))
    table = []
    for i in idx:
        case = CASES[i]
        print(f"case {case.name}", flush=True)
        x = suite.make_inputs(case, dev)
        di, dx, dl = x["dec"]
        kw = dict(q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)

        def ws():
            return torch.empty(256 << 20, dtype=torch.uint8, device=dev)

        def pod_wrapper():
            w = ca.PODWithPagedKVCacheWrapper(ws(), "NHD")
            w.plan(di, dx, dl, case.hq, case.hkv, suite.D, case.page, **kw)
            return lambda: w.run(x["q_p"], x["k_p"], x["v_p"], x["q_d"], x["cache"],
                                 causal_p=True)

        wd = ca.BatchPrefillWithPagedKVCacheWrapper(ws(), "NHD")
        wd.plan(x["qo_d"], di, dx, dl, case.hq, case.hkv, suite.D, case.page, causal=False, **kw)
        calls = {
            "prefill": lambda: ca.single_prefill_with_kv_cache(x["q_p"], x["k_p"], x["v_p"],
                                                              causal=True),
            "decode": lambda: wd.run(x["q_d"], x["cache"]),
        }
        calls["apart (parts)"] = lambda: (calls["prefill"](), calls["decode"]())
        settings = {"fused": POD_FUSED, "pod apart": POD_APART}
        graphs, outs, keep = {}, {}, []
        for name, fn in calls.items():
            graphs[name], outs[name] = capture_graph(fn)
        for name, s in settings.items():
            fn = pod_wrapper()
            with override(**s):
                graphs[name], outs[name] = capture_graph(fn)
            keep.append(fn)  # a graph's replay does not keep the wrapper's plan alive
        if args.fused64:
            with _fused64():
                fn = pod_wrapper()
                graphs["fused64"], outs["fused64"] = capture_graph(fn)
            keep.append(fn)
        for g in graphs.values():
            g.replay()
        torch.cuda.synchronize()
        ref = outs["apart (parts)"]
        med = medians_us({k: g.replay for k, g in graphs.items()}, args.rounds)
        for k, us in med.items():
            o = outs[k]
            if isinstance(o, tuple) and len(o) == 2 and isinstance(ref, tuple) and k not in (
                    "prefill", "decode"):
                diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(o, ref))
            else:
                diff = float("nan")
            table.append((case.name, k, us, diff))
        graphs = outs = calls = x = keep = None
        torch.cuda.empty_cache()
    print(f"{'case':<34} {'call':<14} {'us':>9} {'diff':>9}")
    for name, k, us, diff in table:
        print(f"{name:<34} {k:<14} {us:9.1f} {diff:9.1e}")


if __name__ == "__main__":
    main()
