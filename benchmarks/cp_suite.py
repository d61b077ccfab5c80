"""The context-parallel suite: causal prefill of one long prompt on 1 GPU (the op on the whole
sequence) and on 2 GPUs (compiled_attn.cp.prefill over NCCL), in one run on one machine.

    python -m benchmarks.cp_suite [--out PATH] [--reps N]

spawns 2 ranks itself (or runs under ``torchrun --nproc-per-node 2 -m benchmarks.cp_suite``).
Cases: 32k and 128k tokens, GQA 32/8 (all-gather) and MHA 32/32 (ring), D 128, bf16, and 512k
GQA on 2 GPUs where it fits. The same run measures NVLink: an all-gather and a ring pass of
512 MiB per rank (GB/s received per GPU and direction), carried on every row. Rows (the format
of benchmarks/results.py) carry ``gpus`` 1 or 2 under the same ``case`` name; 2-GPU rows carry
``speedup_vs_1gpu``. TFLOP/s count the causal work of the whole prompt
(4 * S * (S + 1) / 2 * Hq * D) over the wall time of the slowest rank. Written to --out, else
$OUT/cp_suite.json, else benchmarks/results/cp.json. A budget (BUDGET_S) keeps the run under
8 minutes on a 2-GPU H100 machine: cases past it are recorded as not run.
"""

from __future__ import annotations

import argparse
import datetime
import os
import socket
import statistics
import time

import torch

SUITE = "cp"
D = 128
CASES = [  # (S, Hq, Hkv, method, gpus)
    (32768, 32, 8, "all_gather", (1, 2)),
    (32768, 32, 32, "ring", (1, 2)),
    (131072, 32, 8, "all_gather", (1, 2)),
    (131072, 32, 32, "ring", (1, 2)),
    (524288, 32, 8, "all_gather", (2,)),
]
BUDGET_S = 360.0
_BUDGET_ENV = "COMPILED_ATTN_CP_BUDGET_S"


def _budget() -> float:
    """The run's budget in seconds: --budget-s (passed to the ranks by the environment)."""
    return float(os.environ.get(_BUDGET_ENV, BUDGET_S))


BW_BYTES = 512 << 20
TARGETS = {(32768, 8): 1.6, (131072, 8): 1.85, (131072, 32): 1.7}  # (S, Hkv) -> 2-GPU speedup


def _case_name(s, hq, hkv):
    return f"S{s // 1024}k_H{hq}/{hkv}_D{D}_causal"


def _flops(s, hq):
    return 4.0 * s * (s + 1) / 2 * hq * D


def _time(fn, reps, group=None):
    """Median seconds of fn() over reps (after one warm-up), the slowest rank's per rep."""
    import torch.distributed as dist

    fn()
    times = []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        dt = torch.tensor([time.perf_counter() - t0], device="cuda")
        if group is not None:
            dist.all_reduce(dt, op=dist.ReduceOp.MAX, group=group)
        times.append(dt.item())
    return statistics.median(times)


def _bandwidth(group, world, rank):
    """GB/s received per GPU: all-gather of BW_BYTES per rank, and one ring step (each rank
    sends BW_BYTES to the next and receives as much from the previous)."""
    import torch.distributed._functional_collectives as fc

    from compiled_attn.cp import _wait

    x = torch.empty(BW_BYTES // 2, dtype=torch.bfloat16, device="cuda")
    ag = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
    t_ag = _time(lambda: _wait(ag(x, 0, group)), 5, group)
    dst = [(i + 1) % world for i in range(world)]
    t_p2p = _time(lambda: _wait(fc.permute_tensor(x, dst, group)), 5, group)
    recv = BW_BYTES * (world - 1)
    return {"nvlink_all_gather_GBps": recv / t_ag / 1e9, "nvlink_ring_GBps": BW_BYTES / t_p2p / 1e9}


def _inputs(s, hq, hkv):
    g = torch.Generator(device="cuda").manual_seed(s + hkv)
    return [torch.randn(s, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for h in (hq, hkv, hkv)]


def _row(s, hq, hkv, method, gpus, sec, extra):
    row = dict(suite=SUITE, case=_case_name(s, hq, hkv), provider="compiled_attn", gpus=gpus,
               S=s, Hq=hq, Hkv=hkv, D=D, causal=True, dtype="bfloat16",
               method=method if gpus > 1 else "single", **extra)
    if sec is None:
        row.update(median_ms=None, tflops=None, status="unavailable")
        row.setdefault("error", "not run")
    else:
        row.update(median_ms=sec * 1e3, tflops=_flops(s, hq) / sec / 1e12, status="ok")
    return row


def _one_gpu(s, hq, hkv):
    from compiled_attn import cp

    q, k, v = _inputs(s, hq, hkv)
    return lambda: cp._attend(q, k, v, [(s, s)], True,
                              dict(window_left=-1, sm_scale=D ** -0.5, logits_soft_cap=0.0))


def _two_gpus(s, hq, hkv, method, group, world, rank):
    from compiled_attn import cp

    q, k, v = (cp.shard(t, world, rank) for t in _inputs(s, hq, hkv))
    torch.cuda.empty_cache()
    return lambda: cp.prefill(q, k, v, group=group, causal=True, method=method)


def run(rank, world, reps):
    """Every case on this rank; rank 0 returns the rows."""
    import torch.distributed as dist

    from benchmarks import results

    group = dist.group.WORLD
    start = time.time()
    bw = _bandwidth(group, world, rank)
    rows, single = [], {}
    for s, hq, hkv, method, gpus in CASES:
        for n in gpus:
            over = time.time() - start > _budget()
            sec, extra = None, dict(bw, world=world)
            if over:
                extra["error"] = f"past the suite's {_budget():.0f} s budget"
            else:
                try:
                    if n == 1:  # rank 0 alone; the others wait at the barrier below
                        sec = _time(_one_gpu(s, hq, hkv), reps) if rank == 0 else 0.0
                    else:
                        sec = _time(_two_gpus(s, hq, hkv, method, group, world, rank), reps,
                                    group)
                except torch.cuda.OutOfMemoryError as e:
                    sec, extra["error"] = None, f"out of memory: {e}"[:300]
                torch.cuda.empty_cache()
            dist.barrier(group)
            if n == 1 and sec:
                single[s, hq, hkv] = sec
            if n > 1 and sec and (s, hq, hkv) in single:
                extra["speedup_vs_1gpu"] = single[s, hq, hkv] / sec
            if rank == 0:  # (a 1-GPU case ran on rank 0 alone)
                rows.append(_row(s, hq, hkv, method, n, sec, extra))
                print({k: rows[-1][k] for k in ("case", "gpus", "median_ms", "tflops")},
                      flush=True)
    fp = results.kernel_fingerprint()
    for r in rows:
        r["kernel_src"] = fp
    return rows if rank == 0 else None


def plot(doc: dict, path) -> None:
    """TFLOP/s of each case on 1 and 2 GPUs (bars), the 2-GPU speedup and its target above
    them; nothing when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = doc["rows"]
    cases = list(dict.fromkeys(r["case"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, n in enumerate((1, 2)):
        for j, c in enumerate(cases):
            r = next((r for r in rows if r["case"] == c and r["gpus"] == n), {})
            if r.get("tflops"):
                label = f"{n} GPU{'s' * (n > 1)}"
                ax.bar(j + (i - 0.5) * 0.38, r["tflops"], 0.38, color=f"C{i}",
                       label=None if label in ax.get_legend_handles_labels()[1] else label)
            if n == 2 and r.get("tflops"):
                target = TARGETS.get((r["S"], r["Hkv"]))
                text = f"{r['speedup_vs_1gpu']:.2f}x" if r.get("speedup_vs_1gpu") else ""
                if target:
                    text += f"\n(target {target}x)"
                ax.text(j + 0.19, r["tflops"], text, ha="center", va="bottom", fontsize=7)
    names = [c.replace(f"_D{D}_causal", "").replace("_", " ") + "\n"
             + next(r["method"] for r in rows if r["case"] == c and r["gpus"] == 2)
             for c in cases]
    ax.set_xlabel(f"case (D {D}, causal, bf16) and the 2-GPU method")
    ax.set_xticks(range(len(cases)), names, fontsize=7)
    ax.set_ylabel("TFLOP/s (whole prompt's causal work / wall time)")
    bw = rows[0].get("nvlink_all_gather_GBps") if rows else None
    ax.set_title(f"cp suite: {doc['gpu']} x2, torch {doc['torch']}, triton {doc['triton']}, "
                 f"{doc['date'][:10]}" + (f"; NVLink all-gather {bw:.0f} GB/s" if bw else ""),
                 fontsize=8)
    ax.legend(fontsize=8)
    ax.set_ylim(0, max((r["tflops"] or 0) for r in rows) * 1.25 if rows else 1)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _out_path(arg):
    if arg:
        return arg
    if os.environ.get("OUT"):
        return os.path.join(os.environ["OUT"], "cp_suite.json")
    return os.path.join(os.path.dirname(__file__), "results", "cp.json")


def _rank_main(rank, world, port, reps, out):
    import torch.distributed as dist

    from benchmarks import results

    torch.cuda.set_device(rank)
    if port is None:  # under torchrun
        dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=600))
    else:
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=600))
    rows = run(rank, world, reps)
    if rank == 0:
        results.write(out, results.environment(), rows)
        plot(results.load(out), os.path.splitext(out)[0] + ".png")
        print(f"wrote {len(rows)} rows to {out}", flush=True)
    dist.destroy_process_group()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--budget-s", type=float, default=BUDGET_S,
                    help=f"cases past this many seconds are recorded as not run ({BUDGET_S:.0f})")
    a = ap.parse_args(argv)
    os.environ[_BUDGET_ENV] = str(a.budget_s)  # the spawned ranks read it (_budget)
    out = _out_path(a.out)
    if "RANK" in os.environ:  # torchrun
        _rank_main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, a.reps, out)
        return
    if torch.cuda.device_count() < 2:
        raise SystemExit("cp_suite needs 2 GPUs (found {})".format(torch.cuda.device_count()))
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mp.spawn(_rank_main, args=(2, port, a.reps, out), nprocs=2, join=True)


if __name__ == "__main__":
    main()
