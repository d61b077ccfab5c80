"""Decode key chunks on the host (no kernel): which batches the launch policy cuts
(ops.choose.decode_chunk_sms, ops.schedule.decode_chunk_count) and the chunk requests' index
arrays (ops.schedule.build_decode_chunks), checked against the page table they cut."""

import pytest
import torch

import compiled_attn as ca
from compiled_attn.ops import choose
from compiled_attn.ops.choose import H200, Device, decode_chunk_sms
from compiled_attn.ops.policy import override
from compiled_attn.ops.schedule import build_decode_chunks, decode_chunk_count
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


def test_build_decode_chunks_refuses_multi_row_requests():
    with pytest.raises(ValueError, match="request 1 has 2 query rows"):
        build_decode_chunks([0, 1, 3], [0, 4, 8], [16, 16], 16, 4)


def test_cpu_plans_are_not_cut():
    """Plans on a device the kernels do not run (CPU outside the interpreter: the reference
    path) are never cut, whatever the policy."""
    cache, kvi, idx, last, *_ = make_paged([40, 61], 2, 16, 16, 4)
    w = ca.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1), "NHD")
    with override(decode_chunks="always", decode_chunk_min_keys=8):
        w.plan(indptr([1, 1]), kvi, idx, last, 4, 2, 16, 4, q_data_type=torch.float64)
    assert not choose.INTERPRET and w._plan.chunk_work is None
