"""Context-parallel prefill: one long prompt (or a packed batch of documents) split over the ranks
of a torch.distributed group, attended with compiled_attn's ragged op.

Layout (head-tail, "zigzag"): each document of length L is cut into 2N chunks of
C = ceil(L / 2N) tokens (N ranks; the last chunks are padded up to 2N * C, padding at the
document's end); rank r holds chunk r (head) and chunk 2N-1-r (tail) of every document, in
document order: ``[doc0 head, doc0 tail, doc1 head, doc1 tail, ...]``. For one document with L a
multiple of 2N this is exactly torch's ``_HeadTailLoadBalancer`` order followed by an even shard
(torch.distributed.tensor.experimental context_parallel); for packed documents every rank holds
each document's head and tail chunk (TransformerEngine's THD partitioning, and the diagram of
torch's ``_PerDocumentHeadTailLoadBalancer``; torch 2.13's code of that balancer orders the
global buffer document-major instead, which an even shard does not balance). Causal work per rank
is then equal up to one chunk row.

Padding rows (positions >= L) are part of the local tensors: their queries see no key (output 0,
LSE -inf) and their keys are never seen. ``shard`` writes zeros there, ``unshard`` drops them.

Two methods (``prefill``):
- ``"all_gather"`` (the default for GQA): K/V of every rank are all-gathered (in one piece by
  default; ``head_slices`` > 1 issues them per slice of the KV heads, so that the gather of slice
  h + 1 runs under the attention of slice h), and each local query chunk
  attends its document's key prefix in one ragged launch: the bottom-right causal alignment
  (query row i at position kv_len - qo_len + i) makes a chunk against its prefix exact, with no
  merge. The prefixes of a rank's head and tail chunk overlap, and the ragged op reads each
  request's keys as one segment of a monotone indptr, so the prefixes are concatenated into one
  buffer (a copy of (2N+1)/2N of the keys: memory-bound, ~1 ms at 128k tokens against ~150 ms
  of attention).
- ``"ring"`` (the default for MHA): zigzag ring pass-KV. At step s rank r holds rank
  (r - s) mod N's K/V and sends it on to r + 1 while attending it (the next step's K/V is in
  flight during this step's launch: two buffers). Step 0 is a causal launch over the local
  chunks (order-preserving, so local causal is global causal); a source j < r contributes its
  head chunk to every local row, a source j > r both its chunks to the tail rows only; partial
  results are merged by LSE (``merge_state``'s rule) in float32.

Communication is torch's functional collectives (``all_gather_single`` / ``all_gather_tensor``,
``permute_tensor``): the same code runs eagerly (NCCL's stream, asynchronous until the result
is used) and traces under torch.compile(fullgraph=True) and torch.export as
``_c10d_functional`` nodes that Inductor can schedule around the attention ops. ``as_op=True``
instead enters a graph as one opaque custom op, ``compiled_attn::cp_prefill``, that takes the
group by name and runs the eager code inside (its collectives, index cache and launches as an
eager call has them); docs/context-parallel.md compares the two forms' times.

LSEs are base 2 (natural logsumexp / ln 2), as every compiled_attn entry point returns.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from . import _validate as V
from .op_call import call_op
from .op_call import capturing as _capturing  # (a name of this module: tests replace it)
from .ops import MASK_CAUSAL, MASK_NONE, POS_NONE
from .ops.contracts import refuse_backward
from .ops.schedule import block_m_for, build_work
from .utils import _lse_weights

__all__ = ["Layout", "shard", "unshard", "prefill", "METHODS"]

METHODS = ("auto", "all_gather", "ring")


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------
class Layout:
    """The head-tail layout of documents of ``lengths`` tokens over ``world_size`` ranks
    (module docstring). All sizes are host ints, so a Layout traces as constants."""

    def __init__(self, world_size: int, lengths: Sequence[int]):
        V.check_count("world_size", world_size, 1)
        self.world_size = n = int(world_size)
        for x in lengths:
            V.check_count("lengths", x, 0)
        self.lengths = tuple(int(x) for x in lengths)
        self.chunks = tuple(-(-length // (2 * n)) for length in self.lengths)
        self.local_len = 2 * sum(self.chunks)
        self.doc_starts = tuple(_cumsum(self.lengths))  # natural order, without padding
        self.total = sum(self.lengths)
        self.local_starts = tuple(_cumsum([2 * c for c in self.chunks]))

    @classmethod
    def of(cls, world_size: int, *, indptr=None, seq_len: int | None = None) -> "Layout":
        """The layout of documents split by ``indptr`` (host ints or a CPU integer tensor
        [docs + 1], from 0), or of one document of ``seq_len`` tokens."""
        if indptr is None:
            if seq_len is None:
                raise ValueError("indptr / seq_len: pass the documents' boundaries (indptr) or "
                                 "the length of the one document (seq_len)")
            V.check_count("seq_len", seq_len, 0)
            return cls(world_size, [int(seq_len)])
        if torch.is_tensor(indptr):
            ind = V.host_indptr("indptr", indptr).tolist()
        else:
            # operator.index: ints only (a float entry is an error, not truncated); traced, a
            # symbolic entry becomes a constant of the graph, guarded (new lengths compile
            # again), as prefill's sizes
            if any(isinstance(x, bool) for x in indptr):
                raise TypeError(f"indptr: got {list(indptr)!r}; pass ints")
            try:
                ind = [operator.index(x) for x in indptr]
            except TypeError:
                raise TypeError(f"indptr: got {list(indptr)!r}; pass ints (document "
                                "boundaries in tokens)") from None
            if not ind or ind[0] != 0 or any(b < a for a, b in zip(ind, ind[1:])):
                raise ValueError(f"indptr: got {list(indptr)!r}; pass the document boundaries "
                                 "[0, end of doc 0, end of doc 1, ...], non-decreasing from 0")
        if seq_len is not None and int(seq_len) != ind[-1]:
            raise ValueError(f"seq_len: {seq_len} differs from indptr[-1] = {ind[-1]}; pass one "
                             "of them or make them agree")
        return cls(world_size, [b - a for a, b in zip(ind, ind[1:])])

    def real(self, doc: int, chunk: int) -> int:
        """Tokens of document ``doc``'s chunk ``chunk`` that are not padding (a prefix)."""
        c = self.chunks[doc]
        return min(max(self.lengths[doc] - chunk * c, 0), c)

    def side_chunks(self, rank: int) -> tuple[int, int]:
        """The chunks rank holds in every document: (head, tail)."""
        return rank, 2 * self.world_size - 1 - rank

    def chunk_row(self, doc: int, chunk: int) -> tuple[int, int]:
        """(rank, row in that rank's local tensor) of the first token of a chunk."""
        n = self.world_size
        rank = chunk if chunk < n else 2 * n - 1 - chunk
        return rank, self.local_starts[doc] + (0 if chunk < n else self.chunks[doc])

    def real_rows(self, doc: int, rank: int) -> int:
        """Tokens of the document on ``rank`` that are not padding (a prefix of its head and
        tail chunks: a tail chunk holds tokens only when the head chunk is full)."""
        head, tail = self.side_chunks(rank)
        return self.real(doc, head) + self.real(doc, tail)


def _cumsum(xs):
    out, s = [], 0
    for x in xs:
        out.append(s)
        s += x
    return out


def _check_x(x: torch.Tensor, dim: int) -> None:
    """x is a tensor with a dim ``dim`` (its tokens')."""
    V.check_tensor("x", x)
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim: got {dim!r} for x of {x.dim()} dims; pass the tokens' dim "
                         f"(an int in [-{x.dim()}, {x.dim()}))")


def _seq_layout(x: torch.Tensor, world_size: int, indptr, dim: int) -> Layout:
    _check_x(x, dim)
    return Layout.of(world_size, indptr=indptr, seq_len=None if indptr is not None
                     else x.shape[dim])


def shard(x: torch.Tensor, world_size: int, rank: int, *, indptr=None,
          dim: int = 0) -> torch.Tensor:
    """Rank ``rank``'s part of x in the head-tail layout (module docstring).

    x: the whole sequence, natural order, tokens along ``dim`` (e.g. q ``[S, Hq, D]``).
    indptr: document boundaries (host ints / CPU tensor [docs + 1]; default: one document of
    x.shape[dim] tokens). Returns ``[Layout.local_len, ...]`` along dim: per document its head
    chunk then its tail chunk, each of ceil(L / 2N) tokens, padding rows zero.
    """
    lay = _seq_layout(x, world_size, indptr, dim)
    if isinstance(rank, bool) or not hasattr(type(rank), "__index__"):
        raise TypeError(f"rank: got {rank!r} ({type(rank).__name__}); pass an int "
                        "(dist.get_rank())")
    rank = operator.index(rank)  # (an integer type: a numpy int, as world_size takes)
    if not 0 <= rank < lay.world_size:
        raise ValueError(f"rank: got {rank}; use 0 <= rank < world_size = {lay.world_size}")
    if indptr is not None and x.shape[dim] != lay.total:
        raise ValueError(f"x: {x.shape[dim]} tokens along dim {dim} but indptr[-1] = "
                         f"{lay.total}; pass the whole sequence")
    pieces = []
    for b in range(len(lay.lengths)):
        for c in lay.side_chunks(rank):
            real, size = lay.real(b, c), lay.chunks[b]
            if real:
                pieces.append(x.narrow(dim, lay.doc_starts[b] + c * size, real))
            if real < size:
                shape = list(x.shape)
                shape[dim] = size - real
                pieces.append(x.new_zeros(shape))
    if not pieces:
        shape = list(x.shape)
        shape[dim] = 0
        return x.new_empty(shape)
    return torch.cat(pieces, dim=dim)


def unshard(x: torch.Tensor, world_size: int, *, indptr=None, seq_len: int | None = None,
            dim: int = 0) -> torch.Tensor:
    """The natural-order sequence from the ranks' parts.

    x: every rank's local tensor concatenated in rank order along ``dim`` (what an all-gather
    of the local tensors gives), ``[world_size * local_len, ...]``. indptr / seq_len: the
    documents (as for shard; one of them, since padding hides the true length). Returns
    ``[S, ...]`` without the padding rows.
    """
    _check_x(x, dim)
    lay = Layout.of(world_size, indptr=indptr, seq_len=seq_len)
    if x.shape[dim] != lay.world_size * lay.local_len:
        raise ValueError(f"x: {x.shape[dim]} rows along dim {dim}, but {lay.world_size} ranks "
                         f"x {lay.local_len} local rows are expected for these documents; pass "
                         "every rank's part, concatenated in rank order")
    pieces = []
    for b in range(len(lay.lengths)):
        for c in range(2 * lay.world_size):
            real = lay.real(b, c)
            if real:
                rank, row = lay.chunk_row(b, c)
                pieces.append(x.narrow(dim, rank * lay.local_len + row, real))
    if not pieces:
        shape = list(x.shape)
        shape[dim] = 0
        return x.new_empty(shape)
    return torch.cat(pieces, dim=dim)


# --------------------------------------------------------------------------------------------
# one ragged launch over a list of (query rows, key rows) requests
# --------------------------------------------------------------------------------------------
def _attend(q, k, v, reqs, causal: bool, opts: dict, out_dtype: torch.dtype | None = None):
    """The ragged op over consecutive requests ``reqs`` = [(qo_len, kv_len), ...] that tile q's
    rows and k's rows in order (a request of qo_len 0 skips keys; one of kv_len 0 gives its
    rows output 0, LSE -inf). q: [Nq, Hq, Dqk]; k / v: [Nk, Hkv, D] with Nk >= the keys
    listed. Returns out [Nq, Hq, Dvo] (out_dtype, default q's), lse float32 [Nq, Hq], base 2."""
    reqs = [r for r in reqs if r[0] or r[1]]
    qo = [r[0] for r in reqs]
    kv = [r[1] for r in reqs]
    # head counts and dims are constexprs of the kernel: specialised when traced symbolically
    group = int(q.shape[1]) // int(k.shape[1])
    dqk, dvo = int(q.shape[2]), int(v.shape[2])
    block_m = block_m_for(dqk, dvo, group, max(kv, default=0), causal)
    qo_indptr, kv_indptr, work = _indices(tuple(qo), tuple(kv), group, block_m, q.device)
    return call_op("batch_ragged_prefill", q, k, v, qo_indptr, kv_indptr, work, None, None,
                   None, None, block_m, MASK_CAUSAL if causal else MASK_NONE,
                   opts["window_left"], 0, opts["sm_scale"], opts["logits_soft_cap"], POS_NONE,
                   1.0, 1e4, 1.0, out_dtype or q.dtype)


# (device, stream, qo lengths, kv lengths, group, block_m) -> (qo_indptr, kv_indptr, work).
# Every head slice of a call and every layer of a model launch the same requests: built once,
# they cost a repeated call no host work and no blocking host-to-device copy (a pageable copy
# waits for the stream, which would serialise the next slice's launch behind the running one).
# The op only reads these tensors.
_INDEX_CACHE: dict = {}
_INDEX_CACHE_SIZE = 64


def _indices(qo: tuple, kv: tuple, group: int, block_m: int, dev: torch.device):
    """The ragged op's qo_indptr / kv_indptr [len + 1] and work [W, 2] (int32, on dev) for the
    requests (qo[i], kv[i]); cached for eager calls, built in the graph when traced."""
    def lists():
        return (_cumsum(qo) + [sum(qo)], _cumsum(kv) + [sum(kv)],
                _work_rows(qo, kv, group, block_m))

    if torch.compiler.is_compiling():  # constants of the graph
        qi, ki, w = (torch.tensor(x, dtype=torch.int32, device=dev) for x in lists())
        return qi, ki, w.reshape(-1, 2)
    # the stream is part of the key: a cached tensor is read on the stream that copied it
    stream = torch.cuda.current_stream(dev).cuda_stream if dev.type == "cuda" else 0
    key = (dev, stream, qo, kv, group, block_m)
    hit = _INDEX_CACHE.get(key)
    if hit is None:
        host = [torch.tensor(x, dtype=torch.int32) for x in lists()]
        if dev.type == "cuda":  # pinned: copied without waiting for the stream
            host = [t.pin_memory() for t in host]
        qi, ki, w = (t.to(dev, non_blocking=True) for t in host)
        if len(_INDEX_CACHE) >= _INDEX_CACHE_SIZE:
            _INDEX_CACHE.clear()
        hit = _INDEX_CACHE[key] = (qi, ki, w.reshape(-1, 2))
    return hit


@torch.compiler.assume_constant_result
def _work_rows(qo: tuple, kv: tuple, group: int, block_m: int) -> tuple:
    """build_work's list as nested tuples of ints: computed on the host when traced (Dynamo
    cannot trace its sort), a constant of the graph."""
    return tuple(map(tuple, build_work(list(qo), group, block_m, "cpu", kv_lens=list(kv)).tolist()))


def _pad_rows(reqs: list, rows: int, taken: int) -> None:
    """Append the request giving a document's padding query rows no key."""
    if rows > taken:
        reqs.append((rows - taken, 0))


# --------------------------------------------------------------------------------------------
# all-gather
# --------------------------------------------------------------------------------------------
def _prefix_plan(lay: Layout, rank: int, causal: bool):
    """For the all-gather method: the requests over the local query rows and the key pieces
    (rank, local row, rows) that, concatenated, form each request's keys."""
    reqs, pieces = [], []
    for b in range(len(lay.lengths)):
        size = lay.chunks[b]
        if not causal:  # every real local row sees the document's real keys
            rows = lay.real_rows(b, rank)
            if rows:
                reqs.append((rows, lay.lengths[b]))
                pieces += _natural_pieces(lay, b, lay.lengths[b])
            _pad_rows(reqs, 2 * size, rows)
            continue
        for c in lay.side_chunks(rank):
            real = lay.real(b, c)
            if real:  # the chunk's real rows against the keys up to their last position
                reqs.append((real, c * size + real))
                pieces += _natural_pieces(lay, b, c * size + real)
            _pad_rows(reqs, size, real)
    return reqs, pieces


def _natural_pieces(lay: Layout, doc: int, keys: int):
    """The (rank, local row, rows) runs holding a document's first ``keys`` tokens."""
    out, size = [], lay.chunks[doc]
    for c in range(-(-keys // size) if size else 0):
        rank, row = lay.chunk_row(doc, c)
        out.append((rank, row, min(size, keys - c * size)))
    return out


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    """Issue the all-gather of x along dim 0 (asynchronous until the result is used)."""
    import torch.distributed._functional_collectives as fc

    ag = getattr(fc, "all_gather_single", None) or fc.all_gather_tensor
    return ag(x.contiguous(), 0, group)


def _wait(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed._functional_collectives as fc

    return t.wait() if isinstance(t, fc.AsyncCollectiveTensor) else t


def _join(gathered: torch.Tensor, pieces, local_len: int) -> torch.Tensor:
    """The key runs ``pieces`` of an all-gathered [N * local_len, H, D] tensor, concatenated."""
    if not pieces:
        return gathered[:0]
    return torch.cat([gathered.narrow(0, r * local_len + row, n) for r, row, n in pieces])


def _all_gather(q, k, v, lay: Layout, rank: int, group, causal: bool, opts: dict,
                head_slices: int):
    reqs, pieces = _prefix_plan(lay, rank, causal)
    hkv, g = int(k.shape[1]), int(q.shape[1]) // int(k.shape[1])
    step = hkv // head_slices
    slices = [(h, h + step) for h in range(0, hkv, step)]
    if lay.world_size == 1:
        gathered = [(k[:, a:b], v[:, a:b]) for a, b in slices]
    else:  # every slice's gather goes out first; slice i's attention runs under i + 1's
        gathered = [(_gather(k[:, a:b], group), _gather(v[:, a:b], group)) for a, b in slices]
    outs, lses = [], []
    for (a, b), (gk, gv) in zip(slices, gathered):
        kk = _join(_wait(gk), pieces, lay.local_len)
        vv = _join(_wait(gv), pieces, lay.local_len)
        qs = q if len(slices) == 1 else q[:, a * g:b * g].contiguous()
        o, s = _attend(qs, kk, vv, reqs, causal, opts)
        outs.append(o)
        lses.append(s)
    if len(slices) == 1:
        return outs[0], lses[0]
    return torch.cat(outs, dim=1), torch.cat(lses, dim=1)


# --------------------------------------------------------------------------------------------
# ring
# --------------------------------------------------------------------------------------------
def _ring_plan(lay: Layout, rank: int, source: int, causal: bool):
    """(requests, causal) of the ring step that holds rank ``source``'s K/V: per document the
    local query rows against the source's key rows (module docstring), each request's keys a
    prefix of the source's document rows, the rest skipped."""
    reqs = []
    step_causal = causal and source == rank
    for b in range(len(lay.lengths)):
        size = lay.chunks[b]
        rows = lay.real_rows(b, rank)
        src_head, src_tail = lay.side_chunks(source)
        if not causal or source == rank:  # all real rows against all real keys
            keys = lay.real_rows(b, source)
            reqs.append((rows, keys))
        elif source < rank:  # every local row sees the source's head chunk only
            keys = lay.real(b, src_head)
            reqs.append((rows, keys))
        else:  # source > rank: only the tail rows see the source, both its chunks
            keys = lay.real_rows(b, source)
            tail = lay.real(b, lay.side_chunks(rank)[1])
            reqs += [(size, 0), (tail, keys)]
            rows = size + tail
        _pad_rows(reqs, 2 * size, rows)
        reqs.append((0, 2 * size - keys))  # the source's rows this step does not read
    return reqs, step_causal


def _pass_on(t: torch.Tensor, group, world_size: int) -> torch.Tensor:
    """Issue the send of t to rank + 1 and the receive of rank - 1's t (asynchronous)."""
    import torch.distributed._functional_collectives as fc

    dst = [(i + 1) % world_size for i in range(world_size)]
    return fc.permute_tensor(t.contiguous().reshape(-1), dst, group)


def _ring(q, k, v, lay: Layout, rank: int, group, causal: bool, opts: dict):
    n = lay.world_size
    acc = None
    kc, vc = k, v
    for s in range(n):
        nxt = None
        if s < n - 1:  # the next step's K/V is in flight during this step's launch
            nxt = (_pass_on(kc, group, n), _pass_on(vc, group, n))
        reqs, step_causal = _ring_plan(lay, rank, (rank - s) % n, causal)
        # float32 partials where steps are merged: the output is rounded to q's dtype once
        o, lse = _attend(q, kc, vc, reqs, step_causal, opts,
                         torch.float32 if n > 1 else None)
        acc = (o, lse) if acc is None else _merge_step(acc[0], acc[1], o, lse)
        if nxt is not None:
            kc = _wait(nxt[0]).reshape(k.shape)
            vc = _wait(nxt[1]).reshape(v.shape)
    return acc[0].to(q.dtype), acc[1]


def _merge_step(acc: torch.Tensor, s_acc: torch.Tensor, o: torch.Tensor, s_o: torch.Tensor):
    """merge_state of the running (acc, s_acc) and a step's (o, s_o) into a float32 acc, in
    two passes over the [N, H, D] tensors (merge_state stacks both states first and casts
    them: ~4x the memory traffic, a cost per ring step); the weights by merge_state's rule
    (utils._lse_weights, on the small [N, 2, H] LSEs). acc: float32 (the first step's output,
    the ring asks its steps for float32, or an earlier result of this function)."""
    w, denom, lse = _lse_weights(torch.stack([s_acc, s_o], dim=1).float())
    a, b = (w[:, 0] / denom).unsqueeze(-1), (w[:, 1] / denom).unsqueeze(-1)
    if acc.dtype == torch.float32:
        out = acc.mul_(a)  # acc is this function's own earlier result
    else:
        out = torch.mul(acc, a)  # float32: a is
    return out.addcmul_(o, b), lse


# --------------------------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------------------------
def _group_coords(group) -> tuple[int, int]:
    import torch.distributed as dist

    if group is None:
        raise ValueError("group: pass the torch.distributed process group the sequence is "
                         "split over (e.g. torch.distributed.group.WORLD)")
    return dist.get_world_size(group), dist.get_rank(group)


def _method(method, hq: int, hkv: int, causal: bool, window_left: int,
            sliced: bool = False) -> str:
    """The method "auto" stands for (all_gather for GQA, windows and head slices), checked
    against the options."""
    if method not in METHODS:
        raise ValueError(f"method: got {method!r}; use one of {list(METHODS)}")
    if method == "auto":
        method = "all_gather" if hq > hkv or window_left >= 0 or sliced else "ring"
    if method == "ring" and window_left >= 0:
        V.unsupported("window_left", "the ring method has no sliding window (a window's keys "
                      "are mostly on the query's own rank); use method='all_gather'")
    if window_left >= 0 and not causal:
        V.unsupported("window_left", "with causal=False (the window's left bound alone) under "
                      "context parallelism; pass causal=True")
    return method


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, group, indptr=None,
            method: str = "auto", causal: bool = False, sm_scale: float | None = None,
            window_left: int = -1, logits_soft_cap: float | None = None,
            head_slices: int | None = None,
            as_op: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of this rank's query rows against the whole sequence spread over ``group``.

    q: ``[local_len, Hq, D_qk]``, k: ``[local_len, Hkv, D_qk]``, v: ``[local_len, Hkv, D_vo]``:
    this rank's part in the head-tail layout (``shard``; module docstring), the same on every
    rank of ``group`` (a torch.distributed ProcessGroup). indptr: document boundaries of the
    whole packed sequence (host ints or a CPU tensor [docs + 1]; under torch.compile pass a
    list), without padding; default one document of world_size * local_len tokens (a
    document shard()ed without indptr whose length L is not a multiple of 2 * world_size
    needs indptr=[0, L] here: without it its padding rows are taken as tokens, which count as
    keys when causal=False and get outputs of their own either way).
    method: "all_gather" (K/V gathered, one launch per head slice, exact: each row's result is
    the single-GPU op's on the same tiles), "ring" (K/V passed around the ring, partial results
    merged by LSE in float32), or "auto": all_gather for GQA (Hq > Hkv), windows and
    head_slices > 1, ring for MHA. causal, sm_scale (default 1/sqrt(D_qk)), window_left
    (causal only; all_gather only), logits_soft_cap: as single_prefill_with_kv_cache, over
    global positions. head_slices (all_gather): the gathers issued per slice of the KV heads,
    each slice's attention launched when its own gather lands (a divisor of Hkv; default 1, one
    gather and one launch: on two H200s the overlap cost more than the gather it hid,
    docs/context-parallel.md).
    as_op: run the call as the one custom op ``compiled_attn::cp_prefill`` (the group passed by
    its name), which a traced graph holds as one opaque node whose body is the eager call;
    default False: the functional collectives and the attention ops enter the graph apiece
    (module docstring).
    Every argument but the local tensors must be the same on every rank of ``group``, as a
    collective's are: they are not compared across ranks (that would cost a collective per
    call), and ranks that disagree about indptr get wrong numbers, or wait on each other
    forever where their local_len differs.
    Under torch.compile the plan of each step is built from the lengths and head counts while
    tracing, so they are specialised: a new length or head count compiles the call again
    (symbolic sizes, as torch's automatic dynamic shapes make them, are made constants).

    Returns out ``[local_len, Hq, D_vo]`` (q's dtype) and lse float32 ``[local_len, Hq]``,
    base 2 (natural logsumexp / ln 2) over the final logits, for the local rows in the same
    layout; padding rows (those indptr says are padding) and rows that see no key: output 0,
    LSE -inf.
    """
    V.check_tensor("q", q, ndim=3, what="[local_len, Hq, D_qk]")
    V.check_tensor("k", k, ndim=3, device=q.device, what="[local_len, Hkv, D_qk]")
    V.check_tensor("v", v, ndim=3, device=q.device, what="[local_len, Hkv, D_vo]")
    if k.shape[0] != q.shape[0] or v.shape[:2] != k.shape[:2] or k.shape[2] != q.shape[2]:
        raise ValueError(f"q / k / v: shapes {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)} disagree; pass [local_len, Hq, D_qk], "
                         "[local_len, Hkv, D_qk], [local_len, Hkv, D_vo] of one shard")
    V.check_qkv_dtypes(q.dtype, k.dtype, v.dtype)
    # Traced, each plan is built from these sizes: operator.index makes a symbolic one (torch's
    # automatic dynamic shapes) a constant of the graph, guarded, so a new length or head count
    # compiles again (int() would leave it symbolic, and no plan could be built from it).
    for t in (q, k, v):
        for size in t.shape:
            operator.index(size)
    hq, hkv = int(q.shape[1]), int(k.shape[1])
    V.check_heads(hq, hkv, names=("q's head count (q.shape[1])", "k's KV head count"))
    if _capturing(q.device):
        V.unsupported("q", "context-parallel prefill under CUDA-graph capture (its collectives "
                      "and cached index tensors are not captured); call it eagerly or under "
                      "torch.compile")
    world, rank = _group_coords(group)
    lay = Layout.of(world, indptr=indptr,
                    seq_len=world * int(q.shape[0]) if indptr is None else None)
    if lay.local_len != q.shape[0]:
        raise ValueError(f"q: {q.shape[0]} local rows, but the documents {list(lay.lengths)} "
                         f"over {world} ranks give {lay.local_len} per rank (each document "
                         "padded to a multiple of 2 * world_size); pass shard()'s output")
    if not isinstance(causal, bool):
        raise TypeError(f"causal: got {causal!r}; pass a bool")
    opts = dict(
        sm_scale=V.check_scale("sm_scale", sm_scale, 1.0 / math.sqrt(q.shape[2]),
                               positive=False),
        window_left=V.check_window_left(window_left),
        logits_soft_cap=V.check_soft_cap(logits_soft_cap))
    method = _method(method, hq, hkv, bool(causal), opts["window_left"],
                     head_slices not in (None, 1))
    if method == "ring" and head_slices not in (None, 1):
        V.unsupported("head_slices", "the ring method passes whole K/V; leave it None")
    if head_slices is None:
        head_slices = 1
    V.check_count("head_slices", head_slices, 1)
    if hkv % head_slices:
        raise ValueError(f"head_slices: {head_slices} does not divide the {hkv} KV heads; "
                         "pass a divisor of k.shape[1]")
    if not isinstance(as_op, bool):
        raise TypeError(f"as_op: got {as_op!r}; pass a bool")
    if as_op:
        return torch.ops.compiled_attn.cp_prefill(
            q, k, v, _group_name(group), list(lay.lengths), method, bool(causal),
            opts["sm_scale"], opts["window_left"], opts["logits_soft_cap"], head_slices)
    return _run(q, k, v, lay, rank, group, method, bool(causal), opts, head_slices)


def _run(q, k, v, lay: Layout, rank: int, group, method: str, causal: bool, opts: dict,
         head_slices: int):
    """The checked call's communication and launches (prefill's body, and cp_prefill's)."""
    if method == "ring":
        return _ring(q, k, v, lay, rank, group, causal, opts)
    return _all_gather(q, k, v, lay, rank, group, causal, opts, head_slices)


def _group_name(group) -> str:
    name = getattr(group, "group_name", None)
    if not name:
        raise ValueError("group: as_op=True passes the group by name, and this group has none; "
                         "pass a torch.distributed ProcessGroup (e.g. from new_group)")
    return name


# --------------------------------------------------------------------------------------------
# the opaque form: one custom op, the group by name
# --------------------------------------------------------------------------------------------
@torch.library.custom_op("compiled_attn::cp_prefill", mutates_args=())
def _cp_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group_name: str,
                lengths: list[int], method: str, causal: bool, sm_scale: float,
                window_left: int, logits_soft_cap: float,
                head_slices: int) -> tuple[torch.Tensor, torch.Tensor]:
    """prefill(..., as_op=True)'s op: arguments checked by prefill; lengths are the documents'
    token counts (the Layout); method "all_gather" or "ring". q / k / v: [local_len, H, D]."""
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    world, rank = _group_coords(group)
    opts = dict(sm_scale=sm_scale, window_left=window_left, logits_soft_cap=logits_soft_cap)
    return _run(q, k, v, Layout(world, lengths), rank, group, method, causal, opts, head_slices)


@_cp_prefill.register_fake
def _cp_prefill_fake(q, k, v, group_name, lengths, method, causal, sm_scale, window_left,
                     logits_soft_cap, head_slices):
    rows, hq = q.shape[0], q.shape[1]
    return (q.new_empty((rows, hq, v.shape[2])),
            q.new_empty((rows, hq), dtype=torch.float32))


refuse_backward(_cp_prefill, "compiled_attn::cp_prefill")
