"""The Triton kernel's row-max output (save_softmax_stats) and skip-softmax rule under the
Triton interpreter, through trtllm_fmha_v2_prefill and the ragged / paged ops: split-KV
partials carry their maxima to the merge; a factor of 0 is the exact path bit for bit; skipped
tiles stay within the left-out mass's bound. fp16 / fp32 (the interpreter's bf16 is wrong)."""

import pytest
import torch

import compiled_attn
from compiled_attn.ops import schedule as plan
from compiled_attn.ops import MASK_CAUSAL, POS_NONE, reference
from compiled_attn.ops.choose import config as _config
from tests.helpers import (_build, _call, _seqs, check_skip, check_stats, peaked_seqs)

OPS = torch.ops.compiled_attn
TILE = _config(64, 16, 16)["BLOCK_N"]  # the interpreter's key tile


def test_interpreter_runs_the_kernel():
    assert compiled_attn.ops.contracts.INTERPRET


@pytest.mark.parametrize("layout", ["SEPARATE_Q_K_V", "Q_PAGED_KV_HND"])
@pytest.mark.parametrize("dtype,soft_cap", [(torch.float32, 0.0), (torch.float16, 1.5)])
def test_save_softmax_stats(layout, dtype, soft_cap):
    torch.manual_seed(len(layout))
    qo, kv = [5, 0, 40], [9, 4, 70]
    qs, ks, vs = _seqs(qo, kv, 4, 2, 16, 16, dtype=dtype)
    qkv, table = _build(layout, qs, ks, vs, seed=2, page=5, kv_dtype=dtype)
    cap = dict(logits_soft_cap_scale=soft_cap) if soft_cap else {}
    out, stats = _call(qkv, layout, table, qo, kv, save_softmax_stats=True, **cap)
    plain = _call(qkv, layout, table, qo, kv, **cap)
    assert torch.equal(out, plain)
    again, stats2 = _call(qkv, layout, table, qo, kv, save_softmax_stats=True, **cap)
    assert torch.equal(again, out) and torch.equal(stats2, stats)  # a bound launch's replay
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    check_stats(stats, qs, ks, bmm1_scale=0.3, soft_cap=soft_cap, rtol=tol, atol=tol)


def _ragged_op(qo, kv, work, bm, merge=None, dtype=torch.float32, ref_kw=None, **kw):
    """The ragged op on a fixed random batch, and the float64 reference (kw: row_max,
    skip_softmax; ref_kw: the reference's own, e.g. skip_tile)."""
    torch.manual_seed(5)
    hq, hkv, d = 4, 2, 16
    q = torch.randn(sum(qo), hq, d, dtype=dtype)
    k, v = torch.randn(sum(kv), hkv, d, dtype=dtype), torch.randn(sum(kv), hkv, d, dtype=dtype)
    qi = torch.tensor([0] + torch.tensor(qo).cumsum(0).tolist(), dtype=torch.int32)
    ki = torch.tensor([0] + torch.tensor(kv).cumsum(0).tolist(), dtype=torch.int32)
    tail = (MASK_CAUSAL, -1, 0, 0.3, 0.0, POS_NONE, 1.0, 1e4, 1.0, None)
    got = OPS.batch_ragged_prefill(q, k, v, qi, ki, work, None, None, None, None, bm, *tail,
                                   merge=merge, **kw)
    ref = reference.batch_ragged_prefill(
        q.double(), k.double(), v.double(), qi, ki, None, None, None, None,
        out_dtype=torch.float64, mask_mode=MASK_CAUSAL, window_left=-1, chunk_size=0,
        sm_scale=0.3, logits_soft_cap=0.0, pos_encoding_mode=POS_NONE, rope_scale=1.0,
        rope_theta=1e4, v_scale=1.0, **kw, **(ref_kw or {}))
    return got, ref


def test_row_max_through_split_kv():
    """Split-KV chunks store their maxima beside their LSEs; the merge keeps the largest."""
    qo, kv = [3, 2], [150, 90]
    bm = plan.block_m_for(16, 16, 2)
    work, merge = plan.build_split_work(qo, kv, 2, bm, 2, num_sms=64, min_keys_per_chunk=32)
    assert merge is not None and int(work[:, 3].max()) >= 3
    (o, st), (ro, rst) = _ragged_op(qo, kv, work, bm, merge, row_max=True)
    assert st.shape == (5, 4, 2) and not torch.isnan(st).any()
    torch.testing.assert_close(st.double(), rst.double(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(o.double(), ro, rtol=1e-5, atol=1e-5)
    (o1, l1), _ = _ragged_op(qo, kv, work, bm, merge)  # the same numbers without row_max
    assert torch.equal(o1, o) and torch.equal(l1, st[..., 0])


@pytest.mark.parametrize("layout", ["SEPARATE_Q_K_V", "Q_PAGED_KV_NHD"])
@pytest.mark.parametrize("mask_mode", ["causal", "padding"])
def test_skip_softmax(layout, mask_mode):
    qo, kv = [40, 3], [100, 70]
    qs, ks, vs = peaked_seqs(qo, kv, 4, 2, 16, TILE, dtype=torch.float32,
                             seed=len(layout) + len(mask_mode))
    qkv, table = _build(layout, qs, ks, vs, seed=1, page=16, kv_dtype=torch.float32)
    got = _call(qkv, layout, table, qo, kv, mask_mode=mask_mode, bmm1_scale=0.25,
                skip_softmax_threshold_scale_factor=4.0)
    check_skip(got, qs, ks, vs, sm_scale=0.25, factor=4.0, tile=TILE,
               causal=mask_mode == "causal", atol=1e-5, rtol=1e-5)


def test_skip_softmax_zero_is_bit_identical():
    qs, ks, vs = peaked_seqs([40, 3], [100, 70], 4, 2, 16, TILE, dtype=torch.float16, seed=4)
    qkv, _ = _build("SEPARATE_Q_K_V", qs, ks, vs)
    base = _call(qkv, "SEPARATE_Q_K_V", None, [40, 3], [100, 70])
    for f in (0, None):
        got = _call(qkv, "SEPARATE_Q_K_V", None, [40, 3], [100, 70],
                    skip_softmax_threshold_scale_factor=f)
        assert torch.equal(got, base)
    assert not torch.equal(base, _call(qkv, "SEPARATE_Q_K_V", None, [40, 3], [100, 70],
                                       skip_softmax_threshold_scale_factor=4.0))


def test_skip_softmax_matches_reference_tiles():
    """The op under the interpreter and the CPU reference with the same key tile agree on
    random data, where some tiles are skipped."""
    qo, kv = [3, 2], [150, 90]
    bm = plan.block_m_for(16, 16, 2)
    work = plan.build_work(qo, 2, bm)
    (o, lse), (ro, rlse) = _ragged_op(qo, kv, work, bm, skip_softmax=50.0,
                                      ref_kw=dict(skip_tile=TILE))
    _, (exact, _) = _ragged_op(qo, kv, work, bm)
    assert not torch.allclose(ro, exact, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(o.double(), ro, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), rlse.double(), rtol=1e-5, atol=1e-5)
