"""The helper functions (packbits, segment_packbits, page bookkeeping, merge_state(s), ALiBi
slopes) against numpy / straightforward computations written here."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

import compiled_attn as fi

from .helpers import D64, dense, rand, slopes


@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 61])
@pytest.mark.parametrize("bitorder", ["little", "big"])
def test_packbits_matches_numpy(n, bitorder):
    x = torch.rand(n, generator=torch.Generator().manual_seed(n)) > 0.5
    got = fi.packbits(x, bitorder=bitorder)
    want = np.packbits(x.numpy(), bitorder=bitorder)
    assert got.dtype == torch.uint8 and got.tolist() == want.tolist()


def test_packbits_default_bitorder_is_flashinfers_big():
    x = torch.tensor([1, 0, 0, 0, 0, 0, 0, 0], dtype=torch.bool)
    assert fi.packbits(x).tolist() == [128]
    assert fi.packbits(x, bitorder="little").tolist() == [1]


def test_segment_packbits_per_segment_bytes():
    lens = [4, 0, 11, 8, 3]
    ind = torch.tensor([0] + np.cumsum(lens).tolist(), dtype=torch.int32)
    x = torch.rand(sum(lens), generator=torch.Generator().manual_seed(1)) > 0.5
    packed, new_ind = fi.segment_packbits(x, ind, bitorder="little")
    want, ptr = [], [0]
    for a, b in zip(ind[:-1].tolist(), ind[1:].tolist()):
        seg = np.packbits(x[a:b].numpy(), bitorder="little").tolist()
        want += seg
        ptr.append(ptr[-1] + len(seg))
    assert packed.tolist() == want and new_ind.tolist() == ptr
    assert new_ind.dtype == torch.int32
    with pytest.raises(ValueError, match=r"indptr: ends at 26 but x.numel\(\) is 25"):
        fi.segment_packbits(x[:-1], ind)
    with pytest.raises(ValueError, match="bitorder"):
        fi.segment_packbits(x, ind, bitorder="middle")
    # as FlashInfer's kernel reads it: x past indptr[-1] and before indptr[0] are not packed
    longer, _ = fi.segment_packbits(torch.cat([x, ~x]), ind, bitorder="little")
    shifted, shifted_ind = fi.segment_packbits(torch.cat([~x[:5], x]), ind + 5, bitorder="little")
    assert longer.tolist() == want and shifted.tolist() == want
    assert shifted_ind.tolist() == ptr
    with pytest.raises(ValueError, match="indptr: must start at 0 or more"):
        fi.segment_packbits(x, ind - 1)


def test_get_seq_lens():
    kv_indptr = torch.tensor([0, 2, 2, 5], dtype=torch.int32)
    last = torch.tensor([3, 0, 16], dtype=torch.int32)
    assert fi.get_seq_lens(kv_indptr, last, 16).tolist() == [19, 0, 48]
    # FlashInfer's arithmetic: the dtypes' promotion (it was last's dtype: 2^20 pages of 4096
    # wrapped in int32), and a last page of 0 counted as such (it raised)
    big = fi.get_seq_lens(torch.tensor([0, 2 ** 20]), torch.tensor([4096], dtype=torch.int32),
                          4096)
    assert big.dtype == torch.int64 and big.tolist() == [2 ** 32]
    assert fi.get_seq_lens(torch.tensor([0, 1, 3], dtype=torch.int32),
                           torch.tensor([0, 0], dtype=torch.int32), 4).tolist() == [0, 4]


def test_get_batch_indices_positions():
    append_indptr = torch.tensor([0, 1, 3, 6, 10], dtype=torch.int32)
    seq_lens = torch.tensor([5, 5, 5, 5])
    b, p = fi.get_batch_indices_positions(append_indptr, seq_lens, 12)
    assert b.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3, -1, -1]
    assert p.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4, 0, 0]
    assert b.dtype == p.dtype == torch.int32
    bi, pi = torch.empty(12, dtype=torch.int32), torch.empty(12, dtype=torch.int32)
    rb, rp = fi.get_batch_indices_positions(append_indptr, seq_lens, 12, bi, pi)
    assert rb is bi and rp is pi and bi.tolist() == b.tolist()
    # a caller's positions buffer keeps its padding entries, as FlashInfer's kernel leaves them
    pi = torch.full((12,), 77, dtype=torch.int32)
    fi.get_batch_indices_positions(append_indptr, seq_lens, 12, bi, pi)
    assert pi.tolist() == p.tolist()[:10] + [77, 77]
    with pytest.raises(RuntimeError, match=r"append_indptr\[-1\] is past nnz"):
        fi.get_batch_indices_positions(append_indptr, seq_lens, 9)


@pytest.mark.parametrize("layout,fmt", [("NHD", "5d"), ("HND", "tuple")])
def test_append_paged_kv_cache(layout, fmt):
    page, h, d = 4, 2, 3
    kv_lens, append = [6, 9], [2, 5]  # lengths after the append
    kv_indptr = torch.tensor([0, 2, 5], dtype=torch.int32)
    kv_indices = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    last = torch.tensor([2, 1], dtype=torch.int32)
    shape = (6, page, h, d) if layout == "NHD" else (6, h, page, d)
    kc, vc = torch.zeros(shape, dtype=D64), torch.zeros(shape, dtype=D64)
    cache = torch.stack([kc, vc], 1) if fmt == "5d" else (kc, vc)
    ak, av = rand(7, h, d, seed=1), rand(7, h, d, seed=2)
    app_indptr = torch.tensor([0, 2, 7], dtype=torch.int32)
    b, p = fi.get_batch_indices_positions(app_indptr, torch.tensor(kv_lens), 8)  # one padding
    fi.append_paged_kv_cache(torch.cat([ak, ak[:1]]), torch.cat([av, av[:1]]), b, p, cache,
                             kv_indices, kv_indptr, last, kv_layout=layout)
    k_all, v_all = (cache[:, 0], cache[:, 1]) if fmt == "5d" else cache
    if layout == "HND":
        k_all, v_all = k_all.transpose(1, 2), v_all.transpose(1, 2)
    t = 0
    for req in range(2):
        for j in range(append[req]):
            pos = kv_lens[req] - append[req] + j
            pg = int(kv_indices[int(kv_indptr[req]) + pos // page])
            assert torch.equal(k_all[pg, pos % page], ak[t])
            assert torch.equal(v_all[pg, pos % page], av[t])
            t += 1
    assert int((k_all != 0).any(-1).any(-1).sum()) == 7  # nothing else written


def test_merge_state_equals_attention_over_the_union():
    q, k, v = rand(6, 4, 8, seed=3), rand(20, 4, 8, seed=4), rand(20, 4, 8, seed=5)
    full_o, full_l = dense(q, k, v)
    a_o, a_l = dense(q, k[:7], v[:7])
    b_o, b_l = dense(q, k[7:], v[7:])
    o, l = fi.merge_state(a_o, a_l, b_o, b_l)
    torch.testing.assert_close(o, full_o, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(l.to(D64), full_l, atol=1e-5, rtol=1e-6)
    parts = [dense(q, k[s], v[s]) for s in (slice(0, 3), slice(3, 11), slice(11, 20))]
    o3, l3 = fi.merge_states(torch.stack([x[0] for x in parts], 1),
                             torch.stack([x[1] for x in parts], 1))
    torch.testing.assert_close(o3, full_o, atol=1e-12, rtol=1e-12)
    assert l3.dtype == torch.float32 and o3.dtype == D64


def test_merge_state_empty_rows_give_zero_and_minus_inf():
    v = rand(3, 2, 4, seed=6)
    s_inf = torch.full((3, 2), -math.inf)
    o, l = fi.merge_state(v, s_inf, v * 2, s_inf)
    assert torch.all(o == 0) and torch.all(l == -math.inf)
    s = torch.zeros(3, 2)
    o, l = fi.merge_state(v, s, v * 5, s_inf)  # one side empty: the other side unchanged
    torch.testing.assert_close(o, v)
    assert torch.all(l == 0)


def test_merge_state_in_place_writes_merge_state_and_skips_masked_rows():
    """FlashInfer's merge_state_in_place: merge_state's result written into v and s; rows
    whose mask entry is False (or 0) keep their values; a -inf side leaves the other one."""
    v, v_o = rand(5, 3, 8, seed=8), rand(5, 3, 8, seed=9)
    s, s_o = rand(5, 3, seed=10).float(), rand(5, 3, seed=11).float()
    s_o[1] = -math.inf
    want_v, want_s = fi.merge_state(v, s, v_o, s_o)
    for mask in (None, torch.tensor([True, False, True, True, False]),
                 torch.tensor([1, 0, 1, 1, 0], dtype=torch.int32)):
        got_v, got_s = v.clone(), s.clone()
        assert fi.merge_state_in_place(got_v, got_s, v_o, s_o, mask) is None
        rows = torch.ones(5, dtype=torch.bool) if mask is None else mask != 0
        torch.testing.assert_close(got_v[rows], want_v[rows], atol=0, rtol=0)
        torch.testing.assert_close(got_s[rows], want_s[rows], atol=0, rtol=0)
        assert torch.equal(got_v[~rows], v[~rows]) and torch.equal(got_s[~rows], s[~rows])
    torch.testing.assert_close(want_v[1], v[1])  # (the -inf side merged away)
    with pytest.raises(ValueError, match=r"mask: expected shape \(5,\)"):
        fi.merge_state_in_place(v.clone(), s.clone(), v_o, s_o, torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="mask: expected a bool"):
        fi.merge_state_in_place(v.clone(), s.clone(), v_o, s_o, torch.ones(5))
    with pytest.raises(ValueError, match=r"s_other: expected shape \(5, 3\)"):
        fi.merge_state_in_place(v.clone(), s.clone(), v_o, s_o[:4])


@pytest.mark.parametrize("h", [1, 7, 8, 12, 32])
def test_get_alibi_slopes(h):
    got = fi.get_alibi_slopes(h)
    assert got.dtype == torch.float32 and got.shape == (h,)
    torch.testing.assert_close(got.to(D64), slopes(h), atol=0, rtol=1e-7)


def test_helpers_bad_inputs():
    """Bad inputs to the helpers name the argument (ValueError / TypeError), or, for values on
    the device, fail a device-side check (RuntimeError at once on CPU): never an IndexError, a
    broadcast, or a write into another request's page."""
    ind = torch.tensor([0, 2, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"kv_last_page_len: expected shape \(2,\)"):
        fi.get_seq_lens(ind, torch.tensor([1], dtype=torch.int32), 4)
    with pytest.raises(ValueError, match="page_size: got 0"):
        fi.get_seq_lens(ind, torch.tensor([1, 2], dtype=torch.int32), 0)
    with pytest.raises(ValueError, match=r"seq_lens: expected shape \(2,\)"):
        fi.get_batch_indices_positions(ind, torch.tensor([5]), 5)
    with pytest.raises(ValueError, match="nnz: got -1"):
        fi.get_batch_indices_positions(ind, torch.tensor([5, 5]), -1)
    for bad in (2.5, True, 0, "8"):
        with pytest.raises(ValueError, match="n_heads: got"):
            fi.get_alibi_slopes(bad)
    v = rand(3, 2, 4, seed=7)
    with pytest.raises(ValueError, match=r"v_b: expected shape \(3, 2, 4\)"):
        fi.merge_state(v, torch.zeros(3, 2), v[:2], torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"s_b: expected shape \(3, 2\)"):
        fi.merge_state(v, torch.zeros(3, 2), v, torch.zeros(3, 1))
    with pytest.raises(ValueError, match=r"s: expected shape \(3, 2, 2\)"):
        fi.merge_states(torch.stack([v, v], 1), torch.zeros(3, 2))
    # append: a batch index past the table, a position past its request's pages
    page, h, d = 4, 2, 3
    kv_indices = torch.tensor([3, 0, 4, 1, 2], dtype=torch.int32)
    last = torch.tensor([2, 1], dtype=torch.int32)
    cache = torch.zeros(6, 2, page, h, d, dtype=D64)
    k = rand(2, h, d, seed=8)
    for b, p, match in (([0, 2], [0, 1], "batch_indices has entries >= the page table's 2"),
                        ([0, 0], [0, 8], "a position outside its request's pages"),
                        ([1, 1], [-1, 0], "a position outside its request's pages")):
        with pytest.raises(RuntimeError, match=match):
            fi.append_paged_kv_cache(k, k, torch.tensor(b, dtype=torch.int32),
                                     torch.tensor(p, dtype=torch.int32), cache, kv_indices, ind,
                                     last)
    # a negative kv_indptr entry (it wrote into page kv_indices[0], another request's)
    with pytest.raises(RuntimeError, match="kv_indptr holds a negative entry"):
        fi.append_paged_kv_cache(k, k, torch.tensor([0, 0], dtype=torch.int32),
                                 torch.tensor([0, 1], dtype=torch.int32), cache, kv_indices,
                                 torch.tensor([-1, 0, 2], dtype=torch.int32), last)
    # a V cache of other pages than K's (an IndexError after K was written)
    for v_cache in (cache[:3, 1], cache[:, 1, :2]):
        with pytest.raises(ValueError, match="paged_kv_cache: the V cache has"):
            fi.append_paged_kv_cache(k, k, torch.tensor([0, 0], dtype=torch.int32),
                                     torch.tensor([0, 1], dtype=torch.int32),
                                     (cache[:, 0], v_cache), kv_indices, ind, last)
    assert not cache.any()
    # a page index outside the cache (a negative one once wrapped to another page and wrote
    # there), and a kv_indptr past kv_indices' end
    bad_pages = (([3, 0, -1, 1, 2], 0, "holds a page index outside the cache's 6 pages"),
                 ([3, 0, 6, 1, 2], 0, "holds a page index outside the cache's 6 pages"),
                 ([3, 0, 4, 1], 8, "kv_indptr points past kv_indices' 4 entries"))
    for pages, pos, match in bad_pages:
        with pytest.raises(RuntimeError, match=match):
            fi.append_paged_kv_cache(k, k, torch.tensor([1, 1], dtype=torch.int32),
                                     torch.tensor([5, pos], dtype=torch.int32), cache,
                                     torch.tensor(pages, dtype=torch.int32), ind, last)
    assert not cache.any()
    # a scale given as a string is not a number
    with pytest.raises(TypeError, match="k_scale: got '2'; pass a number"):
        fi.single_prefill_with_kv_cache(rand(2, 2, 8), rand(3, 2, 8), rand(3, 2, 8), k_scale="2")


def test_helpers_refuse_float_indices():
    # Float index arrays were truncated silently (kv_indptr [0., 1.5] gave a length of 3,
    # kv_last_page_len [1.5] one of 5.5, kv_indices [1.7] wrote page 1): integer dtypes only.
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    f32 = lambda *x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    cases = [
        (lambda: fi.get_seq_lens(f32(0., 1.5), i32(1), 2), "kv_indptr"),
        (lambda: fi.get_seq_lens(i32(0, 1), f32(1.5), 2), "kv_last_page_len"),
        (lambda: fi.get_batch_indices_positions(i32(0, 3), f32(3.5), 3), "seq_lens"),
        (lambda: fi.get_batch_indices_positions(f32(0., 3.), i32(3), 3), "append_indptr"),
    ]
    for fn, name in cases:
        with pytest.raises(TypeError, match=f"^{name}: expected an integer dtype"):
            fn()
    cache = torch.zeros(3, 2, 2, 1, 4, dtype=D64)
    k = rand(1, 1, 4, seed=1)
    for name, idx, ptr, last in (("kv_indices", f32(1.7), i32(0, 1), i32(1)),
                                 ("kv_indptr", i32(1), f32(0., 1.), i32(1)),
                                 ("kv_last_page_len", i32(1), i32(0, 1), f32(1.))):
        with pytest.raises(TypeError, match=f"^{name}: expected an integer dtype"):
            fi.append_paged_kv_cache(k, k, i32(0), i32(0), cache, idx, ptr, last)
    assert not cache.any()


def test_get_batch_indices_positions_indptr_not_at_zero():
    # Tokens before append_indptr[0] belong to no request, as the docstring says (they were
    # given to request 0 with a position one before its first appended token); FlashInfer's
    # kernel fills only [append_indptr[0], append_indptr[-1]).
    b, p = fi.get_batch_indices_positions(torch.tensor([1, 3], dtype=torch.int32),
                                          torch.tensor([5], dtype=torch.int32), 4)
    assert b.tolist() == [-1, 0, 0, -1] and p.tolist() == [0, 3, 4, 0]
    with pytest.raises(RuntimeError, match="append_indptr decreases or starts below 0"):
        fi.get_batch_indices_positions(torch.tensor([-1, 3], dtype=torch.int32),
                                       torch.tensor([5], dtype=torch.int32), 4)


def test_append_paged_kv_cache_checks_devices_before_writing():
    # A key or an index array on another device returned without writing K (V was written)
    # or wrote nothing; now each names the argument, and nothing is written.
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cache = torch.zeros(3, 2, 2, 1, 4, dtype=D64)
    k = rand(1, 1, 4, seed=2)
    args = dict(append_key=k, append_value=k, batch_indices=i32(0), positions=i32(1),
                paged_kv_cache=cache, kv_indices=i32(2), kv_indptr=i32(0, 1),
                kv_last_page_len=i32(2))
    for name in ("append_key", "append_value", "batch_indices", "positions", "kv_indices",
                 "kv_indptr", "kv_last_page_len"):
        bad = dict(args, **{name: args[name].to("meta")})
        with pytest.raises(ValueError, match=f"^{name}: is on meta but must be on cpu"):
            fi.append_paged_kv_cache(**bad)
    with pytest.raises(ValueError, match=r"^paged_kv_cache \(v\): is on meta"):
        fi.append_paged_kv_cache(**dict(args, paged_kv_cache=(cache[:, 0], cache[:, 1].to("meta"))))
    assert not cache.any()
    fi.append_paged_kv_cache(**args)  # the same call on one device writes K and V
    assert torch.equal(cache[2, 0, 1], k[0]) and torch.equal(cache[2, 1, 1], k[0])
    # any integer index dtype (FlashInfer converts with .int())
    cache.zero_()
    fi.append_paged_kv_cache(**dict(args, batch_indices=args["batch_indices"].to(torch.int8),
                                    positions=args["positions"].to(torch.int16)))
    assert torch.equal(cache[2, 0, 1], k[0]) and torch.equal(cache[2, 1, 1], k[0])


def test_append_paged_kv_cache_refuses_integer_caches_and_keys():
    # Keys appended into an int32 cache were truncated, into a uint8 one wrapped (-1.5 became
    # 255); FlashInfer's kernel refuses a cache of no key / value dtype. Nothing is written.
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    k = rand(1, 1, 4, seed=4) * 3
    for dt in (torch.int32, torch.uint8, torch.bool):
        cache = torch.zeros(3, 2, 2, 1, 4, dtype=dt)
        with pytest.raises(TypeError, match=rf"^paged_kv_cache \(k\): dtype {dt} is not"):
            fi.append_paged_kv_cache(k, k, i32(0), i32(1), cache, i32(2), i32(0, 1), i32(2))
        assert not cache.any()
    cache = torch.zeros(3, 2, 2, 1, 4, dtype=D64)
    for name in ("append_key", "append_value"):
        args = [k, k]
        args[name == "append_value"] = k.to(torch.int32)
        with pytest.raises(TypeError, match=f"^{name}: dtype torch.int32 is not"):
            fi.append_paged_kv_cache(*args, i32(0), i32(1), cache, i32(2), i32(0, 1), i32(2))
    assert not cache.any()
    for dt in (torch.float16, torch.bfloat16, torch.float8_e4m3fn):  # converted, as before
        cache = torch.zeros(3, 2, 2, 1, 4, dtype=dt)
        fi.append_paged_kv_cache(k, k, i32(0), i32(1), cache, i32(2), i32(0, 1), i32(2))
        assert torch.equal(cache[2, 0, 1], k[0].to(dt))


def test_get_batch_indices_positions_refuses_lengths_past_int32():
    # An int64 seq_lens entry of 2^32 + 3 gave the positions of a 3-key request (int32 wrap)
    i64 = lambda *x: torch.tensor(x, dtype=torch.int64)  # noqa: E731
    ai = torch.tensor([0, 2, 5], dtype=torch.int32)
    for lens in (i64(2 ** 32 + 3, 4), i64(3, 2 ** 31)):
        with pytest.raises(RuntimeError, match="seq_lens entry is 2\\^31 or more"):
            fi.get_batch_indices_positions(ai, lens, 5)
    b, p = fi.get_batch_indices_positions(ai, i64(3, 2 ** 31 - 1), 5)
    assert b.tolist() == [0, 0, 1, 1, 1] and p.tolist() == [1, 2, 2 ** 31 - 4, 2 ** 31 - 3,
                                                             2 ** 31 - 2]


def test_merge_state_passes_nan_through_and_refuses_integer_values():
    # A NaN LSE merged to -inf ("saw no key") beside a NaN output; int32 values merged to
    # int32 (1 and 2 gave 1).
    v = rand(2, 1, 4, seed=3)
    s = torch.zeros(2, 1)
    s_nan = torch.tensor([[float("nan")], [0.0]])
    o, lse = fi.merge_state(v, s_nan, v * 2, s)
    assert torch.isnan(o[0]).all() and torch.isnan(lse[0]).all()
    torch.testing.assert_close(o[1], v[1] * 1.5)
    assert float(lse[1, 0]) == 1.0
    o, lse = fi.merge_states(torch.stack([v, v], 1), torch.stack([s_nan, s_nan], 1))
    assert torch.isnan(lse[0]).all() and torch.isnan(o[0]).all() and float(lse[1, 0]) == 1.0
    ones = torch.ones(1, 2, 1, 1, dtype=torch.int32)
    with pytest.raises(TypeError, match="^v: expected a floating dtype"):
        fi.merge_states(ones, torch.zeros(1, 2, 1))
    with pytest.raises(TypeError, match="^s: expected a floating dtype"):
        fi.merge_states(ones.float(), torch.zeros(1, 2, 1, dtype=torch.int32))
    with pytest.raises(TypeError, match="^v_a: expected a floating dtype"):
        fi.merge_state(ones[:, 0], torch.zeros(1, 1), ones[:, 0], torch.zeros(1, 1))


def test_page_helpers_compile_once_over_lengths():
    """torch.compile(dynamic=True, fullgraph=True) of get_batch_indices_positions and of an
    append over growing batches: one graph each (nnz, the batch size and the page counts were
    specialised by operator.index, int() of shapes and formatted error messages: a recompile
    for every length); the cache as the eager append writes it."""
    from torch._dynamo.utils import counters

    def indptr_of(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda ai, sl, n: fi.get_batch_indices_positions(ai, sl, n),
                      fullgraph=True, dynamic=True, backend="eager")
    for lens in ([3, 5], [4, 8], [6, 11], [7, 13]):
        ai, sl = indptr_of(lens), torch.tensor(lens, dtype=torch.int32) + 2
        got = f(ai, sl, sum(lens))
        want = fi.get_batch_indices_positions(ai, sl, sum(lens))
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def test_single_prefill_with_a_mask_compiles_once_over_lengths():
    """A custom (or packed) mask's length check formatted the traced lengths into its message
    before checking: a recompile for every (qo_len, kv_len)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    f = torch.compile(lambda q, k, v, m: fi.single_prefill_with_kv_cache(q, k, v, custom_mask=m),
                      fullgraph=True, dynamic=True, backend="eager")
    for qo, kv in ((5, 9), (7, 13), (11, 20)):
        q, k, v = rand(qo, 4, 16, seed=qo), rand(kv, 2, 16, seed=kv), rand(kv, 2, 16, seed=3)
        m = torch.rand(qo, kv, generator=torch.Generator().manual_seed(qo)) > 0.3
        torch.testing.assert_close(f(q, k, v, m),
                                   fi.single_prefill_with_kv_cache(q, k, v, custom_mask=m))
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])


def _on_meta(t):
    return torch.empty_like(t, device="meta")


@pytest.mark.parametrize("case", ["get_seq_lens", "merge_state", "merge_states",
                                  "merge_state_in_place", "append_paged_kv_cache"])
def test_device_errors_name_what_sets_the_device(case):
    """A tensor on another device than its partner is named, with the argument whose device it
    must share (not a wrapper's workspace buffer these functions do not have)."""
    v, s = torch.randn(3, 2, 4), torch.randn(3, 2)
    i32 = dict(dtype=torch.int32)
    if case == "get_seq_lens":
        call = lambda: fi.get_seq_lens(torch.tensor([0, 1, 3], **i32),  # noqa: E731
                                       _on_meta(torch.tensor([1, 2], **i32)), 16)
        want = "kv_last_page_len: is on meta but must be on cpu (the device of kv_indptr)"
    elif case == "merge_state":
        call = lambda: fi.merge_state(v, s, _on_meta(v), s)  # noqa: E731
        want = "v_b: is on meta but must be on cpu (the device of v_a)"
    elif case == "merge_states":
        call = lambda: fi.merge_states(v[:, None], _on_meta(s[:, None]))  # noqa: E731
        want = "s: is on meta but must be on cpu (the device of v)"
    elif case == "merge_state_in_place":
        call = lambda: fi.merge_state_in_place(  # noqa: E731
            v.clone(), s.clone(), v, s, mask=_on_meta(torch.ones(3, dtype=torch.bool)))
        want = "mask: is on meta but must be on cpu (the device of v)"
    else:
        cache = torch.zeros(4, 2, 16, 2, 4)  # [pages, 2, page, Hkv, D]
        k = torch.randn(3, 2, 4)
        call = lambda: fi.append_paged_kv_cache(  # noqa: E731
            k, _on_meta(k), torch.zeros(3, **i32), torch.arange(3, **i32), cache,
            torch.tensor([0], **i32), torch.tensor([0, 1], **i32), torch.tensor([3], **i32))
        want = ("append_value: is on meta but must be on cpu (the device of paged_kv_cache "
                "(its K cache))")
    with pytest.raises(ValueError, match=re.escape(want)):
        call()
