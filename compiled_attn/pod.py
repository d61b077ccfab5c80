"""FlashInfer's POD (prefill-on-decode) wrappers on ``torch.ops.compiled_attn.pod_prefill_decode``.

Both wrappers run a prefill batch and a decode batch in one launch of the POD op, whose work
list (int32 [W, 3] = (part 0 prefill / 1 decode, request, first packed row)) holds the tiles
of both. ``PODWithPagedKVCacheWrapper`` takes one prefill request with contiguous k/v at run
time (passed to the op as a one-page cache ``[1, kv_len, Hkv, D]``, built with device ops only)
and a planned decode batch on a paged cache; ``BatchPODWithPagedKVCacheWrapper`` plans both
batches on paged caches. plan() reads the index arrays on the host and validates them (shared
checks in ``_validate``); run() reads no device value. Unlike FlashInfer, the LSEs are returned
when asked for (base 2, as everywhere in compiled_attn), and every run-time option takes effect
or raises. The op applies one position encoding (mode, rope_scale, rope_theta) to both parts;
prefill and decode options that would need two raise NotImplementedError.

Where the decodes are too small to hide under the prefill (ops.choose.pod_apart: their bytes
under 5% of the prefill's FLOPs counted at Hopper's rate for BatchPOD, under about the
prefill's time for POD, whose prefill alone runs on contiguous k / v, and under three times it
where the fused launch gathers both parts; on parts of ~100 us or more together), the fused
launch would cost the prefill more than it saves, and run() launches the parts apart
instead: the prefill through the single_prefill op (POD) or batch_paged_prefill (BatchPOD), the
decodes through batch_paged_prefill, with the same numbers to the last bits of the dtype (few
decodes alone, or side by side, run the swapped products: POLICY.decode_swap); and so always
where the fused launch would not be the Gluon kernel's (ops.choose.pod_fused_gluon). Calls
traced by torch.compile go apart only in that second case, which needs no sizes; torch.export
keeps one POD op.

Few long decode requests run as key chunks (one-row chunk requests over the same page table,
their outputs merged by LSE; _plan_chunks): inside the fused launch where they would leave it a
few long items that finish unevenly (ops.choose.pod_cut), and apart where a paged call of them
alone would cut them. In CUDA-graph mode the first plan decides the chunk counts and every
re-plan writes into its tensors (_plan_graph_chunks), so that a captured run() serves them.

Where both parts are large (ops.choose.pod_side), or on page 1 where the fused launch would
gather a prefill of 2048 tokens or so beside fewer decodes, an eager or captured run()
launches them side by side (_side_by_side): the decodes on a second stream over their share
of the SMs (about half; a quarter at least for small calls; more where they dominate), the
prefill on the current stream beside them. Eager calls replay that as a bound call.
"""

from __future__ import annotations

import functools
import math
import operator
import threading

import torch

from . import _validate as V
from ._host import gather_host, to_device
from ._plan_options import LastOptions, PlanOptions, options_key
from .op_call import bound_run, call_op, capturing
from .ops import choose
from .ops import decode_chunks as _chunks
from .ops.launch import (Memo, adopt_scratch, plain_tensors, programs_cap, two_streams,
                          untraced)
from .ops import MASK_CAUSAL, MASK_CUSTOM, MASK_NONE, POS_ALIBI, POS_NONE, POS_ROPE_LLAMA
from .ops.policy import version as policy_version
from .ops.tiles import one_page_size
from .ops.schedule import (block_m_for, build_decode_chunks, build_work, int32_host,
                           planned_chunk_count, uniform_work)
from .prefill import _split_v_scale, _WrapperBase, pages_fit, same_launches, table_with_room
from .utils import (_byte_offsets, _pack_from_sources, _paged_kv_views, _segment_bit_sources,
                    get_alibi_slopes, packbits)

__all__ = ["PODWithPagedKVCacheWrapper", "BatchPODWithPagedKVCacheWrapper"]

_RETURN_DOC = """
        Returns ``(out_p, out_d)`` (out_p ``[prefill rows, Hq, D]``, out_d ``[decode rows, Hq,
        D]``, q's dtype). When an LSE is asked for, returns ``((out_p, out_d), (lse_p, lse_d))``
        (FlashInfer's BatchPOD run code returns this shape; FlashInfer's POD never fills the
        LSEs), each lse float32 ``[rows, Hq]``, base 2 (natural logsumexp / ln 2) over the final
        logits, -inf for a row that sees no key (its output is 0); an LSE not asked for is None.
        """


class _PODBase(_WrapperBase):
    """Plan options and the op call shared by both POD wrappers."""

    # plan fields that run() reads for no launch of a plan that launches as the last one
    # (_launches_as), each checked before a replay where it matters
    _PLAN_ONLY: frozenset = frozenset()
    # run()'s bound calls' free sizes (launch.Memo's free): the tensors whose first dimension
    # a bound call may replay at any size
    _FREE: tuple = ()

    def _init_common(self, float_workspace_buffer, kv_layout):
        V.check_tensor("float_workspace_buffer", float_workspace_buffer)
        self._float_workspace_buffer = float_workspace_buffer
        self._int_workspace_buffer = None
        self.device = float_workspace_buffer.device
        self._kv_layout = V.check_kv_layout(kv_layout)
        self._plan = None
        self._use_cuda_graph = False
        self._options = LastOptions()  # (the last plan's options: _plan_options)
        self._derived = None  # (those options, {key: a choice made from them}): _per_options

    def _options_key(self, args: dict):
        """What _plan_options' answer depends on (_plan_options.options_key): the option
        arguments, the wrapper's device, the launch policy's version and the device plans are
        made for."""
        return options_key(args, _OPTION_ARGS, self.device, policy_version(),
                           choose._plan_device())

    def _plan_options(self, args: dict) -> dict:
        """The plan dict's options, from a POD plan()'s arguments by FlashInfer name
        (PlanOptions.of_pod), with the tile height and the ALiBi slopes (alibi: the plan's
        ALiBi, or None; alibi_run: the same slopes whatever the mode, for a run() that asks
        ALiBi of a plan without it). A serving step re-plans with the same options: the
        previous plan's answer is reused where its key (_options_key) is the same."""
        # (a copy: the plan dict is filled in)
        made = self._options.get(self._options_key(args), lambda: self._make_plan_options(args))
        if self._derived is None or self._derived[0] is not made:
            self._derived = (made, {})
        return dict(made)

    def _per_options(self, key, make):
        """make()'s answer for ``key``, kept while plan() reuses the last plan's options
        (_plan_options): for the launch choices that read nothing but the options, the launch
        policy and the device plans are made for (all in the options' key) and what ``key``
        holds."""
        known = self._derived[1]
        if key not in known:
            known[key] = make()
        return known[key]

    def _decode_tile(self, p: dict, qo_l: list) -> int:
        """The decodes' own tile (block_m_d) for their query rows per request qo_l: where the
        fused launch would not be the Gluon kernel's (e.g. fp8 K/V), pod_tile is not theirs
        (choose.pod_decode_tile, which reads the rows through the longest request alone: the
        answer is kept per longest, _per_options)."""
        return self._per_options(("block_m_d", max(qo_l, default=0)), lambda: (
            choose.pod_decode_tile(p["head_dim"], p["group"], p["page_size"], qo_l,
                                   p["block_m"], p["kv_dtype"])))

    def _chunk_sms(self, p: dict) -> dict:
        """_chunk_sms for the fused launch and for the decodes' own, by _CHUNK_KEYS' key, on
        plan p's decode tile (they read nothing else but the options: _per_options)."""
        return self._per_options(("chunk_sms", p["block_m_d"]), lambda: {
            key: _chunk_sms(p, apart) for key, apart in _CHUNK_KEYS})

    def _plan_both_chunks(self, p: dict, qo_h, ind_h, last_h, qo_l: list, kv_lens: list,
                          non_blocking: bool, old: dict | None) -> None:
        """p["chunks"] and p["chunks_apart"]: _plan_chunks for the fused launch and for the
        decodes' own launch, on their SM counts (_chunk_sms), their arrays written into the
        last plan ``old``'s chunk tensors (_send_chunks), and kept as old's where they launch
        as those (_kept_chunks)."""
        sms = self._chunk_sms(p)
        for key, apart in _CHUNK_KEYS:
            p[key] = _kept_chunks(None if old is None else old.get(key), _plan_chunks(
                p, qo_h, ind_h, last_h, qo_l, kv_lens, self.device, apart=apart,
                non_blocking=non_blocking, sms=sms[key],
                send=functools.partial(self._send_chunks, old, non_blocking, key)))

    def _send_chunks(self, old: dict | None, non_blocking: bool, key: str,
                     host: dict) -> dict:
        """_send of the host arrays of a plan's chunk requests p[key] (_chunk_device's), into
        the last plan ``old``'s chunk tensors of that key where shapes match, recorded as
        "key.name"."""
        self._plan = None  # (old's tensors take this plan's values: it is retired, _to_device)
        c = None if old is None else old.get(key)
        into = None if c is None else {f"{key}.{k}": c[k] for k in _CHUNK_ARRAYS}
        dev = self._send({f"{key}.{k}": v for k, v in host.items()}, non_blocking, into)
        return {k: dev[f"{key}.{k}"] for k in host}

    def _make_plan_options(self, args: dict) -> dict:
        """_plan_options' answer, made from the arguments."""
        o = PlanOptions.of_pod(args, self.device.type)
        plain = o.pos_encoding_mode == POS_NONE and o.window_left < 0
        fused = choose.pod_fused_gluon(o.head_dim_qk, args["page_size"], o.kv_dtype, plain=plain)
        slopes = _run_slopes(o.num_qo_heads, self.device)  # (read only: one per heads count)
        return dict(num_qo_heads=o.num_qo_heads, num_kv_heads=o.num_kv_heads,
                    head_dim=o.head_dim_qk, group=o.group,
                    block_m=choose.pod_tile(o.head_dim_qk, o.group, args["page_size"],
                                            o.kv_dtype, plain=plain, fused_gluon=fused),
                    fused_gluon=fused,
                    fused_gathers=fused and choose.pod_fused_gathers(o.head_dim_qk,
                                                                     args["page_size"]),
                    page_size=args["page_size"], pos=o.pos_encoding_mode,
                    window_left=o.window_left, sm_scale=o.sm_scale, rope_scale=o.rope_scale,
                    rope_theta=o.rope_theta, q_dtype=o.q_dtype, kv_dtype=o.kv_dtype,
                    alibi=slopes if o.pos_encoding_mode == POS_ALIBI else None,
                    alibi_run=slopes)

    def _set_plan(self, p: dict, old: dict | None = None) -> None:
        """Take plan p; run() replays launches bound for it (its tensors keyed by identity).
        Where p launches as the plan ``old`` before it (_launches_as: its tensors written
        anew, its other values but the largest page index equal), the launches bound for old
        and its prefill parts are kept: a serving step's first run() after plan() then
        replays too."""
        self._plan = p
        self._classes = {}  # (run()'s launch classes read the plan: _bound_part)
        if old is not None and self._launches_as(old, p):
            return
        self._memo = Memo(static=[*p.values(), *(p.get("chunks") or {}).values(),
                                  *(p.get("chunks_apart") or {}).values()], free=self._FREE)
        self._parts = {}

    def _launches_as(self, old: dict, p: dict) -> bool:
        """Whether run() launches for plan p as for the last plan old (prefill.same_launches,
        outside the wrapper's _PLAN_ONLY)."""
        return same_launches(old, p, self._PLAN_ONLY, _SAME_OBJECT)

    def _to_device(self, host: dict, non_blocking: bool, old: dict | None) -> dict:
        """to_device of a plan's host arrays, into the last plan ``old``'s tensors where shapes
        match (_into). old is retired first: its tensors now take this plan's values, so a
        plan() that raised later leaves no plan rather than compute the old one on them. An
        array that is the very host object the last call sent (the decodes' cached lists,
        _decode_lists) or holds its values is not copied again: old's tensor holds it
        (_send)."""
        if old is None:
            return self._send(host, non_blocking, None)
        self._plan = None
        return self._send(host, non_blocking, _into(old, host))

    def _bound(self, inputs: tuple, options: tuple, lse_p: bool, lse_d: bool, full):
        """run() without scales or custom masks as a bound launch (op_call.bound_run):
        full() returns ((out_p, out_d), (lse_p, lse_d))."""
        if self._plan is None:
            return full()  # (raises: run() before plan())
        out_p, out_d, l_p, l_d = bound_run(
            self._memo, inputs, options, lambda: tuple(x for pair in full() for x in pair),
            discard=(() if lse_p else (2,)) + (() if lse_d else (3,)))
        if lse_p or lse_d:
            return (out_p, out_d), (l_p if lse_p else None, l_d if lse_d else None)
        return out_p, out_d

    def _alibi(self, p: dict, pos: int):
        """The ALiBi slopes [Hq] float32 that a launch of position encoding ``pos`` passes:
        the plan's (None where it has none and pos is not ALiBi). A run() that asks for ALiBi
        on a plan without it (POD's pos_encoding_mode_p / _d) takes the plan's alibi_run,
        made when it planned (_run_slopes): a run() may be captured by a CUDA graph, where a
        copy from the host would not run (and the graph would keep a host buffer)."""
        if pos != POS_ALIBI or p["alibi"] is not None:
            return p["alibi"]
        return p["alibi_run"]

    def _capturing(self) -> bool:
        """Whether a CUDA graph captures this (eager) call."""
        return capturing(self.device)

    def _launches(self, p, traced: bool, works: tuple, eager_side, eager_apart) -> tuple:
        """_call's (side, apart): the decodes' programs where the parts run side by side (an
        untraced CUDA call asks eager_side(): _side), else 0; the parts' own work lists
        ``works`` where they run as two launches (side by side, or apart: _apart_works), else
        None."""
        side = 0 if traced or self.device.type != "cuda" or not untraced() else eager_side()
        return side, works if side else _apart_works(p, traced, works, eager_apart)

    def _check_plan(self):
        if self._plan is None:
            raise RuntimeError("run() before plan(): call plan(...) with the page table first")
        return self._plan

    def _check_q(self, name, q, rows, p, rows_what, indptr=None):
        """q [rows, Hq, head_dim] of the plan; rows None: any (POD's prefill part), unless
        indptr names the plan's indptr whose last entry the rows must be (BatchPOD): then rows
        is its host count, None while traced (V.rows_match checks the device copy)."""
        V.check_tensor(name, q, ndim=3, device=self.device, what="[rows, Hq, head_dim]")
        if indptr is not None:
            rows_ok = V.rows_match(name, q.shape[0], indptr, p[indptr], rows)
        else:
            rows_ok = rows is None or q.shape[0] == rows
        if not rows_ok or tuple(q.shape[1:]) != (p["num_qo_heads"], p["head_dim"]):
            shown = rows if rows is not None else "*" if indptr is None else rows_what
            want = f"[{shown}, {p['num_qo_heads']}, {p['head_dim']}]"
            raise ValueError(f"{name}: shape {tuple(q.shape)} does not match the plan: {want} "
                             f"({rows_what}, num_qo_heads, head_dim)")
        if q.dtype != p["q_dtype"]:
            raise TypeError(f"{name}: dtype {q.dtype} but the plan has q_data_type="
                            f"{p['q_dtype']}; pass q_data_type={q.dtype} to plan()")

    def _check_cache(self, name, cache, p, suffix=""):
        """K and V of a paged cache argument, checked against the plan; suffix: that of the
        plan's page-table keys ("" for POD's decode batch, "_p" / "_d" for BatchPOD's)."""
        k, v = _paged_kv_views(cache, self._kv_layout, name)
        for part, t in (("k", k), ("v", v)):
            if t.dtype != p["kv_dtype"]:
                raise TypeError(f"{name} ({part}): dtype {t.dtype} but the plan has kv_data_type="
                                f"{p['kv_dtype']}; pass kv_data_type={t.dtype} to plan()")
            V.check_tensor(f"{name} ({part})", t, device=self.device)
            want = (p["page_size"], p["num_kv_heads"], p["head_dim"])
            if tuple(t.shape[1:]) != want or t.shape[0] != k.shape[0]:
                raise ValueError(f"{name} ({part}): logical NHD shape {tuple(t.shape)} does not "
                                 f"match the plan: [P, {want[0]}, {want[1]}, {want[2]}] "
                                 f"(page_size, num_kv_heads, head_dim; kv_layout="
                                 f"{self._kv_layout!r})")
        V.check_pages_in_cache(f"{name}'s page indices", p[f"max_page{suffix}"], k.shape[0],
                               name, p[f"kv_indices{suffix}"])
        return k, v

    def _call(self, p, part_p: tuple, part_d: tuple, *, work, packed_p, mask_indptr_p,
              opt_p: tuple, opt_d: tuple, rope: tuple, v_scale, want_lse: tuple, apart=None,
              cut=None, side: int = 0):
        """One POD launch. part_p / part_d: each part's (q, k, v, qo_indptr, kv_indptr,
        kv_indices, last_page_len) in the op's order; opt_p / opt_d: (mask mode, window_left,
        sm_scale); rope: (pos_encoding_mode, rope_scale, rope_theta), shared; want_lse: (prefill,
        decode). v_scale (decode only, as FlashInfer) multiplies out_d afterwards. apart: None,
        or the parts' own work lists (work_p, work_d), int32 [W_x, 2], to run them as two
        launches (ops.choose.pod_apart): the decodes through batch_paged_prefill on their own
        tile (p["block_m_d"]), the prefill through single_prefill where it is POD's one
        request with contiguous k / v (dense, work_p None, its own tile), else
        batch_paged_prefill on its own tile (p["block_m_p"]). cut: None, or (decode key chunks
        of the plan, the launch's work list over them): the decode part then runs as its chunk
        requests (_plan_chunks; each chunk row reading its request's row of q_d in place, the
        ops' row map), fused or apart, and their outputs are merged per request (_cut says
        when). side (with apart): the decodes' programs where the two launches run side by
        side (_side_by_side), 0 where one follows the other."""
        v_f, v_t = _split_v_scale(v_scale)
        alibi = self._alibi(p, rope[0])
        rows = merge = None  # the decodes' row map (the ops' q_rows) and merge rows, in chunks
        if cut is not None:
            chunks, cut_work = cut
            merge = chunks["merge"]
            q_d = part_d[0]
            rows = chunks["src"]
            part_d = (q_d, *part_d[1:3], chunks["qo_indptr"], chunks["kv_indptr"], part_d[5],
                      chunks["last_page_len"])
            if apart is None:
                work = cut_work
            else:
                apart = (apart[0], cut_work)
        if apart is None:
            out_p, lse_p, out_d, lse_d = call_op(
                "pod_prefill_decode", *part_p, *part_d, work, packed_p, mask_indptr_p,
                alibi, p["block_m"], *opt_p, 0.0, *opt_d, 0.0, *rope, 1.0, part_p[0].dtype,
                q_rows_d=rows)
        else:
            tail = (0.0, *rope, 1.0, part_p[0].dtype)  # soft cap, position encoding, v_scale
            work_p, work_d = apart

            def prefill():
                if work_p is None:
                    q, k, v = part_p[:3]
                    o, lse = call_op("single_prefill", q.unsqueeze(0), k, v, packed_p, alibi,
                                     None, opt_p[0], opt_p[1], 0, opt_p[2], *tail)
                    return o[0], lse[0]
                return call_op("batch_paged_prefill", *part_p, work_p, packed_p, mask_indptr_p,
                               alibi, None, p["block_m_p"], opt_p[0], opt_p[1], 0, opt_p[2],
                               *tail)

            def decode():
                o, lse = call_op("batch_paged_prefill", *part_d, work_d, None, None, alibi,
                                 None, p["block_m_d"], opt_d[0], opt_d[1], 0, opt_d[2], *tail,
                                 q_rows=rows)
                if merge is not None:  # the chunks' outputs, merged per request
                    o, lse = _merged(o, lse, merge, q_d.shape[0])
                return o, lse

            if side:
                (out_p, lse_p), (out_d, lse_d) = _side_by_side(prefill, decode, side,
                                                               part_d[0].device)
            else:
                out_p, lse_p = prefill()
                out_d, lse_d = decode()
        if apart is None and merge is not None:  # the chunks' outputs, merged per request
            out_d, lse_d = _merged(out_d, lse_d, merge, q_d.shape[0])
        if v_f != 1.0 or v_t is not None:
            ct = torch.float64 if out_d.dtype == torch.float64 else torch.float32
            scale = v_t.to(ct) if v_t is not None else v_f
            out_d = (out_d.to(ct) * scale).to(out_d.dtype)
        want_lse_p, want_lse_d = want_lse
        if want_lse_p or want_lse_d:
            return (out_p, out_d), (lse_p if want_lse_p else None, lse_d if want_lse_d else None)
        return out_p, out_d


# ALiBi slopes by (heads, device), made at plan time (a run() may be captured by a CUDA graph,
# where a copy from the host would not run); read only, kept for the process (a few floats
# each).
_run_slopes = functools.cache(get_alibi_slopes)

# The plan() arguments PlanOptions.of_pod and _PODBase._plan_options read (both POD plans).
_OPTION_ARGS = ("num_qo_heads", "num_kv_heads", "head_dim", "page_size", "pos_encoding_mode",
                "window_left", "q_data_type", "kv_data_type", "data_type", "sm_scale",
                "rope_scale", "rope_theta")


def _merged(out_d, lse_d, merge, requests: int):
    """Decode key chunks' outputs (each an op's output that the merge reads: scratch of a
    bound call) merged per request (ops.decode_chunks.merge_chunks)."""
    adopt_scratch(out_d)
    adopt_scratch(lse_d)
    return _chunks.merge_chunks(out_d, lse_d, merge, requests)


# A high-priority stream per thread and device for the decodes of POD calls run side by side
# (per thread: a stream one thread's CUDA-graph capture has joined must not take another
# thread's eager launches)
_SIDE_STREAMS = threading.local()


# the POD plans' values that a re-plan must keep as the same objects to launch alike
# (same_launches): tensors, the chunk dicts, and the decodes' host rows (part_rows_d: the same
# tuple while the decodes' host lists are, _decode_lists)
_SAME_OBJECT = (torch.Tensor, dict, tuple)


def _into(old: dict, names) -> dict:
    """to_device's ``into`` from the last plan ``old`` for the arrays ``names`` (in the order
    the plan wrote them, as old's fields): old's tensors by those names, each object once (an
    alias, e.g. a work list that is also the decodes' own, is written under its first name
    alone)."""
    seen = set()
    out = {}
    for k in names:
        t = old.get(k)
        if isinstance(t, torch.Tensor) and id(t) not in seen:
            seen.add(id(t))
            out[k] = t
    return out


def _batch_choices(p: dict) -> tuple:
    """A BatchPOD plan's eager launch choices under the policy now, for either prefill mask:
    (side-by-side programs, apart) for causal False, then True."""
    return tuple((_side(p, p["pairs_p"][c], p["decode_bytes"], p["window_left"], p["pos"]),
                  _apart(p, p["pairs_p"][c], p["decode_bytes"], dense_prefill=False,
                         captured=False, fused_rows=p["work"].shape[0]))
                 for c in (False, True))


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    streams = getattr(_SIDE_STREAMS, "by_device", None)
    if streams is None:
        streams = _SIDE_STREAMS.by_device = {}
    side = streams.get(device)
    if side is None:
        side = streams[device] = torch.cuda.Stream(device, priority=-1)
    return side


def _side_by_side(prefill, decode, programs: int, device: torch.device):
    """prefill() and decode() (each launching one part, returning its (out, lse)) at once:
    the decodes first, on a high-priority stream forked from the current one, their
    persistent grid capped at ``programs`` (launch.programs_cap: one program a SM; on the
    64-row D 128 tile the swapped products or a deeper K / V ring), so that they hold those
    SMs while the prefill's tiles, launched next on the current stream, take the others and
    then every SM the decodes leave; the current stream then waits for both (also when a
    launch raises, so that a CUDA graph's capture stays joined). Eagerly, that is: a CUDA
    graph's two branches run in no set order and without the streams' priorities. The
    decodes' outputs, made on the side stream, are marked used on the current one
    (record_stream; not while a CUDA graph captures the call, whose pool reuses a block only
    on its own stream, after a wait on the current one). The fork and join are
    launch.two_streams', so that a bound call replays the two streams (its replay allocates
    every output on the current stream)."""
    cur = torch.cuda.current_stream(device)
    with two_streams(_side_stream, device) as side:
        with torch.cuda.stream(side), programs_cap(programs):
            dec = decode()
        pre = prefill()
    if not capturing(device):
        for t in dec:
            t.record_stream(cur)
    return pre, dec


def _side(p: dict, pairs, decode_bytes, window_d: int = -1, pos: int = POS_NONE, *,
          dense_prefill: bool = False) -> int:
    """choose.pod_side for a call (prefill of ``pairs`` query-key pairs, decodes reading
    ``decode_bytes``; window_d, pos: the run's decode window and position encoding) of a plan
    whose decodes' own launch is the Gluon kernel's persistent 64-row launch (pages read by
    TMA boxes or gathered), where the run's options keep it there (no window, no position
    encoding); 0 otherwise, or with an empty part. dense_prefill: the prefill reads contiguous
    k / v (POD's), which the plan's fused launch may gather (p["fused_gathers"]). Asked of a
    CUDA wrapper's untraced calls (and of CPU-planned wrappers by
    benchmarks.pod.launch_plan)."""
    if pairs <= 0 or decode_bytes <= 0 or window_d >= 0 or pos != POS_NONE:
        return 0
    return choose.pod_side(4.0 * p["num_qo_heads"] * p["head_dim"] * pairs, decode_bytes,
                           gluon_64=p["fused_gluon"] and p["block_m_d"] == 64,
                           dense_gathers=dense_prefill and p["fused_gathers"])


def _pairs(qo_len: int, kv_len: int, causal: bool) -> int:
    """Query-key pairs a request computes: all, or under the bottom-right causal mask (row i
    sees kv_len - qo_len + 1 + i keys, clamped to [0, kv_len])."""
    if not causal:
        return qo_len * kv_len
    first = kv_len - qo_len + 1  # the keys row 0 sees
    if first >= 1:
        return qo_len * first + qo_len * (qo_len - 1) // 2
    return kv_len * (kv_len + 1) // 2  # rows before -first see none


def _decode_bytes(p: dict, pages: int) -> int:
    """The K and V bytes a part reads from ``pages`` whole pages of the plan's cache."""
    per_key = p["num_kv_heads"] * p["head_dim"] * 2 * p["kv_dtype"].itemsize
    return pages * p["page_size"] * per_key


def _chunks_exact(p: dict) -> bool:
    """Whether decode key chunks compute plan p's decodes exactly (ops.decode_chunks.exact;
    POD's decode part takes no custom mask, soft cap or sinks)."""
    return _chunks.exact(custom_mask=False, window_left=p["window_left"],
                         pos_encoding_mode=p["pos"], logits_soft_cap=0.0, sinks=None,
                         dtypes=(p["q_dtype"], p["kv_dtype"]))


# The plan's key-chunk entries: (key, for the decodes' own launch apart)
_CHUNK_KEYS = (("chunks", False), ("chunks_apart", True))


def _chunk_tile(p: dict, apart: bool) -> int:
    """The tile height of the launch that runs plan p's decode chunks: the decodes' own
    (block_m_d) apart, the fused launch's (block_m) else."""
    return p["block_m_d"] if apart else p["block_m"]


def _chunk_sms(p: dict, apart: bool) -> int:
    """The SMs plan p's decode key chunks are planned for (0: never cut), by the plan's
    options alone: for the fused launch (ops.choose.pod_chunk_sms) or the decodes' own launch
    apart (choose.decode_chunk_sms on their tile, block_m_d), where the chunks compute the
    decodes exactly (_chunks_exact)."""
    if not _chunks_exact(p):
        return 0
    # (the plan's device, as pod_tile's)
    return (choose.decode_chunk_sms(p["page_size"], p["head_dim"], p["head_dim"],
                                    _chunk_tile(p, apart), p["kv_dtype"], plain=True) if apart
            else choose.pod_chunk_sms(p["fused_gluon"]))


def _chunk_count(p: dict, qo_l: list, kv_lens: list, apart: bool,
                 sms: int | None = None) -> tuple[int, int, int]:
    """(chunks a request, the SMs they are planned for, the launch's tile height) for plan p's
    decodes, 0 chunks where they are not cut (_plan_chunks says when); sms: _chunk_sms's
    answer where the caller has it."""
    sms = _chunk_sms(p, apart) if sms is None else sms
    n = sms and planned_chunk_count(qo_l, kv_lens, p["num_kv_heads"], sms, pod_fused=not apart)
    return n, sms, _chunk_tile(p, apart)


# A CUDA-graph POD plan's chunk arrays that depend on its batch size and chunk count alone
# (build_decode_chunks' pad over one-row requests): every re-plan checks them on the host.
_GRAPH_FIXED = ("qo_indptr", "src", "merge")


def _chunk_tensors(p: dict, qo_h, ind_h, last_h, n: int, block_m: int,
                   device: torch.device, *, pad: bool = False, non_blocking: bool = True,
                   send=None) -> dict:
    """The chunk requests of plan p's decodes cut into n chunks a request
    (schedule.build_decode_chunks; pad: exactly n each) as device tensors: qo_indptr,
    kv_indptr, last_page_len, src, merge, and work (their work list on the launch's tile
    block_m, int32 [W, 2]); non_blocking: plan()'s, for the copies; send: _chunk_device's."""
    c = build_decode_chunks(qo_h.tolist(), ind_h.tolist(), last_h.tolist(), p["page_size"], n,
                            pad=pad)
    return _chunk_device(p, c, block_m, device, non_blocking, send)


# the chunk requests' device arrays (_chunk_device)
_CHUNK_ARRAYS = ("qo_indptr", "kv_indptr", "last_page_len", "src", "merge", "work")


def _chunk_device(p: dict, c: dict, block_m: int, device: torch.device,
                  non_blocking: bool = True, send=None) -> dict:
    """_chunk_tensors' device tensors of chunk requests c (schedule.build_decode_chunks), and
    part_rows, their work list's rows in a POD work list (_part_rows). send: where given,
    send(host arrays) -> device tensors in their place (a wrapper's copies into its last
    plan's chunk tensors, _PODBase._send_chunks); else new tensors."""
    rows = (c["qo_indptr"][1:] - c["qo_indptr"][:-1]).tolist()
    host = {k: c[k] for k in _CHUNK_ARRAYS[:-1]}
    host["work"] = build_work(rows, p["group"], block_m, "cpu")
    dev = to_device(host, device, non_blocking) if send is None else send(host)
    return dict(dev, part_rows=_part_rows(host["work"]))


def _plan_chunks(p: dict, qo_h: torch.Tensor, ind_h: torch.Tensor, last_h: torch.Tensor,
                 qo_l: list, kv_lens: list, device: torch.device, *,
                 apart: bool, non_blocking: bool = True, sms: int | None = None,
                 send=None) -> dict | None:
    """The decode part's key chunks of a POD plan p, or None: each request's pages cut into
    one-row chunk requests over the same page table (schedule.build_decode_chunks), whose
    outputs run() merges (_call's cut), in as many chunks as schedule.planned_chunk_count
    gives. For the fused launch (apart False): where few one-row requests would leave most of
    its resident slots to the prefill (ops.choose.pod_chunk_sms), so that their items even out
    the prefill's tail. For the decodes' own launch when the parts run apart (apart True):
    where a paged call of them alone would cut them (choose.decode_chunk_sms on their own
    tile, block_m_d; the paged plan's rule), so that apart runs each part as a call of it
    alone would. Only where the chunks compute the decodes exactly (_chunks_exact).
    qo_h / ind_h / last_h: the decode part's host index arrays [B + 1] / [B + 1] / [B]; qo_l /
    kv_lens: its query rows and keys per request. The dict holds _chunk_tensors' device
    arrays and the numbers choose.pod_cut reads (sms, longest). sms: _chunk_sms's answer
    where the caller has it; send: _chunk_device's."""
    n, sms, block_m = _chunk_count(p, qo_l, kv_lens, apart, sms)
    if not n:
        return None
    return dict(_chunk_tensors(p, qo_h, ind_h, last_h, n, block_m, device,
                               non_blocking=non_blocking, send=send), sms=sms,
                longest=max(kv_lens, default=0))


def _kept_chunks(old: dict | None, new: dict | None) -> dict | None:
    """new (a plan's chunks, _plan_chunks'), or the last plan's chunk dict ``old`` where new
    launches as it: its device tensors are old's (written anew), its work list's rows and SM
    count are old's, and its longest decode is on the same side of choose.pod_cut's bound.
    old then takes new's longest (old's plan is retired), and a re-plan of a decode step whose
    keys grew keeps the same dict, so its plan launches as the last one (_launches_as: a dict
    is compared as the same object) and keeps the calls bound to it."""
    if (old is None or new is None or new["sms"] != old["sms"]
            or any(new[k] is not old[k] for k in _CHUNK_ARRAYS)
            or not torch.equal(new["part_rows"][0], old["part_rows"][0])
            or choose.pod_cut_long(new["longest"]) != choose.pod_cut_long(old["longest"])):
        return new
    old["longest"] = new["longest"]
    return old


def _prefill_tiles(p: dict, qo_len: int) -> int:
    """The fused launch's work rows for POD's prefill request of qo_len rows (one KV head's)."""
    return -(-qo_len * p["group"] // p["block_m"])


def _chunks_for(p: dict, apart: bool, prefill_tiles: int, window_d: int = -1,
                pos: int = POS_NONE) -> dict | None:
    """The decode key chunks (_plan_chunks) that a launch of plan p runs, by the plan and the
    options alone, or None: the plan's for the launch (apart: the parts as two launches),
    where the call's options keep them exact (pos: the launch's position encoding; window_d:
    the decodes' window) and, fused, the launch's items ask for them (ops.choose.pod_cut;
    prefill_tiles: the prefill's work rows, each times the KV heads)."""
    c = p.get("chunks_apart" if apart else "chunks")
    if c is None or window_d >= 0 or pos != POS_NONE:
        return None
    if apart or choose.pod_cut(prefill_tiles * p["num_kv_heads"], c["longest"], c["sms"]):
        return c
    return None


def _cut(p: dict, apart: bool, prefill_tiles: int, window_d: int, pos: int,
         tensors: tuple) -> dict | None:
    """_chunks_for's chunks where the call can run them: eager on plain tensors (``tensors``:
    q_p, q_d and the caches; the merge is a direct launch, and the row map reads q_d's rows
    with its strides)."""
    c = _chunks_for(p, apart, prefill_tiles, window_d, pos)
    if c is None or not (untraced() and plain_tensors(tensors)):
        return None
    return c


def _decode_ring(p: dict, requests: int) -> bool:
    """Whether the decode part's own launch (apart: work_d_apart over its ``requests``, or the
    chunk requests of chunks_apart) reads faster in at most one program a SM (the few-programs
    ring or the swapped products: ops.choose.few_programs_ring), for choose.pod_apart."""
    c = p["chunks_apart"]
    items, requests = ((c["work"].shape[0], c["qo_indptr"].shape[0] - 1) if c is not None
                       else (p["work_d_apart"].shape[0], requests))
    return choose.few_programs_ring(p["block_m_d"], p["head_dim"], items, p["num_kv_heads"],
                                    requests)


def _apart(p: dict, pairs, decode_bytes, *, dense_prefill: bool, fused_rows: int,
           captured: bool = False) -> bool:
    """ops.choose.pod_apart for a prefill part of ``pairs`` query-key pairs (4 Hq D FLOPs
    each) and decodes reading ``decode_bytes``; an empty part stays in the fused launch, where
    it costs nothing. dense_prefill: the prefill alone reads contiguous k / v on its own tiles
    (POD's), so the fused launch slows it, more where it gathers both parts
    (p["fused_gathers"]); BatchPOD's prefill alone reads the same pages as the fused launch.
    captured: a CUDA graph captures the call; fused_rows: the fused launch's work rows before
    any decode key chunks (both parts', each times the KV heads).
    (Traced calls ask _traced_apart instead: the plan's numbers would be guards, a recompile
    per re-plan, and a trace's sizes may be symbolic.)"""
    if pairs <= 0 or decode_bytes <= 0:
        return False
    return choose.pod_apart(4.0 * p["num_qo_heads"] * p["head_dim"] * pairs, decode_bytes,
                            gluon=p["fused_gluon"], dense_prefill=dense_prefill,
                            fused_gathers=p["fused_gathers"], decode_ring=p["decode_ring"],
                            captured=captured, over_wave=captured and choose.pod_over_wave(
                                fused_rows * p["num_kv_heads"], p["block_m"]))


def _traced_apart(p: dict) -> bool:
    """Whether a call traced by torch.compile runs its parts as two launches: where an eager
    call would whatever its sizes (ops.choose.pod_apart_any_size: the fused launch would not be
    the Gluon kernel's), so that the compiled call runs what the eager one does (each part's
    op kept opaque for the Gluon kernel where its eager launch takes it: ops.dispatch). Never
    under torch.export: its program, and an AOTInductor package made from it, keep one POD
    op (the Triton POD launch)."""
    return (not V.exporting()
            and choose.pod_apart_any_size(p["fused_gluon"]) is True)


def _apart_works(p: dict, traced: bool, works: tuple, eager_apart) -> tuple | None:
    """_call's ``apart``: the parts' own work lists ``works`` where the call runs them as two
    launches, else None. A traced call asks _traced_apart (no sizes, no guards), an eager one
    eager_apart() (its sizes: _apart)."""
    return works if (_traced_apart(p) if traced else eager_apart()) else None


def _host_part(p: dict, qo_len: int, kv_len: int, mask_bytes: int | None,
               device: torch.device) -> dict:
    """PODWithPagedKVCacheWrapper._prefill_part's dict for an eager call, its arrays built on
    the host and written to the device in one copy (as device ops they were ~20 small
    launches, ~300 us of a serving step's host time for each new prefill length), each a view
    of that copy (an eager call's own: a trace or a capture builds its own by device ops). The
    decodes' rows of the two work lists are the plan's (_part_rows)."""
    has_kv = 1 if kv_len > 0 else 0
    head = [0, qo_len, 0, has_kv, *([0] * has_kv), kv_len]
    if mask_bytes is not None:
        head += [0, mask_bytes]
    n = len(head)
    for row in range(0, qo_len * p["group"], p["block_m"]):  # (_pod_work's prefill rows)
        head += (0, 0, row)
    h = int32_host(head)
    pre = h[n:]  # (each work list: the prefill's rows, then the decodes' rows of the plan)
    c = p["chunks"]
    decodes = [p["part_rows_d"][0]] + ([] if c is None else [c["part_rows"][0]])
    # (non_blocking: a blocking copy from the host would wait for every launch queued on the
    # stream, the step's earlier layers; from pageable memory the copy has read the array
    # when it returns)
    flat = torch.cat([h[:n], *(x for d in decodes for x in (pre, d))])
    flat = flat.to(device, non_blocking=True)
    views = flat.split(
        [2, 2, has_kv, 1, n - 5 - has_kv, *(pre.numel() + d.numel() for d in decodes)])
    qo, kv, idx, last, mask = views[:5]
    if not has_kv:  # (its own: an empty view would share the next one's pointer)
        idx = torch.empty(0, dtype=torch.int32, device=device)
    work = [v.view(-1, 3) for v in views[5:]]
    return dict(table=(qo, kv, idx, last), mask_indptr=mask if mask_bytes is not None else None,
                work=work[0], work_cut=work[1] if c is not None else None,
                flat=flat)


def _part_rows(work: torch.Tensor) -> tuple:
    """The decode rows of POD work lists (_pod_work's part 1) from the decodes' host work list
    ``work`` [W, 2], flat int32 [3 W], in a tuple (plan values: the memo keys no tensor of
    it)."""
    return (torch.cat([torch.ones_like(work[:, :1]), work], 1).reshape(-1),)


def _pod_work(prefill: torch.Tensor, decode: torch.Tensor | None = None, *,
              rows: torch.Tensor | None = None) -> torch.Tensor:
    """[W, 3] = (part, request, first packed row) from the two parts' [W_x, 2] lists (or the
    decodes' rows already so, rows: _part_rows' flat tensor), the prefill's rows first
    (interleaving the parts in proportion measured the same or up to 4% slower on the H200:
    benchmarks/NOTES.md, 2026-11-27, POD's work order)."""
    part_p = torch.zeros_like(prefill[:, :1])
    if rows is None:
        rows = _part_rows(decode)[0]
    return torch.cat([torch.cat([part_p, prefill], 1), rows.view(-1, 3)], 0)


def _decode_mask(mask_p: int, mask_d: int, single_rows: bool) -> int:
    """The decode part's mask mode for the launch: the prefill's where every decode request has
    at most one query row (that row, its request's last position, sees every key with or
    without a causal mask) and the prefill's is causal or none, so that one launch serves both
    parts with one mask (ops.choose.pod_gluon); else its own."""
    if single_rows and mask_p in (MASK_NONE, MASK_CAUSAL) and mask_d in (MASK_NONE, MASK_CAUSAL):
        return mask_p
    return mask_d


class PODWithPagedKVCacheWrapper(_PODBase):
    """One prefill request (contiguous k/v given at run) plus a planned batch of decode
    requests (one query row each) on a paged cache, in one launch."""

    # the largest page index, checked against the cache before any replay (_pages_fit). The
    # decodes' bytes stay compared: run()'s launch choices read them with the run's prefill.
    # (the decodes' bytes: run()'s choices read them, and its bound calls key the choices,
    # _launch_class)
    _PLAN_ONLY = frozenset({"max_page", "decode_bytes"})
    _FREE = (1, 2)  # k_p, v_p: a chunked prefill's keys grow every step

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD",
                 use_cuda_graph: bool = False,
                 paged_kv_indptr_buffer: torch.Tensor | None = None,
                 paged_kv_indices_buffer: torch.Tensor | None = None,
                 paged_kv_last_page_len_buffer: torch.Tensor | None = None,
                 jit_args=None) -> None:
        """float_workspace_buffer: a tensor on the device the wrapper runs on. kv_layout of the
        decode cache: "NHD"/"HND". use_cuda_graph: fixed decode batch size B, with int32
        buffers paged_kv_indptr_buffer ``[B+1]``, paged_kv_indices_buffer ``[max pages]``,
        paged_kv_last_page_len_buffer ``[B]`` that plan() copies into. jit_args raises
        NotImplementedError."""
        V.reject_if_set("jit_args", jit_args, "custom JIT attention variants are not supported")
        self._init_common(float_workspace_buffer, kv_layout)
        self._use_cuda_graph = bool(use_cuda_graph)
        self._bufs = None
        # CUDA-graph mode: {"chunks" / "chunks_apart": (apart, chunks a request, SMs, tile, the
        # chunk tensors every re-plan writes, the host arrays every re-plan must equal)},
        # decided at the first plan (_plan_graph_chunks)
        self._graph_chunks = None
        self._graph_shapes = None  # (Hq, Hkv, D) of the first CUDA-graph plan
        self._lists = None  # (key, the decodes' host arrays) of the last plan: _decode_lists
        # device tensors of our own that a captured CUDA graph reads at every replay (see
        # _prefill_part): kept for the wrapper's life, past re-plans
        self._captured = []
        if self._use_cuda_graph:
            bufs = dict(paged_kv_indptr_buffer=paged_kv_indptr_buffer,
                        paged_kv_indices_buffer=paged_kv_indices_buffer,
                        paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer)
            for name, buf in bufs.items():
                if not torch.is_tensor(buf):
                    raise ValueError(f"{name}: use_cuda_graph=True needs this int32 buffer")
                V.check_tensor(name, buf, ndim=1, dtypes=(torch.int32,), device=self.device)
            b = paged_kv_last_page_len_buffer.numel()
            if paged_kv_indptr_buffer.numel() != b + 1:
                raise ValueError(f"paged_kv_indptr_buffer: has {paged_kv_indptr_buffer.numel()} "
                                 f"entries but batch size {b} (paged_kv_last_page_len_buffer) "
                                 f"needs {b + 1}")
            self._fixed_batch_size = b
            self._bufs = bufs

    def plan(self, indptr: torch.Tensor, indices: torch.Tensor, last_page_len: torch.Tensor,
             num_qo_heads: int, num_kv_heads: int, head_dim: int, page_size: int,
             pos_encoding_mode: str = "NONE", window_left: int = -1, q_data_type=None,
             kv_data_type=None, data_type=None, sm_scale: float | None = None,
             rope_scale: float | None = None, rope_theta: float | None = None,
             non_blocking: bool = True) -> None:
        """Plan the decode batch: indptr ``[B+1]`` (pages per request), indices
        ``[>= indptr[-1]]`` (a longer pre-allocated buffer: entries past indptr[-1] are not
        read), last_page_len ``[B]`` (integer, CPU or GPU; read on the host). The
        options (pos_encoding_mode, window_left, sm_scale, rope_*) are the decode part's;
        data_type is FlashInfer's deprecated alias for q_data_type and kv_data_type."""
        args = dict(locals())  # the arguments by FlashInfer name, for _plan_options
        b = (last_page_len.shape[0] if torch.is_tensor(last_page_len)
             and last_page_len.dim() == 1 else None)  # (else V.page_table names its shape)
        ind_h, idx_h, last_h, kv_lens, max_page = V.page_table(
            ("indptr", "indices", "last_page_len"), indptr, indices, last_page_len, page_size,
            length=None if b is None else b + 1,
            length_from=None if b is None else f"last_page_len's {b} entries",
            hosts=gather_host(indptr, indices, last_page_len))
        b = ind_h.numel() - 1
        p = self._plan_options(args)
        # (the decodes' work lists built on the host: on the device each was five small
        # launches; every host array goes to the device as one int32 copy, _host.to_device)
        rows = [1] * b  # (a decode is a one-row request)
        # the decodes' own tile when they run as a launch of their own (pod_apart)
        p["block_m_d"] = self._decode_tile(p, rows)
        qo_h, work_d, work_d_apart, p["part_rows_d"] = self._decode_lists(b, p)
        host = dict(qo_indptr=qo_h, work_d=work_d, work_d_apart=work_d_apart)
        if self._use_cuda_graph:
            if b != self._fixed_batch_size:
                raise ValueError(f"last_page_len: batch size {b} differs from the "
                                 f"{self._fixed_batch_size} the CUDA-graph buffers were made for")
            shapes = (p["num_qo_heads"], p["num_kv_heads"], p["head_dim"])
            if self._graph_shapes not in (None, shapes):
                raise ValueError("num_qo_heads / num_kv_heads / head_dim changed since the first "
                                 "plan in CUDA-graph mode (its decode chunks and captured "
                                 "launches are for those); create a new wrapper for new shapes")
            nb = self._bufs["paged_kv_indices_buffer"]
            if idx_h.numel() > nb.numel():
                raise ValueError(f"paged_kv_indices_buffer: holds {nb.numel()} entries but this "
                                 f"plan needs {idx_h.numel()}; allocate a larger buffer")
            self._graph_shapes = shapes  # (after the checks: a failed first plan fixes none)
            self._bufs["paged_kv_indptr_buffer"].copy_(ind_h, non_blocking=non_blocking)
            self._bufs["paged_kv_last_page_len_buffer"].copy_(last_h, non_blocking=non_blocking)
            nb[:idx_h.numel()].copy_(idx_h, non_blocking=non_blocking)
            nb[idx_h.numel():].fill_(0)  # a valid page: entries past indptr[-1] are never used
            p.update(kv_indptr=self._bufs["paged_kv_indptr_buffer"], kv_indices=nb,
                     last_page_len=self._bufs["paged_kv_last_page_len_buffer"])
        else:
            # (a table with room past the last plan's, so that growing requests keep its
            # tensor)
            old = self._plan
            idx_h = table_with_room(idx_h, None if old is None else old["kv_indices"].numel(),
                                    b, page_size)
            host.update(kv_indptr=ind_h, kv_indices=idx_h, last_page_len=last_h)
        # (outside CUDA-graph mode, into the last plan's tensors where shapes match, so that a
        # re-plan of the same shapes keeps its bound launches: _set_plan)
        old = None if self._use_cuda_graph else self._plan
        p.update(self._to_device(host, non_blocking, old))
        if p["work_d_apart"] is None:
            p["work_d_apart"] = p["work_d"]
        p.update(batch_size=b, max_page=max_page)
        p["decode_bytes"] = _decode_bytes(p, int(ind_h[-1]))
        p["chunks"] = p["chunks_apart"] = None
        qo_h = host["qo_indptr"]
        if self._use_cuda_graph:
            self._plan_graph_chunks(p, qo_h, ind_h, last_h, kv_lens, non_blocking)
        else:
            self._plan_both_chunks(p, qo_h, ind_h, last_h, rows, kv_lens, non_blocking, old)
        p["decode_ring"] = _decode_ring(p, b)
        self._set_plan(p, old)

    def _decode_lists(self, b: int, p: dict) -> tuple:
        """The host arrays of b one-row decodes on plan p's tiles: (qo_indptr, work_d,
        work_d_apart or None where the decodes' own tile is the fused launch's, the decodes'
        rows of the prefill parts' work lists: _part_rows). They depend on b and the tiles
        alone, so the last plan's are reused (never written: a copy from them has read them
        when it returns)."""
        key = (b, p["group"], p["block_m"], p["block_m_d"])
        if self._lists is None or self._lists[0] != key:
            rows = [1] * b
            work_d = build_work(rows, p["group"], p["block_m"], "cpu")
            apart = None if p["block_m_d"] == p["block_m"] else build_work(
                rows, p["group"], p["block_m_d"], "cpu")
            self._lists = (key, torch.arange(b + 1, dtype=torch.int32), work_d, apart,
                           _part_rows(work_d))
        return self._lists[1:]

    def _pages_fit(self, paged_kv_cache) -> bool:
        """Whether the plan's largest decode page index is inside the cache (pages_fit), or
        there is no plan."""
        return self._plan is None or pages_fit(self._plan["max_page"], paged_kv_cache)

    def _plan_graph_chunks(self, p: dict, qo_h, ind_h, last_h, kv_lens: list,
                           non_blocking: bool) -> None:
        """CUDA-graph mode's decode key chunks (p["chunks"], p["chunks_apart"]). The first plan
        decides for the wrapper, by _plan_chunks' rule on its lengths, into how many chunks
        each request is cut for the fused launch and for the decodes' own; every later plan
        cuts each request into exactly as many (schedule.build_decode_chunks' pad: the
        trailing chunks without pages) and writes the chunk requests' kv_indptr and
        last_page_len into the first plan's tensors. Their rows, source rows, merge rows and
        work lists depend on the batch size and the chunk count alone (each re-plan checks the
        first three on the host), so a captured run() reads every re-plan's chunks. A plan
        whose options the chunks do not compute exactly (_chunks_exact), or whose tile differs
        from the first plan's, runs uncut."""
        b = p["batch_size"]
        first = self._graph_chunks is None
        cut = {}  # chunk count -> this plan's chunk requests (both launches may share one)

        def chunks(n: int) -> dict:
            if n not in cut:
                cut[n] = build_decode_chunks(qo_h.tolist(), ind_h.tolist(), last_h.tolist(),
                                             p["page_size"], n, pad=True)
            return cut[n]

        if first:
            self._graph_chunks = {}
            for key, apart in _CHUNK_KEYS:
                n, sms, block_m = _chunk_count(p, [1] * b, kv_lens, apart)
                if n:
                    self._graph_chunks[key] = (apart, n, sms, block_m, _chunk_device(
                        p, chunks(n), block_m, self.device, non_blocking), chunks(n))
        for key, (apart, n, sms, block_m, bufs, fixed) in self._graph_chunks.items():
            if not first:
                c = chunks(n)
                for name in _GRAPH_FIXED:  # (host tensors: the invariant the captured run reads)
                    if not torch.equal(c[name], fixed[name]):
                        raise RuntimeError(f"POD CUDA-graph re-plan: the decode chunks' {name} "
                                           "differs from the first plan's (internal error)")
                for name in ("kv_indptr", "last_page_len"):
                    bufs[name].copy_(c[name], non_blocking=non_blocking)
            if _chunks_exact(p) and _chunk_tile(p, apart) == block_m:
                p[key] = dict(bufs, sms=sms, longest=max(kv_lens, default=0))

    begin_forward = plan

    def run(self, q_p: torch.Tensor, k_p: torch.Tensor, v_p: torch.Tensor, q_d: torch.Tensor,
            paged_kv_cache_d, custom_mask_p: torch.Tensor | None = None,
            packed_custom_mask_p: torch.Tensor | None = None, causal_p: bool = False,
            kv_layout_p: str = "NHD", pos_encoding_mode_p: str = "NONE",
            sm_scale_p: float | None = None, window_left_p: int = -1,
            rope_scale_p: float | None = None, rope_theta_p: float | None = None,
            return_lse_p: bool = False, custom_mask_d: torch.Tensor | None = None,
            packed_custom_mask_d: torch.Tensor | None = None, causal_d: bool = False,
            kv_layout_d: str | None = None, pos_encoding_mode_d: str | None = None,
            sm_scale_d: float | None = None, window_left_d: int | None = None,
            rope_scale_d: float | None = None, rope_theta_d: float | None = None,
            q_scale=None, k_scale=None, v_scale=None, return_lse_d: bool = False,
            use_fp16_qk_reduction: bool = False, enable_pdl: bool | None = None, *args):
        """Prefill q_p ``[qo_len, Hq, D]`` against k_p / v_p ``[kv_len, Hkv, D]`` (kv_layout_p
        "NHD") or ``[Hkv, kv_len, D]`` ("HND") with the _p options (as
        single_prefill_with_kv_cache: causal raises when kv_len < qo_len; custom_mask_p bool
        ``[qo_len, kv_len]`` or packed_custom_mask_p little-endian uint8), and decode q_d
        ``[B, Hq, D]`` against paged_kv_cache_d (a 5-D tensor or (k, v) tuple in the wrapper's
        kv_layout). Decode options left None take the plan's values; given, they take effect
        (FlashInfer ignores them). kv_layout_d, if given, must be the wrapper's layout.
        q_scale / k_scale multiply the decode sm_scale and v_scale the decode output, as in
        FlashInfer. Prefill and decode share one position encoding (mode, rope_scale,
        rope_theta): differing values raise NotImplementedError, as do custom_mask_d /
        packed_custom_mask_d, enable_pdl=True and extra positional args.
        use_fp16_qk_reduction is a permission (we reduce in fp32).
        """
        opts = (causal_p, kv_layout_p, pos_encoding_mode_p, sm_scale_p, window_left_p,
                rope_scale_p, rope_theta_p, causal_d, kv_layout_d, pos_encoding_mode_d,
                sm_scale_d, window_left_d, rope_scale_d, rope_theta_d, use_fp16_qk_reduction)
        # (a replay skips run()'s checks: the largest page index, which the key does not hold,
        # against the cache's pages here, where a replay may follow; the full path raises
        # where it fails)
        if (not args and custom_mask_p is None and custom_mask_d is None
                and packed_custom_mask_d is None and q_scale is None and k_scale is None
                and v_scale is None and not enable_pdl and not torch.compiler.is_compiling()
                and self._pages_fit(paged_kv_cache_d)):
            # (the part an input and the launch class an option: a bound call then replays
            # for any key count of its class, Memo's free sizes)
            pc = self._bound_part(q_p, k_p, v_p, packed_custom_mask_p, opts)
        else:
            pc = None
        if pc is not None:
            return self._bound(
                (q_p, k_p, v_p, q_d, paged_kv_cache_d, packed_custom_mask_p, pc[0]),
                opts + (pc[1],), return_lse_p, return_lse_d,
                lambda: self._run(q_p, k_p, v_p, q_d, paged_kv_cache_d, opts,
                                  packed_custom_mask_p=packed_custom_mask_p, return_lse_p=True,
                                  return_lse_d=True))
        return self._run(q_p, k_p, v_p, q_d, paged_kv_cache_d, opts,
                         custom_mask_p=custom_mask_p, packed_custom_mask_p=packed_custom_mask_p,
                         return_lse_p=return_lse_p, custom_mask_d=custom_mask_d,
                         packed_custom_mask_d=packed_custom_mask_d, q_scale=q_scale,
                         k_scale=k_scale, v_scale=v_scale, return_lse_d=return_lse_d,
                         enable_pdl=enable_pdl, args=args)

    def _run(self, q_p, k_p, v_p, q_d, paged_kv_cache_d, opts: tuple, *,
             custom_mask_p=None, packed_custom_mask_p=None, return_lse_p=False,
             custom_mask_d=None, packed_custom_mask_d=None, q_scale=None, k_scale=None,
             v_scale=None, return_lse_d=False, enable_pdl=None, args=()):
        """run() with its per-part options bundled: opts holds the values of run()'s
        parameters causal_p ... rope_theta_p, causal_d ... rope_theta_d and
        use_fp16_qk_reduction, in the signature's order; args: run()'s extra positional
        arguments."""
        (causal_p, kv_layout_p, pos_encoding_mode_p, sm_scale_p, window_left_p, rope_scale_p,
         rope_theta_p, causal_d, kv_layout_d, pos_encoding_mode_d, sm_scale_d, window_left_d,
         rope_scale_d, rope_theta_d, use_fp16_qk_reduction) = opts
        p = self._check_plan()
        if args:
            V.unsupported("*args", "extra positional arguments are not supported")
        V.check_enable_pdl(enable_pdl)
        for name, val in (("custom_mask_d", custom_mask_d),
                          ("packed_custom_mask_d", packed_custom_mask_d)):
            V.reject_if_set(name, val, "a custom mask for the decode part is not supported")
        if kv_layout_d is not None and V.check_kv_layout(kv_layout_d, "kv_layout_d") != \
                self._kv_layout:
            raise ValueError(f"kv_layout_d: {kv_layout_d!r} differs from the wrapper's kv_layout "
                             f"{self._kv_layout!r}; the decode cache uses the wrapper's layout")
        # One position encoding for both parts (the op takes one).
        pos_p = V.check_pos_encoding_mode(pos_encoding_mode_p, "pos_encoding_mode_p")
        pos_d = (p["pos"] if pos_encoding_mode_d is None
                 else V.check_pos_encoding_mode(pos_encoding_mode_d, "pos_encoding_mode_d"))
        if pos_p != pos_d:
            V.unsupported("pos_encoding_mode_p", f"{pos_encoding_mode_p!r} differs from the decode "
                          "part's mode (plan's pos_encoding_mode / pos_encoding_mode_d); one "
                          "launch applies one position encoding: pass the same mode to both")
        V.check_rope_dim(p["head_dim"], pos_p)  # (a plan without RoPE did not check it)
        self._alibi(p, pos_p)  # (made before _prefill_part, whose capture keeps them alive)
        rs_p = V.check_scale("rope_scale_p", rope_scale_p, 1.0)
        rt_p = V.check_scale("rope_theta_p", rope_theta_p, 1e4)
        rs_d = V.check_scale("rope_scale_d", rope_scale_d, p["rope_scale"])
        rt_d = V.check_scale("rope_theta_d", rope_theta_d, p["rope_theta"])
        if pos_p == POS_ROPE_LLAMA and (rs_p, rt_p) != (rs_d, rt_d):
            V.unsupported("rope_scale_p / rope_theta_p", f"({rs_p}, {rt_p}) differ from the "
                          f"decode part's ({rs_d}, {rt_d}); one launch applies one RoPE")
        if not isinstance(use_fp16_qk_reduction, bool):
            raise TypeError("use_fp16_qk_reduction: pass a bool")

        # ---- prefill part: one request, contiguous k/v as a one-page cache ----------------
        layout_p = V.check_kv_layout(kv_layout_p, "kv_layout_p")
        self._check_q("q_p", q_p, None, p, "qo_len")
        kv_what = "[kv_len, Hkv, D]" if layout_p == "NHD" else "[Hkv, kv_len, D]"
        V.check_tensor("k_p", k_p, ndim=3, device=self.device, what=kv_what)
        V.check_tensor("v_p", v_p, ndim=3, device=self.device, what=kv_what)
        kn, vn = (k_p, v_p) if layout_p == "NHD" else (k_p.transpose(0, 1), v_p.transpose(0, 1))
        if tuple(kn.shape[1:]) != (p["num_kv_heads"], p["head_dim"]) or vn.shape != kn.shape:
            raise ValueError(f"k_p / v_p: shapes {tuple(k_p.shape)} / {tuple(v_p.shape)} do not "
                             f"match {kv_what} with Hkv={p['num_kv_heads']}, D={p['head_dim']} "
                             f"(kv_layout_p={layout_p!r})")
        for name, t in (("k_p", k_p), ("v_p", v_p)):
            if t.dtype != p["kv_dtype"]:
                raise TypeError(f"{name}: dtype {t.dtype} but the plan has kv_data_type="
                                f"{p['kv_dtype']}")
        qo_len, kv_len = q_p.shape[0], kn.shape[0]
        dev = self.device
        nbits = qo_len * kv_len
        packed_p = None
        if packed_custom_mask_p is not None:
            packed_custom_mask_p = V.mask_packed_length(
                "packed_custom_mask_p", packed_custom_mask_p, (nbits + 7) // 8,
                lambda: f"ceil(qo_len * kv_len / 8), qo_len={qo_len}, kv_len={kv_len}")
            V.check_tensor("packed_custom_mask_p", packed_custom_mask_p, device=dev)
            packed_p, mask_p = packed_custom_mask_p, MASK_CUSTOM
        elif custom_mask_p is not None:
            V.mask_bool_length("custom_mask_p", custom_mask_p, nbits,
                               lambda: f"qo_len * kv_len = {qo_len} * {kv_len}")
            V.check_tensor("custom_mask_p", custom_mask_p, device=dev)
            packed_p, mask_p = packbits(custom_mask_p, bitorder="little"), MASK_CUSTOM
        else:
            mask_p = MASK_CAUSAL if causal_p else MASK_NONE
            if causal_p and kv_len < qo_len:
                raise ValueError(f"causal_p=True needs kv_len >= qo_len for the prefill request; "
                                 f"got kv_len={kv_len} < qo_len={qo_len}")
        traced = V.traced()
        part = self._prefill_part(qo_len, kv_len,
                                  (nbits + 7) // 8 if packed_p is not None else None, traced)

        # ---- decode part ----------------------------------------------------------------------
        # (traced: the plan's decode qo_indptr checked on the device, so that the batch size is
        # no guard: a re-plan with another batch size reuses the graph)
        self._check_q("q_d", q_d, None if traced else p["batch_size"], p, "batch size",
                      indptr="qo_indptr")
        k_d, v_d = self._check_cache("paged_kv_cache_d", paged_kv_cache_d, p)
        sm_d = V.check_scale("sm_scale_d", sm_scale_d, p["sm_scale"], positive=False)
        sm_d = V.fits_float32("sm_scale_d * q_scale * k_scale", sm_d * V.host_scale(
            "q_scale", q_scale) * V.host_scale("k_scale", k_scale))
        window_d = p["window_left"] if window_left_d is None else V.check_window_left(
            window_left_d, "window_left_d")
        head_dim = p["head_dim"]
        opt_p = (mask_p, V.check_window_left(window_left_p, "window_left_p"),
                 V.check_scale("sm_scale_p", sm_scale_p, 1.0 / math.sqrt(head_dim),
                               positive=False))
        causal = mask_p == MASK_CAUSAL
        side, apart = self._launches(
            p, traced, (None, p["work_d_apart"]),
            lambda: self._launch_side(qo_len, kv_len, causal, window_d, pos_p),
            lambda: self._launch_apart(qo_len, kv_len, causal))
        c = None if traced else _cut(p, apart is not None, _prefill_tiles(p, qo_len), window_d,
                                     pos_p, (q_p, q_d, k_p, v_p, k_d, v_d))
        return self._call(
            p, (q_p, kn.unsqueeze(0), vn.unsqueeze(0), *part["table"]),
            (q_d, k_d, v_d, p["qo_indptr"], p["kv_indptr"], p["kv_indices"], p["last_page_len"]),
            work=part["work"], packed_p=packed_p, mask_indptr_p=part["mask_indptr"], opt_p=opt_p,
            opt_d=(_decode_mask(mask_p, MASK_CAUSAL if causal_d else MASK_NONE, True), window_d,
                   sm_d),
            rope=(pos_p, rs_p, rt_p), v_scale=v_scale, want_lse=(return_lse_p, return_lse_d),
            apart=apart, cut=None if c is None else (c, c["work"] if apart else part["work_cut"]),
            side=side)

    run.__doc__ += _RETURN_DOC

    def _launch_apart(self, qo_len: int, kv_len: int, causal: bool,
                      captured: bool | None = None) -> bool:
        """Whether an eager call with this prefill request runs the parts as two launches
        (ops.choose.pod_apart; captured: whether a CUDA graph captures it, by default asked of
        the current stream). Asked at every call, never kept with the part: it reads the
        launch policy, which a scoped override may change between calls."""
        p = self._plan
        return _apart(p, _pairs(qo_len, kv_len, causal), p["decode_bytes"], dense_prefill=True,
                      captured=self._capturing() if captured is None else captured,
                      fused_rows=_prefill_tiles(p, qo_len) + p["work_d"].shape[0])

    def _launch_side(self, qo_len: int, kv_len: int, causal: bool, window_d: int = -1,
                     pos: int = POS_NONE) -> int:
        """The decodes' programs where an eager or captured call with this prefill request
        (and the decodes' window and position encoding) runs the parts side by side (_side:
        ops.choose.pod_side), else 0. Asked at every call, as _launch_apart."""
        return _side(self._plan, _pairs(qo_len, kv_len, causal), self._plan["decode_bytes"],
                     window_d, pos, dense_prefill=True)

    def _eager_part(self, qo_len: int, kv_len: int, mask_bytes: int | None) -> dict:
        """_prefill_part's dict for an eager call (not captured), made once per (qo_len,
        kv_len, mask bytes) and kept, at most 64 (an engine's many lengths: then they start
        over, and the launch classes that name them with them; a bound call takes its part as
        an input, so none holds them)."""
        key = (qo_len, kv_len, mask_bytes)
        part = self._parts.get(key)
        if part is None:
            if len(self._parts) >= 64:
                self._parts.clear()
                self._classes.clear()
            part = self._parts[key] = _host_part(self._plan, qo_len, kv_len, mask_bytes,
                                                 self.device)
        return part

    def _launch_class(self, qo_len: int, kv_len: int, opts: tuple, masked: bool = False):
        """What a bound run() call's key holds of its prefill's key count (launch.Memo's
        free sizes leave k_p / v_p's out): the launch choices that read it (side by side,
        apart: _launch_side, _launch_apart, by the plan's decode bytes and the policy), the
        one-page size constexpr where the fused launch gathers pages (tiles.one_page_size),
        and whether there are keys. masked: the call passes a packed mask (then not causal,
        as in _run). None where the options do not parse (the full path raises)."""
        p = self._plan
        try:
            pos = V.check_pos_encoding_mode(opts[2], "pos_encoding_mode_p")
            window_d = (p["window_left"] if opts[11] is None
                        else V.check_window_left(opts[11], "window_left_d"))
            causal = bool(opts[0]) and not masked
            return (self._launch_side(qo_len, kv_len, causal, window_d, pos),
                    self._launch_apart(qo_len, kv_len, causal, captured=False),
                    one_page_size(kv_len) if p["fused_gathers"] else 0, kv_len > 0)
        except Exception:  # noqa: BLE001  (the full path names what is wrong)
            return None

    def _bound_part(self, q_p, k_p, v_p, packed_mask, opts: tuple):
        """(the prefill part's flat tensor, the launch class: _launch_class) that a bound
        run() call passes beside its tensors (its part an input: the key holds no key count),
        or None where the call takes the full path (no plan; not the plain tensors of an NHD
        call whose k_p and v_p have one key count; a capture, where no part is made). Kept per
        (sizes, options, policy version) until the next plan() or the parts' eviction
        (_eager_part)."""
        if (self._plan is None or type(q_p) is not torch.Tensor
                or type(k_p) is not torch.Tensor or type(v_p) is not torch.Tensor
                or q_p.dim() != 3 or k_p.dim() != 3 or v_p.shape != k_p.shape
                or opts[1] != "NHD"):
            return None
        qo_len, kv_len = q_p.shape[0], k_p.shape[0]
        masked = packed_mask is not None
        key = (qo_len, kv_len, opts[0], opts[2], opts[11], masked, policy_version())
        known = self._classes.get(key)
        if known is None:
            mask_bytes = (qo_len * kv_len + 7) // 8 if masked else None
            if (qo_len, kv_len, mask_bytes) not in self._parts and self._capturing():
                return None  # (a capture makes no eager part)
            part = self._eager_part(qo_len, kv_len, mask_bytes)
            cls = self._launch_class(qo_len, kv_len, opts, masked)
            if cls is None:
                return None
            known = self._classes[key] = (part["flat"], cls)
        return known

    def _prefill_part(self, qo_len: int, kv_len: int, mask_bytes: int | None, traced: bool):
        """The prefill request's device tensors, made once per (qo_len, kv_len, mask bytes)
        and kept: plain numbers decide them, and run() then launches no copy for them (the
        memo keys them by identity). A dict: "table" (qo indptr, kv indptr, one-page table,
        last page length), "mask_indptr" (or None) and "work" (the POD work list with the
        plan's decodes, p["work_d"]; "work_cut" the same over its decode key chunks). An eager
        call's are made on the host in one copy (_host_part); traced: V.traced() (a traced
        graph holds its own, made by device ops; the dict would be a guard), as is a
        capture's."""
        capturing = not traced and self._capturing()
        part = None if traced else self._parts.get((qo_len, kv_len, mask_bytes))
        if part is None and not (traced or capturing):
            part = self._eager_part(qo_len, kv_len, mask_bytes)
        elif part is None:
            p, dev = self._plan, self.device
            i2 = torch.arange(2, dtype=torch.int32, device=dev)
            has_kv = 1 if kv_len > 0 else 0
            work_p = uniform_work(1, qo_len, p["group"], p["block_m"], dev)
            part = dict(
                table=(i2 * qo_len, i2 * has_kv,
                       torch.zeros(has_kv, dtype=torch.int32, device=dev),
                       torch.full((1,), kv_len, dtype=torch.int32, device=dev)),
                mask_indptr=None if mask_bytes is None else i2 * mask_bytes,
                work=_pod_work(work_p, p["work_d"]),
                # the fused launch's list over the plan's decode key chunks (_plan_chunks)
                work_cut=None if p["chunks"] is None else _pod_work(work_p,
                                                                    p["chunks"]["work"]))
            # (made by device ops, which a trace or a CUDA graph's capture takes in; tensors
            # made while a CUDA graph captures hold their values only in the graph's replays:
            # never kept for eager calls)
        if capturing:
            # The graph reads this part and the plan's decode qo_indptr, ALiBi slopes, decode
            # work lists and key chunks at every replay; a re-plan (CUDA-graph mode's new decode
            # lengths) or the eviction above would free them for the allocator to hand out again.
            p = self._plan
            self._captured.append((part, p["qo_indptr"], p["alibi"], p["work_d"],
                                   p["work_d_apart"], p["chunks"], p["chunks_apart"]))
        return part


class BatchPODWithPagedKVCacheWrapper(_PODBase):
    """A paged prefill batch and a paged decode batch in one launch, both planned."""

    # run()'s launch choices read the prefill's pairs and the decodes' bytes: a re-plan
    # compares the choices themselves (_launches_as); the largest page indices and the packed
    # mask's bytes are checked before any replay (_replayable)
    _PLAN_ONLY = frozenset({"max_page_p", "max_page_d", "pairs_p", "decode_bytes",
                            "mask_bits_p", "mask_bytes_p"})

    def _launches_as(self, old: dict, p: dict) -> bool:
        """_PODBase's, and the same eager launch choices for both plans under the policy now
        (_batch_choices: the calls bound under an earlier policy version are never replayed
        again, as their key holds the version)."""
        return (super()._launches_as(old, p) and _batch_choices(old) == _batch_choices(p))

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD") -> None:
        """float_workspace_buffer: a tensor of any shape (FlashInfer's: uint8 ``[bytes]``) on the
        device the wrapper runs on; kv_layout of both caches: "NHD" or "HND"."""
        self._init_common(float_workspace_buffer, kv_layout)

    def plan(self, qo_indptr_p: torch.Tensor, kv_indptr_p: torch.Tensor,
             kv_indices_p: torch.Tensor, last_page_len_p: torch.Tensor,
             qo_indptr_d: torch.Tensor, kv_indptr_d: torch.Tensor, kv_indices_d: torch.Tensor,
             last_page_len_d: torch.Tensor, num_qo_heads: int, num_kv_heads: int,
             head_dim: int, page_size: int, pos_encoding_mode: str = "NONE",
             window_left: int = -1, q_data_type=None, kv_data_type=None, data_type=None,
             sm_scale: float | None = None, rope_scale: float | None = None,
             rope_theta: float | None = None, non_blocking: bool = True) -> None:
        """Plan both batches, the prefill part (suffix _p, B_p requests) and the decode part
        (suffix _d, B_d requests): qo_indptr_p / qo_indptr_d ``[B_x+1]`` (query rows per
        request), kv_indptr_p / kv_indptr_d ``[B_x+1]`` (pages), kv_indices_p / kv_indices_d
        ``[>= kv_indptr_x[-1]]`` (entries past kv_indptr_x[-1] are not read), last_page_len_p /
        last_page_len_d ``[B_x]`` (integer, CPU or GPU; read on the host). The options apply to
        both parts (as in FlashInfer); decode requests may have any number of rows."""
        p = self._plan_options(dict(locals()))
        old = self._plan  # (the last plan, whose tensors a plan of the same shapes writes)
        arrays = {"p": (qo_indptr_p, kv_indptr_p, kv_indices_p, last_page_len_p),
                  "d": (qo_indptr_d, kv_indptr_d, kv_indices_d, last_page_len_d)}
        hosts = gather_host(*arrays["p"], *arrays["d"])
        host = {}  # the plan's int32 host arrays, for _host.to_device
        works = []
        for x in ("p", "d"):
            qo, kvi, idx, last = arrays[x]
            qo_h = V.host_indptr(f"qo_indptr_{x}", qo, hosts=hosts)
            ind_h, idx_h, last_h, kv_lens, max_page = V.page_table(
                (f"kv_indptr_{x}", f"kv_indices_{x}", f"last_page_len_{x}"), kvi, idx, last,
                page_size, length=qo_h.numel(), length_from=f"qo_indptr_{x}", hosts=hosts)
            # (the lengths as lists: each torch op on a small host tensor costs microseconds)
            qo_v, kv_l = qo_h.tolist(), kv_lens
            qo_l = V.lengths(qo_v)
            works.append(build_work(qo_l, p["group"], p["block_m"], "cpu", kv_lens=kv_l))
            if x == "p":
                # The prefill's own tile when it runs as a launch of its own (pod_apart): the
                # fused launch's tile (choose.pod_tile) suits the decodes.
                p["block_m_p"] = block_m_for(
                    p["head_dim"], p["head_dim"], p["group"], max(kv_l, default=None), True,
                    True, page_size=page_size, qo_lens=qo_l, kv_dtype=p["kv_dtype"])
                work_p = works[0] if p["block_m_p"] == p["block_m"] else build_work(
                    qo_l, p["group"], p["block_m_p"], "cpu", kv_lens=kv_l)
            # (a table with room past the last plan's, so that growing requests keep its tensor)
            idx_h = table_with_room(idx_h, None if old is None else
                                    old[f"kv_indices_{x}"].numel(), len(kv_l), page_size)
            host.update({f"qo_indptr_{x}": qo_h, f"kv_indptr_{x}": ind_h,
                         f"kv_indices_{x}": idx_h, f"last_page_len_{x}": last_h})
            p.update({f"rows_{x}": qo_v[-1], f"max_page_{x}": max_page})
            if x == "d":
                p["single_rows_d"] = max(qo_l, default=0) <= 1
                # the decodes' own tile when they run apart (as the prefill's above)
                p["block_m_d"] = self._decode_tile(p, qo_l)
                work_d = works[1] if p["block_m_d"] == p["block_m"] else build_work(
                    qo_l, p["group"], p["block_m_d"], "cpu", kv_lens=kv_l)
            if x == "p":
                mask_bits = list(map(operator.mul, qo_l, kv_l))
                host["mask_indptr_p"] = int32_host(_byte_offsets(mask_bits))
                p.update(mask_bits_p=mask_bits, mask_bytes_p=int(host["mask_indptr_p"][-1]),
                         # query-key pairs without and with the causal mask (choose.pod_apart)
                         pairs_p=tuple(sum(_pairs(q, k, c) for q, k in zip(qo_l, kv_l))
                                       for c in (False, True)))
            else:
                p["decode_bytes"] = _decode_bytes(p, int(ind_h[-1]))
                self._plan_both_chunks(p, qo_h, ind_h, last_h, qo_l, kv_l, non_blocking, old)
        # (the cut launch's work list: the prefill's tiles on the fused tile, then the chunk
        # requests' rows; into the last plan's, as the others)
        c = p["chunks"]
        host.update(work=_pod_work(*works), work_p=work_p, work_d_apart=work_d,
                    work_cut=None if c is None else _pod_work(works[0], rows=c["part_rows"][0]))
        p.update(self._to_device(host, non_blocking, old))
        p["tiles_p"] = works[0].shape[0]
        p["decode_ring"] = _decode_ring(p, p["qo_indptr_d"].shape[0] - 1)
        self._set_plan(p, old)

    begin_forward = plan

    def run(self, q_p: torch.Tensor, paged_kv_cache_p, q_d: torch.Tensor, paged_kv_cache_d,
            custom_mask_p: torch.Tensor | None = None,
            packed_custom_mask_p: torch.Tensor | None = None, causal_p: bool = False,
            q_scale=None, k_scale=None, v_scale=None, return_lse: bool = False,
            use_fp16_qk_reduction: bool = False, enable_pdl: bool | None = None):
        """Prefill q_p ``[qo_indptr_p[-1], Hq, D]`` against paged_kv_cache_p and decode q_d
        ``[qo_indptr_d[-1], Hq, D]`` against paged_kv_cache_d (each a 5-D tensor or a (k, v)
        tuple in the wrapper's kv_layout). causal_p: bottom-right aligned per prefill request
        (kv_len < qo_len allowed). custom_mask_p: bool, each prefill request's
        ``[qo_len, kv_len]`` mask flattened and concatenated, or packed_custom_mask_p: uint8,
        packed per request with ``segment_packbits(..., bitorder="little")`` (FlashInfer packs
        the whole batch as one bit string, which misplaces requests after the first); a bool
        mask is packed here with a host-built index (not CUDA-graph capturable: pass the packed
        form for capture). q_scale / k_scale multiply the decode sm_scale and v_scale the
        decode output, as in FlashInfer. enable_pdl=True raises; use_fp16_qk_reduction is a
        permission (we reduce in fp32).
        """
        if (custom_mask_p is None and q_scale is None and k_scale is None and v_scale is None
                and not enable_pdl and (torch.compiler.is_compiling() or self._replayable(
                    paged_kv_cache_p, paged_kv_cache_d, packed_custom_mask_p))):
            return self._bound(
                (q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, packed_custom_mask_p),
                (causal_p, use_fp16_qk_reduction), return_lse, return_lse,
                lambda: self._run(q_p, paged_kv_cache_p, q_d, paged_kv_cache_d,
                                  packed_custom_mask_p=packed_custom_mask_p, causal_p=causal_p,
                                  return_lse=True, use_fp16_qk_reduction=use_fp16_qk_reduction))
        return self._run(q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, custom_mask_p,
                         packed_custom_mask_p, causal_p, q_scale, k_scale, v_scale, return_lse,
                         use_fp16_qk_reduction, enable_pdl)

    def _run(self, q_p, paged_kv_cache_p, q_d, paged_kv_cache_d, custom_mask_p=None,
             packed_custom_mask_p=None, causal_p=False, q_scale=None, k_scale=None,
             v_scale=None, return_lse=False, use_fp16_qk_reduction=False, enable_pdl=None):
        p = self._check_plan()
        V.check_enable_pdl(enable_pdl)
        if not isinstance(use_fp16_qk_reduction, bool):
            raise TypeError("use_fp16_qk_reduction: pass a bool")
        traced = V.traced()  # the plan's row counts would be guards (V.rows_match)
        for x, q in (("p", q_p), ("d", q_d)):
            self._check_q(f"q_{x}", q, None if traced else p[f"rows_{x}"], p,
                          f"qo_indptr_{x}[-1]", f"qo_indptr_{x}")
        k_p, v_p = self._check_cache("paged_kv_cache_p", paged_kv_cache_p, p, "_p")
        k_d, v_d = self._check_cache("paged_kv_cache_d", paged_kv_cache_d, p, "_d")
        packed_p = mask_indptr_p = None
        if packed_custom_mask_p is not None:
            # (traced: the plan's device byte offsets, the host count would be a guard)
            packed_custom_mask_p = V.mask_packed_length(
                "packed_custom_mask_p", packed_custom_mask_p,
                None if traced else sum((n + 7) // 8 for n in p["mask_bits_p"]),
                "sum over prefill requests of ceil(qo_len * kv_len / 8)",
                device_total=p["mask_indptr_p"][-1:] if traced else None)
            V.check_tensor("packed_custom_mask_p", packed_custom_mask_p, device=self.device)
            packed_p, mask_p = packed_custom_mask_p, MASK_CUSTOM
        elif custom_mask_p is not None:
            V.mask_bool_length("custom_mask_p", custom_mask_p, sum(p["mask_bits_p"]),
                               "sum over prefill requests of qo_len * kv_len")
            V.check_tensor("custom_mask_p", custom_mask_p, device=self.device)
            src, _ = _segment_bit_sources(p["mask_bits_p"], self.device)
            packed_p, mask_p = _pack_from_sources(custom_mask_p, src, "little"), MASK_CUSTOM
        else:
            mask_p = MASK_CAUSAL if causal_p else MASK_NONE
        if packed_p is not None:
            mask_indptr_p = p["mask_indptr_p"]
        sm_d = V.fits_float32("sm_scale * q_scale * k_scale", p["sm_scale"] * V.host_scale(
            "q_scale", q_scale) * V.host_scale("k_scale", k_scale))
        part = {x: tuple(p[f"{name}_{x}"] for name in ("qo_indptr", "kv_indptr", "kv_indices",
                                                        "last_page_len")) for x in ("p", "d")}
        causal = mask_p == MASK_CAUSAL
        side, apart = self._launches(p, traced, (p["work_p"], p["work_d_apart"]),
                                     lambda: self._launch_side(causal),
                                     lambda: self._launch_apart(causal))
        c = None if traced else _cut(p, apart is not None, p["tiles_p"], p["window_left"],
                                     p["pos"], (q_p, q_d, k_p, v_p, k_d, v_d))
        return self._call(
            p, (q_p, k_p, v_p, *part["p"]), (q_d, k_d, v_d, *part["d"]), work=p["work"],
            packed_p=packed_p, mask_indptr_p=mask_indptr_p,
            opt_p=(mask_p, p["window_left"], p["sm_scale"]),
            opt_d=(_decode_mask(mask_p, MASK_NONE, p["single_rows_d"]), p["window_left"], sm_d),
            rope=(p["pos"], p["rope_scale"], p["rope_theta"]), v_scale=v_scale,
            want_lse=(return_lse, return_lse), apart=apart,
            cut=None if c is None else (c, c["work"] if apart else p["work_cut"]), side=side)

    run.__doc__ += _RETURN_DOC

    def _replayable(self, cache_p, cache_d, packed_mask) -> bool:
        """Whether a replay may stand in for this call as far as what its key does not hold
        goes (a plan that launches as the last one keeps its bound calls): the plan's largest
        page indices inside the caches and a packed mask of the plan's bytes, or nothing says
        otherwise (no plan; an argument the full path will name as wrong). Else the full path
        runs, and raises."""
        p = self._plan
        if p is None:
            return True
        return (pages_fit(p["max_page_p"], cache_p) and pages_fit(p["max_page_d"], cache_d)
                and (not isinstance(packed_mask, torch.Tensor) or packed_mask.dim() != 1
                     or packed_mask.shape[0] == p["mask_bytes_p"]))

    def _launch_apart(self, causal: bool, captured: bool | None = None) -> bool:
        """Whether an eager call with the plan's prefill runs the parts as two launches
        (ops.choose.pod_apart; causal: the prefill's mask; captured as POD's). Asked at every
        call, as POD's."""
        p = self._plan
        return _apart(p, p["pairs_p"][causal], p["decode_bytes"], dense_prefill=False,
                      captured=self._capturing() if captured is None else captured,
                      fused_rows=p["work"].shape[0])

    def _launch_side(self, causal: bool) -> int:
        """As POD's, for the plan's prefill (causal: its mask) and options."""
        p = self._plan
        return _side(p, p["pairs_p"][causal], p["decode_bytes"], p["window_left"], p["pos"])
