"""Decode key chunks for few requests, alone and inside POD (dev probe, GPU).

A decode batch of few requests (16 x 8 KV heads = 128 programs on 132 SMs) runs one program a
SM where the Gluon kernel's 64-row tile keeps two resident, and its decodes read below the copy
ceiling; inside POD's fused launch the same decodes read slower still. This probe times, for
the pod suite's cases (``--only`` as benchmarks.pod's), as CUDA graph replays in interleaved
rounds (medians, microseconds):

- ``dec``: the decodes through BatchPrefillWithPagedKVCacheWrapper (the launch policy as is);
  ``dec fill F``: planned with POLICY.decode_chunk_fill F (cut where the programs fill at most
  F of a wave of two a SM);
- ``pod``: POD's fused launch, uncut (pod_apart_balance 0, pod_chunks off); ``apart``: the
  prefill's single prefill, then ``dec``; ``apart fill F``: then ``dec fill F``;
- ``pod cut N``: POD's fused launch whose decode part is the batch cut into N key chunks a
  request (schedule.build_decode_chunks, over the same page table), with the chunk rows'
  gather and merge (ops.decode_chunks) in the graph;
- ``pod policy``: the POD wrapper's call as the launch policy decides it (POLICY.pod_chunks
  included); ``pod own apart``: the wrapper's own two launches (its decodes cut as a paged call
  of them alone would be); ``pod graph plan``: ``pod policy`` in CUDA-graph mode
  (use_cuda_graph=True: the first plan's chunk counts, padded chunk tensors); ``pod policy
  gathered`` / ``pod own apart gathered``: the same with the decode chunks' query rows gathered
  by a launch of their own instead of read in place (dev.decode_probe.gathered_rows);
- ``copy``: a device copy of the decodes' K/V bytes (eager), the ceiling.

Each variant's decode output is checked against ``dec``'s (max abs difference printed).

    python -m dev.pod_chunk_probe --only "pod p256 d16x32768 g32/8 page16,..." [--rounds 5]
        [--fills 0.5] [--cuts 2,4] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics

import torch

import compiled_attn
from benchmarks import pod as suite
from compiled_attn.ops import decode_chunks as chunks_op
from compiled_attn.ops.policy import POD_APART, POD_FUSED, override
from compiled_attn.ops.schedule import build_decode_chunks
from dev.decode_probe import gathered_rows
from dev.pod_order import _time


def _cases(only: str) -> list:
    """The pod suite's cases that ``only`` names, and any other "pod pP dBxKV gHQ/HKV pageN"
    name parsed into a case of its own (kv lengths the grid lacks)."""
    out = []
    for item in only.split(","):
        got = suite.pick(suite.case_list(), item)
        m = re.fullmatch(r"pod p(\d+) d(\d+)x(\d+) g(\d+)/(\d+) page(\d+)", item.strip())
        if not got and m:
            p, d, kv, hq, hkv, page = map(int, m.groups())
            got = [suite.PodCase("pod", (p,), d, kv, hq, hkv, page)]
        out += [c for c in got if c not in out]
    return out


def _ws():
    return torch.empty(256 << 20, dtype=torch.uint8, device="cuda")


def _decoder(case, x, **policy):
    """The decodes alone through the paged prefill wrapper, planned under ``policy``."""
    di, dx, dl = x["dec"]
    w = compiled_attn.BatchPrefillWithPagedKVCacheWrapper(_ws(), "NHD")
    with override(**policy):
        w.plan(x["qo_d"], di, dx, dl, case.hq, case.hkv, suite.D, case.page, causal=False,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    cut = getattr(w._plan, "chunk_work", None) is not None

    def call():
        with override(**policy):
            return w.run(x["q_d"], x["cache"])
    return call, cut


def _pod(case, x, cut: int = 0, graph: bool = False, **policy):
    """POD's fused launch (or, with ``policy``, the wrapper's call under those settings); cut >
    0: its decode part cut into ``cut`` chunks a request, the chunk rows gathered before and
    merged after; graph: the wrapper in CUDA-graph mode (use_cuda_graph=True, its plan in
    buffers). Returns a call giving (out_p, out_d)."""
    di, dx, dl = x["dec"]
    bufs = {}
    if graph:
        i32 = dict(dtype=torch.int32, device=x["q_d"].device)
        bufs = dict(use_cuda_graph=True,
                    paged_kv_indptr_buffer=torch.empty(case.decodes + 1, **i32),
                    paged_kv_indices_buffer=torch.empty(dx.numel(), **i32),
                    paged_kv_last_page_len_buffer=torch.empty(case.decodes, **i32))
    w = compiled_attn.PODWithPagedKVCacheWrapper(_ws(), "NHD", **bufs)
    if not cut:
        settings = policy or dict(POD_FUSED, pod_chunks="off")
        with override(**settings):
            w.plan(di, dx, dl, case.hq, case.hkv, suite.D, case.page,
                   q_data_type=torch.bfloat16)

        def call():
            with override(**settings):
                return w.run(x["q_p"], x["k_p"], x["v_p"], x["q_d"], x["cache"], causal_p=True)
        return call
    qo = list(range(case.decodes + 1))
    c = build_decode_chunks(qo, di.tolist(), dl.tolist(), case.page, cut)
    dev = x["q_d"].device
    src, merge = c["src"].to(dev), c["merge"].to(dev)
    fused = dict(POD_FUSED, pod_chunks="off")
    with override(**fused):
        w.plan(c["kv_indptr"].to(dev), dx, c["last_page_len"].to(dev), case.hq, case.hkv,
               suite.D, case.page, q_data_type=torch.bfloat16)

    def call():
        q_c = chunks_op.gather_rows(x["q_d"], src)
        with override(**fused):
            (out_p, out_c), (_, lse_c) = w.run(x["q_p"], x["k_p"], x["v_p"], q_c, x["cache"],
                                                causal_p=True, return_lse_d=True)
        out_d, _ = chunks_op.merge_chunks(out_c, lse_c, merge, case.decodes)
        return out_p, out_d
    return call


def _within(context, fn):
    """fn called inside a fresh context() each time (a CUDA graph captures it there)."""
    def call():
        with context():
            return fn()
    return call


def _diff(a, b) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", required=True, help="the pod suite's cases (comma-separated)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--fills", default="0.5", help="decode_chunk_fill values beside the default")
    ap.add_argument("--cuts", default="2,4", help="chunks a request for 'pod cut N'")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    fills = [float(f) for f in args.fills.split(",") if f]
    cuts = [int(n) for n in args.cuts.split(",") if n]
    rows = []
    for case in _cases(args.only):
        x = suite.make_inputs(case, torch.device("cuda"))
        calls, info = {}, {}
        calls["dec"], info["dec"] = _decoder(case, x)
        for f in fills:
            calls[f"dec fill {f}"], info[f"dec fill {f}"] = _decoder(case, x, decode_chunk_fill=f)
        single = lambda: compiled_attn.single_prefill_with_kv_cache(  # noqa: E731
            x["q_p"], x["k_p"], x["v_p"], causal=True)
        calls["pod"] = _pod(case, x)
        dec = calls["dec"]
        calls["apart"] = lambda: (single(), dec())
        for f in fills:
            d_f = calls[f"dec fill {f}"]
            calls[f"apart fill {f}"] = lambda d_f=d_f: (single(), d_f())
        for n in cuts:
            calls[f"pod cut {n}"] = _pod(case, x, n)
        # the wrapper as the launch policy has it, and its own apart path
        calls["pod policy"] = _pod(case, x, pod_chunks="gluon")
        calls["pod own apart"] = _pod(case, x, **POD_APART)
        calls["pod graph plan"] = _pod(case, x, graph=True, pod_chunks="gluon")
        # (wrappers of their own: a bound call replays what its first call recorded)
        calls["pod policy gathered"] = _within(gathered_rows, _pod(case, x, pod_chunks="gluon"))
        calls["pod own apart gathered"] = _within(gathered_rows, _pod(case, x, **POD_APART))
        ref = calls["dec"]()
        diffs = {}
        for k, fn in calls.items():
            out = fn()
            out_d = out[1] if isinstance(out, tuple) else out
            diffs[k] = _diff(out_d, ref)
        replays = {k: suite._graph(fn) for k, fn in calls.items()}
        copy = lambda: x["copy_dst"].copy_(x["copy_src"])  # noqa: E731
        replays["copy"] = copy
        times = {k: [] for k in replays}
        for _ in range(args.rounds):
            for k, r in replays.items():
                times[k].append(_time(r))
        med = {k: statistics.median(v) for k, v in times.items()}
        copy_bytes = 2 * x["copy_src"].numel() * x["copy_src"].element_size()
        copy_tbs = copy_bytes / med["copy"] / 1e6
        dec_bytes = case.decode_bytes()
        for k, us in med.items():
            row = dict(case=case.name, variant=k, median_us=us, diff_vs_dec=diffs.get(k),
                       cut=info.get(k))
            if k.startswith("dec"):
                row["over_copy"] = dec_bytes / us / 1e6 / copy_tbs
            rows.append(row)
        print(case.name, flush=True)
        for k, us in med.items():
            extra = (f"  over copy {dec_bytes / us / 1e6 / copy_tbs:.3f}"
                     if k.startswith("dec") else "")
            print(f"  {k:16} {us:10.1f} us  diff {diffs.get(k, 0.0):.2e}"
                  f"{'  cut' if info.get(k) else ''}{extra}", flush=True)
        x = replays = calls = None
        torch.cuda.empty_cache()
    if args.out:
        gpu = torch.cuda.get_device_name()
        json.dump(dict(gpu=gpu, torch=torch.__version__, rows=rows), open(args.out, "w"),
                  indent=1)


if __name__ == "__main__":
    main()
