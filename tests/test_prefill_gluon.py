"""The Gluon Hopper kernel's CPU tier: it compiles for sm_90 under the installed Triton (the
Gluon dialect is experimental and its API moves between releases; the H100 runs triton 3.6, CI
3.9), the 2D K/V views its descriptors read, and which launches the op gives it (every
exclusion of its scope on its own). Its numbers are checked on the H100
(tests/test_prefill_gluon_gpu.py)."""

import re

import pytest
import torch

from compiled_attn.ops import choose
from compiled_attn import ops
from compiled_attn.ops import prefill_kernel as K
from compiled_attn.ops.policy import POLICY

from .helpers import KernelRecorder

gluon_mod = pytest.importorskip("compiled_attn.ops.prefill_gluon")


# (ws, pp): warp-specialized, ping-pong (two compute groups of half the warps; implies ws);
# short: GATHER_SHORT_TILE (gathered pages, short requests) instead of TILES'
@pytest.mark.parametrize("dense,page,block_m,d,causal,ws,pp,short", [c + (False, ) for c in [
    (False, 0, 64, 128, True, False, False), (True, 0, 128, 64, False, True, True),
    (False, 8, 64, 128, True, True, False),
    (False, 64, 64, 128, True, False, False), (False, 16, 128, 128, True, True, True),
    (True, 0, 64, 64, False, True, False), (False, 0, 128, 128, True, False, False),
    (False, 0, 128, 256, True, True, True), (False, 128, 128, 256, False, True, True),
    (False, 1, 128, 128, True, True, True), (False, 3, 64, 128, False, True, False),
    (False, 1, 128, 64, True, True, True)]] + [(False, 2, 128, 128, True, True, True, True)])
def test_compiles_for_sm90(dense, page, block_m, d, causal, ws, pp, short):
    import triton

    from .sm90 import gluon_source, target

    src, opts, facts = gluon_source(dense, page, block_m, d, causal, ws, pp, short)
    block_n, gather, persistent, regs = (facts[k] for k in ("block_n", "gather", "persistent",
                                                            "regs"))
    k = triton.compile(src, target=target(), options=opts)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx
    # warp specialized: the load warp's registers given back, the compute warps' raised; the
    # compute warps release each slot (mbarrier arrive) instead of issuing its copy
    assert ("setmaxnreg.dec" in ptx and "setmaxnreg.inc" in ptx) == ws
    assert ("mbarrier.arrive.shared" in ptx) == ws
    if gather:
        # K / V by 16-byte cp.async copies, each producer thread arriving on the slot's barrier
        # once its copies land; TMA for Q alone (persistent: Q_TMA)
        assert re.search(r"cp\.async\.cg\.shared\.global \[[^]]*\], \[[^]]*\], 0x10", ptx)
        assert "cp.async.mbarrier.arrive.noinc" in ptx
        assert ("cp.async.bulk.tensor" in ptx) == persistent
    else:
        if page and page < block_n:
            assert ptx.count("cp.async.bulk.tensor") >= block_n // page * 2  # a box per page
        # K, V and (persistent: Q_TMA) Q boxes
        assert ptx.count("cp.async.bulk.tensor") >= (3 if persistent else 2)
    # persistent: work items from a global counter
    assert ("atom.global" in ptx) == persistent
    # Q K^T of a tile and P V of the previous one in flight together: a wait for one group
    assert "wgmma.wait_group.sync.aligned 1;" in ptx
    # ping-pong: the worker compute group's registers raised to its setting
    raised = {int(n) for n in re.findall(r"setmaxnreg\.inc\S*\s+(\d+)", ptx)}
    assert (regs[0] in raised) == pp


@pytest.mark.parametrize("page,block_m,ws", [(16, 64, True), (0, 128, False)])
def test_q_row_map_compiles_for_sm90(page, block_m, ws):
    """Q's rows through a row map (Schedule.Q_ROWS: decode key chunks reading q's rows in
    place) load the map's rows in the compute groups (persistent on boxes, or a program an item
    on contiguous rows): one more 32-bit global load than without the map."""
    import triton

    from .sm90 import gluon_source, target

    ptx = {}
    for q_rows in (True, False):
        src, opts, facts = gluon_source(False, page, block_m, 128, True, ws, False, False,
                                        q_tma=False, q_rows=q_rows)
        assert facts["persistent"] == (ws and block_m == 64)
        ptx[q_rows] = triton.compile(src, target=target(), options=opts).asm["ptx"]
    assert ptx[True] != ptx[False]
    # (the map's int32 rows: one more global load of 32-bit words than without it)
    loads = {k: len(re.findall(r"ld\.global[^\n]*\.b32", v)) for k, v in ptx.items()}
    assert loads[True] > loads[False], loads


def test_kv_2d_views():
    k = torch.randn(10, 4, 64, dtype=torch.bfloat16)
    v2 = gluon_mod.kv_2d(k, "ragged")
    assert v2.shape == (10, 256) and v2.data_ptr() == k.data_ptr()
    assert torch.equal(v2[3, 64:128], k[3, 1])
    kd = torch.randn(2, 5, 4, 64, dtype=torch.bfloat16)
    assert torch.equal(gluon_mod.kv_2d(kd, "dense")[7, :64], kd[1, 2, 0])
    hnd = torch.randn(2, 4, 5, 64, dtype=torch.bfloat16).transpose(1, 2)  # heads not packed
    assert gluon_mod.kv_2d(hnd, "dense") is None and gluon_mod.kv_2d(hnd, "paged") is None
    sliced = torch.randn(2, 8, 4, 64, dtype=torch.bfloat16)[:, :5]  # batch not packed
    assert gluon_mod.kv_2d(sliced, "dense") is None
    assert gluon_mod.kv_2d(torch.randn(10, 4, 64, dtype=torch.bfloat16)[:, :, :32],
                           "ragged") is None  # dims not packed
    assert gluon_mod.kv_2d(torch.zeros(0, 16, 4, 64, dtype=torch.bfloat16), "paged") is None
    # a combined cache [P, 2, page, Hkv, D]: K page p at row p * 2 * page, V's page p after it
    cache = torch.randn(3, 2, 16, 4, 64, dtype=torch.bfloat16)
    for i, t in enumerate((cache[:, 0], cache[:, 1])):
        t2, rows = gluon_mod.kv_2d(t, "paged"), gluon_mod.page_rows(t)
        assert rows == 32 and t2.shape == (2 * 32 + 16, 256)
        assert torch.equal(t2[2 * rows + 5, 128:192], cache[2, i, 5, 2])


def _scope(monkeypatch, kv_mode=K.KV_RAGGED, dtype=torch.bfloat16, d=128, dv=None,
           block_m=64, page=0, hnd=False, **flags):
    """The Gluon kernel's views of a launch on an H100 description when choose.choose gives
    it that kernel, else None."""
    monkeypatch.setattr(choose, "device_of", lambda device: choose.H100)
    monkeypatch.setattr(choose, "eager_launch", lambda: True)
    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)  # (the scope, not the size rule)
    q = torch.randn(6, 8, d, dtype=dtype)
    if page:  # a combined cache [P, 2, page, Hkv, D] (or its HND form)
        kv_mode = K.KV_PAGED
        cache = torch.randn(5, 2, 2, page, d, dtype=dtype).transpose(2, 3) if hnd else \
            torch.randn(5, 2, page, 2, d, dtype=dtype)
        k, v = cache[:, 0], cache[:, 1]
    else:
        k = torch.randn(9, 2, d, dtype=dtype)
        v = torch.randn(9, 2, dv or d, dtype=dtype)
    out = torch.empty(6, 8, dv or d, dtype=dtype)
    params = dict(mask_mode=ops.MASK_CAUSAL, window_left=-1, chunk_size=0, sm_scale=0.1,
                  logits_soft_cap=0.0, pos_encoding_mode=ops.POS_NONE, rope_scale=1.0,
                  rope_theta=1e4, v_scale=1.0)
    sinks = torch.zeros(8) if flags.pop("sinks", False) else None
    params.update(flags)
    slopes = torch.ones(8) if params["pos_encoding_mode"] == ops.POS_ALIBI else None
    scalars, consts = K._flags(q, slopes, sinks, **params)
    choice = choose.choose(kv_mode, q, k, v, consts, scalars, out.dtype, block_m=block_m,
                           requests=1, items=1, pages=k.shape[0])
    if choice.kernel != "gluon":
        return None
    return K._gluon_views(kv_mode, k, v, scalars, page)


def test_scope_in(monkeypatch):
    views = _scope(monkeypatch)
    assert views["k2"].shape == (9, 256) and views["qk_scale"] == pytest.approx(0.1 * K.LOG2E)
    assert views["paged"] is None
    assert _scope(monkeypatch, mask_mode=ops.MASK_NONE, d=64, block_m=128) is not None
    assert _scope(monkeypatch, d=256, block_m=128) is not None  # D 256: 128-row tiles only
    assert _scope(monkeypatch, d=256, block_m=128, page=64)["paged"] == (64, 128, 128)
    for page, block_m in ((64, 64), (128, 128), (128, 64), (256, 128)):
        views = _scope(monkeypatch, page=page, block_m=block_m)
        assert views["paged"] == (page, 2 * page, 2 * page)
    for page, block_m in ((8, 64), (8, 128), (16, 64), (16, 128), (32, 128), (64, 128),
                          (1, 64), (1, 128), (3, 128), (4, 64), (7, 128)):
        # a box per page (WS); pages below MIN_BOX_PAGE gathered
        assert _scope(monkeypatch, page=page, block_m=block_m)["paged"] == (page, 2 * page,
                                                                            2 * page)
    for d in (64, 256):  # gathered pages at every head dim
        assert _scope(monkeypatch, page=1, d=d, block_m=128)["paged"] == (1, 2, 2)


@pytest.mark.parametrize("change", [
    dict(dtype=torch.float32), dict(d=96), dict(d=128, dv=64),
    dict(block_m=256), dict(mask_mode=ops.MASK_CUSTOM), dict(window_left=8),
    dict(chunk_size=16), dict(logits_soft_cap=30.0), dict(pos_encoding_mode=ops.POS_ALIBI),
    dict(pos_encoding_mode=ops.POS_ROPE_LLAMA), dict(v_scale=0.5), dict(sm_scale=-0.1),
    dict(sinks=True), dict(page=12), dict(page=96), dict(page=48, block_m=128),
    dict(page=64, hnd=True), dict(page=16, d=64), dict(d=256), dict(d=512, block_m=128),
    dict(d=256, block_m=128, page=16), dict(d=256, dv=128, block_m=128)], ids=str)
def test_scope_out(change, monkeypatch):
    assert _scope(monkeypatch, **change) is None


def test_scope_off_switch_and_device(monkeypatch):
    monkeypatch.setattr(POLICY, "use_gluon", False)
    assert _scope(monkeypatch) is None
    monkeypatch.undo()
    assert not choose.device_of(torch.device("cpu")).gluon and choose.H100.gluon


@pytest.mark.parametrize("gluon", [True, False])
@pytest.mark.parametrize("d,block_m,cap", [(128, 64, 0.0), (64, 128, 0.0), (256, 128, 0.0),
                                           (256, 128, 30.0)])
def test_only_asking_launches_get_it(gluon, d, block_m, cap, monkeypatch):
    # A launch that may not run the Gluon kernel (a split plan, POD) never gets its views and
    # keeps Triton's host descriptors; one that may gets the views and no descriptors. D 64 and
    # D 256 on 128-row tiles have descriptors in the Gluon kernel alone (_gluon_launch, asked
    # first): without it, or out of its scope (a soft cap), the Triton kernel's pointer loads.
    monkeypatch.setattr(choose, "device_of", lambda device: choose.H100)
    monkeypatch.setattr(choose, "eager_launch", lambda: True)
    monkeypatch.setattr(choose, "_tma_ok", lambda *a: True)
    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    q = torch.randn(256, 8, d, dtype=torch.bfloat16)
    k, v = (torch.randn(512, 2, d, dtype=torch.bfloat16) for _ in range(2))
    indptr = torch.tensor([0, 256], dtype=torch.int32)
    params = dict(mask_mode=ops.MASK_CAUSAL, window_left=-1, chunk_size=0, sm_scale=0.1,
                  logits_soft_cap=cap, pos_encoding_mode=ops.POS_NONE, rope_scale=1.0,
                  rope_theta=1e4, v_scale=1.0)
    work = torch.zeros(4, 2 if gluon else 4, dtype=torch.int32)  # (a split plan: no Gluon)
    _, _, (args, consts, cfg) = K._ragged_args(q, k, v, indptr, indptr * 2, None, None, None,
                                               None, block_m, torch.bfloat16, params, work)
    takes = gluon and not cap
    assert (cfg.get("gluon") is not None) == takes
    if d == 128:
        assert consts["TMA"] == 2
        assert isinstance(args["k_ptr"], torch.Tensor) == gluon  # descriptors only for Triton
    else:
        assert consts["TMA"] == (2 if takes else 0) and isinstance(args["k_ptr"], torch.Tensor)


def test_gluon_pages_are_tiled_like_contiguous_kv(monkeypatch):
    # Where the Gluon kernel reads a page size (D 128: TMA boxes for pages of 8+ keys dividing
    # both tiles, gathers below 8 keys), block_m_for tiles paged K/V as it tiles contiguous K/V
    # (64-row tiles up to GLUON_SHORT_KV causal keys, then its ping-pong 128-row tiles); the
    # Triton kernel's pages keep 128-row tiles.
    monkeypatch.setattr(choose, "INTERPRET", False)
    monkeypatch.setattr(choose, "device_of", lambda device: choose.H100)
    tile = lambda page, d=128, kv=1024: choose.tile(d, d, 4, kv, True, True,  # noqa: E731
                                                    page_size=page)
    assert tile(16) == tile(64) == tile(128) == tile(8) == 64 and tile(16, kv=2048) == 128
    assert tile(0, kv=2048) == tile(48, kv=2048) == tile(16, d=64, kv=2048) == 128
    # pages 8 and 1-4 (boxes, gathers) keep these tiles where requests would fill the Triton
    # kernel's 256-row small-page tiles; without the Gluon kernel they take those
    full = lambda page, kv_dtype=None: choose.tile(  # noqa: E731
        128, 128, 4, 2048, True, True, page_size=page, qo_lens=[2048] * 4, kv_dtype=kv_dtype)
    assert full(8) == full(4) == full(1) == 128
    # gathered pages (1-7 keys) take 128-row tiles from GATHER_MIN_KV causal keys on (half
    # that without a mask), where the others keep 64-row ones up to GLUON_SHORT_KV
    gathered = lambda page, kv, causal=True: choose.tile(  # noqa: E731
        128, 128, 4, kv, causal, True, page_size=page)
    assert gathered(1, choose.GATHER_MIN_KV) == gathered(3, choose.GATHER_MIN_KV) == 64
    assert gathered(1, choose.GATHER_MIN_KV + 1) == tile(1) == tile(3) == tile(7) == 128
    assert (gathered(1, choose.GATHER_MIN_KV // 2, False), gathered(1, choose.GATHER_MIN_KV, False)) \
        == (64, 128)
    assert tile(8) == gathered(16, 1024) == gathered(16, 512, False) == 64
    assert full(8, torch.bfloat16) == full(8, torch.float16) == 128
    # fp8 K/V never take the Gluon kernel: their page 8 keeps the small pages' tiles
    assert full(8, torch.float8_e4m3fn) == K.SMALL_PAGE_BLOCK_M
    monkeypatch.setattr(POLICY, "use_gluon", False)
    assert tile(16, kv=2048) == 128 and full(8) == full(1) == K.SMALL_PAGE_BLOCK_M


def test_decode_rows_take_64_row_tiles(monkeypatch):
    # Requests of at most DECODE_ROWS packed rows (decodes, short speculative rows) on pages
    # read by TMA boxes or gathered (pages 1-7) take 64-row tiles at any key length, known or
    # not (a CUDA-graph plan); longer requests, fp8 K/V and the Triton kernel keep theirs.
    monkeypatch.setattr(choose, "INTERPRET", False)
    monkeypatch.setattr(choose, "device_of", lambda device: choose.H100)

    def tile(qo, g=4, page=16, kv=32768, **kw):
        return choose.tile(128, 128, g, kv, False, True, page_size=page, qo_lens=qo, **kw)

    assert tile([1] * 128) == tile([1], g=8) == tile([1] * 3, g=1) == tile([16, 1]) == 64
    assert tile([1] * 128, page=64) == tile([8, 0], g=8) == 64
    assert tile([17, 1]) == tile([1, 2048]) == tile([]) == tile([0, 0]) == 128
    assert tile([1] * 128, page=1) == tile([1] * 128, page=4) == tile([1], page=1, kv=None) \
        == 64  # gathered
    assert tile([17, 1], page=1) == 128
    assert tile([1] * 128, kv_dtype=torch.float8_e4m3fn) == 128
    assert choose.tile(128, 128, 4, None, False, True, page_size=16, qo_lens=[1] * 8) == 64
    assert choose.tile(128, 128, 4, None, False, True, page_size=16) == 128
    assert choose.tile(64, 64, 4, 32768, False, True, page_size=16, qo_lens=[1] * 8) == 128
    monkeypatch.setattr(POLICY, "use_gluon", False)
    assert tile([1] * 128) == 128


def test_gluon_short_kv_bound(monkeypatch):
    # Eager D 128 launches on Hopper (the Gluon kernel) take 128-row ping-pong tiles beyond
    # GLUON_SHORT_KV causal keys (half that without a mask); elsewhere SHORT_KV holds.
    monkeypatch.setattr(choose, "INTERPRET", False)
    tile = lambda kv, causal=True, d=128: choose.tile(d, d, 1, kv, causal)  # noqa: E731
    monkeypatch.setattr(choose, "device_of", lambda device: choose.Device("cuda", 8, 108))
    assert (tile(2048), tile(4096), tile(8192), tile(2048, False)) == (64, 64, 128, 64)
    monkeypatch.setattr(choose, "device_of", lambda device: choose.H100)
    assert (tile(choose.GLUON_SHORT_KV), tile(choose.GLUON_SHORT_KV + 1)) == (64, 128)
    assert (tile(2048), tile(2048, False), tile(4096, d=64)) == (128, 128, 128)


def _Recorder():
    """Stands in for _gluon_fwd: records the grid and keywords of the launch."""
    return KernelRecorder(gluon_mod._gluon_fwd)


@pytest.mark.parametrize("page,block_m,boxes,ws", [
    (0, 64, 1, True), (0, 128, 1, True), (64, 64, 1, True), (128, 128, 1, True),
    (16, 64, 4, True), (16, 128, 8, True), (8, 64, 8, True), (1, 128, 1, True),
    (3, 64, 1, True)])
def test_launch_box_and_warp_plan(page, block_m, boxes, ws, monkeypatch):
    # launch() (host side of the GPU-only kernel): pages below a key tile take a box each and
    # force warp specialization, with its register cap; pages below MIN_BOX_PAGE are gathered
    # (the producer warp group's registers); a page size it cannot read raises.
    rec = _Recorder()
    monkeypatch.setattr(gluon_mod, "_gluon_fwd", rec)
    monkeypatch.setattr(gluon_mod, "_sm_count", lambda device: 1)  # a 1-SM GPU
    q = torch.randn(40, 8, 128, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(40, 8)
    work = torch.zeros(3, 2, dtype=torch.int32)
    indptr = torch.tensor([0, 40], dtype=torch.int32)
    if page:
        cache = torch.randn(6, page, 2, 128, dtype=torch.bfloat16)
        k2 = v2 = gluon_mod.kv_2d(cache, "paged")
        table, last = torch.arange(6, dtype=torch.int32), torch.tensor([5], dtype=torch.int32)
        paged = (page, table, last, page, page)
    else:
        k2 = v2 = gluon_mod.kv_2d(torch.randn(50, 2, 128, dtype=torch.bfloat16), "ragged")
        paged = None
    gluon_mod.launch(q, k2, v2, out, lse, indptr, indptr, work, dense=None, qk_scale=0.1,
                     causal=True, block_m=block_m, paged=paged)
    gather = 0 < page < gluon_mod.MIN_BOX_PAGE
    # (6 keys: gathered pages on the 128-row tile take its short tile, GATHER_SHORT_TILE)
    short = gather and block_m == 128
    block_n, warps = (gluon_mod.GATHER_SHORT_TILE if short else gluon_mod.TILES[block_m, 128])[:2]
    # persistent programs (64-row tiles, ping-pong with a box per page or short gathers): a 1D
    # grid of as many as the GPU holds at once (1 SM x _WS_CTAS) for 3 items x 2 KV heads;
    # other ping-pong launches a program per item
    persistent = block_m == 64 or boxes > 1 or short
    assert rec.grid == ((gluon_mod._WS_CTAS[warps], ) if persistent else (3, 2))
    src, sched = rec.kw["SOURCE"], rec.kw["SCHEDULE"]
    assert sched.PERSISTENT == persistent
    assert not sched.Q_TMA and rec.arg("q_req_rows") == 0  # GQA 4:1: Q through registers
    assert (src.BOXES, sched.WS, src.PAGE) == (boxes, ws, page)
    assert src.PAGED == (2 if gather else 1 if page else 0)
    assert sched.PRODUCER_REGS == (gluon_mod.GATHER_REGS[1] if gather else 24)
    assert rec.arg("k_ptr") is k2 and rec.arg("gather_strides").stride_kr == k2.stride(0)
    assert src.WIDE is False  # a small cache: the gather's row offsets in int32
    assert rec.kw.get("maxnreg") == (gluon_mod.ws_maxnreg(warps) if ws else None)
    # 128-row tiles run ping-pong: two groups of half the warps (num_warps is the first's)
    pp = block_m == 128
    assert (sched.PINGPONG, rec.kw["num_warps"]) == (pp, warps // 2 if pp else warps)
    assert rec.arg("k_desc").block_shape == [block_n // boxes, 128]  # the K descriptor's box
    if page:
        assert rec.arg("page_idx_ptr") is table and rec.arg("last_page_len_ptr") is last
        with pytest.raises(ValueError, match="page size 12"):
            gluon_mod.launch(q, k2, v2, out, lse, indptr, indptr, work, dense=None,
                             qk_scale=0.1, causal=True, block_m=block_m,
                             paged=(12, table, last, page, page))


def _one_item_launch(monkeypatch):
    """A _Recorder in _gluon_fwd's place on a 1-SM GPU, and a ragged launch's q [40, 2, 128],
    out [40, 2, 128], lse [40, 2] and work list of one item."""
    rec = _Recorder()
    monkeypatch.setattr(gluon_mod, "_gluon_fwd", rec)
    monkeypatch.setattr(gluon_mod, "_sm_count", lambda device: 1)
    q = torch.randn(40, 2, 128, dtype=torch.bfloat16)
    return rec, q, torch.empty_like(q), torch.empty(40, 2), torch.zeros(1, 2, dtype=torch.int32)


@pytest.mark.parametrize("pages,wide", [(2 ** 31 // 256 - 1, False), (2 ** 31 // 256, True)])
def test_launch_gather_offset_width(pages, wide, monkeypatch):
    # page 1 gathers: the producer's row offsets are int32 while a cache's elements stay below
    # 2^31 (the fast path) and int64 from there (meta caches: no memory behind them)
    rec, q, out, lse, work = _one_item_launch(monkeypatch)
    k2 = gluon_mod.kv_2d(torch.empty(2, 1, 2, 128, dtype=torch.bfloat16, device="meta"), "paged")
    big = gluon_mod.kv_2d(torch.empty(pages, 1, 2, 128, dtype=torch.bfloat16, device="meta"),
                          "paged")
    table, last = torch.arange(40, dtype=torch.int32), torch.tensor([1], dtype=torch.int32)
    indptr = torch.tensor([0, 40], dtype=torch.int32)
    for kc, vc in ((big, k2), (k2, big)):  # either cache decides
        gluon_mod.launch(q, kc, vc, out, lse, indptr, indptr, work, dense=None, qk_scale=0.1,
                         causal=True, block_m=128, paged=(1, table, last, 1, 1))
        src = rec.kw["SOURCE"]
        assert src.PAGED == gluon_mod.PAGED_GATHER.value and src.WIDE is wide


@pytest.mark.parametrize("causal", [True, False])
def test_launch_gather_short_tile(causal, monkeypatch):
    # Gathered pages on the 128-row tile: requests averaging at most GLUON_SHORT_KV keys
    # (causal; half that without a mask), counted from the page table's entries, take
    # GATHER_SHORT_TILE (64-key slots three deep, persistent); longer ones TILES' 128-row
    # tile (a program per item); an explicit tile or pages read by boxes are left alone.
    rec, q, out, lse, work = _one_item_launch(monkeypatch)
    indptr = torch.tensor([0, 20, 40], dtype=torch.int32)  # two requests
    short = choose.GLUON_SHORT_KV if causal else choose.GLUON_SHORT_KV // 2

    def tile_of(pages, page=1, **kw):
        cache = torch.empty(pages // page + 1, page, 2, 128, dtype=torch.bfloat16,
                            device="meta")
        k2 = gluon_mod.kv_2d(cache, "paged")
        table = torch.zeros(pages // page, dtype=torch.int32)
        gluon_mod.launch(q, k2, k2, out, lse, indptr, indptr, work, dense=None, qk_scale=0.1,
                         causal=causal, block_m=128, paged=(page, table, indptr[1:], page, page),
                         **kw)
        shape, sched = rec.kw["SHAPE"], rec.kw["SCHEDULE"]
        return (shape.BLOCK_N, shape.STAGES, sched.PERSISTENT, rec.kw["SOURCE"].PAGED)

    gather = gluon_mod.PAGED_GATHER.value
    assert tile_of(2 * short) == tile_of(2 * short, page=2) == (64, 3, True, gather)
    assert tile_of(2 * short + 1) == tile_of(2 * short + 4, page=4) == (128, 2, False, gather)
    assert tile_of(2 * short, tile=gluon_mod.TILES[128, 128]) == (128, 2, False, gather)
    assert tile_of(2 * short, page=16) == (128, 2, True, gluon_mod.PAGED_BOXES.value)


@pytest.mark.parametrize("layout", ["ragged", "dense", "dense-heads-strided", "gqa", "no-ws",
                                    "p-smem", "per-item"])
def test_launch_q_box(layout, monkeypatch):
    # Persistent launches with one query head per KV head take Q by the load warp's TMA: a
    # descriptor over Q seen as [rows, Hq * D], boxes of the tile's rows, a dense entry's rows
    # Sq apart; GQA, heads not packed, no load warp, P through shared memory (no room for Q's
    # second slot) or a program per item (ping-pong on contiguous K / V): Q through registers.
    rec = _Recorder()
    monkeypatch.setattr(gluon_mod, "_gluon_fwd", rec)
    monkeypatch.setattr(gluon_mod, "_sm_count", lambda device: 1)
    hq = 8 if layout == "gqa" else 2
    k2 = gluon_mod.kv_2d(torch.randn(50, 2, 128, dtype=torch.bfloat16), "ragged")
    work = torch.zeros(3, 2, dtype=torch.int32)
    indptr = torch.tensor([0, 40], dtype=torch.int32)
    tile = {"no-ws": (64, 4, 2, False, False, False), "p-smem": (64, 4, 2, True, True, False),
            "per-item": (128, 8, 2, False, True, True)}.get(layout)
    if layout.startswith("dense"):
        q = torch.randn(3, 40, hq, 128, dtype=torch.bfloat16)
        if layout == "dense-heads-strided":
            q = torch.randn(3, hq, 40, 128, dtype=torch.bfloat16).transpose(1, 2)
        out, lse, dense = torch.empty_like(q), torch.empty(3, 40, hq), (3, 40, 40, 1, 1)
    else:
        q = torch.randn(40, hq, 128, dtype=torch.bfloat16)
        out, lse, dense = torch.empty_like(q), torch.empty(40, hq), None
    gluon_mod.launch(q, k2, k2, out, lse, indptr, indptr, work, dense=dense, qk_scale=0.1,
                     causal=True, block_m=128 if layout == "per-item" else 64, tile=tile)
    q_desc, q_req_rows = rec.arg("q_desc"), rec.arg("q_req_rows")
    if layout in ("ragged", "dense"):
        assert rec.kw["SCHEDULE"].Q_TMA and list(q_desc.block_shape) == [64, 128]
        assert tuple(q_desc.base.shape) == (120 if dense else 40, hq * 128)
        assert q_desc.base.data_ptr() == q.data_ptr() and q_req_rows == (40 if dense else 0)
    else:
        assert not rec.kw["SCHEDULE"].Q_TMA and q_req_rows == 0


def test_launch_q_row_map(monkeypatch):
    # A row map (q_rows: decode key chunks reading q's rows in place) goes to the kernel with
    # Q_ROWS on and Q through registers (a TMA box reads consecutive rows), on a launch that
    # would take Q by TMA without it; outputs have the map's rows; dense launches refuse it
    rec, q, out, lse, work = _one_item_launch(monkeypatch)
    k2 = gluon_mod.kv_2d(torch.randn(50, 2, 128, dtype=torch.bfloat16), "ragged")
    rows = torch.tensor([3, 3, 0, 39, 7], dtype=torch.int32)
    out5, lse5 = torch.empty(5, 2, 128, dtype=torch.bfloat16), torch.empty(5, 2)
    indptr = torch.tensor([0, 5], dtype=torch.int32)
    for q_rows in (None, rows):
        o, l_ = (out, lse) if q_rows is None else (out5, lse5)
        gluon_mod.launch(q, k2, k2, o, l_, indptr, indptr, work, dense=None, qk_scale=0.1,
                         causal=True, block_m=64, q_rows=q_rows)
        sched = rec.kw["SCHEDULE"]
        assert sched.Q_ROWS == (q_rows is not None) and sched.Q_TMA == (q_rows is None)
        assert rec.arg("q_ptr") is q and rec.arg("o_ptr") is o
        if q_rows is not None:
            assert rec.arg("q_rows_ptr") is rows
    with pytest.raises(ValueError, match="q_rows"):
        gluon_mod.launch(q.unsqueeze(0), k2, k2, out.unsqueeze(0), lse.unsqueeze(0), indptr,
                         indptr, work, dense=(1, 40, 50, 1, 1), qk_scale=0.1, causal=True,
                         block_m=64, q_rows=rows)


@pytest.mark.parametrize("block_m,d,block_n,stages", [(128, 64, 128, 3), (128, 256, 64, 2)])
def test_launch_tile_by_head_dim(block_m, d, block_n, stages, monkeypatch):
    # The tile follows the head dim: D 64's 128-row tile streams K / V three deep, D 256's reads
    # 64-key tiles; both ping-pong with a program per item (Q through registers). A height
    # with no tile at that head dim raises instead of launching one that cannot fit.
    rec = _Recorder()
    monkeypatch.setattr(gluon_mod, "_gluon_fwd", rec)
    q = torch.randn(40, 2, d, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(40, 2)
    work = torch.zeros(3, 2, dtype=torch.int32)
    indptr = torch.tensor([0, 40], dtype=torch.int32)
    k2 = v2 = gluon_mod.kv_2d(torch.randn(50, 2, d, dtype=torch.bfloat16), "ragged")
    gluon_mod.launch(q, k2, v2, out, lse, indptr, indptr, work, dense=None, qk_scale=0.1,
                     causal=True, block_m=block_m)
    shape, sched = rec.kw["SHAPE"], rec.kw["SCHEDULE"]
    assert (shape.BLOCK_N, shape.STAGES, shape.D) == (block_n, stages, d)
    assert sched.PINGPONG and not sched.PERSISTENT and rec.grid == (3, 2)
    assert rec.arg("k_desc").block_shape == [block_n, d]
    if d == 256:
        with pytest.raises(ValueError, match="no Gluon tile for block_m 64 at head dim 256"):
            gluon_mod.launch(q, k2, v2, out, lse, indptr, indptr, work, dense=None,
                             qk_scale=0.1, causal=True, block_m=64)


@pytest.mark.parametrize("cap,programs", [(0, 6), (4, 4), (1, 1), (9, 6)])
def test_launch_grid_under_programs_cap(cap, programs, monkeypatch):
    """A persistent launch (the 64-row tile, paged on boxes) made inside launch.programs_cap
    runs at most cap programs (0: as many as the GPU holds at once, here 132 SMs x _WS_CTAS,
    and at most one per item: 3 items x 2 KV heads)."""
    from compiled_attn.ops import launch as L

    rec, launch = _paged_launch(monkeypatch, 8)
    with L.programs_cap(cap):
        launch()
    assert rec.kw["SCHEDULE"].PERSISTENT and rec.grid == (programs, )


def _paged_launch(monkeypatch, hq, block_m=64, **kw):
    """(a _Recorder in _gluon_fwd's place on 132 SMs, a call of prefill_gluon.launch with kw):
    one request of 40 rows of q [40, hq, 128] bf16 over a page-16 cache of 2 KV heads (6
    pages, 5 keys in the last), 3 work rows, tiles of block_m rows."""
    rec = _Recorder()
    monkeypatch.setattr(gluon_mod, "_gluon_fwd", rec)
    monkeypatch.setattr(gluon_mod, "_sm_count", lambda device: 132)
    q = torch.randn(40, hq, 128, dtype=torch.bfloat16)
    out, lse = torch.empty_like(q), torch.empty(40, hq)
    work = torch.zeros(3, 2, dtype=torch.int32)
    indptr = torch.tensor([0, 40], dtype=torch.int32)
    cache = torch.randn(6, 16, 2, 128, dtype=torch.bfloat16)
    k2 = v2 = gluon_mod.kv_2d(cache, "paged")
    paged = (16, torch.arange(6, dtype=torch.int32), torch.tensor([5], dtype=torch.int32), 16, 16)

    def launch():
        gluon_mod.launch(q, k2, v2, out, lse, indptr, indptr, work, dense=None, qk_scale=0.1,
                         causal=True, block_m=block_m, paged=paged, **kw)
    return rec, launch


@pytest.mark.parametrize("page", [16, 1])
def test_swap_tile_compiles_for_sm90(page):
    """The swap tile (decode rows' swapped products) compiles for sm_90 on pages read by boxes
    and gathered: every wgmma is 64 keys (or V's dims) by SWAP_ROWS query rows, and its
    shared memory leaves one program a SM (two 128-key K / V slots, Q, P)."""
    import triton

    from .sm90 import gluon_source, target

    src, opts, _ = gluon_source(False, page, 64, 128, True, True, False, False, q_tma=False,
                                tile=gluon_mod.SWAP_TILE)
    k = triton.compile(src, target=target(), options=opts)
    shapes = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)", k.asm["ptx"]))
    assert shapes == {f"m64n{gluon_mod.SWAP_ROWS.value}k16"}
    assert 2 * 2 * 128 * 128 * 2 < k.metadata.shared <= 227 * 1024


@pytest.mark.parametrize("swap", [True, False])
def test_persistent_grid_holds_resident_programs(swap, monkeypatch):
    """A persistent launch's grid holds as many programs as the SMs hold at once: two a SM on
    the 64-row tile, one on the swap tile (its shared memory), 6 items on 2 SMs here."""
    rec, go = _paged_launch(monkeypatch, 2, tile=gluon_mod.SWAP_TILE if swap else
                            gluon_mod.TILES[64, 128]._replace(persistent=True))
    monkeypatch.setattr(gluon_mod, "_sm_count", lambda device: 2)
    go()
    assert rec.grid == ((2, ) if swap else (4, ))


@pytest.mark.parametrize("tile,block_m,error", [
    (gluon_mod.SWAP_TILE, 64, None),                                     # the decode rows' tile
    (gluon_mod.SWAP_TILE, 16, None),                                     # 16-row work items
    (gluon_mod.SWAP_TILE._replace(persistent=False), 64, "persistent False"),  # per item
    (gluon_mod.SWAP_TILE._replace(warps=8, pingpong=True), 128, "pingpong True"),  # two groups
    (gluon_mod.SWAP_TILE._replace(warps=8), 64, "warps 8"),              # two warp groups
    (gluon_mod.SWAP_TILE, 8, "block_m 8"),                               # under 16 rows
])
def test_launch_swap_tile(tile, block_m, error, monkeypatch):
    """A swap tile (the swapped products) launches persistent programs of one compute group
    with Schedule.SWAP, Q through registers (never the load warp's TMA, even with one query
    head per KV head) and the plan's work items (a multiple of 16 rows); a tile that is not
    persistent, ping-pongs or has other than 4 warps, or work items of other heights, is
    refused, naming what it got."""
    rec, go = _paged_launch(monkeypatch, 2, block_m=block_m, tile=tile)
    if error:
        with pytest.raises(ValueError, match=error):
            go()
        return
    go()
    sched, shape = rec.kw["SCHEDULE"], rec.kw["SHAPE"]
    assert sched.SWAP and sched.PERSISTENT and sched.WS and not sched.PINGPONG
    assert not sched.Q_TMA and shape.BLOCK_M == block_m and shape.BLOCK_N == 128
    assert rec.kw["SOURCE"].BOXES == 128 // 16 and rec.grid == (6, )
