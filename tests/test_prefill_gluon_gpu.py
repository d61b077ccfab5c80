"""GPU tier of the Gluon Hopper kernel (ops/prefill_gluon.py, pytest -m gpu on the H100): every
tile it may run, against the float64 reference with the bound of tests/kernel_cases.py, on the
edge cases of its scope: odd lengths and key tails (a partial last key tile, whose V rows past
kv_len belong to the next request), an empty request, rows that see no key (causal qo > kv, and
kv 0), GQA 7:1, D 64, 128 and 256, bf16 and fp16, causal and no mask, and a key range long
enough for the K/V rings to wrap many times."""

import pytest
import torch

from compiled_attn import ops
from compiled_attn.ops.modes import LOG2E
from compiled_attn.ops.schedule import build_work
from tests.kernel_cases import check, make_case, move_past_2_31, params
from compiled_attn.ops.policy import POLICY

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available()
                       or torch.cuda.get_device_capability()[0] != 9, reason="needs a Hopper GPU"),
]

# (BLOCK_M, BLOCK_N, warps, stages, P through shared memory, warp-specialized, ping-pong);
# warp-specialized tiles run persistent programs or not as prefill_gluon.persistent_default
# says, and take Q by TMA where a query head has its own KV head ("odd", "unseen")
TILES = [(64, 64, 4, 2, True, False, False), (64, 64, 4, 3, True, False, False),
         (128, 64, 8, 2, True, False, False), (128, 128, 8, 2, True, False, False),
         (64, 64, 4, 2, False, False, False), (128, 128, 8, 2, False, False, False),
         (64, 64, 4, 3, False, False, False), (128, 128, 8, 2, True, True, False),
         (64, 64, 4, 2, False, True, False), (128, 128, 8, 2, False, True, True),
         (128, 128, 8, 3, False, True, True), (128, 64, 8, 2, False, True, True)]
D64_TILE, D256_TILE = TILES[10], TILES[11]  # (three 128-key slots fit at D 64 only; D 256
# fits 64-key slots only)
# prefill_gluon.GATHER_SHORT_TILE (gathered pages on 128-row tiles, short requests): 64-key
# slots three deep, persistent
GATHER_SHORT = (128, 64, 8, 3, False, True, True, True)

CASES = {  # name: (qo_lens, kv_lens, hq, hkv, d)
    "odd": ([1, 37, 200, 0, 64], [130, 37, 333, 50, 64], 4, 4, 128),
    "gqa7": ([5, 77, 130], [5, 300, 131], 7, 1, 64),
    "unseen": ([100, 9], [20, 0], 2, 2, 128),
    "long": ([1000, 3000], [1000, 3100], 2, 1, 128),
}


def _runner(tile):
    from compiled_attn.ops import prefill_gluon as G

    # persistent (the default's where absent), swap (False where absent)
    bm, bn, warps, stages, p_smem, ws, pp, *rest = tile

    def run(c, p, out_dtype=None):
        qo = c.qo_indptr.diff().tolist()
        group = c.q.shape[1] // c.k.shape[-2]
        causal = p["mask_mode"] == ops.MASK_CAUSAL
        out = torch.empty(c.q.shape[:2] + (c.v.shape[-1],), dtype=c.q.dtype, device=c.q.device)
        lse = torch.empty(c.q.shape[:2], dtype=torch.float32, device=c.q.device)
        if c.kind == "paged":
            work = build_work(qo, group, bm, c.q.device)
            paged = (c.k.shape[1], c.page_indices, c.last_page_len, G.page_rows(c.k),
                     G.page_rows(c.v))
            return G.launch(c.q, G.kv_2d(c.k, "paged"), G.kv_2d(c.v, "paged"), out, lse,
                            c.qo_indptr, c.kv_indptr, work, dense=None,
                            qk_scale=p["sm_scale"] * LOG2E, causal=causal,
                            block_m=bm, tile=(bn, warps, stages, p_smem, ws, pp, *rest),
                            paged=paged)
        work = build_work(qo, group, bm, c.q.device, kv_lens=c.kv_indptr.diff().tolist())
        return G.launch_ragged(c.q, c.k, c.v, c.qo_indptr, c.kv_indptr, work, out, lse,
                               sm_scale=p["sm_scale"], causal=causal, block_m=bm, block_n=bn,
                               stages=stages, num_warps=warps, p_smem=p_smem, ws=ws,
                               pingpong=pp, persistent=rest[0] if rest else None,
                               swap=len(rest) > 1 and rest[1])
    return run


def _tile_id(t):
    return ("x".join(map(str, t[:4])) + ("s" if t[4] else "r") + ("-ws" if t[5] else "")
            + ("-pp" if t[6] else "") + ("-swap" if len(t) > 8 and t[8] else ""))


@pytest.mark.parametrize("tile", TILES, ids=_tile_id)
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gluon_ragged(tile, case, causal, dt):
    qo, kv, hq, hkv, d = CASES[case]
    if tile == D64_TILE and d != 64:
        pytest.skip("D 64's tile: its three 128-key slots do not fit in shared memory at D 128")
    if causal and case != "unseen":
        kv = [max(a, b) for a, b in zip(qo, kv)]
    c = make_case("ragged", qo, kv, hq, hkv, d, dtype=dt, device="cuda", seed=len(qo) + d)
    p = params(mask_mode=ops.MASK_CAUSAL if causal else ops.MASK_NONE, head_dim=d)
    check(c, p, runner=_runner(tile))


def _nan_unused(c):
    """Poison every cache slot no request owns (spare pages, the tails of last pages) with NaN:
    a kernel that lets one reach an output fails the check."""
    page = c.k.shape[1]
    used = torch.zeros(c.k.shape[:2], dtype=torch.bool, device=c.k.device)
    ind, last = c.kv_indptr.tolist(), c.last_page_len.tolist()
    pages = c.page_indices.tolist()
    for r in range(len(ind) - 1):
        for j in range(ind[r], ind[r + 1]):
            used[pages[j], :last[r] if j == ind[r + 1] - 1 else page] = True
    c.k[~used] = float("nan")
    c.v[~used] = float("nan")


# Paged caches: pages as large as a key tile or larger (one box per tile, inside a page) and
# pages of 8 to 32 keys (a box per page, the warp-specialized kernel), a shuffled page table
# in a combined K/V cache, partial last pages, a request without keys, a long one wrapping
# the rings, GQA 4:1; every slot no request owns holds NaN.
@pytest.mark.parametrize("tile", [TILES[0], TILES[3], TILES[4], TILES[7], TILES[8], TILES[9]],
                         ids=_tile_id)
@pytest.mark.parametrize("page", [8, 16, 32, 64, 128, 256])
@pytest.mark.parametrize("causal", [True, False])
def test_gluon_paged(tile, page, causal):
    from compiled_attn.ops import prefill_gluon as G

    if not G.page_fits(page, tile[1], 128):
        pytest.skip("page size does not tile this key block")
    check(*_paged_case(page, 8, 2, causal), runner=_runner(tile))


# Pages too small for a TMA box (1 to 7 keys, prefill_gluon.page_gathered; 3 and 5 straddle
# key tiles) are gathered key by key by a producer warp group (PAGED_GATHER): the paged case
# above on the 64-row and the ping-pong tiles (2 and 3 stages), D 64 and D 256 on theirs, fp16.
@pytest.mark.parametrize("tile,page,d,dt", [
    (TILES[8], 1, 128, torch.bfloat16), (TILES[8], 3, 128, torch.bfloat16),
    (TILES[9], 1, 128, torch.bfloat16), (TILES[9], 2, 128, torch.float16),
    (TILES[9], 5, 128, torch.bfloat16), (TILES[10], 1, 128, torch.bfloat16),
    (TILES[10], 4, 64, torch.bfloat16), (D256_TILE, 1, 256, torch.bfloat16),
    (GATHER_SHORT, 1, 128, torch.bfloat16), (GATHER_SHORT, 5, 128, torch.float16)],
    ids=lambda x: _tile_id(x) if isinstance(x, tuple) else str(x))
@pytest.mark.parametrize("causal", [True, False])
def test_gluon_paged_gather(tile, page, d, dt, causal):
    check(*_paged_case(page, 8, 2, causal, d=d, dtype=dt), runner=_runner(tile))


# The gathers in a cache of 2^31 elements or more (its pages at the cache's end, so every key
# offset is past 2^31): the producer's row offsets must be int64 there (WIDE), int32 below.
@pytest.mark.gpu_solo  # 8.6 GB of cache: beside 7 other shards it may run out of memory
@pytest.mark.parametrize("tile,page", [(TILES[9], 1), (TILES[8], 3)],
                         ids=lambda x: _tile_id(x) if isinstance(x, tuple) else str(x))
def test_gluon_gather_past_2_31_elements(tile, page):
    c, p = _paged_case(page, 8, 2, True)
    move_past_2_31(c)
    check(c, p, runner=_runner(tile))


def _paged_case(page, hq, hkv, causal, d=128, dtype=torch.bfloat16):
    """The paged case above (unowned slots NaN) and its parameters."""
    qo, kv = [37, 0, 200, 5, 64, 700], [300, 9, 333, 5, 1000, 1500]
    c = make_case("paged", qo, kv, hq, hkv, d, dtype=dtype, device="cuda", page_size=page,
                  seed=page)
    _nan_unused(c)
    return c, params(mask_mode=ops.MASK_CAUSAL if causal else ops.MASK_NONE, head_dim=d)


# D 256 on its tile (64-key slots, a program per item, Q through registers): the ragged cases
# above at D 256 (odd lengths and an empty request, rows that see no key, GQA 2:1 over a range
# wrapping the rings) and pages of whole key tiles, unowned slots NaN.
@pytest.mark.parametrize("case", ["odd", "unseen", "long", "paged64", "paged128"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
def test_gluon_d256(case, causal, dt):
    if case.startswith("paged"):
        c, p = _paged_case(int(case[5:]), 4, 2, causal, d=256, dtype=dt)
    else:
        qo, kv, hq, hkv, _ = CASES[case]
        if causal and case != "unseen":
            kv = [max(a, b) for a, b in zip(qo, kv)]
        c = make_case("ragged", qo, kv, hq, hkv, 256, dtype=dt, device="cuda", seed=len(qo))
        p = params(mask_mode=ops.MASK_CAUSAL if causal else ops.MASK_NONE, head_dim=256)
    check(c, p, runner=_runner(D256_TILE))


# Persistent programs on a GPU pretending to have one SM: each of the one or two programs
# then takes every work item in turn, so the K / V rings, the ping-pong turns, the item
# hand-off and the Q slots run on across items (on the real GPU the small cases above have
# fewer items than programs); and the same tiles with a program per item. "paged16-mha" (one
# query head per KV head) takes Q by TMA, as do "odd" and "unseen".
PAGED = {"paged16": (16, 8, 2), "paged128": (128, 8, 2), "paged16-mha": (16, 2, 2),
         "paged1": (1, 8, 2), "paged1-mha": (1, 2, 2), "paged3": (3, 8, 2)}


@pytest.mark.parametrize("tile", [TILES[8], TILES[9]], ids=_tile_id)
@pytest.mark.parametrize("case", list(CASES) + list(PAGED))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("persistent", [True, False])
def test_gluon_persistent_few_programs(tile, case, causal, persistent, monkeypatch):
    from compiled_attn.ops import prefill_gluon as G

    monkeypatch.setattr(G, "_sm_count", lambda device: 1)
    if case in PAGED:
        c, p = _paged_case(*PAGED[case], causal)
    else:
        c, p = _ragged_case(case, causal)
    check(c, p, runner=_runner(tile + (persistent, )))


def _ragged_case(case, causal):
    """CASES[case] as a bf16 ragged case (causal: keys at least the rows, but "unseen", whose
    rows see no key) and its parameters."""
    qo, kv, hq, hkv, d = CASES[case]
    if causal and case != "unseen":
        kv = [max(a, b) for a, b in zip(qo, kv)]
    c = make_case("ragged", qo, kv, hq, hkv, d, dtype=torch.bfloat16, device="cuda",
                  seed=len(qo) + d)
    return c, params(mask_mode=ops.MASK_CAUSAL if causal else ops.MASK_NONE, head_dim=d)


# The short gather tile on one SM's programs: the three-deep rings, the ping-pong turns and
# the item hand-off run on across the items of page 1 (GQA 4:1 and one query head per KV head,
# Q by TMA) and page 3.
@pytest.mark.parametrize("case", ["paged1", "paged1-mha", "paged3"])
@pytest.mark.parametrize("causal", [True, False])
def test_gluon_gather_short_tile_few_programs(case, causal, monkeypatch):
    from compiled_attn.ops import prefill_gluon as G

    assert G.Tile(*GATHER_SHORT[1:]) == G.GATHER_SHORT_TILE
    monkeypatch.setattr(G, "_sm_count", lambda device: 1)
    check(*_paged_case(*PAGED[case], causal), runner=_runner(GATHER_SHORT))


# Decode rows on the swapped products (swap tiles: the keys as the wgmma's M, the query rows
# as its N, prefill_gluon.SWAP_ROWS at a time): paged caches read by boxes (pages of 8 and 16
# keys, a box per page; 64 and 128, a box per tile) and gathered (pages of 1 and 3), the ragged
# cases (requests of several rows: 64-row items in up to four passes, causal rows within a
# pass, rows that see no key, an empty request, GQA 7:1 at D 64), on one SM's programs (the
# rings, the item hand-off and the Q buffer running on across items and passes). The first
# tile is prefill_gluon.SWAP_TILE; the last takes 16-row items (a pass each).
SWAP_TILES = [(64, 128, 4, 2, False, True, False, True, True),
              (64, 64, 4, 3, False, True, False, True, True),
              (16, 64, 4, 2, True, True, False, True, True)]


@pytest.mark.parametrize("tile", SWAP_TILES, ids=_tile_id)
@pytest.mark.parametrize("case", ["paged8", "paged16", "paged64", "paged128", "paged1",
                                  "paged3", "paged16-mha", "odd", "gqa7", "unseen", "long"])
@pytest.mark.parametrize("causal", [True, False])
def test_gluon_swap_rows(tile, case, causal, monkeypatch):
    from compiled_attn.ops import prefill_gluon as G

    assert G.Tile(*SWAP_TILES[0][1:]) == G.SWAP_TILE
    if case.startswith("paged"):
        page = int(case[5:].split("-")[0])
        if not G.page_read(page, tile[1], 128):
            pytest.skip("page size does not tile this key block")
        c, p = _paged_case(page, 2 if case.endswith("mha") else 8, 2, causal)
    else:
        if tile[1] == 128 and case == "gqa7":
            pytest.skip("(D 64 at 128-key slots: the 64-key tile covers it)")
        c, p = _ragged_case(case, causal)
    monkeypatch.setattr(G, "_sm_count", lambda device: 1)
    check(c, p, runner=_runner(tile))


def _spy(monkeypatch):
    from compiled_attn.ops import prefill_kernel

    seen = []
    orig = prefill_kernel._gluon.launch

    def spy(*a, **kw):
        seen.append((kw["block_m"], "single" if kw["dense"] is not None else
                     "paged" if kw["paged"] is not None else "ragged"))
        return orig(*a, **kw)

    monkeypatch.setattr(prefill_kernel._gluon, "launch", spy)
    monkeypatch.setattr(POLICY, "host_tma_min_flop", 0)
    return seen


# The ops hand the Gluon kernel their host-descriptor launches in its scope: ragged and dense
# (the dense item order with several (entry, KV head) groups), paged with pages of whole key
# tiles, pages of 16 and 8 keys (a box per page) and of 1, 2 and 3 keys (gathered; short
# requests on GATHER_SHORT_TILE), both tile heights, GQA; a launch out of its scope (soft cap,
# a window, page 12: neither boxes nor gathers) runs the Triton kernel.
@pytest.mark.parametrize("kind,qo,kv,block_m,causal", [
    ("ragged", [300, 17, 0, 129], [700, 17, 5, 129], 64, True),
    ("paged64", [300, 17, 0, 129], [700, 17, 5, 129], 64, True),
    ("paged128", [1000, 600], [1000, 2600], 128, False),
    ("paged16", [300, 17, 0, 129], [700, 17, 5, 129], 64, True),
    ("paged16", [1000, 600], [1000, 2600], 128, True),
    ("paged8", [300, 17, 0, 129], [700, 17, 5, 129], 64, True),
    ("paged8", [1000, 600], [1000, 2600], 128, True),
    ("paged1", [300, 17, 0, 129], [700, 17, 5, 129], 64, True),
    ("paged1", [1000, 600], [1000, 2600], 128, True),
    ("paged1", [300, 17, 0, 129], [700, 17, 5, 129], 128, True),  # (GATHER_SHORT_TILE)
    ("paged2", [300, 17, 0, 129], [700, 17, 5, 129], 128, False),
    ("paged3", [1000, 600], [1000, 2600], 128, False),
    ("ragged", [1000, 600], [1000, 2600], 128, False),
    ("single", [777], [1501], 64, True),
    ("single", [2048], [2048], 128, True)])
@pytest.mark.parametrize("hq,hkv", [(8, 2), (4, 4)])  # 4 / 4: Q by the load warp's TMA
def test_op_runs_gluon(kind, qo, kv, block_m, causal, hq, hkv, monkeypatch):
    _op_runs_gluon(kind, qo, kv, block_m, causal, hq, hkv, 128, monkeypatch)


# D 256 and D 64 on their own 128-row tiles (TILES by head dim), through the ops.
@pytest.mark.parametrize("kind,qo,kv,causal", [
    ("ragged", [300, 17, 0, 129], [700, 17, 5, 129], True),
    ("paged128", [1000, 600], [1000, 2600], False),
    ("paged1", [1000, 600], [1000, 2600], True),
    ("single", [777], [1501], True)])
@pytest.mark.parametrize("d", [64, 256])
def test_op_runs_gluon_by_head_dim(kind, qo, kv, causal, d, monkeypatch):
    _op_runs_gluon(kind, qo, kv, 128, causal, 8, 2, d, monkeypatch)


def _op_runs_gluon(kind, qo, kv, block_m, causal, hq, hkv, d, monkeypatch):
    seen = _spy(monkeypatch)
    page = int(kind[5:]) if kind.startswith("paged") else 16
    kind = kind[:5] if kind.startswith("paged") else kind
    c = make_case(kind, qo, kv, hq=hq, hkv=hkv, dqk=d, dtype=torch.bfloat16, device="cuda",
                  page_size=page, seed=5)
    if kind == "single":
        c.q = c.q.expand(3, -1, -1, -1).contiguous()
        c.k = c.k.expand(3, -1, -1, -1).contiguous() * torch.randn(3, 1, 1, 1, device="cuda",
                                                                   dtype=c.k.dtype)
        c.v = c.v.expand(3, -1, -1, -1).contiguous()
        monkeypatch.setattr(ops.choose, "dense_tile", lambda *a, **k: block_m)
    else:
        c.block_m = block_m
        c.work = build_work(qo, hq // hkv, block_m, "cuda", kv_lens=kv)
    check(c, params(mask_mode=ops.MASK_CAUSAL if causal else ops.MASK_NONE, head_dim=d))
    assert seen == [(block_m, kind)]


@pytest.mark.parametrize("kind,page,p", [
    ("ragged", 16, params(logits_soft_cap=30.0, head_dim=128)),
    ("paged", 64, params(window_left=100, head_dim=128)),
    ("paged", 12, params(head_dim=128))], ids=["ragged-cap", "paged-window", "paged-page12"])
def test_op_out_of_scope_runs_triton(kind, page, p, monkeypatch):
    seen = _spy(monkeypatch)
    c = make_case(kind, [300, 17], [700, 17], hq=8, hkv=2, dqk=128, dtype=torch.bfloat16,
                  device="cuda", page_size=page, seed=6)
    check(c, p)
    assert seen == []


@pytest.mark.parametrize("kind", ["ragged", "paged"])
def test_split_plan_in_scope_runs_triton(kind, monkeypatch):
    # A split-KV plan of a launch otherwise in the Gluon scope: the Triton kernel runs it
    # (ragged: with the host descriptors the scope check left unbuilt; paged: gathers).
    from compiled_attn.ops.schedule import build_split_work

    seen = _spy(monkeypatch)
    qo, kv = [3, 1, 40, 0, 2], [3000, 970, 2600, 5, 1]
    c = make_case(kind, qo, kv, hq=8, hkv=2, dqk=128, dtype=torch.bfloat16, device="cuda",
                  page_size=128, seed=31)
    c.work, c.merge = build_split_work(qo, kv, 4, c.block_m, 2, num_sms=132,
                                       min_keys_per_chunk=256)
    c.work, c.merge = c.work.cuda(), c.merge.cuda()
    assert int(c.merge[:, 3].max()) > 2
    check(c, params(head_dim=128))
    assert seen == []
