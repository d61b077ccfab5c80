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
