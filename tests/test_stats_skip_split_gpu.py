"""GPU tier (pytest -m gpu, bf16) of three FlashInfer options on the Triton kernel:
trtllm_fmha_v2_prefill(save_softmax_stats=True) checked the way FlashInfer's
tests/attention/test_fmha_v2_prefill.py checks it (LSE rebuilt from (max, sum)), split-KV
chunks carrying their row maxima to the merge, skip-softmax against a row-by-row float64 oracle
at the launch's key tile and within the left-out mass's bound, and fixed_split_size's batch
invariance as tests/attention/test_batch_invariant_fa2.py tests it. None of these may run the
Gluon kernel (it writes no row max and has no skip rule)."""

import math

import pytest
import torch

from compiled_attn.ops import choose
import compiled_attn
from compiled_attn.ops import schedule as plan
from compiled_attn.ops import MASK_CAUSAL, MASK_NONE, POS_NONE, policy, reference
from compiled_attn.ops import prefill_kernel as pk
from tests.helpers import batch_invariance, check_fixed_split_plan, dense_batch
from tests.helpers import check_stats, peaked_seqs, skip_oracle
from tests.helpers import dense_request

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
BF16 = torch.bfloat16


@pytest.fixture
def no_gluon(monkeypatch):
    """Fail any launch of the Gluon kernel (and forget bound launches decided before)."""
    if pk._gluon is not None:
        def boom(*a, **k):
            raise AssertionError("the Gluon kernel ran a launch that asked for the row max or "
                                 "skip-softmax")
        monkeypatch.setattr(pk._gluon, "launch", boom)
    policy.touch()
    yield
    policy.touch()


def _cum(lens, dev="cuda"):
    return torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32,
                        device=dev)


def _trtllm(qkv, layout, qo, kv, **kw):
    """trtllm_fmha_v2_prefill on CUDA copies of qkv (a tensor or tuple of CPU tensors)."""
    dev = lambda t: t.to("cuda")  # noqa: E731
    qkv = dev(qkv) if torch.is_tensor(qkv) else tuple(dev(t) for t in qkv)
    return compiled_attn.trtllm_fmha_v2_prefill(
        qkv, layout, torch.empty(16, dtype=torch.uint8, device="cuda"),
        torch.tensor(kv, dtype=torch.int32, device="cuda"), max_q_len=max(qo),
        max_kv_len=max(kv), batch_size=len(qo), cum_seq_lens_q=_cum(qo),
        cum_seq_lens_kv=_cum(kv), **kw)


def _seqs(qo, kv, hq, hkv, d, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda n, h: torch.randn(n, h, d, generator=g).to(BF16)  # noqa: E731
    return [mk(n, hq) for n in qo], [mk(n, hkv) for n in kv], [mk(n, hkv) for n in kv]


@pytest.mark.parametrize("d,hq,hkv", [(128, 32, 4), (128, 4, 4), (256, 8, 4)])
@pytest.mark.parametrize("soft_cap", [0.0, 30.0])
def test_trtllm_save_softmax_stats(d, hq, hkv, soft_cap, no_gluon):
    """CONTIGUOUS_Q_KV (the layout FlashInfer's stats test runs), causal, seq lens in
    [max/2, max], sm_scale 1/sqrt(D): out against the float64 oracle, stats in Hopper's
    encoding."""
    g = torch.Generator().manual_seed(d + hq)
    kv = torch.randint(128, 257, (3,), generator=g).tolist()
    qo = kv
    qs, ks, vs = _seqs(qo, kv, hq, hkv, d, seed=d + hq + 1)
    qkv = (torch.cat(qs), torch.stack([torch.cat(ks), torch.cat(vs)], 1))
    scale = 1.0 / math.sqrt(d)
    cap = dict(logits_soft_cap_scale=soft_cap) if soft_cap else {}
    out, stats = _trtllm(qkv, "CONTIGUOUS_Q_KV", qo, kv, bmm1_scale=scale, bmm2_scale=1.0,
                         save_softmax_stats=True, **cap)
    assert stats.dtype == torch.float32 and stats.shape == (sum(qo), hq, 2)
    # FlashInfer's tolerances for the rebuilt LSE (rtol 1e-2, atol 1e-2)
    check_stats(stats.cpu(), qs, ks, bmm1_scale=scale, soft_cap=soft_cap, rtol=1e-2, atol=1e-2)
    ref = torch.cat([dense_request(q, k, v, sm_scale=scale, causal=True, soft_cap=soft_cap)[0]
                     for q, k, v in zip(qs, ks, vs)])
    torch.testing.assert_close(out.cpu().double(), ref, rtol=2e-2, atol=2e-2)


def test_row_max_through_split_kv(no_gluon):
    """A split plan (few rows, long keys): each chunk's max reaches the merge."""
    qo, kv, hq, hkv, d = [16, 3], [8192, 3000], 16, 4, 128
    qs, ks, vs = _seqs(qo, kv, hq, hkv, d, seed=5)
    q, k, v = torch.cat(qs), torch.cat(ks), torch.cat(vs)
    bm = plan.block_m_for(d, d, hq // hkv, max(kv), True)
    work, merge = plan.build_split_work(qo, kv, hq // hkv, bm, hkv, "cuda")
    assert merge is not None
    tail = (MASK_CAUSAL, -1, 0, 1.0 / math.sqrt(d), 0.0, POS_NONE, 1.0, 1e4, 1.0, None)
    out, st = torch.ops.compiled_attn.batch_ragged_prefill(
        q.cuda(), k.cuda(), v.cuda(), _cum(qo), _cum(kv), work, None, None, None, None, bm,
        *tail, merge=merge.cuda(), row_max=True)
    ref_out, ref_st = reference.batch_ragged_prefill(
        q.double(), k.double(), v.double(), _cum(qo, "cpu"), _cum(kv, "cpu"), None, None, None,
        None, out_dtype=torch.float64, mask_mode=MASK_CAUSAL, window_left=-1, chunk_size=0,
        sm_scale=1.0 / math.sqrt(d), logits_soft_cap=0.0, pos_encoding_mode=POS_NONE,
        rope_scale=1.0, rope_theta=1e4, v_scale=1.0, row_max=True)
    assert not torch.isnan(st).any()
    torch.testing.assert_close(st.cpu().double(), ref_st.double(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=3e-2, atol=3e-2)


def _launch_tile(d, group, qo, kv, causal):
    """The key tile (BLOCK_N) of trtllm_fmha_v2_prefill's ragged launch for these lengths."""
    bm = plan.block_m_for(d, d, group, max(kv), causal, False, page_size=0, qo_lens=[max(qo)],
                          kv_dtype=BF16)
    return choose.config(bm, d, d, pk.KV_RAGGED, MASK_CAUSAL if causal else MASK_NONE)["BLOCK_N"]


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("mask_mode", ["causal", "padding"])
def test_trtllm_skip_softmax(d, mask_mode, no_gluon):
    qo, kv, hq, hkv = [64, 5], [1024, 700], 4, 2
    causal = mask_mode == "causal"
    tile = _launch_tile(d, hq // hkv, qo, kv, causal)
    scale = 1.0 / math.sqrt(d)
    # first-tile logits about 6 above the rest: with ln(4 / 1024) = -5.5 as the threshold,
    # most rows leave out some later tiles and keep others (left-out mass up to 3-5%)
    peak = math.sqrt(6.0 / (d * scale))
    qs, ks, vs = peaked_seqs(qo, kv, hq, hkv, d, tile, dtype=BF16, seed=d, peak=peak)
    qkv = (torch.cat(qs), torch.cat(ks), torch.cat(vs))
    run = lambda **kw: _trtllm(qkv, "SEPARATE_Q_K_V", qo, kv, bmm1_scale=scale,  # noqa: E731
                               bmm2_scale=1.0, mask_mode=mask_mode, **kw).cpu()
    got = run(skip_softmax_threshold_scale_factor=4.0)
    ref, exact, mass = skip_oracle(qs, ks, vs, sm_scale=scale, factor=4.0, tile=tile,
                                   causal=causal)
    assert not torch.isnan(got).any()
    assert float(mass.max()) > 1e-4  # the case skips something
    vmax = max(float(v.double().abs().max()) for v in vs)
    err = (got.double() - exact).abs().amax(-1)
    assert bool((err <= 2 * mass * vmax + 5e-3).all())
    assert float(err.max()) > 5e-3  # the approximation is in effect (exact: about 1-2e-2 away)
    # bf16 rounding of outputs of about 0.1: far below the skipped tiles' 1-2e-2
    torch.testing.assert_close(got.double(), ref, rtol=1e-2, atol=5e-3)


def test_trtllm_skip_softmax_zero_is_bit_identical():
    qs, ks, vs = _seqs([300, 40], [900, 512], 8, 2, 128, seed=8)
    qkv = (torch.cat(qs), torch.cat(ks), torch.cat(vs))
    base = _trtllm(qkv, "SEPARATE_Q_K_V", [300, 40], [900, 512], bmm1_scale=0.09,
                   bmm2_scale=1.0)
    for f in (0, 0.0, None):
        got = _trtllm(qkv, "SEPARATE_Q_K_V", [300, 40], [900, 512], bmm1_scale=0.09,
                      bmm2_scale=1.0, skip_softmax_threshold_scale_factor=f)
        assert torch.equal(got, base)


# FlashInfer's test_batch_prefill_tensor_cores grid, sampled: (batch, qo_len, kv_len, page,
# group, head dim, layout, pos encoding), 4 KV heads, invariant batch 2, fixed split 2048 pages.
INVARIANT_CASES = [
    (3, 128, 4096, 1, 1, 128, "NHD", "NONE"),
    (4, 256, 5000, 1, 4, 128, "HND", "NONE"),
    (3, 128, 5000, 16, 8, 128, "NHD", "ROPE_LLAMA"),
    (4, 256, 4096, 8, 4, 256, "HND", "NONE"),
]


@pytest.mark.parametrize("disable_split_kv", [False, True])
@pytest.mark.parametrize("case", INVARIANT_CASES, ids=lambda c: "-".join(map(str, c)))
def test_batch_prefill_invariant(case, disable_split_kv):
    bs, qo, kv, page, group, d, layout, pos = case
    plan_, *_ = batch_invariance(
        "paged", qo_lens=[qo] * bs, kv_lens=[kv] * bs, inv=2, page=page, hq=4 * group, hkv=4,
        d=d, fixed_split_size=None if disable_split_kv else 2048,
        disable_split_kv=disable_split_kv, layout=layout, pos_encoding_mode=pos, dtype=BF16,
        device="cuda", seed=bs + qo + page)
    if not disable_split_kv:
        check_fixed_split_plan_any(plan_, [qo] * bs, [kv] * bs, 2048 * page, group)


def check_fixed_split_plan_any(plan_, qo, kv, chunk_keys, group):
    """check_fixed_split_plan without requiring a split (2048 pages of 16 keys cover 5000)."""
    try:
        check_fixed_split_plan(plan_, qo, kv, chunk_keys, group)
    except AssertionError:
        assert chunk_keys >= max(kv) and plan_.work.shape[1] == 4
        assert int(plan_.work[:, 3].max()) == 1


@pytest.mark.parametrize("kind", ["paged", "ragged"])
def test_fixed_split_size_heterogeneous_batch(kind):
    """The request left out of the sub-batch is the longest: without fixed_split_size it
    would set the tile height (and the split) of the batch's plan; with it the shared
    requests' bits stay, and the output matches the float64 oracle."""
    qo, kv = [100, 37, 64], [1500, 700, 9000]
    plan_, out, lse, ks, vs, q = batch_invariance(
        kind, qo_lens=qo, kv_lens=kv, inv=2, page=16 if kind == "paged" else 1, hq=16,
        hkv=4, d=128, fixed_split_size=32 if kind == "paged" else 512, dtype=BF16,
        device="cuda", seed=3)
    check_fixed_split_plan(plan_, qo, kv, 512, 4)
    ref_out, _ = dense_batch(q.cpu().double(), qo, ks, vs, causal=True)
    torch.testing.assert_close(out.cpu().double(), ref_out, rtol=3e-2, atol=3e-2)
