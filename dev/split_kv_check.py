"""Split-KV on a decode-like batch (dev check): the wrapper's split plan against the same batch
with disable_split_kv=True, same inputs, one process; prints both times and the max difference."""

import torch

import compiled_attn
from benchmarks.providers import time_ms


def main():
    for qo, kv in (([1] * 8 + [16] * 8, [8192] * 16), ([1, 16], [32768, 32768])):
        case(qo, kv)


def case(qo, kv):
    torch.manual_seed(0)
    page, hq, hkv, d = 16, 32, 8, 128
    print(f"qo_lens {qo}, kv_lens {kv}, Hq {hq} / Hkv {hkv}, D {d}, page {page}")
    pages = [(n + page - 1) // page for n in kv]
    qi = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
    ki = torch.tensor([0] + torch.tensor(pages).cumsum(0).tolist(), dtype=torch.int32)
    idx = torch.randperm(sum(pages)).to(torch.int32)
    last = torch.tensor([(n - 1) % page + 1 for n in kv], dtype=torch.int32)
    cache = torch.randn(sum(pages), 2, page, hkv, d, device="cuda", dtype=torch.bfloat16)
    q = torch.randn(sum(qo), hq, d, device="cuda", dtype=torch.bfloat16)
    outs, times = [], []
    for disable in (True, False):
        w = compiled_attn.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1, device="cuda"))
        w.plan(qi, ki, idx, last, hq, hkv, d, page, causal=True, q_data_type=torch.bfloat16,
               disable_split_kv=disable)
        outs.append(w.run(q, cache))
        times.append(time_ms(lambda: w.run(q, cache), warmup_ms=25, rep_ms=100))
        print(f"disable_split_kv={disable}: work items {w._plan.work.shape[0]}, merge rows "
              f"{0 if w._plan.merge is None else w._plan.merge.shape[0]}, {times[-1]:.3f} ms")
    print(f"split-KV speedup {times[0] / times[1]:.2f}x, max |diff| "
          f"{(outs[0].float() - outs[1].float()).abs().max().item():.2e}")


if __name__ == "__main__":
    main()
