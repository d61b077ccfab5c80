"""Decode key chunks on the host (no kernel): which batches the launch policy cuts
(ops.choose.decode_chunk_sms, ops.schedule.decode_chunk_count), the chunk requests' index
arrays (ops.schedule.build_decode_chunks), checked against the page table they cut, and the
CUDA-graph buffers' capacity (ops.schedule.decode_chunk_capacity)."""

import pytest
import torch

import compiled_attn as ca
from compiled_attn.ops import choose
from compiled_attn.ops.choose import H200, Device, decode_chunk_sms
from compiled_attn.ops.policy import override
from compiled_attn.ops.schedule import (build_decode_chunks, build_work, decode_chunk_capacity,
                                        decode_chunk_count)
from tests.helpers import indptr, make_paged


@pytest.mark.parametrize("qo,kv,hkv,want", [
    ([1], [32768], 8, 16),  # 8 programs: MAX_CHUNKS
    ([1] * 8, [4096] * 8, 8, 4),  # 64 programs: one wave of two a SM over 132 SMs
    ([1] * 8, [4096] * 7 + [100], 8, 4),  # the longest request decides
    ([1] * 4, [16384] * 4, 8, 8),  # 8 x 32 programs fit the 264 slots; 9 x 32 would not
    ([1], [2048], 8, 4),  # chunks of at least 512 keys
    ([1] * 16, [1024] * 16, 8, 0),  # 128 programs: a split plan would not split them
    ([1] * 48, [1024] * 48, 8, 0),
    ([1, 0, 1], [1000, 9000, 1000], 8, 0),  # chunks of at least 512 keys: one
    ([2, 1], [32768, 32768], 8, 0),  # a two-row request: not decode rows
    ([0, 0], [100, 100], 8, 0),  # no row
    ([], [], 8, 0),
])
def test_decode_chunk_count(qo, kv, hkv, want):
    assert decode_chunk_count(qo, kv, hkv, 132) == want


def test_decode_chunk_sms_follows_the_policy_and_the_gluon_scope():
    bf16 = torch.bfloat16
    assert decode_chunk_sms(16, 128, 128, 64, bf16, plain=True, device=H200) == 132
    assert decode_chunk_sms(1, 128, 128, 64, bf16, plain=True, device=H200) == 132  # gathered
    assert decode_chunk_sms(16, 128, 128, 64, bf16, plain=False, device=H200) == 0
    assert decode_chunk_sms(16, 128, 128, 128, bf16, plain=True, device=H200) == 0
    assert decode_chunk_sms(16, 64, 64, 64, bf16, plain=True, device=H200) == 0
    assert decode_chunk_sms(16, 128, 128, 64, torch.float8_e4m3fn, plain=True, device=H200) == 0
    assert decode_chunk_sms(16, 128, 128, 64, bf16, plain=True, device=Device("cuda", 8, 108)) == 0
    with override(decode_chunks="off"):
        assert decode_chunk_sms(16, 128, 128, 64, bf16, plain=True, device=H200) == 0
    with override(decode_chunks="always"):
        assert decode_chunk_sms(3, 16, 16, 128, None, plain=True, device=Device("cpu")) == 132
        assert decode_chunk_sms(3, 16, 16, 128, None, plain=False, device=Device("cpu")) == 0
    with override(decode_chunks="sometimes"), pytest.raises(ValueError, match="decode_chunks"):
        decode_chunk_sms(16, 128, 128, 64, bf16, plain=True, device=H200)


@pytest.mark.parametrize("qo,kv,page,chunks", [
    ([1, 0, 1, 1], [637, 80, 0, 4001], 16, 4),
    ([1, 1, 1], [5, 300, 129], 1, 16),
    ([1], [32768], 16, 16),
    ([0, 1, 0], [10, 33, 7], 4, 3),
])
def test_build_decode_chunks_covers_each_request_in_order(qo, kv, page, chunks):
    _, kvi, idx, last, *_ = make_paged(kv, 1, 8, 8, page)
    c = build_decode_chunks(indptr(qo), kvi, last, page, chunks)
    c_qo, c_kv, c_last = c["qo_indptr"], c["kv_indptr"], c["last_page_len"]
    assert c_kv[0] == kvi[0] and c_kv[-1] == kvi[-1] and bool((c_kv.diff() >= 0).all())
    assert c_qo[0] == 0 and c_qo[-1] == c["src"].numel()
    assert c["merge"].shape == (sum(qo), 3)
    keys = [((int(c_kv[j + 1]) - int(c_kv[j]) - 1) * page + int(c_last[j])
             if c_kv[j + 1] > c_kv[j] else 0) for j in range(c_last.numel())]
    rows = c_qo.diff().tolist()
    assert c["kv_lens"] == keys
    assert all(0 <= k for k in keys) and set(rows) <= {0, 1}
    j = 0  # chunk requests in request order: a placeholder a request without rows, else n
    for b, (n_rows, n_keys) in enumerate(zip(qo, kv)):
        if n_rows == 0:
            assert rows[j] == 0 and keys[j] == n_keys
            j += 1
            continue
        out_row, first, n = c["merge"][sum(1 for x in qo[:b] if x)].tolist()
        assert out_row == sum(qo[:b]) and first == int(c_qo[j]) and 1 <= n <= chunks
        assert sum(keys[j:j + n]) == n_keys and rows[j:j + n] == [1] * n
        assert all(k > 0 for k in keys[j:j + n]) or n_keys == 0
        # every chunk but the last holds whole pages, a multiple of 128 keys where it can
        per = keys[j]
        assert all(k == per for k in keys[j:j + n - 1])
        if n > 1 and per >= 128:
            assert per % 128 == 0
        assert c["src"][first:first + n].tolist() == [out_row] * n
        j += n
    assert j == c_last.numel()


@pytest.mark.parametrize("kv,page,chunks", [([637, 80, 0, 4001], 16, 4),
                                             ([5, 300, 129, 1], 1, 16), ([33, 7], 4, 3)])
def test_build_decode_chunks_padded(kv, page, chunks):
    """pad: exactly ``chunks`` chunk requests a one-row request, the same pages and keys as
    without padding, then chunks without pages (last_page_len 0); the rows, source rows and
    merge rows follow from the batch size and ``chunks`` alone."""
    _, kvi, idx, last, *_ = make_paged(kv, 1, 8, 8, page)
    qo = indptr([1] * len(kv))
    plain = build_decode_chunks(qo, kvi, last, page, chunks)
    c = build_decode_chunks(qo, kvi, last, page, chunks, pad=True)
    b = len(kv)
    assert c["qo_indptr"].tolist() == list(range(b * chunks + 1))
    assert c["src"].tolist() == [r for r in range(b) for _ in range(chunks)]
    assert c["merge"].tolist() == [[r, r * chunks, chunks] for r in range(b)]
    j = 0
    for first, n in plain["merge"][:, 1:].tolist():
        assert c["kv_lens"][j:j + n] == plain["kv_lens"][first:first + n]
        assert c["last_page_len"][j:j + n].tolist() == plain["last_page_len"][
            first:first + n].tolist()
        assert c["kv_lens"][j + n:j + chunks] == [0] * (chunks - n)
        assert c["last_page_len"][j + n:j + chunks].tolist() == [0] * (chunks - n)
        j += chunks
    assert c["kv_indptr"][-1] == kvi[-1] and bool((c["kv_indptr"].diff() >= 0).all())


def test_build_decode_chunks_keeps_multi_row_requests_whole():
    c = build_decode_chunks([0, 1, 4, 4], [0, 40, 48, 50], [16, 5, 9], 16, 4)
    assert c["qo_indptr"].tolist() == [0, 1, 2, 3, 6, 6]  # 3 chunks, the 3 rows whole, none
    assert c["kv_indptr"].tolist() == [0, 16, 32, 40, 48, 50]
    assert c["last_page_len"].tolist() == [16, 16, 16, 5, 9]
    assert c["src"].tolist() == [0, 0, 0, 1, 2, 3]
    assert c["merge"].tolist() == [[0, 0, 3], [1, 3, 1], [2, 4, 1], [3, 5, 1]]


@pytest.mark.parametrize("seed", range(30))
def test_decode_chunk_capacity_bounds_every_batch(seed):
    """A CUDA-graph plan's chunk buffers (sized by decode_chunk_capacity at the first plan)
    hold build_decode_chunks' and build_work's output for any batch of that size and at most
    that many rows: decode rows cut as decode_chunk_count says, or any batch at one chunk a
    request."""
    g = torch.Generator().manual_seed(seed)
    b, hkv = 6, [1, 2, 8][seed % 3]
    group, block_m, page = [1, 4, 7, 16][seed % 4], 64, [1, 16][seed % 2]
    decode = seed % 2 == 0
    max_rows = b if decode else int(torch.randint(b, 4 * b, (1,), generator=g))
    cap = decode_chunk_capacity(b, max_rows, group, block_m, hkv, 2 * 132)
    if decode:
        qo = (torch.rand(b, generator=g) < 0.8).long()
    else:
        qo = torch.zeros(b, dtype=torch.int64)
        for _ in range(int(torch.randint(0, max_rows + 1, (1,), generator=g))):
            qo[int(torch.randint(0, b, (1,), generator=g))] += 1
    kv = torch.randint(0, 40000, (b,), generator=g)
    n = decode_chunk_count(qo.tolist(), kv.tolist(), hkv, 132, min_keys_per_chunk=1) or 1
    npg = [-(-int(k) // page) for k in kv]
    last = [int(k) - (p - 1) * page if p else 0 for k, p in zip(kv, npg)]
    c = build_decode_chunks(indptr(qo.tolist()), indptr(npg), last, page, n)
    work = build_work(c["qo_indptr"].diff().tolist(), group, block_m)
    assert c["qo_indptr"].numel() <= cap["requests"] + 1
    assert c["src"].numel() <= cap["rows"] and c["merge"].shape[0] <= cap["merge"]
    assert work.shape[0] <= cap["work"]


def test_cpu_plans_are_not_cut():
    """Plans on a device the kernels do not run (CPU outside the interpreter: the reference
    path) are never cut, whatever the policy."""
    cache, kvi, idx, last, *_ = make_paged([40, 61], 2, 16, 16, 4)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD")
    with override(decode_chunks="always", decode_chunk_min_keys=8):
        w.plan(indptr([1, 1]), kvi, idx, last, 4, 2, 16, 4, q_data_type=torch.float64)
    assert not choose.INTERPRET and w._plan.chunk_work is None


def test_exact_says_which_options_chunks_compute_exactly():
    # ops.decode_chunks.exact: the one rule for the paged wrapper's and POD's key chunks
    from compiled_attn.ops import POS_ALIBI, POS_NONE, POS_ROPE_LLAMA
    from compiled_attn.ops.decode_chunks import exact

    bf, f16 = torch.bfloat16, torch.float16
    base = dict(custom_mask=False, window_left=-1, pos_encoding_mode=POS_NONE,
                logits_soft_cap=0.0, sinks=None, dtypes=(bf, bf, bf))
    assert exact(**base)
    for change in (dict(custom_mask=True), dict(window_left=0), dict(window_left=100),
                   dict(pos_encoding_mode=POS_ROPE_LLAMA), dict(pos_encoding_mode=POS_ALIBI),
                   dict(logits_soft_cap=30.0), dict(sinks=torch.zeros(4)),
                   dict(dtypes=(bf, bf, f16)), dict(dtypes=(bf, torch.float8_e4m3fn))):
        assert not exact(**{**base, **change}), change
    assert exact(**{**base, "dtypes": (f16, f16)})
