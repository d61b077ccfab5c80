"""Dev probe: can page-16 K/V go through tensor descriptors (TMA) on Hopper without a gather?
Hopper's TMA cannot gather rows through a page table, but one page of one head ([16, D] rows
of the cache seen as [pages * 16, Hkv * D]) is a plain box. This standalone non-causal kernel
(not our prefill kernel) loads a 64-key tile as four such page boxes and never assembles them:
four [BLOCK_M, 16] score blocks share one running max, and the P @ V product is four K = 16
dots into one accumulator. It is timed against the same loop reading contiguous K/V through
[BLOCK_N, D] boxes, in one process, and checked against SDPA (outputs poisoned first). Run on
the GPU machine: ``python3 -m dev.paged_tma_probe``; writes paged_tma_probe.json under
$OUT (benchmarks/NOTES.md, 2026-11-22)."""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from benchmarks.providers import time_ms
from compiled_attn.ops.modes import LOG2E

PAGE = 16


@triton.jit
def _softmax_step(s, m_i, qk_scale):
    """Running max after a [BLOCK_M, N] score block (unscaled scores, scale folded in)."""
    return tl.maximum(m_i, tl.max(s, 1) * qk_scale)


@triton.jit
def _contig(q_desc, k_desc, v_desc, o_ptr, S, H, qk_scale, BM: tl.constexpr, BN: tl.constexpr,
            D: tl.constexpr, STAGES: tl.constexpr):
    """q, k, v, o: [B * S, H * D]; one BM-row tile of one (batch, head), all S keys."""
    m0 = tl.program_id(0) * BM
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    q = q_desc.load([b * S + m0, h * D])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    for n in tl.range(0, S, BN, num_stages=STAGES):
        k = k_desc.load([b * S + n, h * D])
        s = tl.dot(q, k.T)
        m_new = _softmax_step(s, m_i, qk_scale)
        p = tl.math.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = v_desc.load([b * S + n, h * D])
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    rows = (b * S + m0 + tl.arange(0, BM)).to(tl.int64)
    cols = h * D + tl.arange(0, D)
    tl.store(o_ptr + rows[:, None] * (H * D) + cols[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


@triton.jit
def _paged4(q_desc, k_desc, v_desc, pt_ptr, o_ptr, S, H, qk_scale, BM: tl.constexpr,
            D: tl.constexpr, STAGES: tl.constexpr):
    """As _contig with 64-key tiles, K/V from a page-16 cache seen as [pages * 16, H * D]
    through [16, D] page boxes; pt: int32 [B, S // 16] page table. The tile's four page
    indices are read one tile ahead (loop-carried)."""
    m0 = tl.program_id(0) * BM
    b = tl.program_id(1) // H
    h = tl.program_id(1) % H
    npg = S // 16
    q = q_desc.load([b * S + m0, h * D])
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D], tl.float32)
    row = pt_ptr + b * npg
    p0 = tl.load(row)
    p1 = tl.load(row + 1)
    p2 = tl.load(row + 2)
    p3 = tl.load(row + 3)
    for n in tl.range(0, S, 64, num_stages=STAGES):
        k0 = k_desc.load([p0 * 16, h * D])
        k1 = k_desc.load([p1 * 16, h * D])
        k2 = k_desc.load([p2 * 16, h * D])
        k3 = k_desc.load([p3 * 16, h * D])
        s0 = tl.dot(q, k0.T)
        s1 = tl.dot(q, k1.T)
        s2 = tl.dot(q, k2.T)
        s3 = tl.dot(q, k3.T)
        m_new = _softmax_step(s0, m_i, qk_scale)
        m_new = _softmax_step(s1, m_new, qk_scale)
        m_new = _softmax_step(s2, m_new, qk_scale)
        m_new = _softmax_step(s3, m_new, qk_scale)
        e0 = tl.math.exp2(s0 * qk_scale - m_new[:, None])
        e1 = tl.math.exp2(s1 * qk_scale - m_new[:, None])
        e2 = tl.math.exp2(s2 * qk_scale - m_new[:, None])
        e3 = tl.math.exp2(s3 * qk_scale - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(e0, 1) + tl.sum(e1, 1) + tl.sum(e2, 1) + tl.sum(e3, 1)
        v0 = v_desc.load([p0 * 16, h * D])
        v1 = v_desc.load([p1 * 16, h * D])
        v2 = v_desc.load([p2 * 16, h * D])
        v3 = v_desc.load([p3 * 16, h * D])
        acc = tl.dot(e0.to(v0.dtype), v0, acc * alpha[:, None])
        acc = tl.dot(e1.to(v1.dtype), v1, acc)
        acc = tl.dot(e2.to(v2.dtype), v2, acc)
        acc = tl.dot(e3.to(v3.dtype), v3, acc)
        m_i = m_new
        nxt = n // 16 + 4
        ok = nxt < npg
        p0 = tl.load(row + nxt, mask=ok, other=0)
        p1 = tl.load(row + nxt + 1, mask=ok, other=0)
        p2 = tl.load(row + nxt + 2, mask=ok, other=0)
        p3 = tl.load(row + nxt + 3, mask=ok, other=0)
    rows = (b * S + m0 + tl.arange(0, BM)).to(tl.int64)
    cols = h * D + tl.arange(0, D)
    tl.store(o_ptr + rows[:, None] * (H * D) + cols[None, :], (acc / l_i[:, None]).to(tl.bfloat16))


def _tflops(b, s, h, d, ms):
    return 4 * b * s * s * h * d / ms / 1e9


def main():
    torch.manual_seed(0)
    rows = []
    d = 128
    for b, s, h in ((32, 1024, 32), (8, 4096, 32), (1, 32768, 32)):
        q, k, v = (torch.randn(b * s, h * d, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        ref = torch.nn.functional.scaled_dot_product_attention(
            *(t.view(b, s, h, d).transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
        ref = ref.reshape(b * s, h * d).float()
        npg = b * s // PAGE
        perm = torch.randperm(npg, device="cuda")
        kc = torch.empty(npg, PAGE, h * d, device="cuda", dtype=torch.bfloat16)
        vc = torch.empty_like(kc)
        kc[perm] = k.view(npg, PAGE, h * d)
        vc[perm] = v.view(npg, PAGE, h * d)
        pt = perm.to(torch.int32).view(b, s // PAGE).contiguous()
        kc2, vc2 = kc.view(npg * PAGE, h * d), vc.view(npg * PAGE, h * d)
        scale = d ** -0.5 * LOG2E
        for bm, nw in ((128, 8), (64, 4)):
            for stages in (2, 3, 4):
                o = torch.full_like(q, float("nan"))
                qd = TensorDescriptor(q, list(q.shape), list(q.stride()), [bm, d])
                grid = (s // bm, b * h)
                variants = {}
                for bn in (64, 128):
                    kd = TensorDescriptor(k, list(k.shape), list(k.stride()), [bn, d])
                    vd = TensorDescriptor(v, list(v.shape), list(v.stride()), [bn, d])
                    variants[f"contig{bn}"] = lambda kd=kd, vd=vd, bn=bn: _contig[grid](
                        qd, kd, vd, o, s, h, scale, bm, bn, d, stages, num_warps=nw,
                        num_stages=stages)
                kpd = TensorDescriptor(kc2, list(kc2.shape), list(kc2.stride()), [PAGE, d])
                vpd = TensorDescriptor(vc2, list(vc2.shape), list(vc2.stride()), [PAGE, d])
                variants["paged4"] = lambda: _paged4[grid](
                    qd, kpd, vpd, pt, o, s, h, scale, bm, d, stages, num_warps=nw,
                    num_stages=stages)
                for name, fn in variants.items():
                    r = dict(B=b, S=s, H=h, cfg=f"{bm}/{nw}w/{stages}s", kernel=name)
                    try:
                        o.fill_(float("nan"))
                        fn()
                        torch.cuda.synchronize()
                        r["err"] = (o.float() - ref).abs().max().item()
                        ms = time_ms(fn, warmup_ms=100, rep_ms=400)
                        r["tflops"] = round(_tflops(b, s, h, d, ms), 1)
                    except Exception as e:  # a config that fails to compile is reported
                        r["error"] = f"{type(e).__name__}: {str(e)[-160:]}"
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "paged_tma_probe.json"), "w") as f:
        json.dump(rows, f, indent=1)
    print("\n   B      S  cfg         contig64 contig128 paged4  (TFLOP/s, non-causal, D128)")
    keys = sorted({(r["B"], r["S"], r["cfg"]) for r in rows}, key=lambda x: (x[1], x[2]))
    for key in keys:
        got = {r["kernel"]: r for r in rows if (r["B"], r["S"], r["cfg"]) == key}
        cell = lambda r: (f"{r['tflops']:8.1f}" + ("!" if not r["err"] < 0.05 else " ")
                          if "tflops" in r else "    fail ")
        print(f"{key[0]:4} {key[1]:6}  {key[2]:10} " +
              " ".join(cell(got[n]) for n in ("contig64", "contig128", "paged4")))


if __name__ == "__main__":
    main()
