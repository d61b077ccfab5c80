"""Tile policy of the kernel launch (ops/prefill_kernel.py), checked on the host: the choices
the launch and plan() must agree on, and the combinations known to break the compiler."""

import pytest
import torch

from compiled_attn.ops import choose
from compiled_attn.ops import contracts
from compiled_attn.ops import prefill_kernel as K

pytestmark = pytest.mark.skipif(contracts.INTERPRET, reason="the GPU policy (not interpreter)")


@pytest.mark.parametrize("d", [64, 128, 192, 256])
@pytest.mark.parametrize("mask_mode", [contracts.MASK_NONE, contracts.MASK_CAUSAL,
                                       contracts.MASK_CUSTOM])
def test_configs_fit_and_never_pair_descriptors_with_two_stages(d, mask_mode):
    for kv in (None, 512, 1024, 1025, 4096, 8192, 32768):
        for causal in (True, False):
            for page in (0, 1, 4, 16):
                bm = choose.tile(d, d, 4, kv, causal, page > 0, page_size=page,
                                   qo_lens=None if kv is None else [kv])
                assert bm in (64, 128, 256)
                cfg = choose.config(bm, d, d, K.KV_PAGED if page else K.KV_RAGGED, mask_mode)
                # triton 3.6's ptxas crashes on descriptor loads with a 2-stage pipeline.
                assert not (cfg["TMA"] and cfg["num_stages"] < 3), (d, bm, cfg)
                # 256-row tiles: four 64-row warpgroups (16 warps) of 64 keys
                assert bm != 256 or (cfg["num_warps"], cfg["BLOCK_N"]) == (16, 64), cfg


def test_tile_heights():
    # Unknown lengths (CUDA-graph plans, symbolic shapes): one tile for every re-plan.
    assert choose.tile(128, 128, 1) == 128
    # Short batches: 64-row tiles whatever the addressing.
    assert choose.tile(128, 128, 1, 1024, True, True) == 64
    assert choose.tile(64, 64, 1, 1000) == 64
    # D 128 causal up to SHORT_KV keys through descriptors: 64 rows; paged (pointer loads): 128.
    assert choose.tile(128, 128, 1, 4096) == 64
    assert choose.tile(128, 128, 1, 4096, True, True) == 128
    assert choose.tile(128, 128, 1, 4096, False) == 128
    assert choose.tile(128, 128, 1, 8192) == 128
    assert choose.tile(256, 256, 1, 1024) == 128


def test_small_pages_take_256_row_tiles_when_requests_fill_them():
    bm = choose.tile
    # pages of 1-8 keys, 64 < D <= 128, known lengths, requests that fill 256-row tiles (no
    # GPU here: page 8 is not the Gluon kernel's, which tiles it as contiguous K/V)
    for page in (1, 2, 5, 8):
        assert bm(128, 128, 1, 4096, True, True, page_size=page, qo_lens=[4096] * 3) == 256
    assert bm(96, 96, 4, 1024, False, True, page_size=1, qo_lens=[64, 128]) == 256  # group 4
    # padding: 384 packed rows (two 256-row tiles, three of 128: 1.33x) measured 0.82x; mixed
    # batches weigh every request
    assert bm(128, 128, 4, 4096, True, True, page_size=1, qo_lens=[96]) == 128
    assert bm(128, 128, 1, 4096, True, True, page_size=1, qo_lens=[4096, 4096, 100]) == 256
    assert bm(128, 128, 1, 4096, True, True, page_size=1, qo_lens=[300, 1, 1, 1]) == 128
    # decode-like requests (64 and 128 packed rows measured 0.62x), page 16, D 64 / 256,
    # unknown lengths (CUDA-graph plans), unknown or no rows, contiguous K/V: unchanged
    assert bm(128, 128, 4, 4096, True, True, page_size=1, qo_lens=[16] * 64) == 128
    assert bm(128, 128, 4, 4096, True, True, page_size=1, qo_lens=[32] * 64) == 128
    assert bm(128, 128, 1, 4096, True, True, page_size=16, qo_lens=[4096]) == 128
    assert bm(64, 64, 1, 4096, True, True, page_size=1, qo_lens=[4096]) == 128
    assert bm(256, 256, 1, 4096, True, True, page_size=1, qo_lens=[4096]) == 128
    assert bm(128, 128, 1, None, True, True, page_size=1, qo_lens=[4096]) == 128
    assert bm(128, 128, 1, 4096, True, True, page_size=1) == 128
    assert bm(128, 128, 1, 4096, True, True, page_size=1, qo_lens=[0, 0]) == 128
    assert bm(128, 128, 1, 4096, True, False, page_size=1, qo_lens=[4096]) == 64


@pytest.mark.parametrize("page_size,rows,want", [(1, 512, 256), (1, 40, 128), (1, 300, 128),
                                                 (16, 512, 128)])
def test_paged_plan_passes_page_size_and_rows(page_size, rows, want):
    # plan() hands the tile policy the page size and the mean query rows per request (on the
    # host: no kernel runs here).
    import compiled_attn as fi

    b, kv = 3, 2000
    pages = -(-kv // page_size)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(16, dtype=torch.uint8), "NHD")
    w.plan(torch.arange(b + 1, dtype=torch.int32) * rows,
           torch.arange(b + 1, dtype=torch.int32) * pages,
           torch.arange(b * pages, dtype=torch.int32),
           torch.full((b,), kv - (pages - 1) * page_size, dtype=torch.int32),
           8, 8, 128, page_size, causal=True)
    assert w._plan.block_m == want


def test_work_order_groups_requests_heaviest_first():
    # Requests by their heaviest tile (longest first), each request's tiles heaviest first
    # (causal: the last rows see the most keys): L2 reuse within a request, short tiles last.
    from compiled_attn.ops.schedule import build_work

    qo, kv = [100, 300, 0, 200], [100, 300, 5, 250]
    w = build_work(qo, 1, 64, kv_lens=kv).tolist()
    reqs = [r for r, _ in w]
    assert reqs == [1] * 5 + [3] * 4 + [0] * 2  # request 2 has no rows
    for r in (0, 1, 3):
        rows = [row for b, row in w if b == r]
        assert rows == sorted(rows, reverse=True)
    # every tile exactly once
    assert sorted(w) == sorted([b, row] for b, n in enumerate(qo) for row in range(0, n, 64))


@pytest.mark.parametrize("group,block_m", [(1, 16), (4, 64), (7, 32), (8, 128), (32, 16)])
def test_work_order_is_the_weight_sort(group, block_m):
    # The order by its definition: requests by their keys, longest first (ties in request
    # order), each request's tiles by the keys their last row may see (the causal bound
    # min(k, k - n + 1 + last token)), heaviest first, equal weights in row order (a stable
    # sort). build_work skips the sort where the tile is at least a group high; a group of 32
    # over a 16-row tile gives equal weights (two tiles a token).
    from compiled_attn.ops.schedule import build_work

    g = torch.Generator().manual_seed(group * 1000 + block_m)
    for _ in range(20):
        b = int(torch.randint(1, 6, (1,), generator=g))
        qo = torch.randint(0, 90, (b,), generator=g).tolist()
        kv = [max(0, n + d) for n, d in zip(qo, torch.randint(-40, 40, (b,), generator=g).tolist())]
        want = []
        for r in sorted(range(b), key=lambda r: -kv[r]):
            n, k, end = qo[r], kv[r], qo[r] * group
            tiles = [(min(k, k - n + min(row + block_m, end) // group), row)
                     for row in range(0, end, block_m)]
            want += [[r, row] for _, row in sorted(tiles, key=lambda t: -t[0])]
        assert build_work(qo, group, block_m, kv_lens=kv).tolist() == want, (qo, kv)


@pytest.mark.parametrize("n", [5, 128, 129, 300])
def test_decode_work_lists_one_tile_a_request_by_keys(n):
    # Decode rows (a tile a request), few and many: requests by their keys, longest first
    # (ties in request order), a request without rows left out, row 0 each.
    from compiled_attn.ops.schedule import build_work

    g = torch.Generator().manual_seed(n)
    kv = torch.randint(0, 50, (n,), generator=g).tolist()
    qo = [0 if b % 7 == 3 else 1 for b in range(n)]
    w = build_work(qo, 4, 64, kv_lens=kv)
    assert w.dtype == torch.int32 and w.shape == (n - qo.count(0), 2)
    want = sorted((b for b in range(n) if qo[b]), key=lambda b: (-kv[b], b))
    assert w[:, 0].tolist() == want and not w[:, 1].any()


def test_eager_allocator_installed_only_when_none_is_set():
    # Descriptor launches need Triton's scratch allocator; an allocator the caller set wins.
    import triton
    from triton.runtime import _allocation

    saved = _allocation._allocator.get()
    try:
        triton.set_allocator(_allocation.NullAllocator())
        K._ensure_allocator()
        assert _allocation._allocator.get() is K._scratch
        mine = lambda size, align, stream: None  # noqa: E731
        triton.set_allocator(mine)
        K._ensure_allocator()
        assert _allocation._allocator.get() is mine
    finally:
        _allocation._allocator.set(saved)


def test_device_properties_queried_once_for_capability_and_sm_counts(monkeypatch):
    # The launch decision's device description (capability, SM count), the work-list
    # builder's SM count and the Gluon launcher's persistent grid read one cached properties
    # query per device.
    from types import SimpleNamespace

    from compiled_attn.ops import device as dev

    calls = []

    def props(index):
        calls.append(index)
        return SimpleNamespace(major=9, minor=0, multi_processor_count=7 + index)

    def clear():
        dev._device_properties.cache_clear()
        choose._cuda_device.cache_clear()

    clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    try:
        assert choose.device_of(torch.device("cuda", 1)) == choose.Device("cuda", 9, 8)
        assert dev.sm_count() == 8 and dev.sm_count(1) == 8
        assert choose.device_of(torch.device("cuda")).gluon
        if K._gluon is not None:
            assert K._gluon._sm_count(torch.device("cuda", 1)) == 8
            assert K._gluon._sm_count(torch.device("cuda")) == 8
        assert dev.sm_count(0) == 7 and choose.device_of(torch.device("cuda", 0)).sm_count == 7
        assert calls == [1, 0]
    finally:
        clear()


def test_dense_block_m_is_the_launch_tile():
    # choose.dense_tile (the launch's and ops.dispatch's) is choose.tile over the call's head
    # dims, head ratio and KV length.
    q = torch.empty(2, 4096, 32, 128)
    for hkv, skv, mask in ((8, 4096, contracts.MASK_CAUSAL), (32, 512, contracts.MASK_NONE),
                           (32, 1025, contracts.MASK_CUSTOM)):
        k = v = torch.empty(2, skv, hkv, 128)
        assert choose.dense_tile(q, k, v, mask) == choose.tile(
            128, 128, 32 // hkv, skv, mask != contracts.MASK_NONE)


def test_int32_host():
    # a plan's int32 host arrays from flat lists: values and shape, empty, int32 bounds
    from compiled_attn.ops.schedule import int32_host

    vals = [0, -1, 2 ** 31 - 1, -2 ** 31, 7, 8]
    t = int32_host(vals)
    assert t.dtype == torch.int32 and t.device.type == "cpu" and t.tolist() == vals
    vals[0] = 5  # (a copy of the list's values)
    assert int(t[0]) == 0
    assert int32_host(vals, 2).shape == (3, 2)
    assert int32_host(vals, 3)[1].tolist() == [-2 ** 31, 7, 8]
    assert int32_host([]).shape == (0,) and int32_host([], 3).shape == (0, 3)
    with pytest.raises(OverflowError):
        int32_host([2 ** 31])
