"""ops.choose: the one launch decision.

The launchers' decisions over a curated grid of launches (tests/launch_cases.py: dense,
ragged and paged with pages of 1 / 4 / 16 keys; head dims 64 / 128 / 256 / 96 / 512; no,
causal and custom masks; GQA 1 / 4 / 7; fp16 / bf16 / fp32; short and long keys; split-KV;
each launch-policy override) on an H100 description must equal what they decided before the
decision moved into choose (tests/data/launch_decisions.json), and choose's own answer must be
what the launcher carries out.
"""

from __future__ import annotations

import json

import pytest
import torch

from compiled_attn.ops import choose, contracts
from compiled_attn.ops import prefill_kernel as pk

from . import launch_cases as lc

pytestmark = pytest.mark.skipif(contracts.INTERPRET, reason="the interpreter decides its own "
                                "tiles (64 rows, 32 keys) and paths at any size")

RECORDED = json.loads(lc.DATA.read_text())
CASES = lc.cases()


def test_grid_is_the_recorded_one():
    assert sorted(lc.case_id(c) for c in CASES) == sorted(RECORDED)


@pytest.mark.parametrize("case", CASES, ids=lc.case_id)
def test_decision_unchanged(case):
    assert lc.observe(case) == RECORDED[lc.case_id(case)]


def _choice(case, device):
    """choose.choose's answer for a case, asked directly with meta tensors of its shapes."""
    with lc.hopper(device):  # (the plan's tile on this device)
        name, args, block_m = lc._args(case)
    a, params = lc.dispatch.bind(name, args)
    meta = {k: (t.to("meta") if isinstance(t, torch.Tensor) else t) for k, t in a.items()}
    q = meta["q"]
    paged = name == "batch_paged_prefill"
    k, v = (meta["k_cache"], meta["v_cache"]) if paged else (meta["k"], meta["v"])
    scalars, consts = pk._flags(q, None, None, **params)
    if name == "single_prefill":
        ask = dict(kv_mode=choose.KV_DENSE)
    else:
        ask = pk._ask(meta["work"], meta["qo_indptr"],
                      meta["kv_page_indices"] if paged else None)
        ask.update(kv_mode=choose.KV_PAGED if paged else choose.KV_RAGGED, block_m=block_m)
    kv_mode = ask.pop("kv_mode")
    with lc.hopper(device):
        return choose.choose(kv_mode, q, k, v, consts, scalars, q.dtype, device=device, **ask)


@pytest.mark.parametrize("case", CASES[::3], ids=lc.case_id)
def test_choose_on_meta_tensors_is_the_launch(case):
    # every third case: meta tensors and the device as a description give the launch's answer
    with lc.override(**(lc.POLICIES[case["policy"]] if case["policy"] else {})):
        got = _choice(case, choose.H200)
    seen = RECORDED[lc.case_id(case)]
    assert (got.kernel == "gluon") == (seen["kernels"] == ["_gluon_fwd"])
    # (a ping-pong Gluon tile launches half its compute warps: two groups)
    warps = got.warps // 2 if got.gluon_tile and got.gluon_tile[5] else got.warps
    assert (got.block_m, got.block_n, got.stages, warps) == (
        seen["BLOCK_M"], seen["BLOCK_N"], seen["stages"], seen["warps"])
    assert got.group == seen["group"]
    if got.kernel == "gluon":
        assert got.persistent == seen["persistent"]
        assert got.kv_path == {0: "host", 1: "boxes", 2: "gather"}[seen["paged"]]
    else:
        assert got.tma == seen["tma"] and got.split == seen["split"]
        assert got.kv_path == ("host", "persistent", "device", "pointers")[
            (2, 3, 1, 0).index(seen["tma"])]
    if got.persistent:
        assert seen["grid"] == [got.programs]
    else:
        assert got.programs is None and len(seen["grid"]) == 2


def test_device_is_an_input():
    # The same call on a non-Hopper description never takes the Gluon kernel nor descriptors.
    case = dict(lc.BASE)
    assert _choice(case, choose.H100).kernel == "gluon"
    a100 = choose.Device("cuda", 8, 108)
    got = _choice(case, a100)
    assert got.kernel == "triton" and got.tma == 0 and got.kv_path == "pointers"
    assert not choose.Device("cpu").gluon and choose.H100.tma


def _symbolic(n: int):
    """n as a SymInt of a fresh shape environment (a traced plan's int input under dynamic
    shapes)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv()
    return env.create_symintnode(env.create_symbol(n, ConstantSource("block_m"),
                                                   dynamic_dim=DimDynamic.DYNAMIC), hint=n)


def test_symbolic_tile_height_is_specialised(monkeypatch):
    # torch.compile(dynamic=True) hands the ragged op its block_m as a SymInt; the launch must
    # specialise it (a constexpr) rather than hash it (the persistent-TMA tiles are a set).
    case = next(c for c in CASES if RECORDED[lc.case_id(c)].get("tma") == 3
                and c["kind"] == "ragged")
    policy = lc.POLICIES[case["policy"]] if case["policy"] else {}
    with lc.override(**policy):
        want = _choice(case, choose.H100)
    real = choose.choose
    monkeypatch.setattr(choose, "choose", lambda *a, block_m=None, **kw: real(
        *a, block_m=None if block_m is None else _symbolic(block_m), **kw))
    with lc.override(**policy):
        got = _choice(case, choose.H100)
    assert got == want and type(got.block_m) is int and got.tma == 3


@pytest.mark.parametrize("hkv,sms", [(1, 132), (2, 132), (8, 132), (8, 78), (4, 16)])
def test_split_capacity_bounds_every_split_plan(hkv, sms):
    """schedule.split_capacity, a CUDA-graph plan's work buffer, holds build_split_work's rows
    for every batch of at most that many tiles (random lengths, decode and prefill rows), and
    is reached: a buffer one row smaller would not do."""
    from compiled_attn.ops.schedule import (build_split_work, build_work, chunks_wanted,
                                            split_capacity)

    g = torch.Generator().manual_seed(hkv * 1000 + sms)
    group, block_m, cap = 4, 64, 12
    worst = 0
    for _ in range(300):
        b = int(torch.randint(1, 6, (1,), generator=g))
        qo = torch.randint(0, 40, (b,), generator=g).tolist()
        kv = [q + int(k) for q, k in zip(qo, torch.randint(0, 40000, (b,), generator=g))]
        tiles = sum(-(-q * group // block_m) for q in qo)
        if tiles > cap:
            continue
        work, merge = build_split_work(qo, kv, group, block_m, hkv, num_sms=sms)
        # plan() hands over the tile list it built: the same plan
        again = build_split_work(qo, kv, group, block_m, hkv, num_sms=sms,
                                 tiles=build_work(qo, group, block_m, kv_lens=kv))
        assert torch.equal(again[0], work) and (merge is None) == (again[1] is None)
        assert merge is None or torch.equal(again[1], merge)
        assert work.shape[0] <= split_capacity(cap, hkv, sms)
        assert merge is None or merge.shape[0] <= cap
        worst = max(worst, work.shape[0])
    t = next(t for t in range(1, cap + 1)  # the bound's own worst case, built
             if t * min(16, chunks_wanted(t * hkv, sms)) == split_capacity(cap, hkv, sms))
    work, _ = build_split_work([1] * t, [64 * 1024] * t, 1, 64, hkv, num_sms=sms)  # t tiles
    assert work.shape[0] == split_capacity(cap, hkv, sms) >= worst


@pytest.mark.parametrize("requests,hkv,items,page,block_m,setting,stages", [
    (16, 8, 16, 16, 64, 3, 3),    # 128 programs on 132 SMs: the deeper ring
    (16, 8, 16, 1, 64, 3, 3),     # gathered pages alike
    (33, 4, 33, 16, 64, 3, 3),    # 132 programs: one a SM
    (34, 4, 34, 16, 64, 3, 2),    # 136 programs: the tile's own
    (16, 8, 16, 16, 64, 0, 2),    # the setting off
    (4, 8, 12, 16, 64, 3, 2),     # requests of several tiles (a prefill): the tile's own
    (16, 8, 16, 16, 128, 3, 2),   # the 128-row tile keeps its own
])
def test_few_decode_programs_ring_deeper(requests, hkv, items, page, block_m, setting, stages):
    """Paged requests of one 64-row tile each (decode rows) in at most one program a SM take
    POLICY.few_programs_stages K/V slots (0: the tile's own two)."""
    from compiled_attn.ops.policy import override

    with override(few_programs_stages=setting):
        got = choose._gluon_launch(choose.KV_PAGED, 128, block_m, page, items, hkv, requests,
                                   requests * 64, False, 1, choose.H100)
    assert got.kernel == "gluon" and got.stages == stages
    assert got.gluon_tile[2] == got.stages


@pytest.mark.parametrize("cap,page,block_m,setting,stages,programs", [
    (66, 16, 64, 4, 4, 66),       # POD's decodes side by side: one program a SM, four deep
    (132, 16, 64, 4, 4, 132),     # as many as SMs: still one a SM
    (133, 16, 64, 4, 2, 133),     # more than SMs: two a SM, the tile's own ring
    (66, 16, 64, 0, 2, 66),       # the ring setting off: the cap alone
    (0, 16, 64, 4, 2, 264),       # no cap: the grid of two programs a SM
    (66, 16, 128, 4, 2, 66),      # the 128-row tile keeps its ring
])
def test_programs_cap_deepens_the_ring(cap, page, block_m, setting, stages, programs):
    """A persistent Gluon launch of paged K/V chosen inside launch.programs_cap(cap) runs at
    most cap programs, and on the 64-row D 128 tile with cap <= SMs (one program a SM) rings
    its K / V POLICY.pod_side_stages deep (0: the tile's own). 256 decode requests x 8 KV
    heads, more items than any grid here."""
    from compiled_attn.ops import launch
    from compiled_attn.ops.policy import override

    with override(pod_side_stages=setting), launch.programs_cap(cap):
        got = choose._gluon_launch(choose.KV_PAGED, 128, block_m, page, 256, 8, 256,
                                   256 * 256, False, 1, choose.H100)
    assert launch.programs_cap_now() == 0
    assert got.kernel == "gluon" and got.persistent
    assert got.stages == got.gluon_tile[2] == stages
    expect = programs if block_m == 64 else min(programs, choose.H100.sm_count)
    assert got.programs == expect


@pytest.mark.parametrize("requests,hkv,items,page,rows,cap,setting,swap", [
    (16, 8, 16, 16, (16, 4), 0, True, True),    # 16 decodes, GQA 4: the few-programs ring's place
    (16, 8, 16, 1, (16, 4), 0, True, True),     # gathered pages alike
    (16, 8, 16, 8, (64, 4), 0, True, True),     # 16 rows a request on average: still one pass
    (16, 8, 16, 16, (65, 4), 0, True, False),   # more: the deeper ring
    (16, 8, 16, 16, (4, 32), 0, True, False),   # a query group of 32 (chunk rows' map): 2 passes
    (16, 8, 16, 16, None, 0, True, False),      # rows unknown
    (16, 8, 16, 16, (16, 4), 0, False, False),  # the setting off
    (16, 8, 16, 192, (16, 4), 0, True, False),  # 192-key pages: no 128-key slot reads them
    (256, 8, 256, 16, (256, 4), 66, True, True),  # POD's decodes side by side
    (256, 8, 256, 16, (256, 4), 0, True, False),  # two programs a SM: the 64-row tile
])
@pytest.mark.parametrize("ring", [3, 0])  # (the swap whatever few_programs_stages says)
def test_decode_rows_swap_tile(requests, hkv, items, page, rows, cap, setting, swap, ring):
    """Decode rows in at most one program a SM (few_programs, a grid capped at one program a
    SM) take prefill_gluon.SWAP_TILE where q's query group and its packed rows a request on
    average are at most SWAP_ROWS, its 128-key slots read the pages and POLICY.decode_swap is
    on; few_programs_ring says such a launch reads faster than the tile's own."""
    from compiled_attn.ops import launch
    from compiled_attn.ops import prefill_gluon as G
    from compiled_attn.ops.policy import override

    with override(decode_swap=setting, few_programs_stages=ring), launch.programs_cap(cap):
        assert choose.few_programs_ring(64, 128, items, hkv, requests, choose.H100) == (
            (setting or ring > 0) and items * hkv <= choose.H100.sm_count)
        got = choose._gluon_launch(choose.KV_PAGED, 128, 64, page, items, hkv, requests,
                                   requests * 64, True, 1, choose.H100, rows=rows)
    assert got.kernel == "gluon" and got.persistent
    tile = G.Tile(*got.gluon_tile)
    assert tile.swap == swap
    if swap:
        assert tile == G.SWAP_TILE and (got.block_n, got.stages) == (128, 2)
        assert got.programs == min(items * hkv, cap or items * hkv, choose.H100.sm_count)
    else:
        few, side = items * hkv <= choose.H100.sm_count, 0 < cap <= choose.H100.sm_count
        assert got.block_n == 64
        assert got.stages == (ring if few and ring else 4 if side else 2)


def test_page_table_capacity_keeps_the_short_gather_choice():
    """A plan's page table may be allocated longer than its requests' pages (a re-plan writes
    into it while they grow): the length choose reads then decides gather_short, for either
    mask, as the pages used would; where nothing is crossed the capacity asked is given."""
    from compiled_attn.ops import prefill_gluon as g

    seen = set()
    for page in (1, 4, 16):
        for requests in (1, 3, 32):
            for used in (0, 1, 5, 100, 511, 512, 513, 2048, 4000):
                for want in (used, used + 1, used + 64, 2 * used + 300):
                    cap = choose.page_table_capacity(used, want, page, requests)
                    assert used <= cap <= max(want, used)
                    same = all(g.gather_short(cap, page, requests, c)
                               == g.gather_short(used, page, requests, c) for c in (True, False))
                    assert same, (used, want, page, requests, cap)
                    if all(g.gather_short(want, page, requests, c)
                           == g.gather_short(used, page, requests, c) for c in (True, False)):
                        assert cap == max(want, used)
                    seen.add(cap < want)
    assert seen == {True, False}  # (the grid crosses the bound and stays clear of it)
