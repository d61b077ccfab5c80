"""Bad inputs: each raises the right error type with a message that names the argument and
says how to fix it."""

from __future__ import annotations

import functools

import pytest
import torch

import compiled_attn as fi
from compiled_attn import _validate as V

from .helpers import D64, WS, indptr, make_paged, rand

QO, KV, PAGE, HQ, HKV, D = [3, 4], [5, 9], 4, 4, 2, 8


@pytest.fixture()
def paged():
    cache, kvi, idx, last, _, _ = make_paged(KV, HKV, D, D, PAGE, spare_pages=0)
    return cache, kvi, idx, last


def plan_paged(paged, **kw):
    cache, kvi, idx, last = paged
    args = dict(qo_indptr=indptr(QO), paged_kv_indptr=kvi, paged_kv_indices=idx,
                paged_kv_last_page_len=last, num_qo_heads=HQ, num_kv_heads=HKV, head_dim_qk=D,
                page_size=PAGE, q_data_type=D64)
    args.update(kw)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    w.plan(**args)
    return w


PLAN_ERRORS = [
    (dict(qo_indptr=torch.tensor([1, 3, 7], dtype=torch.int32)), ValueError,
     r"qo_indptr: must start at 0; got qo_indptr\[0\] = 1"),
    (dict(qo_indptr=torch.tensor([0, 5, 3], dtype=torch.int32)), ValueError,
     r"qo_indptr: must be non-decreasing; qo_indptr\[2\] = 3 < qo_indptr\[1\] = 5"),
    (dict(qo_indptr=torch.tensor([0.0, 3.0, 7.0])), TypeError, "qo_indptr: expected an integer"),
    (dict(paged_kv_indptr=torch.tensor([0, 2], dtype=torch.int32)), ValueError,
     r"paged_kv_indptr: has 2 entries but batch_size \+ 1 = 3"),
    (dict(paged_kv_indices=torch.tensor([0, 1, 2, 3], dtype=torch.int32)), ValueError,
     r"paged_kv_indptr: ends at 5 but paged_kv_indices holds only 4 entries"),
    (dict(paged_kv_indices=torch.tensor([0, 1, -2, 3, 4], dtype=torch.int32)), ValueError,
     "paged_kv_indices: entry 2 is -2; page indices must be >= 0"),
    (dict(paged_kv_last_page_len=torch.tensor([0, 1], dtype=torch.int32)), ValueError,
     r"paged_kv_last_page_len: entry 0 is 0 but must be in \[1, page_size\] with page_size = 4"),
    (dict(paged_kv_last_page_len=torch.tensor([1, 5], dtype=torch.int32)), ValueError,
     r"paged_kv_last_page_len: entry 1 is 5"),
    (dict(paged_kv_indptr=torch.tensor([0, 0, 5], dtype=torch.int32),
          paged_kv_last_page_len=torch.tensor([5, 1], dtype=torch.int32)), ValueError,
     r"paged_kv_last_page_len: entry 0 is 5 but must be in \[0, page_size\] \(it has no "
     r"pages\)"),
    (dict(paged_kv_last_page_len=torch.tensor([1, 1, 1], dtype=torch.int32)), ValueError,
     r"paged_kv_last_page_len: expected shape \(2,\)"),
    (dict(page_size=0), ValueError, "page_size: got 0"),
    (dict(num_qo_heads=6, num_kv_heads=4), ValueError,
     "num_qo_heads = 6 is not a multiple of num_kv_heads = 4"),
    (dict(pos_encoding_mode="ROPE"), ValueError, "pos_encoding_mode: got 'ROPE'; use one of"),
    (dict(pos_encoding_mode="ROPE_LLAMA", head_dim_qk=7), ValueError, "even head_dim_qk"),
    (dict(rope_theta=0.0), ValueError, "rope_theta: got 0.0"),
    (dict(custom_mask=torch.ones(3 * 5 + 4 * 9 - 1, dtype=torch.bool)), ValueError,
     "custom_mask: has 50 entries but the plan needs 51"),
    (dict(custom_mask=torch.ones(51, dtype=torch.float32)), TypeError,
     "custom_mask: expected a bool .* got torch.float32.*mask == 0 for an additive one"),
    (dict(packed_custom_mask=torch.zeros(8, dtype=torch.uint8)), ValueError,
     r"packed_custom_mask: has 8 bytes but the plan needs 7 .*segment_packbits"),
    (dict(seq_lens=torch.tensor([5, 8])), ValueError, r"seq_lens: \[5, 8\] disagrees"),
    (dict(max_sequence_kv=8), ValueError, "max_sequence_kv = 8 is below"),
    (dict(fixed_split_size=2.5), ValueError, "fixed_split_size: got 2.5"),
    (dict(fixed_split_size=True), ValueError, "fixed_split_size: got True"),
    (dict(prefix_len_ptr=torch.zeros(2)), NotImplementedError, "prefix_len_ptr: multi-item"),
    (dict(block_tables=torch.zeros(2, 3)), NotImplementedError, "block_tables"),
    (dict(q_data_type=torch.float8_e4m3fn), NotImplementedError, "q_data_type: .*fp8"),
    (dict(q_data_type="float99"), TypeError, "q_data_type: got 'float99'"),
    (dict(kv_data_type=torch.float32), TypeError, "kv_data_type torch.float32 differs"),
    (dict(o_data_type=torch.int8), TypeError, "o_data_type: got torch.int8"),
]


@pytest.mark.parametrize("kw,exc,match", PLAN_ERRORS,
                         ids=[f"{i}-{next(iter(c[0]))}" for i, c in enumerate(PLAN_ERRORS)])
def test_paged_plan_errors(paged, kw, exc, match):
    with pytest.raises(exc, match=match):
        plan_paged(paged, **kw)


def test_paged_run_errors(paged):
    cache = paged[0]
    w = fi.BatchPrefillWithPagedKVCacheWrapper(WS)
    q = rand(sum(QO), HQ, D)
    with pytest.raises(RuntimeError, match=r"run\(\) before plan\(\)"):
        w.run(q, cache)
    w = plan_paged(paged)
    cases = [
        (lambda: w.run(q[:-1], cache), ValueError, r"q: shape \(6, 4, 8\) does not match"),
        (lambda: w.run(q.float(), cache), TypeError, "q_data_type=torch.float32 to plan"),
        (lambda: w.run(q, cache[:4]), ValueError,
         r"paged_kv_indices: entry \d+ is 4 but paged_kv_cache has only 4 pages \(valid 0..3\)"),
        (lambda: w.run(q, cache[:, :, :2]), ValueError, r"do not match the plan: \[P, 4, 2, 8\]"),
        (lambda: w.run(q, cache.float()), TypeError, "kv_data_type=torch.float32 to plan"),
        (lambda: w.run(q, cache[:, 0]), ValueError, "paged_kv_cache: expected a 5-D tensor"),
        (lambda: w.run(q, (cache[:, 0],)), ValueError, r"must be \(k_cache, v_cache\)"),
        (lambda: w.run(q, cache, out=torch.empty(7, 4, 8)), TypeError,
         "out: expected dtype torch.float64"),
        (lambda: w.run(q, cache, out=torch.empty(7, 4, 7, dtype=D64)), ValueError,
         r"out: expected shape \(7, 4, 8\)"),
        (lambda: w.run(q, cache, lse=torch.empty(7, 3)), ValueError, r"lse: expected shape"),
        (lambda: w.run(q, cache, lse=[0.0] * 7), TypeError, "lse: expected a tensor"),
        (lambda: w.run(q, cache, out=[0.0] * 7), TypeError, "out: expected a tensor"),
        (lambda: w.run(q, cache, sinks=torch.zeros(3)), ValueError, r"sinks: expected shape \(4,\)"),
        (lambda: w.run(q, cache, enable_pdl=True), NotImplementedError, "enable_pdl"),
        (lambda: w.run(q, cache, skip_softmax_threshold_scale_factor=1.0), NotImplementedError,
         "skip_softmax"),
        (lambda: w.run(q, cache, use_fp16_softmax=True), NotImplementedError, "use_fp16_softmax"),
        (lambda: w.run(q, cache, torch.ones(1)), NotImplementedError, r"\*args"),
        (lambda: w.run(q, cache, kv_cache_sf=cache), NotImplementedError, "NVFP4"),
        (lambda: w.run(q, cache, k_scale=torch.tensor(1.0, device="meta")), NotImplementedError,
         r"k_scale: got a meta tensor.*pass float\(k_scale\)"),
        (lambda: w.run(q, cache, v_scale=torch.ones(2, device="meta")), NotImplementedError,
         "v_scale: got a tensor of shape"),
        # (a fuzz: these failed inside torch, naming nothing)
        (lambda: w.run(q, cache, v_scale=torch.tensor(1.0, device="meta")), ValueError,
         "v_scale: is on the meta device"),
        (lambda: w.run(q, cache, v_scale=torch.tensor(1 + 0j)), TypeError, "v_scale: got"),
        (lambda: w.run(q, cache, k_scale=torch.tensor(True)), TypeError, "k_scale: got True"),
        (lambda: w.run(q, cache, out=torch.empty(1, 4, 8, dtype=D64).expand(7, 4, 8)),
         ValueError, r"out: is an expanded view \(stride 0"),
        (lambda: w.run(q, cache, return_lse=True, lse=torch.empty(1, 4).expand(7, 4)),
         ValueError, "lse: is an expanded view"),
        (lambda: w.run(q, cache, lse_base="e"), ValueError,
         r"lse_base: got 'e'; use 'log2' .* or 'ln'"),
        (lambda: w.run(q, cache, lse_layout="TN"), ValueError,
         r"lse_layout: got 'TN'; use 'NH' .* or 'HN'"),
        (lambda: w.run(q, cache, return_lse=True, lse=torch.empty(7, 4), lse_layout="HN"),
         ValueError, r"lse: expected shape \(4, 7\).*\(lse_layout='HN'\)"),
        (lambda: w.run(q, cache, return_lse=True, lse=torch.empty(7, 4).t(), lse_layout="HN"),
         ValueError, "lse: with lse_layout='HN' it must be contiguous"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_ragged_errors():
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, "HND")
    with pytest.raises(ValueError, match=r"kv_indptr: has 2 entries but batch_size \+ 1 = 3"):
        w.plan(indptr(QO), torch.tensor([0, 5]), HQ, HKV, D)
    with pytest.raises(NotImplementedError, match="v_indptr: separate value"):
        w.plan(indptr(QO), indptr(KV), HQ, HKV, D, v_indptr=indptr([2, 12]))
    w.plan(indptr(QO), indptr(KV), HQ, HKV, D, q_data_type=D64, v_indptr=indptr(KV))
    q, k = rand(7, HQ, D), rand(HKV, 14, D)
    with pytest.raises(ValueError, match=r"k / v: shapes \(2, 13, 8\) / \(2, 14, 8\)"):
        w.run(q, k[:, :13], k)
    with pytest.raises(ValueError, match="k: expected a 3-D tensor"):
        w.run(q, k[0], k)
    with pytest.raises(NotImplementedError, match="o_scale"):
        w.run(q, k, k, o_scale=2.0)
    w.run(q, k, k, o_scale=1.0)  # the identity is accepted


def test_constructor_errors():
    with pytest.raises(ValueError, match="kv_layout: got 'NDH'"):
        fi.BatchPrefillWithPagedKVCacheWrapper(WS, "NDH")
    with pytest.raises(NotImplementedError, match="trtllm_fmha_v2_prefill"):
        fi.BatchPrefillWithPagedKVCacheWrapper(WS, backend="trtllm-gen")
    for backend in ("cutlass", "fmha_v2"):  # FlashInfer's ragged backends without a kernel here
        with pytest.raises(NotImplementedError, match=f"backend={backend!r}"):
            fi.BatchPrefillWithRaggedKVCacheWrapper(WS, backend=backend)
    with pytest.raises(ValueError, match="backend: got 'fast'"):
        fi.BatchPrefillWithRaggedKVCacheWrapper(WS, backend="fast")
    with pytest.raises(NotImplementedError, match="jit_args"):
        fi.BatchPrefillWithRaggedKVCacheWrapper(WS, jit_args=["x"])
    i32 = dict(dtype=torch.int32)
    with pytest.raises(ValueError, match="paged_kv_indices_buf: use_cuda_graph=True needs"):
        fi.BatchPrefillWithPagedKVCacheWrapper(
            WS, "NHD", True, torch.zeros(3, **i32), torch.zeros(3, **i32), None,
            torch.zeros(2, **i32))
    with pytest.raises(ValueError, match="paged_kv_last_page_len_buf: has 3 entries;.* it needs 2"):
        fi.BatchPrefillWithPagedKVCacheWrapper(
            WS, "NHD", True, torch.zeros(3, **i32), torch.zeros(3, **i32),
            torch.zeros(8, **i32), torch.zeros(3, **i32))
    with pytest.raises(TypeError, match="kv_indptr_buf: expected dtype torch.int32"):
        fi.BatchPrefillWithRaggedKVCacheWrapper(WS, "NHD", True, torch.zeros(3, **i32),
                                                torch.zeros(3))
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, "NHD", True, torch.zeros(3, **i32),
                                                torch.zeros(3, **i32))
    with pytest.raises(ValueError, match="custom_mask_buf: the plan uses a custom mask"):
        w.plan(indptr(QO), indptr(KV), HQ, HKV, D, q_data_type=D64,
               custom_mask=torch.ones(51, dtype=torch.bool))


def test_single_prefill_errors():
    q, k = rand(3, 4, 8), rand(5, 2, 8)
    cases = [
        (lambda: fi.single_prefill_with_kv_cache(q, rand(5, 2, 6), k), ValueError,
         "k: head dim 6 differs from q's 8"),
        (lambda: fi.single_prefill_with_kv_cache(q, k, rand(4, 2, 8)), ValueError,
         r"v: shape \(4, 2, 8\) does not match k's"),
        (lambda: fi.single_prefill_with_kv_cache(q, rand(5, 3, 8), rand(5, 3, 8)), ValueError,
         "is not a multiple of"),
        (lambda: fi.single_prefill_with_kv_cache(q, k.float(), k.float()), TypeError,
         "k.dtype torch.float32 differs from q.dtype torch.float64"),
        (lambda: fi.single_prefill_with_kv_cache(q, k, k.float()), TypeError,
         "v.dtype torch.float32 differs from k.dtype"),
        (lambda: fi.single_prefill_with_kv_cache(q[0], k, k), ValueError,
         r"q: expected a 3-D tensor \[qo_len, Hq, D_qk\]"),
        (lambda: fi.single_prefill_with_kv_cache(q, k, k, kv_layout="HND"), ValueError,
         "is not a multiple of"),  # HND reading of an NHD tensor: 5 heads vs 4
        (lambda: fi.single_prefill_with_kv_cache(q, k, k, custom_mask=torch.ones(3, 4) > 0),
         ValueError, "custom_mask: has 12 entries but the plan needs 15"),
        (lambda: fi.single_prefill_with_kv_cache(
            q, k, k, packed_custom_mask=torch.zeros(3, dtype=torch.uint8)), ValueError,
         "packed_custom_mask: has 3 bytes but the plan needs 2"),
        (lambda: fi.single_prefill_with_kv_cache(q, k, k, o_dtype="int32"), TypeError,
         "o_dtype: got torch.int32"),
        (lambda: fi.single_prefill_with_kv_cache(q, k, k, sm_scale=float("nan")), ValueError,
         "sm_scale: got nan"),
    ]
    for fn, exc, match in cases:
        with pytest.raises(exc, match=match):
            fn()


def test_cuda_head_dims_and_dtypes_rules():
    for ok in [(64, 64), (128, 128), (256, 256), (192, 128), (96, 96), (80, 80), (512, 512),
               (16, 16), (248, 40)]:
        V.check_head_dims(*ok, "cuda")
    with pytest.raises(ValueError, match=r"head_dim_vo = 100 has no kernel on the GPU .*a "
                                         r"multiple of 8 from 16 to 256, or 512"):
        V.check_head_dims(96, 100, "cuda")
    V.check_head_dims(96, 41, "cpu")  # any head dim on CPU
    with pytest.raises(TypeError, match="q: got torch.float64; on cuda use one of"):
        V.check_q_dtype("q", torch.float64, "cuda")


def test_pod_plan_errors():
    w = fi.BatchPODWithPagedKVCacheWrapper(WS)
    _, kvi, idx, last, _, _ = make_paged(KV, HKV, D, D, PAGE)
    with pytest.raises(ValueError, match=r"last_page_len_d: expected shape \(2,\)"):
        w.plan(indptr(QO), kvi, idx, last, indptr([1, 1]), kvi, idx, last[:1], HQ, HKV, D, PAGE)
    with pytest.raises(ValueError, match=r"kv_indptr_p: has 3 entries but batch_size \+ 1 = 2"):
        w.plan(indptr([3]), kvi, idx, last, indptr([1, 1]), kvi, idx, last, HQ, HKV, D, PAGE)
    p = fi.PODWithPagedKVCacheWrapper(WS)
    with pytest.raises(NotImplementedError, match="jit_args"):
        fi.PODWithPagedKVCacheWrapper(WS, jit_args=[1])
    with pytest.raises(ValueError, match="head_dim"):
        p.plan(kvi, idx, last, HQ, HKV, 0, PAGE)


def test_plan_inputs_named_when_malformed(paged):
    """(A fuzz: each of these failed inside torch or took too long.) A mask on the meta device,
    POD's last_page_len of another rank, a ragged v_indptr as a list, and more query rows
    than the kernels' int32 work list holds name the argument."""
    cache, kvi, idx, last = paged
    n = sum(q * k for q, k in zip(QO, KV))
    with pytest.raises(ValueError, match="custom_mask: is on the meta device"):
        plan_paged(paged, custom_mask=torch.ones(n, dtype=torch.bool, device="meta"))
    with pytest.raises(ValueError, match="packed_custom_mask: is on the meta device"):
        plan_paged(paged, packed_custom_mask=torch.ones(8, dtype=torch.uint8, device="meta"))
    pod = fi.PODWithPagedKVCacheWrapper(WS)
    for bad in (last[0], last[None]):
        with pytest.raises(ValueError, match=r"last_page_len: expected shape \(2,\)"):
            pod.plan(kvi, idx, bad, HQ, HKV, D, PAGE, q_data_type=D64)
    rag = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    with pytest.raises(TypeError, match="v_indptr: expected a tensor"):
        rag.plan(indptr(QO), indptr(KV), HQ, HKV, D, v_indptr=[0, 5, 14], q_data_type=D64)
    with pytest.raises(TypeError, match="o_indptr: expected an integer dtype"):
        rag.plan(indptr(QO), indptr(KV), HQ, HKV, D, o_indptr=indptr(QO).float(),
                 q_data_type=D64)
    with pytest.raises(ValueError, match="qo_indptr: .* query rows of 2 heads a KV head "
                                         "exceed the int32 row range"):
        plan_paged(paged, qo_indptr=torch.tensor([0, 3, 2 ** 31 - 1], dtype=torch.int32))


def test_values_flashinfer_reads_as_off(paged):
    """FlashInfer turns a window on for window_left >= 0, a soft cap for logits_soft_cap > 0
    and fixed-size KV chunks for fixed_split_size > 0 (it plans ``fixed_split_size or -1``):
    any other value is the feature off, with the numbers of the plain call (they raised)."""
    q = rand(sum(QO), HQ, D, seed=9)
    want = plan_paged(paged, causal=True).run(q, paged[0])
    for kw in (dict(window_left=-2), dict(logits_soft_cap=-1.0), dict(fixed_split_size=0),
               dict(fixed_split_size=-5)):
        assert torch.equal(plan_paged(paged, causal=True, **kw).run(q, paged[0]), want), kw
    w = plan_paged(paged, causal=True)
    assert torch.equal(w.run(q, paged[0], window_left=-3), want)
    # an integer disable_split_kv is a bool, as FlashInfer's C++ plan takes it (it raised)
    for flag in (1, 0):
        assert torch.equal(plan_paged(paged, causal=True, disable_split_kv=flag).run(q, paged[0]),
                           want)
    for bad in ("yes", 1.0):
        with pytest.raises(TypeError, match="disable_split_kv: got"):
            plan_paged(paged, causal=True, disable_split_kv=bad)
    qs, k, v = rand(5, HQ, D, seed=1), rand(9, HKV, D, seed=2), rand(9, HKV, D, seed=3)
    assert torch.equal(fi.single_prefill_with_kv_cache(qs, k, v, window_left=-7,
                                                       logits_soft_cap=-2.0),
                       fi.single_prefill_with_kv_cache(qs, k, v))


def test_window_left_takes_any_integer_type():
    # A window read from a numpy config (np.int64) is an int >= 0: it takes effect as the int
    # would (it was refused, with a message that read as contradictory); floats and bools are
    # still refused.
    np = pytest.importorskip("numpy")
    q, k, v = rand(5, HQ, D, seed=1), rand(9, HKV, D, seed=2), rand(9, HKV, D, seed=3)
    want = fi.single_prefill_with_kv_cache(q, k, v, causal=True, window_left=3)
    got = fi.single_prefill_with_kv_cache(q, k, v, causal=True, window_left=np.int64(3))
    assert torch.equal(got, want)
    assert not torch.equal(fi.single_prefill_with_kv_cache(q, k, v, causal=True), want)
    assert type(V.check_window_left(np.int32(-1))) is int
    for bad in (3.0, True, "3"):
        with pytest.raises(ValueError, match="window_left: got"):
            V.check_window_left(bad)


def _cudnn(**kw):
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    q, k, v = rand(4, 2, 8, seed=1), rand(6, 2, 8, seed=2), rand(6, 2, 8, seed=3)
    args = dict(max_token_per_sequence=4, max_sequence_kv=6, actual_seq_lens_q=i32(4),
                actual_seq_lens_kv=i32(6), causal=True, return_lse=False)
    scale = kw.pop("scale", 0.3)
    args.update(kw)
    return fi.cudnn_batch_prefill_with_kv_cache(q, k, v, scale, torch.empty(1), **args)


@pytest.mark.parametrize("kw,exc,match", [
    (dict(scale=float("nan")), ValueError, "scale is nan; pass a finite float"),
    (dict(scale=float("inf")), ValueError, "scale is inf"),
    (dict(q_scale=float("inf")), ValueError, "q_scale is inf"),
    (dict(k_scale=torch.tensor([float("nan")])), ValueError, "k_scale is nan"),
    (dict(v_scale=True), TypeError, "v_scale must be a number"),
    (dict(actual_seq_lens_q=torch.tensor(4, dtype=torch.int32)), ValueError,
     r"actual_seq_lens_q must have shape \[B\] or \[B, 1, 1, 1\], got \(\)"),
])
def test_cudnn_scales_and_lengths(kw, exc, match):
    # (an audit: NaN / inf scales ran through, to NaN or inf outputs; a 0-d length tensor
    # was a bare IndexError)
    with pytest.raises(exc, match=match):
        _cudnn(**kw)


@pytest.mark.parametrize("cap", [True, "1.0"])
def test_soft_cap_takes_numbers_only(cap):
    q, k, v = rand(4, 2, 8, seed=1), rand(6, 2, 8, seed=2), rand(6, 2, 8, seed=3)
    with pytest.raises(TypeError, match="logits_soft_cap: got .*; pass a number"):
        fi.single_prefill_with_kv_cache(q, k, v, logits_soft_cap=cap)


def test_helpers_check_values():
    # (an audit: these returned lengths of 13 for two pages of 4, a position of -1, took
    # float indices, or failed inside torch)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(RuntimeError, match=r"kv_last_page_len holds an entry outside \[0, "):
        fi.get_seq_lens(i32(0, 2), i32(9), 4)
    with pytest.raises(RuntimeError, match="kv_indptr decreases"):
        fi.get_seq_lens(i32(0, 2, 1), i32(1, 1), 4)
    assert fi.get_seq_lens(i32(0, 2, 2), i32(3, 0), 4).tolist() == [7, 0]
    with pytest.raises(RuntimeError, match="seq_lens entry is shorter than its request's"):
        fi.get_batch_indices_positions(i32(0, 2, 5), i32(1, 3), 5)
    b, p = fi.get_batch_indices_positions(i32(0), i32(), 3)  # no request
    assert b.tolist() == [-1] * 3 and p.tolist() == [0] * 3
    b, p = fi.get_batch_indices_positions(i32(0, 2, 5), i32(4, 3), 6)
    assert b.tolist() == [0, 0, 1, 1, 1, -1] and p.tolist() == [2, 3, 0, 1, 2, 0]
    with pytest.raises(TypeError, match="batch_indices: expected an integer dtype"):
        fi.append_paged_kv_cache(rand(2, 2, 4), rand(2, 2, 4), torch.tensor([0., 0.]),
                                 torch.tensor([0.5, 1.5]), torch.zeros(1, 2, 2, 2, 4), i32(0),
                                 i32(0, 1), i32(2))
    out, lse = fi.merge_states(rand(2, 0, 1, 4), torch.zeros(2, 0, 1))  # no state to merge
    assert torch.equal(out, torch.zeros(2, 1, 4)) and torch.isneginf(lse).all()
    with pytest.raises(TypeError, match="x: expected a tensor"):
        fi.packbits([1, 0, 1])


def test_index_tensors_and_scales_without_data_name_the_argument(paged):
    # Index tensors on the meta device reached a host copy and raised "Cannot copy out of
    # meta tensor" without naming the argument.
    cache, kvi, idx, last = paged
    for name, t in (("qo_indptr", indptr(QO)), ("paged_kv_indptr", kvi),
                    ("paged_kv_indices", idx), ("paged_kv_last_page_len", last),
                    ("seq_lens", torch.tensor(KV))):
        with pytest.raises(ValueError, match=f"^{name}: is on the meta device"):
            plan_paged(paged, **{name: t.to("meta")})
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS)
    for args in ((indptr(QO).to("meta"), indptr(KV)), (indptr(QO), indptr(KV).to("meta"))):
        with pytest.raises(ValueError, match=r"^(qo|kv)_indptr: is on the meta device"):
            w.plan(*args, HQ, HKV, D, q_data_type=D64)
    with pytest.raises(ValueError, match="^v_indptr: is on the meta device"):
        w.plan(indptr(QO), indptr(KV), HQ, HKV, D, v_indptr=indptr(KV).to("meta"))
    pod = fi.BatchPODWithPagedKVCacheWrapper(WS)
    with pytest.raises(ValueError, match="^kv_indices_d: is on the meta device"):
        pod.plan(indptr(QO), kvi, idx, last, indptr([1, 1]), kvi, idx.to("meta"), last, HQ, HKV,
                 D, PAGE, q_data_type=D64)


def test_scales_and_caps_beyond_float32_raise(paged):
    # 1e39 passed the finite check in float64 and then computed garbage in float32 (CPU:
    # rows zeroed; kernel: NaN), so did a soft cap of 1e39 and a product of scales past
    # float32's range.
    q, k = rand(3, HQ, D), rand(5, HKV, D)
    for kw, name in ((dict(sm_scale=1e39), "sm_scale"), (dict(logits_soft_cap=1e39),
                                                         "logits_soft_cap"),
                     (dict(sm_scale=-1e39), "sm_scale"), (dict(rope_theta=1e39), "rope_theta"),
                     (dict(sm_scale=1e30, k_scale=1e30), r"sm_scale \* k_scale"),
                     (dict(k_scale=1e39), "k_scale")):
        with pytest.raises(ValueError, match=f"^{name}: got .*beyond float32's range"):
            fi.single_prefill_with_kv_cache(q, k, k, **kw)
    for kw, name in ((dict(sm_scale=1e39), "sm_scale"), (dict(logits_soft_cap=1e39),
                                                         "logits_soft_cap")):
        with pytest.raises(ValueError, match=f"^{name}: got .*beyond float32's range"):
            plan_paged(paged, **kw)
    w = plan_paged(paged, sm_scale=1e30)
    with pytest.raises(ValueError, match=r"^sm_scale \* q_scale \* k_scale: got"):
        w.run(rand(sum(QO), HQ, D), paged[0], q_scale=1e5, k_scale=1e5)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    with pytest.raises(ValueError, match="^bmm1_scale: got .*beyond float32's range"):
        fi.trtllm_fmha_v2_prefill((q, k, k), "SEPARATE_Q_K_V", WS, i32(5), 3, 5, 1e39, 1.0, 1,
                                  i32(0, 3), i32(0, 5))
    # the largest float32 is still a scale
    assert V.check_scale("sm_scale", torch.finfo(torch.float32).max, 1.0) > 0


def test_window_wider_than_any_position_is_no_window(paged):
    # window_left=2**64 passed the check, then the kernel launch raised Triton's "integer to be
    # specialized too large" and the CPU path "Expected a value of type 'int'": a window of
    # 2^31 - 1 keys or more reaches every (int32) position, so it is no window.
    assert V.check_window_left(2 ** 64) == -1 and V.check_window_left(2 ** 31 - 1) == -1
    assert V.check_window_left(2 ** 31 - 2) == 2 ** 31 - 2
    q, k, v = rand(5, HQ, D, seed=1), rand(9, HKV, D, seed=2), rand(9, HKV, D, seed=3)
    want = fi.single_prefill_with_kv_cache(q, k, v, causal=True)
    for w in (2 ** 64, 2 ** 31 - 1):
        got = fi.single_prefill_with_kv_cache(q, k, v, causal=True, window_left=w)
        assert torch.equal(got, want)
    qb = rand(sum(QO), HQ, D, seed=4)
    want = plan_paged(paged, causal=True).run(qb, paged[0])
    got = plan_paged(paged, causal=True, window_left=2 ** 64).run(qb, paged[0])
    assert torch.equal(got, want)
    got = plan_paged(paged, causal=True, window_left=1).run(qb, paged[0], window_left=2 ** 64)
    assert torch.equal(got, want)


def test_utils_and_cudnn_name_more_bad_inputs():
    """From a fuzz of bad inputs: each raised inside torch or named another argument."""
    i = functools.partial(torch.tensor, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens: is on the meta device"):
        fi.get_batch_indices_positions(i([0, 2]), i([4]).to("meta"), 2)
    with pytest.raises(ValueError, match="paged_kv_cache: has pages of 0 slots"):  # (ZeroDivision)
        fi.append_paged_kv_cache(torch.randn(1, 2, 8), torch.randn(1, 2, 8), i([0]), i([0]),
                                 torch.zeros(2, 2, 0, 2, 8), i([0]), i([0, 1]), i([1]))
    q = torch.randn(3, 4, 16)
    with pytest.raises(ValueError, match=r"head_dim_vo \(v_cache.shape\[-1\]\)"):
        fi.cudnn_batch_prefill_with_kv_cache(
            q, torch.randn(3, 2, 2, 16), torch.randn(3, 2, 2, 0), 0.3, WS,
            max_token_per_sequence=3, max_sequence_kv=4, actual_seq_lens_q=i([3]),
            actual_seq_lens_kv=i([4]), block_tables=i([[0, 1]]), causal=True, return_lse=True)


def test_pod_plans_say_where_the_batch_size_comes_from():
    """A page table's indptr of the wrong length: the error says which argument set the batch
    size (it named indptr / kv_indptr alone)."""
    i = functools.partial(torch.tensor, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"indptr: has 3 entries but batch_size \+ 1 = 4 are "
                                         r"needed \(the batch size of last_page_len's 3 entries\)"):
        fi.PODWithPagedKVCacheWrapper(WS).plan(i([0, 1, 2]), i([0, 1]), i([1, 1, 1]), 4, 2, 16,
                                               2)
    with pytest.raises(ValueError, match=r"kv_indptr_p: .*\(the batch size of qo_indptr_p\)"):
        fi.BatchPODWithPagedKVCacheWrapper(WS).plan(
            i([0, 2]), i([0, 1, 2]), i([0, 1]), i([1, 1]), i([0, 1]), i([0, 1]), i([0]), i([1]),
            4, 2, 16, 2)


def test_page_table_lengths():
    # a request's keys: (pages - 1) * page_size + last_page_len, 0 for one without pages
    # (whose last_page_len may be 0 to page_size), with and without such requests
    idx = torch.arange(5, dtype=torch.int32)
    for ind, last, want in (([0, 2, 5], [3, 1], [7, 9]), ([0, 2, 5], [4, 4], [8, 12]),
                            ([0, 2, 2, 5], [3, 0, 1], [7, 0, 9]),
                            ([0, 2, 2, 5], [3, 4, 1], [7, 0, 9]), ([0, 0], [0], [0]),
                            ([0], [], [])):
        got = V.page_table(("a", "b", "c"), torch.tensor(ind, dtype=torch.int32), idx,
                           torch.tensor(last, dtype=torch.int32), 4)
        assert got[3] == want, (ind, last)
