"""Dev tool: the CPU cost of one eager call of our dense op, per K/V load path
(choose.KV_PATHS), and its parts: the op through torch's dispatcher, our launcher
called directly (no dispatcher; wrap_triton off, as inside the op), and our argument
preparation alone (no Triton launch). Calls are queued behind a sleeping GPU so the host never
waits on the device; the per-call time is then the host's alone. The paths and parts are
timed in interleaved rounds and the best round kept (the host's own noise is large). Run on
the GPU machine:
``python3 -m dev.dev_launch_cost`` (about a minute); writes dev_launch_cost.txt under
$OUT. docs/design.md "Eager launch cost" quotes it. ``--entries`` times the public entry points
with and without compiled_attn.op_call's direct path instead (entries() below)."""

from __future__ import annotations

import argparse
import os
import time

import torch
from torch._library.triton import set_wrap_triton_enabled

from compiled_attn.ops import choose
from compiled_attn import ops
from compiled_attn.ops import prefill_kernel as K

from .kv_paths import forced_kv_path
from compiled_attn.ops.policy import POLICY

CALLS, ROUNDS = 300, 7  # at most ~600 launches queued (CUDA blocks the host near 1024)
ENTRY_CALLS = 150  # an entry point's call may launch a few kernels (the persistent counter)


def _inputs(b, s, h, d):
    """Fresh random bf16 q, k, v [b, s, h, d] and the causal launch parameters."""
    q, k, v = (torch.randn(b, s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    params = dict(mask_mode=ops.MASK_CAUSAL, window_left=-1, chunk_size=0, sm_scale=d ** -0.5,
                  logits_soft_cap=0.0, pos_encoding_mode=0, rope_scale=1.0, rope_theta=1e4,
                  v_scale=1.0)
    return q, k, v, params


def _as_in_op(fn):
    """fn run as triton_op runs its body in an eager call: with wrap_triton off, so the kernel
    is launched directly (outside, wrap_triton would route it through its traceable wrapper)."""
    def call():
        with set_wrap_triton_enabled(False):
            return fn()
    return call


def _parts(q, k, v, p):
    """name -> a zero-argument call: the op, our launcher, our argument preparation."""
    tail = tuple(p.values()) + (None,)
    return {
        "op": lambda: ops.single_prefill(q, k, v, None, None, None, *tail),
        "launcher": _as_in_op(
            lambda: K.launch_single(q, k, v, None, None, None, out_dtype=q.dtype, **p)),
        "args": _as_in_op(lambda: K._dense_args(q, k, v, None, None, None, q.dtype, p)),
    }


def _host_us(fn, calls: int = CALLS) -> float:
    """Host microseconds per call, with the GPU busy for the whole loop (a sleep kernel first)."""
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e9 * 0.4))  # ~0.4 s of GPU time: longer than the loop
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def _entry_calls(b, s, h, d):
    """name -> a zero-argument call of a public entry point (D128 causal bf16, H heads): the
    ragged and paged (page 16, shuffled pages) wrappers' run() on b requests of s tokens, and
    single_prefill_with_kv_cache on one request of s tokens."""
    import compiled_attn as fi

    from benchmarks.providers import scatter_pages

    q, k, v = (torch.randn(b * s, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    indptr = torch.arange(0, b * s + 1, s, device="cuda", dtype=torch.int32)
    ws = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
    ragged = fi.BatchPrefillWithRaggedKVCacheWrapper(ws)
    ragged.plan(indptr, indptr, h, h, d, causal=True, q_data_type=torch.bfloat16)
    k_cache, v_cache, page_indptr, page_indices, last = scatter_pages(k, v, [s] * b, 16)
    cache = torch.stack([k_cache, v_cache], 1)  # FlashInfer's [P, 2, page, H, D] cache
    paged = fi.BatchPrefillWithPagedKVCacheWrapper(ws)
    paged.plan(indptr, page_indptr, page_indices, last, h, h, d, 16, causal=True,
               q_data_type=torch.bfloat16)
    return {"ragged run": lambda: ragged.run(q, k, v),
            "paged run p16": lambda: paged.run(q, cache),
            "single": lambda: fi.single_prefill_with_kv_cache(q[:s], k[:s], v[:s], causal=True)}


def entries() -> None:
    """--entries: host us per call of the public entry points with compiled_attn.op_call's
    direct path (a plain eager call runs the op's implementation) against the same calls
    through torch's dispatcher (the policy's direct off), interleaved in rounds in one process
    (the host's speed moves between processes); each pair's outputs must be equal bit for bit."""
    from compiled_attn import op_call

    lines = [f"{'case':24} {'entry':14} {'direct':>9} {'dispatch':>9} {'saved':>7}"
             "   (host us per call: median of rounds, [best])"]
    for name, shape in {"B32 x 512 H16": (32, 512, 16, 128),
                        "B4 x 4k H16": (4, 4096, 16, 128)}.items():
        calls = _entry_calls(*shape)
        for entry, fn in calls.items():
            outs = []
            for direct in (True, False):
                POLICY.direct = direct
                outs.append(fn())
            POLICY.direct = True
            assert torch.equal(outs[0], outs[1]), f"{name} {entry}: direct != dispatcher"
        times: dict = {}
        for _ in range(ROUNDS):
            for entry, fn in calls.items():
                for direct in (True, False):
                    POLICY.direct = direct
                    for _ in range(10):
                        fn()
                    times.setdefault((entry, direct), []).append(_host_us(fn, ENTRY_CALLS))
        POLICY.direct = True
        for entry in calls:
            d, x = (sorted(times[entry, f]) for f in (True, False))
            md, mx = d[len(d) // 2], x[len(x) // 2]
            lines.append(f"{name:24} {entry:14} {md:9.1f} {mx:9.1f} {mx - md:7.1f}"
                         f"   [{d[0]:.1f} / {x[0]:.1f}]")
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(os.environ.get("OUT", "."), "dev_launch_cost_entries.txt"), "w") as f:
        f.write(text)
    print(text)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m dev.dev_launch_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--entries", action="store_true",
                    help="time the public entry points with and without compiled_attn.op_call's "
                         "direct path instead of the op's parts per K/V path")
    if ap.parse_args().entries:
        entries()
        return
    cases = {"D128 causal B32 x 512 H16": (32, 512, 16, 128),
             "D128 causal B4 x 4k H16": (4, 4096, 16, 128)}
    lines = [f"{'case':28} {'path':11} " + " ".join(f"{n:>9}" for n in ("op", "launcher", "args"))
             + "   (host us per call, best of rounds)"]
    for name, shape in cases.items():
        parts = _parts(*_inputs(*shape))
        best = {}
        for _ in range(ROUNDS):
            for path in choose.KV_PATHS:
                with forced_kv_path(path):
                    for part, fn in parts.items():
                        for _ in range(10):  # warm (compiles on the first round)
                            fn()
                        us = _host_us(fn)
                        best[path, part] = min(best.get((path, part), us), us)
        for path in choose.KV_PATHS:
            lines.append(f"{name:28} {path:11} " +
                         " ".join(f"{best[path, part]:9.1f}" for part in parts))
            print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    with open(os.path.join(os.environ.get("OUT", "."), "dev_launch_cost.txt"), "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
