"""``python -m compiled_attn``: the demo. Plans and runs one batch of paged prefill requests
(odd lengths, one request with more queries than keys, an empty one; page size 16, GQA 4:1,
causal) through BatchPrefillWithPagedKVCacheWrapper on CUDA when available (bf16), else on CPU
(float32), checks the output and LSE against ``compiled_attn.ops.reference`` in float64, and
prints what it did: shapes, max errors, time per run. Exits non-zero when the check fails.
"""

from __future__ import annotations

import sys
import time

import torch

import compiled_attn as fi
from compiled_attn.ops import MASK_CAUSAL, POS_NONE, reference


def main() -> int:
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

    print(f"compiled_attn {fi.__version__} demo on {dev.type} ({dtype}), torch {torch.__version__}")
    print(f"  paged prefill: {len(qo_lens)} requests, qo_lens {qo_lens}, kv_lens {kv_lens}")
    print(f"  Hq {hq} / Hkv {hkv} (GQA {hq // hkv}:1), head dim {d}, page size {page}, causal, "
          f"cache {tuple(cache.shape)}")
    print(f"  q {tuple(q.shape)} -> out {tuple(out.shape)} {out.dtype}, lse {tuple(lse.shape)} "
          f"{lse.dtype} (base 2)")
    print(f"  vs ops.reference in float64: max |out err| {err_out:.2e}, max |lse err| "
          f"{err_lse:.2e} (tolerance {tol:.0e}), empty rows -inf: {lse_ok}")
    print(f"  plan {t_plan * 1e3:.2f} ms, run {t_run * 1e3:.2f} ms")
    print("  OK" if ok else "  FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
