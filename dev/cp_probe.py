"""Where the 2-GPU context-parallel time goes: cp.prefill against its local attention alone.

    python -m dev.cp_probe [--cases 32k_gqa,32k_mha,128k_gqa] [--out DIR] [--forms]

spawns 2 NCCL ranks. Per case, medians (slowest rank) of: the 1-GPU op on the whole sequence;
cp.prefill with the index cache (as shipped) and without it (a pageable, stream-blocking
host-to-device copy per launch, as before the cache); head_slices 1 / 2 / 4 (all-gather); the
rank's local attention alone (its launches on K/V already gathered and joined, no
communication). Rank 0 then profiles one cp.prefill call and writes its CUDA kernels (name,
start, duration in us) to DIR/cp_probe_<case>.txt. A table is printed last.

--forms times, instead, the forms a traced graph can hold (issue: which overlaps better):
cp.prefill eagerly and with as_op=True eagerly; under torch.compile(fullgraph=True,
dynamic=False), the functional collectives (Inductor's default schedule, and with
reorder_for_compute_comm_overlap) and the opaque op (as_op=True).
"""

from __future__ import annotations

import argparse
import os
import socket

import torch

D = 128
CASES = {"32k_gqa": (32768, 32, 8, "all_gather"), "32k_mha": (32768, 32, 32, "ring"),
         "128k_gqa": (131072, 32, 8, "all_gather"), "128k_mha": (131072, 32, 32, "ring")}


def _time(fn, reps, group):
    """Median ms of fn() over reps, the slowest rank's (benchmarks.cp_suite's timer)."""
    from benchmarks.cp_suite import _time as seconds

    return seconds(fn, reps, group) * 1e3


def _uncached(qo, kv, group, block_m, dev):
    """The index tensors as built before the cache: pageable copies, every call."""
    from compiled_attn import cp

    qi = torch.tensor(cp._cumsum(qo) + [sum(qo)], dtype=torch.int32, device=dev)
    ki = torch.tensor(cp._cumsum(kv) + [sum(kv)], dtype=torch.int32, device=dev)
    w = torch.tensor(cp._work_rows(qo, kv, group, block_m), dtype=torch.int32, device=dev)
    return qi, ki, w.reshape(-1, 2)


def _old_merge(acc, s_acc, o, s_o):
    """The ring's merge before _merge_step: merge_state on float32 copies."""
    from compiled_attn.utils import merge_state

    return merge_state(acc.float(), s_acc, o.float(), s_o)


def _ring_late_send(q, k, v, lay, rank, group, causal, opts):
    """cp._ring with each step's pass issued after its attention launch."""
    from compiled_attn import cp

    n, acc, kc, vc = lay.world_size, None, k, v
    for s in range(n):
        reqs, step_causal = cp._ring_plan(lay, rank, (rank - s) % n, causal)
        o, lse = cp._attend(q, kc, vc, reqs, step_causal, opts)
        nxt = (cp._pass_on(kc, group, n), cp._pass_on(vc, group, n)) if s < n - 1 else None
        acc = (o, lse) if acc is None else cp._merge_step(acc[0], acc[1], o, lse)
        if nxt is not None:
            kc, vc = cp._wait(nxt[0]).reshape(k.shape), cp._wait(nxt[1]).reshape(v.shape)
    return acc[0].to(q.dtype), acc[1]


def _case(name, rank, world, group, reps, out_dir):
    import torch.distributed as dist

    from compiled_attn import cp

    s, hq, hkv, method = CASES[name]
    g = torch.Generator(device="cuda").manual_seed(s + hkv)
    full = [torch.randn(s, h, D, device="cuda", dtype=torch.bfloat16, generator=g)
            for h in (hq, hkv, hkv)]
    opts = dict(window_left=-1, sm_scale=D ** -0.5, logits_soft_cap=0.0)
    res = {}
    # the 1-GPU time on rank 0 alone
    if rank == 0:
        res["1gpu"] = _time(lambda: cp._attend(*full, [(s, s)], True, opts), reps, None)
    dist.barrier(group)
    q, k, v = (cp.shard(t, world, rank) for t in full)
    del full
    torch.cuda.empty_cache()
    call = lambda **kw: cp.prefill(q, k, v, group=group, causal=True, method=method, **kw)  # noqa: E731
    res["cp"] = _time(call, reps, group)
    if rank == 0:
        print(name, "1gpu", res["1gpu"], "cp", res["cp"], flush=True)
    keep = cp._indices
    cp._indices = _uncached
    try:
        res["cp_uncached"] = _time(call, reps, group)
    finally:
        cp._indices = keep
    if method == "all_gather":
        for hs in (1, 2, 4):
            res[f"cp_hs{hs}"] = _time(lambda: call(head_slices=hs), reps, group)
        lay = cp.Layout.of(world, seq_len=s)
        reqs, pieces = cp._prefix_plan(lay, rank, True)
        kk = cp._join(torch.cat([k] * world), pieces, lay.local_len)  # gathered K/V's sizes
        vv = cp._join(torch.cat([v] * world), pieces, lay.local_len)
        res["local_attn"] = _time(lambda: cp._attend(q, kk, vv, reqs, True, opts), reps, group)
    else:
        keep = cp._ring
        try:
            cp._ring = _ring_late_send
            res["ring_late_send"] = _time(call, reps, group)
            cp._ring = keep
            keep_m = cp._merge_step
            cp._merge_step = _old_merge
            res["ring_old_merge"] = _time(call, reps, group)
            cp._merge_step = keep_m
        finally:
            cp._ring = keep
    if rank == 0:
        from torch.profiler import ProfilerActivity, profile

        call()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            call()
            torch.cuda.synchronize()
        evs = [e for e in prof.events() if e.device_type.name == "CUDA"]
        evs.sort(key=lambda e: e.time_range.start)
        t0 = evs[0].time_range.start if evs else 0
        with open(os.path.join(out_dir, f"cp_probe_{name}.txt"), "w") as f:
            for e in evs:
                f.write(f"{e.time_range.start - t0:10.1f} {e.time_range.elapsed_us():10.1f} "
                        f"{e.name[:90]}\n")
        res["kernels"] = len(evs)
    else:  # the same collectives as rank 0's warm-up and profiled call
        call()
        call()
        torch.cuda.synchronize()
    dist.barrier(group)
    return res


def _forms(name, rank, world, group, reps):
    """Medians (slowest rank, ms) of the eager and compiled forms of one case's call."""
    import torch._dynamo
    import torch._inductor.config as icfg

    from compiled_attn import cp

    s, hq, hkv, method = CASES[name]
    g = torch.Generator(device="cuda").manual_seed(s + hkv)
    q, k, v = (cp.shard(torch.randn(s, h, D, device="cuda", dtype=torch.bfloat16, generator=g),
                        world, rank) for h in (hq, hkv, hkv))

    def fn(a, b, c, as_op=False):
        return cp.prefill(a, b, c, group=group, causal=True, method=method, as_op=as_op)

    res = {"eager": _time(lambda: fn(q, k, v), reps, group),
           "eager_as_op": _time(lambda: fn(q, k, v, True), reps, group)}
    ref = fn(q, k, v)
    for key, as_op, reorder in (("compiled", False, False), ("compiled_reorder", False, True),
                                ("compiled_as_op", True, False)):
        torch._dynamo.reset()
        with icfg.patch(reorder_for_compute_comm_overlap=reorder):
            c = torch.compile(lambda a, b, cc: fn(a, b, cc, as_op), fullgraph=True,
                              dynamic=False)
            o, lse = c(q, k, v)  # compiled here, inside the patch
        res[f"{key}_equal"] = bool(torch.equal(o, ref[0]) and torch.equal(lse, ref[1]))
        res[key] = _time(lambda: c(q, k, v), reps, group)
    return res


def _rank_forms(rank, world, port, cases, reps):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = dist.group.WORLD
    keys = ["eager", "eager_as_op", "compiled", "compiled_reorder", "compiled_as_op"]
    table = [(name, _forms(name, rank, world, group, reps)) for name in cases]
    if rank == 0:
        print("\ncase      " + " ".join(f"{k:>17s}" for k in keys) + "  (ms; equal to eager)")
        for name, r in table:
            cells = " ".join(f"{r[k]:11.3f} {str(r.get(k + '_equal', '')):>5s}" for k in keys)
            print(f"{name:10s}{cells}")
    dist.destroy_process_group()


def _rank(rank, world, port, cases, reps, out_dir):
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world)
    group = dist.group.WORLD
    table = []
    for name in cases:
        r = _case(name, rank, world, group, reps, out_dir)
        if rank == 0:
            print(name, {k: (round(v, 2) if isinstance(v, float) else v) for k, v in r.items()},
                  flush=True)
            table.append((name, r))
    if rank == 0:
        keys = ["1gpu", "cp", "cp_uncached", "cp_hs1", "cp_hs2", "cp_hs4", "local_attn",
                "ring_late_send", "ring_old_merge"]
        print("\ncase      " + " ".join(f"{k:>14s}" for k in keys) + "  speedup(cp)")
        for name, r in table:
            cells = " ".join(f"{r[k]:14.2f}" if r.get(k) else f"{'-':>14s}" for k in keys)
            print(f"{name:10s}{cells}  {r['1gpu'] / r['cp']:.3f}x")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="32k_gqa,32k_mha,128k_gqa")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    ap.add_argument("--forms", action="store_true",
                    help="time the eager and compiled forms (functional vs as_op) instead")
    a = ap.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if a.forms:
        mp.spawn(_rank_forms, args=(2, port, a.cases.split(","), a.reps), nprocs=2, join=True)
    else:
        mp.spawn(_rank, args=(2, port, a.cases.split(","), a.reps, a.out), nprocs=2,
                 join=True)


if __name__ == "__main__":
    main()
