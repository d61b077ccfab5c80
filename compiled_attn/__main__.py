"""``python -m compiled_attn`` (``make demo``): the demo, in two sections. ``--quick`` runs the
first alone (seconds); the second needs transformers (``pip install 'compiled_attn[demo]'``).

1. Paged prefill: plans and runs one batch of paged prefill requests (odd lengths, one request
   with more queries than keys, an empty one; page size 16, GQA 4:1, causal) through
   BatchPrefillWithPagedKVCacheWrapper, and checks output and LSE against
   ``compiled_attn.ops.reference`` in float64.
2. The model: a tiny Llama built from a config (random weights, no download; GQA, sdpa
   attention, a batch with left padding) run eager, through ``compiled_attn.compile`` and through
   ``compiled_attn.export`` + AOTInductor (aoti_compile_and_package, load, run). Per path it
   prints the rewrites made (``fx_passes.counters``), the max difference from eager over the
   non-padded rows, and the time (first call, which compiles, and the steady-state call).

On CPU (float32) the compiled_attn ops run their PyTorch reference; on a GPU (bf16) they run our
Triton kernels, and the demo checks that Inductor's generated code launches ``_prefill_fwd``.
On CUDA the AOTInductor package is built here and loaded in a subprocess: on the GPU machine
(torch 2.11+cu130) loading any package crashes, a plain MLP with no compiled_attn included
(``python -m dev.gpu_aoti_probe``), and the demo says so when it happens. Exits non-zero
when a check fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys
import tempfile
import textwrap
import time
import warnings

import torch

import compiled_attn as fi
from compiled_attn.ops import MASK_CAUSAL, POS_NONE, reference


def paged_prefill_check() -> bool:
    """Section 1: one batch of paged prefill requests vs ops.reference in float64."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    hq, hkv, d, page = 16, 4, 128 if dev.type == "cuda" else 64, 16
    qo_lens = [37, 1, 200, 0, 73] if dev.type == "cuda" else [37, 1, 50, 0, 23]
    kv_lens = [101, 64, 150, 5, 73] if dev.type == "cuda" else [61, 17, 40, 5, 23]
    npages = [(n + page - 1) // page for n in kv_lens]
    total_pages = sum(npages) + 4
    cache = torch.randn(total_pages, 2, page, hkv, d, generator=g).to(dev, dtype)
    indices = torch.randperm(total_pages, generator=g)[:sum(npages)].to(torch.int32)
    kv_indptr = torch.tensor([0] + torch.tensor(npages).cumsum(0).tolist(), dtype=torch.int32)
    last = torch.tensor([(n - 1) % page + 1 for n in kv_lens], dtype=torch.int32)
    qo_indptr = torch.tensor([0] + torch.tensor(qo_lens).cumsum(0).tolist(), dtype=torch.int32)
    q = torch.randn(sum(qo_lens), hq, d, generator=g).to(dev, dtype)

    wrapper = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device=dev), "NHD")
    t0 = time.perf_counter()
    wrapper.plan(qo_indptr, kv_indptr, indices, last, hq, hkv, d, page, causal=True,
                 q_data_type=dtype)
    t_plan = time.perf_counter() - t0
    out, lse = wrapper.run(q, cache, return_lse=True)  # warm-up (compiles on CUDA)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    reps = 5 if dev.type == "cuda" else 2
    t0 = time.perf_counter()
    for _ in range(reps):
        out, lse = wrapper.run(q, cache, return_lse=True)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    t_run = (time.perf_counter() - t0) / reps

    c64 = cache.cpu().double()
    ref_out, ref_lse = reference.batch_paged_prefill(
        q.cpu().double(), c64[:, 0], c64[:, 1], qo_indptr, kv_indptr, indices, last, None, None,
        None, None, out_dtype=torch.float64, mask_mode=MASK_CAUSAL, window_left=-1, chunk_size=0,
        sm_scale=d ** -0.5, logits_soft_cap=0.0, pos_encoding_mode=POS_NONE, rope_scale=1.0,
        rope_theta=1e4, v_scale=1.0)
    err_out = (out.cpu().double() - ref_out).abs().max().item()
    fin = torch.isfinite(ref_lse)
    err_lse = (lse.cpu().double()[fin] - ref_lse.double()[fin]).abs().max().item()
    lse_ok = torch.equal(torch.isfinite(lse.cpu()), fin)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    ok = err_out <= tol and err_lse <= tol * 10 and lse_ok and not out.isnan().any().item()

    print(f"[1] paged prefill wrapper on {dev.type} ({dtype})")
    print(f"  paged prefill: {len(qo_lens)} requests, qo_lens {qo_lens}, kv_lens {kv_lens}")
    print(f"  Hq {hq} / Hkv {hkv} (GQA {hq // hkv}:1), head dim {d}, page size {page}, causal, "
          f"cache {tuple(cache.shape)}")
    print(f"  q {tuple(q.shape)} -> out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} "
          f"{lse.dtype} (base 2)")
    print(f"  vs ops.reference in float64: max |out err| {err_out:.2e}, max |lse err| "
          f"{err_lse:.2e} (tolerance {tol:.0e}), empty rows -inf: {lse_ok}")
    print(f"  plan {t_plan * 1e3:.2f} ms, run {t_run * 1e3:.2f} ms")
    print("  OK" if ok else "  FAILED")
    return ok




class _Logits(torch.nn.Module):
    """HF causal LM -> logits tensor (one output, as torch.export and AOTInductor want)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model(input_ids=input_ids, attention_mask=attention_mask,
                          use_cache=False).logits


def _tiny_llama(dev, dtype):
    import transformers

    cuda = dev.type == "cuda"
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=512 if cuda else 128, intermediate_size=1024 if cuda else 256,
        num_hidden_layers=2, num_attention_heads=8 if cuda else 4, num_key_value_heads=2,
        max_position_embeddings=1024, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval().to(dev, dtype)
    return _Logits(model), cfg


def _timed(fn, reps, cuda):
    """(result of the first call, seconds of the first call, median seconds of the next reps)."""
    def once():
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        if cuda:
            torch.cuda.synchronize()
        return out, time.perf_counter() - t0

    out, first = once()
    times = sorted(once()[1] for _ in range(reps))
    return out, first, times[len(times) // 2]


_AOTI_LOADER = textwrap.dedent("""
    import sys, torch
    import compiled_attn  # registers the compiled_attn ops the package calls
    pkg, io, out_path = sys.argv[1:4]
    args = torch.load(io)
    runner = torch._inductor.aoti_load_package(pkg)
    torch.save(runner(*args).cpu(), out_path)
""")


def model_demo() -> bool:
    """Section 2: tiny Llama eager vs compiled_attn.compile vs compiled_attn.export + AOTI."""
    from torch._inductor.utils import run_and_get_code

    from compiled_attn import fx_passes

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    bsz, seq = (2, 256) if cuda else (2, 32)
    model, cfg = _tiny_llama(dev, dtype)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (bsz, seq), generator=g).to(dev)
    am = torch.ones(bsz, seq, dtype=torch.long, device=dev)
    am[0, : seq // 4] = 0  # left padding on request 0: a custom (padding + causal) mask
    rows = am.bool()
    hd = cfg.hidden_size // cfg.num_attention_heads
    print(f"[2] tiny Llama on {dev.type} ({dtype}): {cfg.num_hidden_layers} layers, hidden "
          f"{cfg.hidden_size}, heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} (GQA), "
          f"head dim {hd}, sdpa attention; batch {bsz} x {seq} tokens, request 0 left-padded "
          f"by {seq // 4}")
    print("    ops run " + ("our Triton kernels" if cuda else "their PyTorch reference (CPU)"))
    reps = 10 if cuda else 3
    ok = True

    with torch.no_grad():
        ref, t_first, t_eager = _timed(lambda: model(ids, am), reps, cuda)
        ref64 = None
        scale = ref[rows].float().abs().max().item()
        if cuda:
            # Tolerance from PyTorch's own error: eager bf16 vs the same model in float64.
            m64, _ = _tiny_llama(torch.device("cpu"), torch.float64)
            ref64 = m64(ids.cpu(), am.cpu())
            eager_err = (ref.cpu().double() - ref64)[rows.cpu()].abs().max().item()
            tol = 4 * eager_err + 1e-2 * scale
        else:
            tol = 1e-4 * scale
        print(f"    {'path':<28} {'rewrites':<58} {'max |diff| vs eager':>20} "
              f"{'first call':>11} {'per call':>10}")
        print(f"    {'eager':<28} {'-':<58} {'-':>20} {t_first * 1e3:>9.1f}ms "
              f"{t_eager * 1e3:>8.2f}ms")

        def report(path, out, counters, first, per, extra=""):
            nonlocal ok
            err = (out.float().to(ref.device) - ref.float())[rows].abs().max().item()
            good = bool(torch.isfinite(out).all()) and err <= tol
            ok &= good
            rw = ", ".join(f"{k} {v}" for k, v in sorted(counters.items()) if v)
            print(f"    {path:<28} {rw:<58} {err:>20.2e} {first * 1e3:>9.1f}ms "
                  f"{per * 1e3:>8.2f}ms  {'ok' if good else 'FAILED (tolerance %.1e)' % tol}"
                  f"{extra}")

        # compiled_attn.compile (Inductor with the rewrite pass)
        _progress("compiling with compiled_attn.compile (Inductor: 10-40 s on 2 CPUs)")
        fx_passes.counters.clear()
        torch._dynamo.reset()
        with torch._inductor.config.patch(fx_graph_cache=False):
            compiled = fi.compile(model, fullgraph=True)
            t0 = time.perf_counter()
            out, code = run_and_get_code(compiled, ids, am)
            if cuda:
                torch.cuda.synchronize()
            first = time.perf_counter() - t0
        counters = dict(fx_passes.counters)
        _, _, per = _timed(lambda: compiled(ids, am), reps, cuda)
        code = "\n".join(code)
        extra = ""
        if cuda:
            launches = "_prefill_fwd" in code
            ok &= launches
            extra = ("; generated code launches our Triton kernel _prefill_fwd" if launches else
                     "; FAILED: generated code does not launch _prefill_fwd")
        ok &= counters.get("rewritten", 0) == cfg.num_hidden_layers
        report("compiled_attn.compile", out, counters, first, per, extra)

        # compiled_attn.export + AOTInductor
        _progress("exporting and building the AOTInductor package (10-35 s on 2 CPUs)")
        fx_passes.counters.clear()
        t0 = time.perf_counter()
        ep = fi.export(model, (ids, am))
        counters = dict(fx_passes.counters)
        ok &= counters.get("rewritten", 0) == cfg.num_hidden_layers
        with tempfile.TemporaryDirectory() as tmp:
            with warnings.catch_warnings():
                # AOTInductor deep-copies its graph, whose LeafSpec torch 2.13 itself deprecates:
                # a note about torch's internals, not about this demo's calls
                warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)`",
                                        category=FutureWarning)
                pkg = torch._inductor.aoti_compile_and_package(
                    ep, package_path=os.path.join(tmp, "tiny_llama.pt2"))
            t_build = time.perf_counter() - t0
            if not cuda:
                runner = torch._inductor.aoti_load_package(pkg)
                out, first, per = _timed(lambda: runner(ids, am), reps, cuda)
                report("export + AOTInductor", out, counters, t_build + first, per,
                       f" (build {t_build:.1f}s)")
            else:
                torch.save((ids, am), os.path.join(tmp, "io.pt"))
                res = subprocess.run(
                    [sys.executable, "-c", _AOTI_LOADER, pkg, os.path.join(tmp, "io.pt"),
                     os.path.join(tmp, "out.pt")], capture_output=True, text=True, timeout=300)
                if res.returncode == 0:
                    out = torch.load(os.path.join(tmp, "out.pt"))
                    report("export + AOTInductor", out, counters, t_build, float("nan"),
                           f" (package built in {t_build:.1f}s, loaded and run in a subprocess)")
                else:
                    tail = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["?"]
                    print(f"    {'export + AOTInductor':<28} package built in {t_build:.1f}s "
                          f"({', '.join(f'{k} {v}' for k, v in sorted(counters.items()) if v)});"
                          f" loading it FAILED in a subprocess (exit {res.returncode}: "
                          f"{tail[0][:160]}): on the GPU machine any AOTInductor package crashes "
                          "on load (python -m dev.gpu_aoti_probe), not checked here")
    print("  OK" if ok else "  FAILED")
    return ok


def _progress(what: str) -> None:
    """One line before a step that runs for a while, so the wait has a name."""
    print(f"    ... {what}", flush=True)


DEMO_EXTRA = "pip install 'compiled_attn[demo]'  (transformers)"


def _has_transformers() -> bool:
    return importlib.util.find_spec("transformers") is not None


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m compiled_attn",
        description="compiled_attn demo: [1] a paged prefill batch checked against the float64 "
                    "reference; [2] a tiny Llama (random weights, nothing downloaded) run eager, "
                    "through compiled_attn.compile and through compiled_attn.export + "
                    "AOTInductor, each checked against eager. On CPU the ops compute with their "
                    "PyTorch reference; on CUDA with our Triton kernels. Exits non-zero when a "
                    "check fails.",
        epilog=f"Section 2 needs transformers: {DEMO_EXTRA}. On 2 CPUs the whole demo takes "
               "about 1.5 minutes (two Inductor builds), --quick a few seconds.")
    p.add_argument("--quick", action="store_true",
                   help="section 1 only (seconds; no transformers needed)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    t0 = time.perf_counter()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    print(f"compiled_attn {fi.__version__} demo on {dev}, torch {torch.__version__}", flush=True)
    ok = paged_prefill_check()
    rc = 0 if ok else 1
    if not args.quick:
        if not _has_transformers():
            print(f"[2] tiny Llama: skipped, transformers is not installed; {DEMO_EXTRA}, "
                  "or run with --quick for section 1 alone")
            rc = rc or 2
        else:
            ok &= model_demo()
            rc = 0 if ok else 1
    verdict = "OK" if rc == 0 else ("FAILED" if rc == 1 else "INCOMPLETE")
    print(f"demo {verdict} in {time.perf_counter() - t0:.1f}s")
    return rc


if __name__ == "__main__":
    sys.exit(main())
