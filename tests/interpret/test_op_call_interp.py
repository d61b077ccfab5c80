"""compiled_attn.op_call under the Triton interpreter: a plain eager call of a public entry point
runs the op's implementation directly, and gives the op's own result bit for bit (the op path
taken with op_call.DIRECT off)."""

import pytest
import torch

import compiled_attn as fi
from compiled_attn import op_call
from compiled_attn.ops import contracts
from tests.test_api_prefill import WS, indptr, make_paged, rand

QO, KV = [5, 0, 9], [13, 7, 9]
HQ, HKV, D, PAGE = 4, 2, 32, 4
F32 = torch.float32


def _call(entry):
    if entry == "single":
        q, k, v = rand(9, HQ, D, seed=1, dtype=F32), rand(13, HKV, D, seed=2, dtype=F32), \
            rand(13, HKV, D, seed=3, dtype=F32)
        return "single_prefill", lambda: fi.single_prefill_with_kv_cache(
            q, k, v, causal=True, return_lse=True)
    q = rand(sum(QO), HQ, D, seed=4, dtype=F32)
    if entry == "ragged":
        k, v = rand(sum(KV), HKV, D, seed=5, dtype=F32), rand(sum(KV), HKV, D, seed=6, dtype=F32)
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
        w.plan(indptr(QO), indptr(KV), HQ, HKV, D, causal=True, q_data_type=F32)
        return "batch_ragged_prefill", lambda: w.run(q, k, v, return_lse=True)
    # a shuffled page table with spare pages it never names
    cache, kvi, idx, last, _, _ = make_paged(KV, HKV, D, D, PAGE, dtype=F32, seed=7)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(indptr(QO), kvi, idx, last, HQ, HKV, D, PAGE, causal=True, q_data_type=F32)
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
