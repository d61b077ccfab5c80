"""POD on the Gluon kernel, CPU tier: the kernel compiled offline for sm_90 (tests/sm90.py), the
launch decision (ops.choose.pod_gluon), the launcher's arguments (prefill_gluon.launch_pod with
the kernel recorded instead of run) and the wrappers' work order and decode mask. The launch
itself runs in the GPU tier (tests/test_pod_gluon_gpu.py)."""

import re

import pytest
import torch

from compiled_attn import ops
from compiled_attn import pod as pod_api
from compiled_attn.ops import choose
from compiled_attn.ops import prefill_kernel as K
from compiled_attn.ops.policy import override

from .helpers import KernelRecorder

G = pytest.importorskip("compiled_attn.ops.prefill_gluon")


@pytest.fixture(autouse=True)
def _eager(monkeypatch):
    """The decision as an eager launch makes it (outside the op's eager call, wrap_triton is
    on: choose.eager_launch() reads False there)."""
    monkeypatch.setattr(choose, "eager_launch", lambda: True)
BF16 = torch.bfloat16
SM90_SHARED = 232448  # sm_90's opt-in shared memory per block


@pytest.mark.parametrize("page_p,page_d,causal,block_m", [
    (0, 16, True, 128), (16, 16, True, 128), (0, 8, False, 128), (0, 128, True, 128),
    (128, 16, False, 128), (0, 16, True, 64), (16, 16, False, 64),
    (0, 1, True, 64), (1, 1, False, 64), (3, 3, True, 64), (0, 1, True, 128)])
def test_pod_kernel_compiles_for_sm90(page_p, page_d, causal, block_m):
    import triton

    from .sm90 import gluon_pod_source, target

    src, opts = gluon_pod_source(page_p, page_d, causal, block_m=block_m)
    k = triton.compile(src, target=target(), options=opts)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "wgmma.wait_group.sync.aligned 1;" in ptx
    # persistent, warp-specialized: items from a global counter, the load warp's registers
    # given back, the compute warps' raised (two ping-pong groups, or the 64-row tile's one)
    assert "atom.global" in ptx
    assert "setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx
    n = G.TILES[block_m, 128].block_n
    if G.page_gathered(page_d, n, 128):
        # both parts' K / V gathered by the producer warp group's cp.async copies: no TMA
        assert "cp.async.cg.shared.global" in ptx and "cp.async.bulk.tensor" not in ptx
    else:
        # both parts' K / V boxes: a box a page where pages are smaller than the key tile
        boxes = sum(n // p if 0 < p < n else 1 for p in (page_p, page_d))
        assert ptx.count("cp.async.bulk.tensor") >= 2 * boxes
    # one set of rings for both parts: the shared memory of one part's launch
    assert k.metadata.shared <= SM90_SHARED
    assert len(re.findall(r"wgmma\.mma_async", ptx)) > 0


@pytest.mark.parametrize("page_p,page_d,block_m", [(0, 16, 128)])
def test_pod_kernel_with_the_decodes_row_map_compiles_for_sm90(page_p, page_d, block_m):
    """The decodes' Q rows through a row map (PodConfig.Q_ROWS_D: POD's decode key chunks read
    q_d's rows in place): other code than without it, and the same shared memory."""
    import triton

    from .sm90 import gluon_pod_source, target

    k = {q_rows: triton.compile(gluon_pod_source(page_p, page_d, True, block_m=block_m,
                                                 q_rows=q_rows)[0], target=target(),
                                options=gluon_pod_source(page_p, page_d, True,
                                                         block_m=block_m)[1])
         for q_rows in (True, False)}
    assert k[True].asm["ptx"] != k[False].asm["ptx"]
    assert k[True].metadata.shared == k[False].metadata.shared


@pytest.mark.parametrize("page_p,page_d,group", [(0, 16, 4), (16, 16, 8), (0, 8, 16)])
def test_pod_kernel_with_swapped_decodes_compiles_for_sm90(page_p, page_d, group):
    """The decodes' items on the swapped products beside the prefill's 64-row tiles
    (PodConfig.SWAP_D): both products' wgmmas in the one kernel (the swapped ones N = SWAP_ROWS
    wide), two programs a SM's shared memory still, and the kernel without it unchanged by
    the option's code (other PTX)."""
    import triton

    from .sm90 import gluon_pod_source, target

    k = {}
    for swap in (True, False):
        src, opts = gluon_pod_source(page_p, page_d, True, group=group, block_m=64,
                                     swap_d=swap)
        k[swap] = triton.compile(src, target=target(), options=opts)
    swapped = f"n{G.SWAP_ROWS.value}k16"
    assert swapped in k[True].asm["ptx"] and swapped not in k[False].asm["ptx"]
    assert "n64k16" in k[True].asm["ptx"]  # (the prefill's products, 64 keys wide)
    assert k[True].metadata.shared <= SM90_SHARED // 2


def _part(n_rows, pages, page, hq=8, hkv=2, d=128, dtype=BF16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(n_rows, hq, d, generator=g).to(dtype)
    cache = torch.randn(pages, 2, page, hkv, d, generator=g).to(dtype)
    return q, cache[:, 0], cache[:, 1]


def _decide(prefill=None, decode=None, p=None, d=None, block_m=128):
    q_p, k_p, v_p = prefill or _part(300, 1, 700)  # the one-page prefill cache
    q_d, k_d, v_d = decode or _part(6, 40, 16, seed=1)
    params = dict(mask_mode=ops.MASK_CAUSAL, window_left=-1, chunk_size=0, sm_scale=0.09,
                  logits_soft_cap=0.0, pos_encoding_mode=ops.POS_NONE, rope_scale=1.0,
                  rope_theta=1e4, v_scale=1.0)
    sp, cp = K._flags(q_p, None, None, **dict(params, **(p or {})))
    sd, cd = K._flags(q_d, None, None, **dict(params, **(d or {})))
    one_page = choose.one_page_cache(k_p, v_p, torch.zeros(min(k_p.shape[0], 1)))
    return choose.pod_gluon(q_p, k_p, v_p, q_d, k_d, v_d, cp, sp, cd, sd, q_p.dtype, block_m,
                            one_page=one_page, device=choose.H100)


def test_pod_gluon_decision_in_scope():
    assert _decide()
    assert _decide(d=dict(sm_scale=0.2))  # each part its own scale
    assert _decide(prefill=_part(300, 50, 16), p=dict(mask_mode=ops.MASK_NONE),
                   d=dict(mask_mode=ops.MASK_NONE))  # a paged prefill, no mask
    assert _decide(decode=_part(6, 40, 8)) and _decide(decode=_part(6, 4, 128))
    # gathered pages (1-7 keys): both parts gathered, the one-page prefill cache as one page
    assert _decide(decode=_part(6, 40, 1)) and _decide(decode=_part(6, 40, 3))
    assert _decide(prefill=_part(300, 700, 1), decode=_part(6, 40, 1))


@pytest.mark.parametrize("why", [
    dict(d=dict(mask_mode=ops.MASK_NONE)),  # one mask for both parts
    dict(d=dict(window_left=64)), dict(p=dict(logits_soft_cap=30.0)),
    dict(p=dict(pos_encoding_mode=ops.POS_ROPE_LLAMA), d=dict(pos_encoding_mode=ops.POS_ROPE_LLAMA)),
    dict(decode=_part(6, 40, 12)),  # a page neither dividing nor holding whole tiles
    dict(prefill=_part(300, 50, 16), decode=_part(6, 40, 1)),  # boxes beside gathers
    dict(prefill=_part(300, 700, 1), decode=_part(6, 40, 16)),  # gathers beside boxes
    dict(prefill=_part(300, 1, 700, d=64), decode=_part(6, 40, 16, d=64)),  # D 64
    dict(decode=_part(6, 40, 16, dtype=torch.float16)),  # q dtypes differ
    dict(block_m=256)], ids=str)
def test_pod_gluon_decision_out_of_scope(why):
    assert not _decide(**why)


def test_pod_gluon_decision_on_the_64_row_tile():
    # the plan's tile (choose.pod_tile): 64 rows where the decodes' pages take TMA boxes or
    # are gathered
    assert _decide(block_m=64) and _decide(decode=_part(6, 40, 8), block_m=64)
    assert _decide(decode=_part(6, 40, 1), block_m=64)
    with override(pod_gather=False):  # gathered pages then run apart
        assert not _decide(decode=_part(6, 40, 1), block_m=64)
        assert _decide(block_m=64)


def test_pod_plan_tile(monkeypatch):
    # POD plans take the 64-row tile where the Gluon POD launch reads the decodes' pages (by
    # boxes or gathered); fp8 K/V, D 64, pages of 12 keys and the policy switches keep the
    # 128-row tile
    monkeypatch.setattr(choose, "INTERPRET", False)
    def tile(page, d=128, **kw):
        return choose.pod_tile(d, 4, page, device=choose.H100, **kw)

    assert tile(16) == tile(8) == tile(64) == tile(128) == tile(1) == tile(4) == 64
    assert tile(12) == tile(16, kv_dtype=torch.float8_e4m3fn) == tile(16, d=64) == 128
    with override(pod_gather=False):
        assert tile(1) == 128 and tile(16) == 64
    assert tile(16, plain=False) == 128  # position encodings or a window: the Triton launch
    with override(pod_gluon=False):
        assert tile(16) == 128
    with override(use_gluon=False):
        assert tile(16) == 128
    assert choose.pod_tile(128, 4, 16, device=choose.Device("cuda", 8, 108)) == 128
    # the wrappers' plans: the decode part's options decide (POD), both parts' (BatchPOD)
    import compiled_attn

    monkeypatch.setattr(choose, "_plan_device", lambda: choose.H100)
    ind, idx, last = (torch.tensor(x, dtype=torch.int32) for x in ([0, 2, 3], [0, 1, 2], [5, 9]))
    for pos, window, want in (("NONE", -1, 64), ("ROPE_LLAMA", -1, 128), ("NONE", 32, 128)):
        w = compiled_attn.PODWithPagedKVCacheWrapper(torch.empty(1), "NHD")
        w.plan(ind, idx, last, 8, 2, 128, 16, pos_encoding_mode=pos, window_left=window,
               q_data_type=BF16)
        qo = torch.tensor([0, 3, 4], dtype=torch.int32)
        wb = compiled_attn.BatchPODWithPagedKVCacheWrapper(torch.empty(1), "NHD")
        wb.plan(qo, ind, idx, last, qo, ind, idx, last, 8, 2, 128, 16, pos_encoding_mode=pos,
                window_left=window, q_data_type=BF16)
        assert w._plan["block_m"] == wb._plan["block_m"] == want, (pos, window)
        # run apart, the decodes take the tile a paged call of them alone takes
        assert w._plan["block_m_d"] == wb._plan["block_m_d"] == 64, (pos, window)
    # one BatchPOD wrapper re-planned with the same options (its choices kept per options):
    # decodes of 17 rows (68 packed rows a request, over DECODE_ROWS) take the plan's tile,
    # one-row decodes the 64-row tile, in either order
    wb = compiled_attn.BatchPODWithPagedKVCacheWrapper(torch.empty(1), "NHD")
    ind, idx, last = (torch.tensor(x, dtype=torch.int32) for x in ([0, 2, 4], [0, 1, 2, 3],
                                                                   [16, 16]))
    for rows, want in ((1, 64), (17, 128), (1, 64), (17, 128)):
        qd = torch.tensor([0, rows, 2 * rows], dtype=torch.int32)
        wb.plan(qo, ind, idx, last, qd, ind, idx, last, 8, 2, 128, 16,
                pos_encoding_mode="ROPE_LLAMA", q_data_type=BF16)
        assert (wb._plan["block_m"], wb._plan["block_m_d"]) == (128, want), rows


def test_pod_decode_part_tile(monkeypatch):
    # choose.pod_decode_tile: decode rows (at most DECODE_ROWS packed rows a request) on pages
    # the Gluon kernel reads on its 64-row tile, boxes or gathered, take it; else the plan's
    monkeypatch.setattr(choose, "INTERPRET", False)
    def tile(qo, page=16, block_m=128, **kw):
        return choose.pod_decode_tile(128, 4, page, qo, block_m, device=choose.H100, **kw)

    assert tile([1] * 8) == tile([1] * 8, page=1) == tile([16, 1], page=3) == 64
    assert tile([17, 1]) == tile([]) == tile([1], kv_dtype=torch.float8_e4m3fn) == 128
    assert tile([17, 1], block_m=64) == 64
    with override(use_gluon=False):
        assert tile([1] * 8) == 128


def test_pod_gluon_decision_policy_switch():
    with override(pod_gluon=False):
        assert not _decide()
    with override(use_gluon=False):
        assert not _decide()


def _launch_parts(prefill, decode, one_page, monkeypatch):
    """(recorder, the two PodParts) for launch_pod with _gluon_pod_fwd recorded on a 2-SM GPU:
    prefill / decode (q, k, v) as _part makes them, one request each (the prefill's cache one
    page when one_page), scales 0.5 and 0.25."""
    rec = KernelRecorder(G._gluon_pod_fwd)
    monkeypatch.setattr(G, "_gluon_pod_fwd", rec)
    monkeypatch.setattr(G, "_sm_count", lambda device: 2)
    i32 = dict(dtype=torch.int32)
    parts = [K._pod_part(q, k, v, torch.tensor([0, q.shape[0]], **i32),
                         torch.tensor([0, k.shape[0]], **i32), torch.arange(k.shape[0], **i32),
                         torch.tensor([k.shape[1]], **i32), one, BF16, {}, s)
             for (q, k, v), one, s in ((prefill, one_page, 0.5), (decode, False, 0.25))]
    return rec, parts


@pytest.mark.parametrize("one_page", [True, False])
def test_launch_pod_arguments(one_page, monkeypatch):
    q_p, k_p, v_p = prefill = _part(300, 1, 700) if one_page else _part(300, 50, 16)
    rec, parts = _launch_parts(prefill, _part(6, 40, 8, seed=1), one_page, monkeypatch)
    work = torch.zeros(7, 3, dtype=torch.int32)
    out_p, lse_p, out_d, lse_d = G.launch_pod(*parts, work, causal=True)
    assert out_p.shape == (300, 8, 128) and lse_d.shape == (6, 8) and out_d.dtype == BF16
    # persistent: a 1D grid of the programs a 2-SM GPU holds (one 128-row tile each), at most
    # one per item (7 rows x 2 KV heads)
    assert rec.grid == (2 * G._WS_CTAS[8], )
    assert rec.arg("sizes") == (7, 2)  # (PodSizes: work rows, KV heads)
    # no row map: the decodes' Q rows are their own (the map's pointer never read)
    assert not rec.kw["CONFIG"].Q_ROWS_D and rec.arg("q_rows_ptr_d") is parts[1].q
    kw, cfg = rec.kw, rec.kw["CONFIG"]
    assert cfg.SOURCE == ((0, 0, 1, False) if one_page else (1, 16, 8, False))
    assert cfg.SOURCE_D == (1, 8, 16, False)
    assert cfg.PINGPONG and kw["num_warps"] == 4 and kw["maxnreg"] == G.ws_maxnreg(8)
    assert (cfg.GROUP_REGS, cfg.PRODUCER_REGS) == (G.PINGPONG_REGS, 24)
    assert rec.arg("k_desc").block_shape == [128 if one_page else 16, 128]
    assert rec.arg("k_desc_d").block_shape == [8, 128]
    part, part_d = rec.arg("scalars"), rec.arg("scalars_d")
    assert part.qk_scale == 0.5 and part_d.qk_scale == 0.25
    # pages two pages' rows apart (K and V interleave in one [P, 2, page, Hkv, D] buffer); the
    # one-page cache's K view is its 700 rows, its page rows 0 (never read: its one page is
    # page 0; not its key count, so that launches of any count are alike, launch.Memo's free)
    assert part.k_page_rows == (0 if one_page else 32) and part_d.k_page_rows == 16
    assert rec.arg("k_desc").shape[0] == (700 if one_page else 49 * 32 + 16)
    assert rec.arg("q_ptr") is q_p and rec.arg("o_ptr_d") is out_d


@pytest.mark.parametrize("one_page", [True, False])
def test_launch_pod_gathered_arguments(one_page, monkeypatch):
    # decodes on pages of 1 key: both parts gathered through their caches' pointers (the
    # one-page prefill cache as one page of one_page_size keys), the load partition a warp
    # group at GATHER_REGS
    rec, parts = _launch_parts(_part(300, 1, 700) if one_page else _part(300, 700, 1),
                               _part(6, 40, 1, seed=1), one_page, monkeypatch)
    work = torch.zeros(7, 3, dtype=torch.int32)
    G.launch_pod(*parts, work, causal=True, block_m=64)
    cfg = rec.kw["CONFIG"]
    assert cfg.SOURCE == ((2, G.one_page_size(700), 1, False) if one_page else (2, 1, 1, False))
    assert cfg.SOURCE_D == (2, 1, 1, False)
    assert (cfg.GROUP_REGS, cfg.PRODUCER_REGS) == G.GATHER_REGS and not cfg.PINGPONG
    assert rec.arg("k_ptr") is parts[0].k2 and rec.arg("v_ptr_d") is parts[1].v2
    part, part_d = rec.arg("scalars"), rec.arg("scalars_d")
    # K and V interleave in one buffer: a cache row is Hkv * D elements, the next K row of a
    # page two pages' rows on (page_rows)
    assert part.stride_kr == part_d.stride_vr == 2 * 128
    assert part_d.k_page_rows == 2
    # boxes beside gathers: refused with the reason
    parts[0] = parts[0]._replace(page=16)
    with pytest.raises(ValueError, match="read alike"):
        G.launch_pod(*parts, work, causal=True, block_m=64)


def test_launch_pod_swapped_decodes_arguments(monkeypatch):
    # swap_d: PodConfig.SWAP_D on the 64-row tile (one compute group); refused with the reason
    # on the ping-pong tile, on gathered pages and past SWAP_ROWS query heads a KV head
    rec, parts = _launch_parts(_part(300, 1, 700), _part(6, 40, 16, seed=1), True, monkeypatch)
    work = torch.zeros(7, 3, dtype=torch.int32)
    for swap in (True, False):
        G.launch_pod(*parts, work, causal=True, block_m=64, swap_d=swap)
        assert rec.kw["CONFIG"].SWAP_D is swap and not rec.kw["CONFIG"].PINGPONG
    with pytest.raises(ValueError, match="swap_d needs one compute group"):
        G.launch_pod(*parts, work, causal=True, block_m=128, swap_d=True)
    _, gathered = _launch_parts(_part(300, 1, 700), _part(6, 40, 1, seed=1), True, monkeypatch)
    with pytest.raises(ValueError, match="gathered pages True"):
        G.launch_pod(*gathered, work, causal=True, block_m=64, swap_d=True)
    _, wide = _launch_parts(_part(300, 1, 700, hq=34), _part(6, 40, 16, hq=34, seed=1), True,
                            monkeypatch)
    with pytest.raises(ValueError, match="group 17"):
        G.launch_pod(*wide, work, causal=True, block_m=64, swap_d=True)


# (block_m, d, decode page, decode rows, group, requests, swapped): the 64-row D 128 tile on
# pages read by boxes, groups up to SWAP_ROWS, at most SWAP_ROWS packed rows a request on
# average
@pytest.mark.parametrize("block_m,d,page,rows,group,requests,want", [
    (64, 128, 16, 6, 4, 6, True), (64, 128, 8, 6, 16, 6, True), (64, 128, 128, 6, 8, 6, True),
    (64, 128, 16, 10, 4, 6, True), (64, 128, 1, 6, 4, 6, False), (64, 128, 3, 6, 4, 6, False),
    (128, 128, 16, 6, 4, 6, False), (64, 64, 16, 6, 4, 6, False), (64, 128, 16, 6, 17, 6, False),
    (64, 128, 16, 30, 4, 6, False)])
def test_pod_swap_decodes_decision(block_m, d, page, rows, group, requests, want):
    assert choose.pod_swap_decodes(block_m, d, page, rows, group, requests) is want
    with override(pod_decode_swap=False):
        assert choose.pod_swap_decodes(block_m, d, page, rows, group, requests) is False


def test_pod_work_order_and_decode_mask():
    pre = torch.tensor([[0, 128], [0, 0]], dtype=torch.int32)
    dec = torch.tensor([[0, 0], [1, 0], [2, 0]], dtype=torch.int32)
    w = pod_api._pod_work(pre, dec)
    assert w.tolist() == [[0, 0, 128], [0, 0, 0], [1, 0, 0], [1, 1, 0], [1, 2, 0]]
    assert pod_api._pod_work(pre[:0], dec).tolist() == [[1, 0, 0], [1, 1, 0], [1, 2, 0]]
    # single-row decodes take the prefill's causal / no mask (the same keys either way)
    M = ops
    assert pod_api._decode_mask(M.MASK_CAUSAL, M.MASK_NONE, True) == M.MASK_CAUSAL
    assert pod_api._decode_mask(M.MASK_NONE, M.MASK_CAUSAL, True) == M.MASK_NONE
    assert pod_api._decode_mask(M.MASK_CAUSAL, M.MASK_NONE, False) == M.MASK_NONE
    assert pod_api._decode_mask(M.MASK_CUSTOM, M.MASK_NONE, True) == M.MASK_NONE
