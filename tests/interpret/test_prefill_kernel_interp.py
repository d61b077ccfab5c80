"""The Triton prefill kernel itself, run on CPU tensors by the Triton interpreter, against the
float64 reference (tests/kernel_cases.py): every mask mode, transform, layout, page size 1/5/16,
GQA 7:1, empty requests and fully masked rows, in fp16 and fp32 (the interpreter computes bf16
dots wrongly: bf16 is tested on the GPU)."""

import dataclasses

import pytest
import torch

from compiled_attn import ops
from compiled_attn.ops import contracts
from compiled_attn.ops.choose import KV_PATHS
from tests.kernel_cases import _pack, check, force_kv_path, make_case, params, record_tma, run


def test_interpreter_mode_is_on():
    # The op must launch the kernel on CPU tensors here, not the reference.
    assert contracts.INTERPRET and contracts._use_kernel(torch.empty(1))


# (qo_lens, kv_lens): odd lengths, an empty request, qo_len > kv_len (rows that see nothing),
# a request with no keys, a request longer than one tile.
BATCH = ([5, 0, 70, 3, 9], [9, 4, 70, 0, 4])

MODES = {
    "causal": params(),
    "none": params(mask_mode=ops.MASK_NONE),
    "window": params(window_left=6),
    "window_noncausal": params(mask_mode=ops.MASK_NONE, window_left=5),
    "soft_cap": params(logits_soft_cap=2.0, sm_scale=0.5),
    "alibi": params(pos_encoding_mode=ops.POS_ALIBI),
    "rope": params(pos_encoding_mode=ops.POS_ROPE_LLAMA, rope_scale=2.0, rope_theta=500.0),
    "chunked": params(chunk_size=16),
    "custom": params(mask_mode=ops.MASK_CUSTOM),
    "sinks_vscale": params(v_scale=0.5),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_modes(kind, mode):
    c = make_case(kind, *BATCH, hq=4, hkv=2, dqk=64, dtype=torch.float16, page_size=5,
                  custom_mask=mode == "custom", alibi=mode == "alibi",
                  sinks=mode == "sinks_vscale", seed=hash((kind, mode)) % 1000)
    check(c, MODES[mode])


@pytest.mark.parametrize("page_size", [1, 5, 16])
@pytest.mark.parametrize("layout,tuple_cache", [("NHD", False), ("HND", False), ("HND", True)])
def test_paged_layouts(page_size, layout, tuple_cache):
    c = make_case("paged", [17, 1, 40], [33, 8, 40], hq=2, hkv=1, dqk=32, page_size=page_size,
                  layout=layout, tuple_cache=tuple_cache, seed=page_size)
    check(c, params(head_dim=32))


def test_gqa_7_to_1_fp32_dqk_ne_dvo():
    c = make_case("ragged", [13, 30], [20, 45], hq=7, hkv=1, dqk=64, dvo=32,
                  dtype=torch.float32, seed=3)
    check(c, params())


@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("mode", ["causal", "custom", "window_noncausal"])
def test_single(layout, mode):
    c = make_case("single", [37], [50], hq=4, hkv=4, dqk=64, layout=layout,
                  custom_mask=mode == "custom", seed=7)
    check(c, MODES[mode])


def test_single_batched_dense_out_dtype():
    # The dense batch path (FX rewrites of SDPA): B = 3, fp32 output from fp16 inputs.
    c = make_case("single", [20], [20], hq=2, hkv=1, dqk=32, seed=11)
    c.q = torch.randn(3, 20, 2, 32, dtype=torch.float16)
    c.k = torch.randn(3, 20, 1, 32, dtype=torch.float16)
    c.v = torch.randn(3, 20, 1, 32, dtype=torch.float16)
    check(c, params(head_dim=32), out_dtype=torch.float32)


@pytest.mark.parametrize("group", [None, 1, 4, 6])
@pytest.mark.parametrize("path", ["host", "persistent"])
def test_dense_launch_order_groups(group, path, monkeypatch):
    # Dense launches take their (batch entry, KV head) pairs a group at a time, the group's
    # heaviest tiles first: every tile is computed exactly once whatever the grouping. The
    # default here (12 resident programs under the interpreter, 3 tiles per entry: at most 4
    # pairs, a divisor of the 6) is 3; 4 leaves a last group of 2, 1 is one pair at a time, 6
    # all at once. Persistent programs draw items in the same order.
    from compiled_attn.ops import choose

    force_kv_path(monkeypatch, path)
    used, orig = [], choose._dense_group

    def spy(*a):
        used.append(orig(*a) if group is None else group)
        return used[-1]

    monkeypatch.setattr(choose, "_dense_group", spy)
    c = make_case("single", [70], [70], hq=4, hkv=2, dqk=32, seed=13)
    g = torch.Generator().manual_seed(14)
    c.q = torch.randn(3, 70, 4, 32, generator=g).half()
    c.k = torch.randn(3, 70, 2, 32, generator=g).half()
    c.v = torch.randn(3, 70, 2, 32, generator=g).half()
    check(c, MODES["causal"])
    assert used == [3 if group is None else group]


def test_fully_masked_rows_with_custom_mask():
    c = make_case("ragged", [6], [10], hq=1, hkv=1, dqk=32, custom_mask=True, seed=5)
    # Row 2 of the single request sees nothing: its bits are cleared.
    bits = torch.ones(60, dtype=torch.bool)
    bits[20:30] = False
    c.packed_mask = _pack(bits)
    c.mask_indptr = torch.tensor([0, c.packed_mask.numel()], dtype=torch.int32)
    p = params(mask_mode=ops.MASK_CUSTOM, head_dim=32)
    check(c, p)
    out, lse = run(c, p)
    assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))
    assert torch.isfinite(lse[[0, 1, 3, 4, 5]]).all()


@pytest.mark.parametrize("kind", ["paged", "ragged"])
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_kv(kv_dtype, kind):
    # fp8 K/V are converted to q's dtype in the kernel; k_scale is folded into sm_scale and
    # v_scale multiplies the output by the API: here v_scale reaches the op directly.
    c = make_case(kind, [9, 20], [30, 20], hq=2, hkv=1, dqk=32, kv_dtype=kv_dtype, seed=4)
    check(c, params(head_dim=32, v_scale=0.25))


@pytest.mark.parametrize("path", ["host", "persistent"])
def test_padded_work_items_are_skipped(path, monkeypatch):
    # use_cuda_graph / uniform plans pad the work list with request -1 and with tiles past a
    # request's rows: both must write nothing and read nothing (a persistent program goes on
    # to its next item).
    force_kv_path(monkeypatch, path)
    c = make_case("ragged", [5, 9], [5, 9], hq=2, hkv=2, dqk=32, seed=9)
    pad = torch.tensor([[-1, 0], [0, 4096], [1, 128]], dtype=torch.int32)
    c.work = torch.cat([c.work, pad])
    check(c, params(head_dim=32))


@pytest.mark.parametrize("window_d", [-1, 7])
def test_pod_one_launch(window_d):
    # A paged prefill batch and a paged decode batch (qo_len 1 each) through the POD kernel,
    # against the reference of each part; the decode part has its own window and soft cap.
    import torch.nn.functional  # noqa: F401

    from compiled_attn.ops import reference

    pre = make_case("paged", [19, 0, 40], [30, 6, 40], hq=4, hkv=2, dqk=32, page_size=5,
                    custom_mask=True, seed=21)
    dec = make_case("paged", [1] * 5, [9, 1, 33, 0, 17], hq=4, hkv=2, dqk=32, page_size=16,
                    seed=22)
    work_p = torch.cat([torch.zeros(pre.work.shape[0], 1, dtype=torch.int32), pre.work], 1)
    work_d = torch.cat([torch.ones(dec.work.shape[0], 1, dtype=torch.int32), dec.work], 1)
    work = torch.cat([work_p, work_d])
    sp, sd = 32 ** -0.5, 0.3
    outs = ops.pod_prefill_decode(
        pre.q, pre.k, pre.v, pre.qo_indptr, pre.kv_indptr, pre.page_indices, pre.last_page_len,
        dec.q, dec.k, dec.v, dec.qo_indptr, dec.kv_indptr, dec.page_indices, dec.last_page_len,
        work, pre.packed_mask, pre.mask_indptr, None, pre.block_m,
        ops.MASK_CUSTOM, 4, sp, 0.0, ops.MASK_NONE, window_d, sd, 3.0, ops.POS_NONE, 1.0, 1e4,
        1.0, None)
    common = dict(chunk_size=0, pos_encoding_mode=0, rope_scale=1.0, rope_theta=1e4,
                  v_scale=1.0)
    refs = [
        reference.batch_paged_prefill(
            c.q.double(), c.k.double(), c.v.double(), c.qo_indptr, c.kv_indptr,
            c.page_indices, c.last_page_len, mask, mi, None, None, out_dtype=torch.float64,
            mask_mode=mm, window_left=w, sm_scale=sc, logits_soft_cap=cap, **common)
        for c, mask, mi, mm, w, sc, cap in (
            (pre, pre.packed_mask, pre.mask_indptr, ops.MASK_CUSTOM, 4, sp, 0.0),
            (dec, None, None, ops.MASK_NONE, window_d, sd, 3.0))
    ]
    for (out, lse), (r_out, r_lse) in zip((outs[:2], outs[2:]), refs):
        assert not torch.isnan(out).any()
        fin = torch.isfinite(r_lse)
        assert torch.equal(torch.isfinite(lse), fin)
        assert (out.double() - r_out).abs().max() < 2e-3
        assert (lse[fin].double() - r_lse[fin]).abs().max() < 1e-3


@pytest.mark.parametrize("kind", ["ragged", "paged", "ragged_persistent"])
@pytest.mark.parametrize("mode", ["causal", "none", "window", "sinks_vscale", "custom"])
def test_split_kv(kind, mode, monkeypatch):
    # Few query rows, long keys: the plan cuts tiles into key chunks whose partials
    # _merge_fwd combines; every chunk count (1 = no merge) appears. ragged_persistent: the
    # chunks of a persistent grid (programs take several items).
    from compiled_attn.ops.schedule import build_split_work

    if kind == "ragged_persistent":
        force_kv_path(monkeypatch, "persistent")
        kind = "ragged"

    qo, kv = [3, 1, 40, 0, 2], [300, 97, 260, 5, 1]
    c = make_case(kind, qo, kv, hq=4, hkv=2, dqk=32, page_size=16,
                  custom_mask=mode == "custom", sinks=mode == "sinks_vscale", seed=31)
    c.work, merge = build_split_work(qo, kv, 2, c.block_m, 2, num_sms=32, min_keys_per_chunk=64)
    assert merge is not None and int(merge[:, 3].max()) > 2
    assert c.work.shape[0] > merge.shape[0]
    c.merge = merge
    p = dict(MODES[mode])
    p["head_dim"] = None
    p.pop("head_dim")
    p["sm_scale"] = 32 ** -0.5
    check(c, p)


def test_split_plan_without_idle_sms_is_unsplit():
    from compiled_attn.ops.schedule import build_split_work

    work, merge = build_split_work([512] * 8, [4096] * 8, 1, 64, 8, num_sms=16)
    assert merge is None and bool((work[:, 3] == 1).all()) and work.shape[1] == 4


# "gluon" is "host" under the interpreter (the Gluon kernel runs on Hopper GPUs only)
@pytest.mark.parametrize("path", [p for p in KV_PATHS if p != "gluon"])
@pytest.mark.parametrize("mode", ["causal", "window", "custom", "soft_cap"])
@pytest.mark.parametrize("kind", ["ragged", "single"])
def test_kv_load_paths(kind, mode, path, monkeypatch):
    # Dense and ragged K/V go through descriptors over the whole tensor where the layout allows
    # (built on the host in eager calls, once per persistent program in traced graphs), else
    # built per work item; the pointer loads still serve unaligned inputs (and on the GPU
    # custom masks): the same numbers on every path. Persistent programs take several items
    # here (3 programs under the interpreter).
    tma = force_kv_path(monkeypatch, path)
    seen = record_tma(monkeypatch)
    qo, kv = ([37], [50]) if kind == "single" else BATCH
    c = make_case(kind, qo, kv, hq=4, hkv=2, dqk=64, custom_mask=mode == "custom", seed=41)
    check(c, MODES[mode])
    assert seen == [tma]


@pytest.mark.parametrize("path", ["host", "persistent"])
@pytest.mark.parametrize("mode", ["causal", "none"])
def test_ragged_tail_ignores_rows_past_the_request(mode, path, monkeypatch):
    # A descriptor over the whole K/V: a request's last key tile reads the next request's
    # rows, or rows past the last request (here NaN), which must not reach the output.
    tma = force_kv_path(monkeypatch, path)
    seen = record_tma(monkeypatch)
    c = make_case("ragged", *BATCH, hq=4, hkv=2, dqk=64, seed=44)
    pad = torch.full((40, 2, 64), float("nan"), dtype=c.k.dtype)
    c.k, c.v = torch.cat([c.k, pad]), torch.cat([c.v, pad])
    check(c, MODES[mode])
    assert seen == [tma]


def test_expanded_kv_takes_no_host_descriptor(monkeypatch):
    # K/V shared by every batch entry through expand (batch stride 0): no host descriptor
    # (a zero stride is not left to the driver's tensor-map checks); per-program descriptors.
    seen = record_tma(monkeypatch)
    c = make_case("single", [37], [50], hq=4, hkv=2, dqk=64, seed=46)
    q2 = c.q.expand(2, -1, -1, -1).clone()
    k2, v2 = c.k.expand(2, -1, -1, -1), c.v.expand(2, -1, -1, -1)
    assert k2.stride(0) == 0
    p = MODES["causal"]
    out, lse = run(dataclasses.replace(c, q=q2, k=k2, v=v2), p)
    ref_out, ref_lse = run(dataclasses.replace(c, q=q2, k=k2.contiguous(), v=v2.contiguous()), p)
    assert seen == [1, 2]
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=0)
    check(c, p)


def test_empty_kv_takes_no_host_descriptor(monkeypatch):
    # A descriptor cannot describe an empty tensor: a batch without keys takes another path
    # (here the pointer loads: a mean KV length of 0 is short); its rows write 0 and -inf.
    seen = record_tma(monkeypatch)
    c = make_case("ragged", [3, 4], [0, 0], hq=2, hkv=1, dqk=64, seed=45)
    check(c, MODES["causal"])
    assert seen == [0]


def test_tma_choice_follows_alignment():
    # Descriptors need a unit dim stride and 16-byte aligned strides and start; anything else
    # takes the pointer loads (never a misaligned descriptor).
    from compiled_attn.ops.choose import _tma_ok

    k = torch.randn(10, 2, 64, dtype=torch.float16)
    st = lambda t: (0, t.stride(0), 0, t.stride(1), t.stride(2))  # noqa: E731
    assert _tma_ok(k, st(k))
    odd = torch.randn(10, 2, 65, dtype=torch.float16)[..., :64]  # token stride 130 elements
    assert not _tma_ok(odd, st(odd))
    shifted = torch.randn(10 * 2 * 64 + 1, dtype=torch.float16)[1:].view(10, 2, 64)
    assert not _tma_ok(shifted, st(shifted))
    hnd = torch.randn(2, 64, 10, dtype=torch.float16).permute(2, 0, 1)  # dim stride 10
    assert not _tma_ok(hnd, st(hnd))


def test_unaligned_kv_runs_pointer_loads():
    # K/V views whose token stride is not 16-byte aligned: still correct (pointer path).
    c = make_case("ragged", *BATCH, hq=4, hkv=2, dqk=64, seed=43)
    c.k = torch.cat([c.k, torch.randn(c.k.shape[0], 2, 1, dtype=c.k.dtype)], -1)[..., :64]
    c.v = torch.cat([c.v, torch.randn(c.v.shape[0], 2, 1, dtype=c.v.dtype)], -1)[..., :64]
    check(c, MODES["causal"])


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_ragged_kv_offsets_into_a_larger_buffer(dtype):
    """The ragged wrapper's kv_indptr starting past 0 over k / v with rows past kv_indptr[-1]
    (FlashInfer's slices of a larger buffer): the kernel reads rows kv_indptr[0] to
    kv_indptr[-1] only, at the first call and at its replay (the project's error bound)."""
    import compiled_attn as fi
    from tests.helpers import WS, indptr
    from tests.kernel_cases import Case

    hq, hkv, d, qo, kv = 4, 2, 16, [4, 3, 9], [6, 11, 40]
    g = torch.Generator().manual_seed(90)
    q = torch.randn(16, hq, d, generator=g).to(dtype)
    k, v = (torch.randn(5 + sum(kv) + 4, hkv, d, generator=g).to(dtype) for _ in range(2))
    c = Case("ragged", q=q, k=k, v=v, qo_indptr=indptr(qo), kv_indptr=indptr(kv) + 5)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(WS, "NHD")
    w.plan(c.qo_indptr, c.kv_indptr, hq, hkv, d, causal=True, q_data_type=dtype)
    for _ in range(2):
        check(c, params(ops.MASK_CAUSAL, head_dim=d),
              runner=lambda c, p, out_dtype: w.run(c.q, c.k, c.v, return_lse=True))
