"""Where the host time of a torch.compile'd op call goes: the host suite's tiny single prefill
(benchmarks/host.py's inputs), compiled with fullgraph, against compiled SDPA and the eager
call, in interleaved rounds behind a sleeping GPU; the op inlined (its Triton launch in
Inductor's graph, the default for a call the Gluon kernel does not take), the same compiled
with Inductor's static launcher for user-defined Triton kernels
(static_launch_user_defined_triton_kernels, where this torch has it), the entry point traced
by Dynamo as it was before it became one graph call (compiled_ours_traced: its checks' guards
evaluated at every call), and kept opaque (the
graph calls the op, whose front kernel replays a bound launch). With --cpp-wrapper, also
compiled SDPA and the inlined op compiled with Inductor's C++ wrapper (cpp_wrapper: the graph's
launches issued from C++, as an AOTInductor package issues them; each compile takes longer).
With --dump DIR, then a cProfile of each compiled form and Inductor's generated wrapper code
under DIR (eleven files, fifteen with --cpp-wrapper: kept out of a device call's $OUT unless
asked, which returns only so many files).

    python -m dev.compiled_host_probe [--rounds 5] [--calls 200] [--cpp-wrapper] [--dump DIR]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import statistics
import types

import torch


def _compiled(fn, *a):
    """fn compiled and run once with the caches off (the forms share one graph, which the
    launch policy's settings lower differently: a cache hit would return another form)."""
    c = torch.compile(fn, fullgraph=True)
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        c(*a)
    return lambda: c(*a)


class _LogLines(logging.Handler):
    """The messages of the records it handles that contain ``text``."""

    def __init__(self, text: str):
        super().__init__(logging.INFO)
        self.text, self.lines = text, []

    def emit(self, record):
        msg = record.getMessage()
        if self.text in msg:
            self.lines.append(msg)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--dump", default=None, help="folder for the profiles and the wrapper code")
    ap.add_argument("--cpp-wrapper", action="store_true",
                    help="also compiled SDPA and the inlined op under Inductor's cpp_wrapper")
    a = ap.parse_args()
    out_dir = a.dump

    import compiled_attn as ca
    from compiled_attn.ops import dispatch
    from benchmarks.host import HKV, HQ, _inputs, host_us

    x = _inputs(torch.device("cuda"))
    q1, k1, v1 = x["q1"], x["k1"], x["v1"]
    f = torch.nn.functional.scaled_dot_product_attention
    qs = q1.transpose(0, 1).unsqueeze(0)
    ks = k1.repeat_interleave(HQ // HKV, 1).transpose(0, 1).unsqueeze(0)
    vs = v1.repeat_interleave(HQ // HKV, 1).transpose(0, 1).unsqueeze(0)

    def ours(q, k, v):
        return ca.single_prefill_with_kv_cache(q, k, v, causal=True)

    def ours_opaque(q, k, v):  # its own code object: Dynamo caches compiled code per code
        return ca.single_prefill_with_kv_cache(q, k, v, causal=True)

    def ours_static(q, k, v):  # (the same, compiled with Inductor's static launcher for
        return ca.single_prefill_with_kv_cache(q, k, v, causal=True)  # user-defined kernels)

    def ours_cpp(q, k, v):  # (the same, compiled with Inductor's C++ wrapper)
        return ca.single_prefill_with_kv_cache(q, k, v, causal=True)

    # the entry point as Dynamo traced it before it became one graph call (op_call.graph_leaf):
    # a copy of the function, which allow_in_graph does not name
    entry = ca.single_prefill_with_kv_cache.__wrapped__
    traced_entry = types.FunctionType(entry.__code__, entry.__globals__, entry.__name__,
                                      entry.__defaults__, entry.__closure__)
    traced_entry.__kwdefaults__ = entry.__kwdefaults__

    def ours_traced(q, k, v):
        return traced_entry(q, k, v, causal=True)

    q4, k4, v4 = (t.unsqueeze(0) for t in (q1, k1, v1))
    op = torch.ops.compiled_attn.single_prefill
    calls = {"eager_ours": lambda: ours(q1, k1, v1),
             "op_direct": lambda: op(q4, k4, v4, None, None, None, 1, -1, 0, 128 ** -0.5, 0.0,
                                     0, 1.0, 1e4, 1.0, None),
             "eager_sdpa": lambda: f(qs, ks, vs, is_causal=True)}
    from torch._inductor.codecache import PyCodeCache

    def code_of(name):
        if out_dir is None:
            return
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, f"code_{name}.py"), "w") as fh:
            for mod in PyCodeCache.modules[seen[0]:]:
                fh.write(f"# ---- {getattr(mod, '__file__', '?')}\n")
                try:
                    fh.write(open(mod.__file__).read())
                except (OSError, TypeError):
                    pass
        seen[0] = len(PyCodeCache.modules)

    seen = [len(PyCodeCache.modules)]
    calls["compiled_sdpa"] = _compiled(lambda q, k, v: f(q, k, v, is_causal=True), qs, ks, vs)
    code_of("sdpa")
    calls["compiled_ours_inlined"] = _compiled(ours, q1, k1, v1)
    code_of("ours_inlined")
    calls["compiled_ours_traced"] = _compiled(ours_traced, q1, k1, v1)
    code_of("ours_traced")
    # Inductor's static CUDA launcher for user-defined Triton kernels (the inlined op's launch):
    # off by default in torch 2.11-2.13 (config static_launch_user_defined_triton_kernels)
    if hasattr(torch._inductor.config, "static_launch_user_defined_triton_kernels"):
        # (compiled in this process, so that Inductor's log of a kernel it does not launch
        # statically, and why, reaches the handler)
        bypass = _LogLines("Bypassing StaticallyLaunched")
        log = logging.getLogger("torch._inductor.runtime.triton_heuristics")
        level = log.level
        log.addHandler(bypass)
        log.setLevel(logging.INFO)
        try:
            with torch._inductor.config.patch(static_launch_user_defined_triton_kernels=True,
                                              fx_graph_cache=False, compile_threads=1), \
                    torch._functorch.config.patch(enable_autograd_cache=False):
                calls["compiled_ours_static"] = _compiled(ours_static, q1, k1, v1)
        finally:
            log.removeHandler(bypass)
            log.setLevel(level)
        print("compiled_ours_static: kernels not launched statically: "
              + ("; ".join(bypass.lines) or "none"), flush=True)
        code_of("ours_static")
    else:
        print("compiled_ours_static: this torch has no static_launch_user_defined_triton_kernels")
    if a.cpp_wrapper:
        with torch._inductor.config.patch(cpp_wrapper=True):
            calls["compiled_sdpa_cpp"] = _compiled(
                lambda q, k, v: f(q, k, v, is_causal=True), qs, ks, vs)
            code_of("sdpa_cpp")
            calls["compiled_ours_cpp"] = _compiled(ours_cpp, q1, k1, v1)
            code_of("ours_cpp")
    keep = dispatch.keep_opaque
    dispatch.keep_opaque = lambda name, args, kwargs=None: not dispatch.ahead_of_time()
    try:
        calls["compiled_ours_opaque"] = _compiled(ours_opaque, q1, k1, v1)
        code_of("ours_opaque")
    finally:
        dispatch.keep_opaque = keep
    ref = calls["eager_sdpa"]()
    for name, fn in calls.items():
        o = fn()
        o = o[0] if isinstance(o, tuple) else o
        if name == "op_direct":
            o = o[0]
        if "ours" in name or name == "op_direct":  # [S, Hq, D] -> SDPA's [1, Hq, S, D]
            o = o.transpose(0, 1).unsqueeze(0)
        err = (o.float() - ref.float()).abs().max().item()
        print(f"{name}: max |out - sdpa| = {err:.3g}", flush=True)
    res = {k: [] for k in calls}
    for _ in range(a.rounds):
        for name, fn in calls.items():
            res[name].append(host_us(fn, a.calls))
    profiled = ("compiled_ours_inlined", "compiled_ours_static", "compiled_ours_opaque",
                "compiled_sdpa", "compiled_ours_cpp", "compiled_sdpa_cpp",
                "op_direct") if out_dir is not None else ()
    for name in profiled:
        if name not in calls:
            continue
        pr = cProfile.Profile()
        fn = calls[name]
        torch.cuda.synchronize()
        torch.cuda._sleep(1_500_000_000)
        pr.enable()
        for _ in range(a.calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(35)
        with open(os.path.join(out_dir, f"profile_{name}.txt"), "w") as fh:
            fh.write(s.getvalue())
    print("\nprovider                 host us per call (median of rounds)   rounds")
    for name, v in res.items():
        print(f"{name:24s} {statistics.median(v):8.1f}   " + " ".join(f"{t:.1f}" for t in v))


if __name__ == "__main__":
    main()
