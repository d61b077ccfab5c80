"""Ragged A/B (dev tool): our ragged op on B equal causal requests under several variants
(tile height, K/V path), timed interleaved in one process (providers.bench: rounds
of slices in a fresh order, each slice settled first) beside SDPA flash, so that clock drift
cannot tilt the ratios the way it tilts back-to-back do_bench calls (whichever variant ran
first read up to 10% faster there). A variant is TILE:PATH: TILE a tile height (64, 128 or
prod, block_m_for's choice, launched with _config's BLOCK_N / warps / stages) or a whole tile
BM/BN/WARPS/STAGES (e.g. 256/64/16/3), and PATH a K/V path (a key of choose.KV_PATHS:
host, persistent, device, pointers). A third field pN runs the paged op instead, on page size N
with a shuffled page table (providers.scatter_pages; PATH gluon reads pages the Gluon kernel
takes by TMA boxes, every other PATH by the Triton kernel's pointer gathers), so
paged / ragged ratios come from one interleaved timing. List a variant twice for an A/A control:
its spread is the noise floor. A variant prev:BM/BN/WARPS/STAGES[:...] runs a gluon: variant on
another copy of ops/prefill_gluon.py (--prev FILE, e.g. the last commit's), for kernel A/B;
--prev A,B,... loads several, as prev:, prev1:, prev2:, ...

    python3 -m dev.dev_ab --cases 4096,8192 --variants prod:host,prod:host,256/64/16/3:host
    python3 -m dev.dev_ab --variants prod:host,prod:host:p16,256/64/16/3:host:p1
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from compiled_attn.ops import choose
from compiled_attn import ops
from compiled_attn.ops import prefill_kernel as K
from compiled_attn.ops.schedule import build_work

from benchmarks.flops import visible_pairs
from .kv_paths import forced_kv_path, forced_tile
from benchmarks.providers import bench, scatter_pages


@contextlib.contextmanager
def _variant(tile: str | None, path: str):
    """K/V path ``path`` and, when ``tile`` is BM/BN/WARPS/STAGES, that tile."""
    with forced_kv_path(path), (contextlib.nullcontext() if tile is None
                                else forced_tile(*(int(x) for x in tile.split("/")))):
        yield


def _load_prev(path, i=0):
    """The module at ``path``: another copy of ops/prefill_gluon.py (prev: variants), in our
    package's namespace (its relative imports)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"prev_prefill_gluon{i}", path)
    mod = importlib.util.module_from_spec(spec)
    mod.__package__ = "compiled_attn.ops"
    spec.loader.exec_module(mod)
    return mod


def _gluon_runner(var, q, k, v, qi, ki, b, qo, s, d, causal, group, caches, G):
    """The Gluon Hopper kernel (module G: ops/prefill_gluon.py or a prev: copy) on the same
    ragged inputs, called directly (output buffers allocated per call, as the op does); with a
    pN field, on the shuffled page-N caches of the paged variants (``caches``, filled on first
    use)."""
    _, tile, *opt = var.split(":")
    bm, bn, warps, stages = (int(x) for x in tile.split("/"))
    page = next((int(o[1:]) for o in opt if o[:1] == "p" and o[1:].isdigit()), 0)
    w = build_work([qo] * b, group, bm, "cuda", kv_lens=[s] * b)
    cfg = (bn, warps, stages, "r" not in opt, "ws" in opt, "pp" in opt)
    cfg = cfg[:len(next(iter(G.TILES.values())))]  # a prev: copy may take fewer fields
    if "ps" in opt or "np" in opt:  # persistent programs or a program per item (else default)
        cfg += ("ps" in opt, )
    if page and page not in caches:
        caches[page] = scatter_pages(k, v, [s] * b, page)

    def fn():
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if page:
            kc, vc, pi, perm, last = caches[page]
            return G.launch(q, G.kv_2d(kc, "paged"), G.kv_2d(vc, "paged"), out, lse, qi, pi, w,
                            dense=None, qk_scale=d ** -0.5 * K.LOG2E, causal=causal,
                            block_m=bm, tile=cfg, paged=(page, perm, last, G.page_rows(kc),
                                                         G.page_rows(vc)))
        return G.launch_ragged(q, k, v, qi, ki, w, out, lse, sm_scale=d ** -0.5, causal=causal,
                               block_m=bm, block_n=bn, stages=stages, num_warps=warps,
                               p_smem=cfg[3], ws=cfg[4],
                               **({"pingpong": cfg[5]} if cfg[5:] else {}))
    return fn


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="1024,2048,4096,8192", help="sequence lengths S")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=131072, help="B * S")
    ap.add_argument("--variants", default="prod:host,prod:host,prod:persistent",
                    help="TILE:PATH[:pPAGE], comma-separated")
    ap.add_argument("--qo", type=int, default=0,
                    help="query rows per request (default S; fewer: the last rows of each "
                         "request, FlashInfer's bottom-right causal alignment)")
    ap.add_argument("--kv-heads", type=int, default=0, help="KV heads (default --heads)")
    ap.add_argument("--mask", default="causal", choices=["causal", "none"])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rep-ms", type=float, default=1500.0)
    ap.add_argument("--cudnn", action="store_true", help="also time SDPA's cuDNN backend")
    ap.add_argument("--prev", default="", help="another prefill_gluon.py for prev: variants")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    from compiled_attn.ops import prefill_gluon

    mods = {"gluon": prefill_gluon}
    for i, path in enumerate(p for p in a.prev.split(",") if p):
        mods[f"prev{i or ''}"] = _load_prev(path, i)
    h, d, rows = a.heads, a.dim, []
    hkv, causal = a.kv_heads or h, a.mask == "causal"
    tail = (ops.MASK_CAUSAL if causal else ops.MASK_NONE, -1, 0, d ** -0.5, 0.0, 0, 1.0, 1e4,
            1.0, None)
    for s in (int(x) for x in a.cases.split(",")):
        b, qo = max(1, a.tokens // s), min(a.qo or s, s)
        q = torch.randn(b * qo, h, d, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(b * s, hkv, d, device="cuda", dtype=torch.bfloat16)
                for _ in range(2))
        qi = torch.arange(b + 1, device="cuda", dtype=torch.int32) * qo
        ki = torch.arange(b + 1, device="cuda", dtype=torch.int32) * s
        variants = a.variants.split(",")
        runners, outs, caches = [], [], {}
        for var in variants:
            if var.split(":")[0] in mods:  # gluon:BM/BN/WARPS/STAGES[:r][:ws][:pp]
                # [:ps|np][:pN] (r: P in registers; ws: warp-specialized, a load warp issuing
                # the TMAs; pp: ping-pong, two groups of WARPS / 2; ps / np: persistent programs
                # or not; pN: page N); prev: on --prev
                fn = _gluon_runner(var, q, k, v, qi, ki, b, qo, s, d, causal, h // hkv, caches,
                                   mods[var.split(":")[0]])
                outs.append(fn()[0].float())
                runners.append(([fn], contextlib.nullcontext))
                continue
            bm_s, path, *layout = var.split(":")
            page = int(layout[0][1:]) if layout else 0
            tile = bm_s if "/" in bm_s else None
            bm = (choose.tile(d, d, h // hkv, s, causal, page > 0, page_size=page,
                                qo_lens=[qo] * b)
                  if bm_s == "prod" else int(bm_s.split("/")[0]))
            w = build_work([qo] * b, h // hkv, bm, "cuda", kv_lens=[s] * b)
            if page:
                if page not in caches:  # shuffled pages (a partial last page when S % N)
                    caches[page] = scatter_pages(k, v, [s] * b, page)
                kc, vc, pi, perm, last = caches[page]
                fn = (lambda w=w, bm=bm, kc=kc, vc=vc, pi=pi, perm=perm, last=last:
                      ops.batch_paged_prefill(q, kc, vc, qi, pi, perm, last, w, None, None, None,
                                              None, bm, *tail))
            else:
                fn = (lambda w=w, bm=bm: ops.batch_ragged_prefill(q, k, v, qi, ki, w, None, None,
                                                                  None, None, bm, *tail))
            ctx = (lambda tile=tile, path=path: _variant(tile, path))
            with ctx():
                outs.append(fn()[0].float())
            runners.append(([fn], ctx))
        names = [f"{i}:{v}" for i, v in enumerate(variants)]
        if qo == s:  # SDPA's causal mask is FlashInfer's only for square requests
            qt = q.reshape(b, s, h, d).transpose(1, 2)
            kt, vt = (x.reshape(b, s, hkv, d).transpose(1, 2) for x in (k, v))
            sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
                qt, kt, vt, is_causal=causal, enable_gqa=hkv != h)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ref = sdpa().transpose(1, 2).reshape(b * s, h, d).float()
            runners.append(([sdpa], lambda: sdpa_kernel(SDPBackend.FLASH_ATTENTION)))
            names.append("sdpa_flash")
            if a.cudnn:  # the goal peer, timed in the same rounds
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    outs.append(sdpa().transpose(1, 2).reshape(b * s, h, d).float())
                runners.append(([sdpa], lambda: sdpa_kernel(SDPBackend.CUDNN_ATTENTION)))
                names.append("sdpa_cudnn")
        else:  # no peer: the variants are checked against the first
            ref = outs[0]
        # the variants differ from the reference by rounding only; NaN means a broken variant
        errs = [(o - ref).abs().max().item() for o in outs]
        if any(e != e for e in errs):
            raise RuntimeError(f"S {s}: NaN in the output of {variants}: {errs}")
        times = bench(runners, warmup_ms=50, rep_ms=a.rep_ms, cuda=True, rounds=a.rounds)
        flop = 4 * b * visible_pairs(qo, s, causal) * h * d  # the harness's count
        row = dict(s=s, qo=qo, b=b, h=h, hkv=hkv, d=d, causal=causal, max_err=max(errs),
                   err_vs="sdpa_flash" if qo == s else names[0])
        for name, t in zip(names, times):
            row[name] = flop / t.median_ms / 1e9 if t.error is None else repr(t.error)
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(a.out, "dev_ab.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n    S    B  variant                  TFLOP/s  / first  / flash  / cudnn")
    for r in rows:
        keys = [k for k in r if ":" in k]
        for kk in keys:
            x, x0, fl, cu = r[kk], r[keys[0]], r.get("sdpa_flash"), r.get("sdpa_cudnn")
            if not all(isinstance(y, float) for y in (x, x0)):
                print(f"{r['s']:5} {r['b']:4}  {kk:24} {x}")
                continue
            rel = f"{x / fl:7.3f}" if isinstance(fl, float) else "    n/a"
            rel += f" {x / cu:7.3f}" if isinstance(cu, float) else ""
            print(f"{r['s']:5} {r['b']:4}  {kk:24} {x:7.0f} {x / x0:8.3f} {rel}")


if __name__ == "__main__":
    main()
