"""End-to-end: a Llama-3-8B-shaped stack (hidden 4096, 32 heads, 8 KV heads, head dim 128,
intermediate 14336, 4 layers, random weights, bf16, transformers' LlamaModel with sdpa
attention), one 4096-token prompt, batch 1, timed four ways on one GPU: eager, plain
``torch.compile(model)``, ``compiled_attn.compile(model)`` (the same with the attention
rewrite into our ops: the Gluon kernel on Hopper through compiled_attn.graph_dispatch) and
the same with graph_dispatch off (the Triton kernel inlined, as AOTInductor packages it).
Medians of CUDA-event timings after warm-up; TFLOP/s counts the linear layers (2 * tokens *
weights) plus causal attention (2 * 2 * S^2 * H * D / 2 per layer). Checks the rewrite count
(one per layer, nothing skipped; compiles run with Inductor's caches off, which would otherwise
serve a graph without running the rewrite) and that compiled_attn's output agrees with plain
torch.compile's and eager's; writes benchmarks/results/e2e_llama_<gpu>.json and prints a
one-line summary.

Run on the GPU machine from the repository root: ``python3 -m benchmarks.e2e_llama``
(about 1-3 minutes, mostly the three Inductor compiles).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 4, 4096, 32, 8, 128, 14336, 128256


def flops(seq: int) -> float:
    per_layer_weights = HIDDEN * (HEADS * HEAD_DIM) * 2 + HIDDEN * (KV_HEADS * HEAD_DIM) * 2 \
        + 3 * HIDDEN * INTER
    linear = 2.0 * seq * per_layer_weights * LAYERS
    attn = 2.0 * 2.0 * seq * seq * HEADS * HEAD_DIM / 2 * LAYERS  # causal: half the pairs
    return linear + attn


def time_ms(fn, warmup: int, reps: int) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.float(), b.float()
    return ((a - b).norm() / b.norm()).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default=None, help="results JSON (default results/e2e_llama_h100"
                    ".json beside this file on an H100, else e2e_llama_<gpu>.json)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("e2e_llama: needs a CUDA GPU", file=sys.stderr)
        return 2
    import transformers

    import compiled_attn
    from compiled_attn import fx_passes, graph_dispatch

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from benchmarks.compile_path import caches_off
    from benchmarks.results import environment

    t_start = time.perf_counter()
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
        max_position_embeddings=8192, rope_theta=500000.0, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaModel(cfg).to(torch.bfloat16).eval()
    ids = torch.randint(0, VOCAB, (1, args.seq), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(1))

    def runner(m):
        return lambda: m(input_ids=ids, use_cache=False).last_hidden_state

    rows, outs, ms = [], {}, {}
    total = flops(args.seq)
    with torch.no_grad():
        providers = [("eager_sdpa", lambda: model), ("torch_compile", lambda: torch.compile(model)),
                     ("compiled_attn_compile", lambda: compiled_attn.compile(model)),
                     ("compiled_attn_compile_triton", lambda: compiled_attn.compile(model))]
        for name, make in providers:
            torch._dynamo.reset()
            fx_passes.counters.clear()
            m = make()
            t0 = time.perf_counter()
            # compiled_attn_compile_triton: the rewrite with graph_dispatch off, so every call
            # inlines the Triton kernel (what compiled graphs ran before the 20th session)
            graph_dispatch.GRAPH_GLUON = name != "compiled_attn_compile_triton"
            try:
                with caches_off():  # a fresh compile: the rewrite runs and counts
                    outs[name] = runner(m)()  # first call compiles
            finally:
                graph_dispatch.GRAPH_GLUON = True
            torch.cuda.synchronize()
            t_first = time.perf_counter() - t0
            if name.startswith("compiled_attn_compile"):
                c = dict(fx_passes.counters)
                skipped = {k: v for k, v in c.items() if k.startswith("skipped:")}
                if c.get("rewritten") != LAYERS or skipped:
                    print(f"e2e_llama: expected {LAYERS} rewrites, none skipped; got {c}",
                          file=sys.stderr)
                    return 1
                rewrites = c
            ms[name] = time_ms(runner(m), warmup=3, reps=args.reps)
            rows.append({"suite": "e2e_llama", "case": f"llama3-8b-shape L{LAYERS} B1 S{args.seq}",
                         "provider": name, "median_ms": ms[name],
                         "tflops": total / (ms[name] * 1e-3) / 1e12,
                         "first_call_s": round(t_first, 2), "B": 1, "S": args.seq,
                         "layers": LAYERS, "Hq": HEADS, "Hkv": KV_HEADS, "D": HEAD_DIM,
                         "dtype": "bfloat16", "status": "ok"})
            del m

    err_vs_compile = rel_err(outs["compiled_attn_compile"], outs["torch_compile"])
    err_vs_eager = rel_err(outs["compiled_attn_compile"], outs["eager_sdpa"])
    err_compile_eager = rel_err(outs["torch_compile"], outs["eager_sdpa"])
    err_triton = rel_err(outs["compiled_attn_compile_triton"], outs["eager_sdpa"])
    ratio = ms["torch_compile"] / ms["compiled_attn_compile"]
    ratio_triton = ms["torch_compile"] / ms["compiled_attn_compile_triton"]
    for r in rows:
        if r["provider"] == "compiled_attn_compile":
            r.update(ratio_vs_torch_compile=ratio, rel_err_vs_torch_compile=err_vs_compile,
                     rel_err_vs_eager=err_vs_eager, rewrites=rewrites)
        if r["provider"] == "compiled_attn_compile_triton":
            r.update(ratio_vs_torch_compile=ratio_triton, rel_err_vs_eager=err_triton)
        if r["provider"] == "torch_compile":
            r["rel_err_vs_eager"] = err_compile_eager
    # Outputs agree: compiled_attn's distance to eager at most twice plain torch.compile's
    # (both bf16), with a floor of 1e-2 relative (the norm of the whole hidden state).
    bound = max(2 * err_compile_eager, 1e-2)
    agree = err_vs_eager <= bound and err_vs_compile <= bound and err_triton <= bound
    env = environment()
    out = Path(args.out) if args.out else Path(__file__).resolve().parent / "results" / (
        "e2e_llama_h100.json" if "H100" in env["gpu"] else
        f"e2e_llama_{env['gpu'].replace(' ', '_').lower()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({**env, "rows": rows}, indent=1) + "\n")
    print(f"e2e_llama ({env['gpu']}, torch {env['torch']}, triton {env['triton']}): Llama-3-8B "
          f"shape x{LAYERS} layers, 1x{args.seq} tokens bf16: eager {ms['eager_sdpa']:.2f} ms, "
          f"torch.compile {ms['torch_compile']:.2f} ms, compiled_attn.compile "
          f"{ms['compiled_attn_compile']:.2f} ms -> {ratio:.3f}x vs torch.compile (Triton "
          f"kernel in the graph: {ms['compiled_attn_compile_triton']:.2f} ms, "
          f"{ratio_triton:.3f}x); rel err vs "
          f"torch.compile {err_vs_compile:.2e}, vs eager {err_vs_eager:.2e} (torch.compile vs "
          f"eager {err_compile_eager:.2e}) {'agree' if agree else 'DISAGREE'}; "
          f"{time.perf_counter() - t_start:.0f}s total; wrote {out}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
