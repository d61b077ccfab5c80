"""fixed_split_size (FlashInfer's batch-invariant mode) on the Triton kernel under the
interpreter: every tile cut into fixed-size key chunks merged by _merge_fwd, and a sub-batch
re-planned with the same buffers giving the shared requests' output and LSE bit for bit
(tests/test_api_prefill.py batch_invariance, after FlashInfer's test_batch_invariant_fa2)."""

import pytest
import torch

from tests.helpers import (batch_invariance, check_fixed_split_plan, dense_batch)


@pytest.mark.parametrize("kind,layout,page,dtype", [
    ("paged", "NHD", 4, torch.float16),
    ("paged", "HND", 16, torch.float32),
    ("ragged", "NHD", 1, torch.float16),
])
def test_fixed_split_size_batch_invariant(kind, layout, page, dtype):
    qo, kv = [4, 2, 6], [50, 30, 90]
    split = 32 // page  # chunks of 32 keys: whole key blocks of the interpreter's tiles
    plan, out, lse, ks, vs, q = batch_invariance(
        kind, qo_lens=qo, kv_lens=kv, inv=2, page=page, fixed_split_size=split,
        layout=layout, dtype=dtype, seed=70)
    assert plan.merge is not None
    check_fixed_split_plan(plan, qo, kv, split * page, 2)
    ref_out, ref_lse = dense_batch(q.double(), qo, ks, vs, causal=True)
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    torch.testing.assert_close(out.double(), ref_out, rtol=tol, atol=tol)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)


def test_disable_split_kv_batch_invariant():
    """disable_split_kv=True (FlashInfer's other batch-invariant case): no chunks at all."""
    plan, *_ = batch_invariance("paged", qo_lens=[5, 2, 7], kv_lens=[60, 33, 90], inv=2,
                                page=8, fixed_split_size=2, disable_split_kv=True,
                                dtype=torch.float16, seed=71)
    assert plan.work.shape[1] == 2 and plan.merge is None


def test_cuda_graph_plans_split_kv(monkeypatch):
    """use_cuda_graph=True plans whose first plan's tiles leave SMs idle (here 3 decode tiles x
    2 KV heads on 132 SMs) split KV in every plan, as eager plans do: their chunk rows and
    merge rows live in fixed buffers padded with request -1 (the merge kernel's padding rows
    store nothing). Re-plans with other lengths, one that splits nothing and one with
    disable_split_kv, each against the float64 reference; chunks of 16 keys keep it small."""
    import functools

    import compiled_attn as fi
    from compiled_attn import prefill
    from compiled_attn.ops import schedule
    from tests.helpers import WS, indptr, make_paged, paged_graph_bufs, rand

    monkeypatch.setattr(fi.BatchPrefillWithPagedKVCacheWrapper, "_graph_split_sms",
                        lambda self: 132)
    monkeypatch.setattr(prefill, "build_split_work",
                        functools.partial(schedule.build_split_work, min_keys_per_chunk=16))
    page, hq, hkv, d, b, dt = 4, 4, 2, 16, 3, torch.float32
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NHD", True, **paged_graph_bufs(b, 128))
    ids = None
    plans = [([1, 1, 1], [100, 37, 0], False, 2), ([1, 0, 1], [20, 5, 300], False, 1),
             ([1, 1, 1], [50, 50, 50], True, 0), ([1, 1, 0], [3, 1, 0], False, 0)]
    for seed, (qo, kv, no_split, merges) in enumerate(plans):
        cache, kvi, idx, last, ks, vs = make_paged(kv, hkv, d, d, page, seed=80 + seed)
        w.plan(indptr(qo), kvi, idx, last, hq, hkv, d, page, causal=True, q_data_type=dt,
               disable_split_kv=no_split)
        p = w._plan
        ids = ids or (p.work.data_ptr(), p.merge.data_ptr())
        assert (p.work.data_ptr(), p.merge.data_ptr()) == ids  # what a graph replays
        assert p.work.shape[1] == 4 and int((p.merge[:, 0] >= 0).sum()) == merges
        assert torch.all(p.merge[merges:] == torch.tensor([-1, 0, 0, 0], dtype=torch.int32))
        out, lse = w.run(rand(sum(qo), hq, d, seed=90 + seed, dtype=dt),
                         cache.to(dt), return_lse=True)
        q = rand(sum(qo), hq, d, seed=90 + seed, dtype=dt)
        ref_out, ref_lse = dense_batch(q.double(), qo, ks, vs, causal=True)
        torch.testing.assert_close(out.double(), ref_out, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-4, atol=1e-4)
