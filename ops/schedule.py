"""Host-side scheduling: the work list every batch op takes.

A work item is one tile of ``block_m`` packed query rows of one request. Packed row r of a
request is token ``r // G`` and query head ``r % G`` of the KV head's group (G = Hq / Hkv), so
the query heads that share a KV head share one tile and one pass over K/V. The op's grid is
(work items, KV heads). Requests with qo_len 0 have no tiles; requests with kv_len 0 keep theirs
(their rows are written as output 0, LSE -inf).
"""

from __future__ import annotations

import array
from collections.abc import Sequence

import torch

from . import choose
from .device import sm_count
from .policy import POLICY


def block_m_for(*args, **kwargs) -> int:
    """The tile height of a plan: the launch decision's (choose.tile, looked up per call so
    that a tool replacing it reaches every plan)."""
    return choose.tile(*args, **kwargs)


# (C int arrays hold int32: int32_host relies on it)
assert array.array("i").itemsize == 4


def int32_host(values: list, width: int = 1) -> torch.Tensor:
    """An int32 host tensor of a flat list of Python ints, [n] or (width > 1) [n / width,
    width], made through a C int array (torch.frombuffer: the tensor keeps the array as its
    storage): ~3x faster than torch.tensor on a list, which converts element by element (a
    plan builds its index arrays as lists, a decode batch's of hundreds of entries). A value
    outside int32 raises OverflowError."""
    t = (torch.frombuffer(array.array("i", values), dtype=torch.int32) if values
         else torch.empty(0, dtype=torch.int32))
    return t if width == 1 else t.view(-1, width)


def _on(t: torch.Tensor, device) -> torch.Tensor:
    """t (a host tensor) on ``device`` (a copy unless it is the CPU)."""
    return t if device == "cpu" else t.to(device)


def build_work(qo_lens: Sequence[int], group_size: int, block_m: int,
               device: torch.device | str = "cpu",
               kv_lens: Sequence[int] | None = None) -> torch.Tensor:
    """int32 [W, 2] of (request, first packed row), from host-side lengths.

    With kv_lens, requests are ordered by their heaviest tile (the keys a tile's last row may
    see, the causal bound), longest first, and each request's tiles heaviest first: the GPU's
    tail runs short tiles (a longest-processing-time schedule at request granularity) while
    the programs running together mostly read the same request's K/V, which stays in L2.
    (Sorting all tiles globally interleaves requests: on 32 x 4k tokens the concurrent programs
    then stream 32 requests' K/V and become memory-bound.) Without kv_lens, request-major in
    row order.
    """
    # (plain lists and C-level keys: plan() builds this on a serving step's path, so a decode
    # batch, a tile a request, sorts once and skips the per-tile work)
    qo = list(map(int, qo_lens))
    flat: list[int] = []
    if kv_lens is None:
        for b, n in enumerate(qo):
            for row in range(0, n * group_size, block_m):
                flat += (b, row)
        return _on(int32_host(flat, 2), device)
    kv = list(map(int, kv_lens))
    # a request's heaviest tile is its last, which sees all kv_lens[b] keys: requests in order
    # of their keys, longest first (reverse keeps ties in request order)
    order = [b for b in sorted(range(len(qo)), key=kv.__getitem__, reverse=True) if qo[b]]
    if max(qo, default=0) * group_size <= block_m:  # a tile a request (decode rows)
        flat = [0] * (2 * len(order))
        flat[0::2] = order
        return _on(int32_host(flat, 2), device)
    for b in order:
        n, k = qo[b], kv[b]
        end = n * group_size
        if end <= block_m:  # one tile (a decode row beside longer requests)
            flat += (b, 0)
            continue
        # each tile weighed by the keys its last row may see (the causal bound,
        # min(k, k - n + min(row + block_m, end) // G)), heaviest first; the sort is stable,
        # so equal tiles stay in row order
        if block_m >= group_size:
            # min(row + block_m, end) // G then rises by at least 1 a tile (and stays <= n),
            # so the weights rise with the row: heaviest first is the rows in reverse
            rows = range((end - 1) // block_m * block_m, -1, -block_m)
        else:
            tiles = [(min(k, k - n + min(row + block_m, end) // group_size), row)
                     for row in range(0, end, block_m)]
            tiles.sort(key=_neg_weight)
            rows = [row for _, row in tiles]
        seg = [b] * (2 * len(rows))
        seg[1::2] = rows
        flat += seg
    return _on(int32_host(flat, 2), device)


def _neg_weight(tile: tuple) -> int:
    return -tile[0]


def uniform_work(batch_size: int, qo_len: int, group_size: int, block_m: int,
                 device: torch.device | str) -> torch.Tensor:
    """The work list of ``batch_size`` requests of ``qo_len`` rows each, built without reading
    any tensor (traceable: the FX rewrite uses it inside compiled graphs)."""
    tiles = -(-(qo_len * group_size) // block_m)
    req = torch.arange(batch_size, device=device, dtype=torch.int32).repeat_interleave(tiles)
    row = (torch.arange(tiles, device=device, dtype=torch.int32) * block_m).repeat(batch_size)
    return torch.stack([req, row], dim=1)


# The most chunks a split plan cuts one tile's keys into.
MAX_CHUNKS = 16


def chunks_wanted(programs: int, num_sms: int | None) -> int:
    """The chunks per tile a split plan aims at for ``programs`` tiles x KV heads (1: none).
    Measured on the H100: 128 programs over 132 SMs streaming long keys already run at the
    memory rate, and splitting them was slower (0.82x, benchmarks/NOTES.md); split only when
    at most half the SMs would have a program, up to about one program per SM."""
    if num_sms is None or 2 * programs > num_sms:
        return 1
    return -(-num_sms // max(programs, 1))


def split_capacity(tiles: int, num_kv_heads: int, num_sms: int,
                   max_chunks: int = MAX_CHUNKS) -> int:
    """The most work rows build_split_work gives a plan of at most ``tiles`` tiles (with its
    num_sms and max_chunks): a CUDA-graph plan's work buffer, sized once for every re-plan."""
    small = min(tiles, num_sms // (2 * max(num_kv_heads, 1)))  # the tile counts that split
    return max([tiles] + [t * min(max_chunks, chunks_wanted(t * num_kv_heads, num_sms))
                          for t in range(1, small + 1)])


def build_split_work(qo_lens: Sequence[int], kv_lens: Sequence[int], group_size: int,
                     block_m: int, num_kv_heads: int, device: torch.device | str = "cpu", *,
                     num_sms: int | None = None, min_keys_per_chunk: int = 1024,
                     max_chunks: int = MAX_CHUNKS, chunk_keys: int | None = None,
                     causal: bool = True, tiles: torch.Tensor | None = None,
                     ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Split-KV plan: (work int32 [W, 4], merge int32 [T, 4] or None).

    When the tiles times the KV heads would leave most SMs idle (programs <= SMs / 2), a tile
    with a long key range is cut into chunks of at least ``min_keys_per_chunk`` keys, so that
    about one program per SM runs; its chunks are consecutive work rows (request, first
    row, chunk, chunks) and one merge row (request, first row, first work row, chunks) combines
    them. Otherwise the result is build_work's list with (0, 1) chunk columns and no merge.
    num_sms: the GPU's multiprocessor count (default: the current CUDA device's, else 132).

    chunk_keys (FlashInfer's fixed_split_size, batch-invariant mode): every tile is cut into
    ceil(keys / chunk_keys) chunks whatever the rest of the batch, keys being the keys its
    rows may see (the causal bound when ``causal``, else kv_len); the kernel divides the
    tile's key range into that many equal runs of whole key blocks. A request's chunks, and so
    its numbers, then depend on that request alone.

    tiles: build_work's list for these lengths and tile (int32 [W, 2]) where the caller has it
    already (plan() builds it first); else built here.
    """
    if num_sms is None and chunk_keys is None:
        num_sms = sm_count() if torch.cuda.is_available() else 132
    if tiles is None:
        tiles = build_work(qo_lens, group_size, block_m, "cpu", kv_lens=kv_lens)
    tiles = tiles.tolist()
    want = chunks_wanted(len(tiles) * num_kv_heads, num_sms)
    rows, merges = [], []
    for b, row in tiles:
        last_tok = min(row + block_m, int(qo_lens[b]) * group_size) // group_size
        keys = int(kv_lens[b])
        if causal:
            keys = min(keys, keys - int(qo_lens[b]) + last_tok)
        if chunk_keys is not None:
            n = max(1, -(-keys // chunk_keys))
        else:
            n = max(1, min(want, max_chunks, keys // max(min_keys_per_chunk, 1)))
        if n > 1:
            merges += (b, row, len(rows) // 4, n)
        for s in range(n):
            rows += (b, row, s, n)
    work = _on(int32_host(rows, 4), device)
    return work, _on(int32_host(merges, 4), device) if merges else None


def decode_chunk_count(qo_lens: Sequence[int], kv_lens: Sequence[int], num_kv_heads: int,
                       num_sms: int, *, min_keys_per_chunk: int = 512,
                       slots_per_sm: int = 2, fill: float = 0.25, waves: int = 1) -> int:
    """The key chunks per request of a decode batch cut into chunk requests (0: not cut).

    A batch is cut where its programs, one a request and KV head, fill at most ``fill`` of one
    wave of ``slots_per_sm`` programs a SM (the Gluon kernel's 64-row tile runs two; 0.25: at
    most half the SMs, where a split plan would split it, chunks_wanted), into as many chunks as
    fit ``waves`` such waves (one for a launch of its own: a chunk more would start a second,
    mostly idle wave; POD's fused launch takes two, so that its decode items even out the
    prefill's tail), at most MAX_CHUNKS, each of at least ``min_keys_per_chunk`` keys of the
    longest request. Only for decode rows: every request has at most one query row, and one
    has a row."""
    rows = [int(n) for n in qo_lens]
    if not rows or max(rows) != 1 or min(rows) < 0:
        return 0
    programs = sum(rows) * num_kv_heads
    if programs > fill * slots_per_sm * num_sms:
        return 0
    longest = max(int(k) for k, n in zip(kv_lens, rows) if n)
    n = min(waves * slots_per_sm * num_sms // programs, MAX_CHUNKS,
            longest // max(min_keys_per_chunk, 1))
    return n if n > 1 else 0


def planned_chunk_count(qo_lens: Sequence[int], kv_lens: Sequence[int], num_kv_heads: int,
                        num_sms: int, *, pod_fused: bool = False) -> int:
    """decode_chunk_count under the launch policy (0: not cut): for a decode batch's own paged
    launch (POLICY.decode_chunk_fill, decode_chunk_min_keys; one wave), or for POD's fused
    launch (POLICY.pod_chunk_fill, pod_chunk_min_keys; two waves, and only where that makes
    POLICY.pod_chunk_min_chunks chunks or more; where the longest decode has
    POLICY.pod_chunk_long_keys keys or more, chunks of at most POLICY.pod_chunk_long_size keys
    where the waves would make them longer). Two resident 64-row programs a SM."""
    slots = choose.RESIDENT_PER_SM[64]
    if not pod_fused:
        return decode_chunk_count(qo_lens, kv_lens, num_kv_heads, num_sms,
                                  min_keys_per_chunk=POLICY.decode_chunk_min_keys,
                                  slots_per_sm=slots, fill=POLICY.decode_chunk_fill)
    n = decode_chunk_count(qo_lens, kv_lens, num_kv_heads, num_sms,
                           min_keys_per_chunk=POLICY.pod_chunk_min_keys, slots_per_sm=slots,
                           fill=POLICY.pod_chunk_fill, waves=2)
    if n and POLICY.pod_chunk_long_size > 0:
        longest = max(int(k) for k, r in zip(kv_lens, qo_lens) if int(r))
        if longest >= POLICY.pod_chunk_long_keys:
            n = max(n, min(MAX_CHUNKS, -(-longest // POLICY.pod_chunk_long_size)))
    return n if n >= POLICY.pod_chunk_min_chunks else 0


def build_decode_chunks(qo_indptr: Sequence[int], kv_indptr: Sequence[int],
                        last_page_len: Sequence[int], page_size: int, chunks: int, *,
                        align_keys: int = 128, pad: bool = False) -> dict:
    """A batch as chunk requests (host tensors): each one-row request's keys cut into chunks.

    Request b's pages (kv_indptr[b] to kv_indptr[b + 1] of the page table) are cut into at
    most ``chunks`` runs of whole pages, each a multiple of ``align_keys`` keys where the pages
    allow (so that chunks start on key tiles); each run is a one-row request of its own over the
    same page table. A request without a row keeps one chunk request without a row over its
    pages (the chunks' kv_indptr stays contiguous); a row's request without keys has one chunk
    without pages (its output 0, LSE -inf); a request of several rows stays whole, one chunk
    request with its rows (a CUDA-graph plan re-planned with such a batch: the captured launches
    serve it). pad: every one-row request takes exactly ``chunks`` chunk requests, those past
    its pages without pages (output 0, LSE -inf: weight 0 in the merge), so that for a batch
    of one-row requests everything but kv_indptr and last_page_len depends on the batch size
    and ``chunks`` alone (a CUDA-graph POD plan re-planned into the same buffers). Returns
    int32 tensors:
    - qo_indptr [C + 1] (a chunk's rows), kv_indptr [C + 1] (offsets into the page table),
      last_page_len [C]: the chunk requests' index arrays;
    - src [R]: the query row each chunk row reads;
    - merge [M, 3]: per query row (out row, first chunk row, chunks), by row;
    and kv_lens, a list of each chunk request's keys (build_work's ordering).
    """
    qo = [int(x) for x in qo_indptr]
    kv = [int(x) for x in kv_indptr]
    lasts = [int(x) for x in last_page_len]
    align = max(1, align_keys // max(page_size, 1))
    c_qo, c_kv, c_last, c_keys, src, merge = [0], [kv[0]], [], [], [], []
    for b in range(len(qo) - 1):
        rows, pages = qo[b + 1] - qo[b], kv[b + 1] - kv[b]
        if rows != 1:  # no row (a placeholder over its pages), or several: whole
            for i in range(rows):
                merge += (qo[b] + i, len(src) + i, 1)
            src.extend(range(qo[b], qo[b + 1]))
            c_qo.append(c_qo[-1] + rows)
            c_kv.append(kv[b + 1])
            c_last.append(lasts[b])
            c_keys.append((pages - 1) * page_size + lasts[b] if pages else 0)
            continue
        per = -(-max(pages, 1) // max(chunks, 1))
        per = -(-per // align) * align if per > align else per
        n = max(1, -(-pages // per))
        total = max(n, chunks) if pad else n
        merge += (qo[b], len(src), total)
        # (by runs, not chunk by chunk: a plan cuts hundreds of chunks) n - 1 chunks of
        # ``per`` whole pages, the last chunk up to the request's last page (its last page's
        # count; none without pages), then the pad's chunks without pages
        full, rest = n - 1, total - n
        c_qo.extend(range(c_qo[-1] + 1, c_qo[-1] + total + 1))
        c_kv.extend(range(kv[b] + per, kv[b] + per * n, per))
        c_kv.extend([kv[b + 1]] * (1 + rest))
        c_last.extend([page_size] * full)
        c_last.append(lasts[b] if pages else 0)
        c_last.extend([0] * rest)
        c_keys.extend([per * page_size] * full)
        c_keys.append((pages - full * per - 1) * page_size + lasts[b] if pages else 0)
        c_keys.extend([0] * rest)
        src.extend([qo[b]] * total)
    return dict(qo_indptr=int32_host(c_qo), kv_indptr=int32_host(c_kv),
                last_page_len=int32_host(c_last), src=int32_host(src),
                merge=int32_host(merge, 3), kv_lens=c_keys)


def decode_chunk_capacity(batch_size: int, max_rows: int, group_size: int, block_m: int,
                          num_kv_heads: int, slots: int) -> dict:
    """The most entries build_decode_chunks and build_work over its chunk requests give a
    batch of ``batch_size`` requests and at most ``max_rows`` query rows, cut into
    decode_chunk_count's chunks for ``slots`` programs (slots_per_sm x num_sms), or one chunk a
    request: the sizes of a CUDA-graph plan's chunk buffers (requests, chunk rows, work rows,
    merge rows). Cut, R one-row requests take n <= slots // (R x num_kv_heads) chunks each, so
    at most slots // num_kv_heads chunk rows in all; uncut, a row each."""
    rows = max(max_rows, slots // max(num_kv_heads, 1))
    tiles = (max_rows * group_size + batch_size * (block_m - 1)) // block_m
    per_chunk = -(-group_size // block_m)  # a one-row chunk's tiles
    return dict(requests=rows + batch_size, rows=rows, work=max(tiles, rows * per_chunk),
                merge=max_rows)
