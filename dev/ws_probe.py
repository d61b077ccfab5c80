"""Dev probe: does Triton's automatic warp specialisation (``tl.range(...,
warp_specialize=True)``) compile, stay correct and pay for a minimal non-causal attention loop
on this GPU? A standalone kernel (host tensor descriptors for Q, K, V, O; not our prefill
kernel), timed with and without the attribute for a few tiles against SDPA's output; prints a
table and writes ws_probe.json under $OUT. Run on the GPU machine: ``python3 -m
dev.ws_probe``. H100, triton 3.6 (benchmarks/NOTES.md, 2026-11-22): no gain where it
compiles, wrong output (NaN) at 64x64 / 4 warps, compile failures for 128-row 4-warp tiles;
worth re-running on a newer Triton."""
import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.providers import time_ms
from compiled_attn.ops.modes import LOG2E


@triton.jit
def _probe(q_desc, k_desc, v_desc, o_desc, S, qk_scale, BM: tl.constexpr, BN: tl.constexpr,
           D: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    """One BM-row tile of one (batch, head): online softmax over all S keys (no mask)."""
    m0 = tl.program_id(0) * BM
    bh = tl.program_id(1)
    row = bh * S
    q = q_desc.load([row + m0, 0])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for n in tl.range(0, S, BN, num_stages=STAGES, warp_specialize=WS):
        k = k_desc.load([row + n, 0])
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([row + n, 0])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    o_desc.store([row + m0, 0], (acc / l_i[:, None]).to(o_desc.dtype))


def run(bm, bn, nw, ns, ws, B, H, S, D=128):
    """(max abs error against SDPA, TFLOP/s) of the probe with this tile and WS setting; q, k,
    v, o are [B * H * S, D] bf16 (head-major rows)."""
    dev = "cuda"
    q, k, v = (torch.randn(B * H * S, D, device=dev, dtype=torch.bfloat16) for _ in range(3))
    o = torch.full_like(q, float("nan"))  # poisoned: rows the kernel skips stay NaN
    mk = lambda t, r: TensorDescriptor(t, list(t.shape), list(t.stride()), [r, D])
    qd, kd, vd, od = mk(q, bm), mk(k, bn), mk(v, bn), mk(o, bm)
    grid = (S // bm, B * H)
    f = lambda: _probe[grid](qd, kd, vd, od, S, D ** -0.5 * LOG2E, bm, bn, D,
                             ws, ns, num_warps=nw, num_stages=ns)
    f()
    torch.cuda.synchronize()
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.view(B, H, S, D) for t in (q, k, v))).reshape(B * H * S, D)
    err = (o.float() - ref.float()).abs().max().item()
    ms = time_ms(f, warmup_ms=100, rep_ms=400)
    return err, 4 * B * H * S * S * D / ms / 1e9


if __name__ == "__main__":
    rows = []
    for S in (4096, 16384):
        B, H = max(1, 16384 // S), 16
        for bm, bn, nw, ns in ((128, 128, 8, 3), (128, 128, 4, 3), (128, 64, 4, 3),
                               (64, 64, 4, 3), (128, 128, 8, 2), (128, 64, 8, 3)):
            for ws in (False, True):
                try:
                    err, tf = run(bm, bn, nw, ns, ws, B, H, S)
                    r = dict(S=S, cfg=f"{bm}x{bn}/{nw}w/{ns}s", ws=ws, tflops=round(tf, 1), err=err)
                except Exception as e:
                    r = dict(S=S, cfg=f"{bm}x{bn}/{nw}w/{ns}s", ws=ws,
                             error=f"{type(e).__name__}: {str(e)[-200:]}")
                rows.append(r)
                print(json.dumps(r), flush=True)
    json.dump(rows, open(os.path.join(os.environ.get("OUT", "."), "ws_probe.json"), "w"), indent=1)
    print("\nS      cfg              ws    TFLOP/s   err")
    for r in rows:
        res = f"{r['tflops']:8.1f}  {r['err']:.1e}" if "tflops" in r else r["error"][:90]
        print(f"{r['S']:6} {r['cfg']:16} {str(r['ws']):5} {res}")
