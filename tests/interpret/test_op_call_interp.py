"""compiled_attn.op_call under the Triton interpreter: a plain eager call of a public entry point
runs the op's implementation directly, and gives the op's own result bit for bit (the op path
taken with op_call.DIRECT off)."""

import pytest
import torch

import compiled_attn as fi
from compiled_attn import op_call
from compiled_attn.ops import contracts

WS = torch.empty(16, dtype=torch.uint8)
QO, KV = [5, 0, 9], [13, 7, 9]
HQ, HKV, D, PAGE = 4, 2, 32, 4


def _indptr(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)


def _call(entry):
    g = torch.Generator().manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float32)  # noqa: E731
    if entry == "single":
        q, k, v = rnd(9, HQ, D), rnd(13, HKV, D), rnd(13, HKV, D)
        return "single_prefill", lambda: fi.single_prefill_with_kv_cache(
            q, k, v, causal=True, return_lse=True)
    q = rnd(sum(QO), HQ, D)
    if entry == "ragged":
        k, v = rnd(sum(KV), HKV, D), rnd(sum(KV), HKV, D)
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
        w.plan(_indptr(QO), _indptr(KV), HQ, HKV, D, causal=True, q_data_type=torch.float32)
        return "batch_ragged_prefill", lambda: w.run(q, k, v, return_lse=True)
    pages = [-(-n // PAGE) for n in KV]
    total = sum(pages)
    cache = rnd(total + 3, 2, PAGE, HKV, D)  # spare pages the table never names
    idx = torch.randperm(total + 3, generator=g)[:total].to(torch.int32)
    last = torch.tensor([n - (p - 1) * PAGE for n, p in zip(KV, pages)], dtype=torch.int32)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(_indptr(QO), _indptr(pages), idx, last, HQ, HKV, D, PAGE, causal=True,
           q_data_type=torch.float32)
    return "batch_paged_prefill", lambda: w.run(q, cache, return_lse=True)


@pytest.mark.parametrize("entry", ["single", "ragged", "paged"])
def test_direct_call_is_the_op_bit_for_bit(entry, monkeypatch):
    name, run = _call(entry)
    calls = []
    impl = contracts.IMPLEMENTATIONS[name]
    monkeypatch.setitem(contracts.IMPLEMENTATIONS, name,
                        lambda *a, **k: calls.append(name) or impl(*a, **k))
    out, lse = run()
    assert calls == [name]  # the direct path ran (the op holds its own reference to impl)
    monkeypatch.setattr(op_call, "DIRECT", False)
    ref_out, ref_lse = run()
    assert calls == [name]
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
