"""Argument validation shared by every public entry point, with messages that say how to fix.

Each check names the offending argument, states what was expected and what came in, and where
it helps, how to fix it. The checks are general (an indptr, a page table, head counts, a tensor
of some shape/dtype/device, a string option) so every entry-point family (FlashInfer-style
wrappers, the cuDNN and TRT-LLM adapters) reuses them. Checks that look at tensor *values*
(indptr arrays, page indices, mask lengths) run in plan(), on host copies; run() only checks
shapes, dtypes and devices, which never reads a device value. Errors are ValueError for a bad
value or shape, TypeError for a wrong type or dtype, NotImplementedError for an accepted
argument whose feature compiled_attn does not have.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence

import torch

from .ops.contracts import INTERPRET, FP8_DTYPES, check_kernel_head_dims, refuse_if_miscomputed

__all__: list[str] = []  # internal module: nothing is re-exported by compiled_attn

HALF_DTYPES = (torch.float16, torch.bfloat16)
POS_ENCODING_CODES = {"NONE": 0, "ROPE_LLAMA": 1, "ALIBI": 2}  # = ops.POS_* codes
BACKENDS = ("auto", "fa2", "fa3")


def _shape(t) -> tuple:
    return tuple(t.shape) if torch.is_tensor(t) else type(t).__name__


# --------------------------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------------------------
def check_kv_layout(layout, name: str = "kv_layout") -> str:
    if layout not in ("NHD", "HND"):
        raise ValueError(f"{name}: got {layout!r}; use 'NHD' (k/v [tokens, heads, dim]) or "
                         "'HND' ([heads, tokens, dim])")
    return layout


def check_pos_encoding_mode(mode, name: str = "pos_encoding_mode") -> int:
    """The op's integer code of a FlashInfer position-encoding name."""
    if mode not in POS_ENCODING_CODES:
        raise ValueError(f"{name}: got {mode!r}; use one of {sorted(POS_ENCODING_CODES)}")
    return POS_ENCODING_CODES[mode]


LSE_BASES = ("log2", "ln")
LSE_LAYOUTS = ("NH", "HN")


def check_lse_base(base, name: str = "lse_base") -> str:
    if base not in LSE_BASES:
        raise ValueError(f"{name}: got {base!r}; use 'log2' (FlashInfer's base-2 LSE, the "
                         "default) or 'ln' (natural log, as torch.logsumexp)")
    return base


def check_lse_layout(layout, name: str = "lse_layout") -> str:
    if layout not in LSE_LAYOUTS:
        raise ValueError(f"{name}: got {layout!r}; use 'NH' ([tokens, Hq], the default) or "
                         "'HN' (its contiguous transpose [Hq, tokens])")
    return layout


WINDOW_ALL = 2 ** 31 - 1  # key positions are int32: a window this wide sees every key


def check_window_left(w, name: str = "window_left") -> int:
    """Any integer type (a numpy integer too, by operator.index; not bool) -> a Python int. A
    negative window is no window (-1), as FlashInfer turns it on for window_left >= 0 only. A
    window of WINDOW_ALL (2^31 - 1) keys or more reaches every key position (positions are
    int32), so it is no window either (the kernels then never see an integer past int32)."""
    try:
        wi = None if isinstance(w, bool) else operator.index(w)
    except TypeError:
        wi = None
    if wi is None:
        raise ValueError(f"{name}: got {w!r}; use an int >= 0 (keys j >= position - window_left "
                         "are seen) or -1 to disable the window")
    return -1 if wi < 0 or wi >= WINDOW_ALL else int(wi)


def check_soft_cap(c, name: str = "logits_soft_cap") -> float:
    """None, 0 or a negative value -> 0.0 (disabled: FlashInfer caps for a value > 0 only)."""
    if c is None:
        return 0.0
    c = _number(name, c)
    if not math.isfinite(c):
        raise ValueError(f"{name}: got {c!r}; use a finite value > 0 to cap the logits at "
                         "c * tanh(s / c), or 0 / None to disable")
    return fits_float32(name, c) if c > 0 else 0.0


def is_number(x) -> bool:
    """A real number: anything float() takes but a string, a bool or a complex number."""
    if isinstance(x, (torch.SymInt, torch.SymFloat)):  # (a traced size: hasattr would break)
        return True
    return (not isinstance(x, (str, bytes, bool, complex)) and hasattr(x, "__float__")
            and not (torch.is_tensor(x) and (x.dtype.is_complex or x.dtype == torch.bool)))


def _number(name: str, x) -> float:
    """A real number (is_number) as a float."""
    if not is_number(x):
        raise TypeError(f"{name}: got {x!r}; pass a number")
    return float(x)


def check_count(name: str, n, least: int) -> None:
    """n is an integer (anything with __index__, a traced size included; not a bool) >= least.
    A traced symbolic size is compared as it is (operator.index would make it a constant)."""
    try:
        ok = not isinstance(n, bool) and (n if isinstance(n, (int, torch.SymInt))
                                          else operator.index(n)) >= least
    except TypeError:
        ok = False
    if not ok:
        raise ValueError(f"{name}: got {n!r}; pass an int >= {least}")


def check_scale(name: str, x, default: float, *, positive: bool = True) -> float:
    """A float option (sm_scale, rope_scale, rope_theta); None -> default."""
    if x is None:
        return float(default)
    if torch.is_tensor(x):
        raise TypeError(f"{name}: got a tensor; pass a Python float")
    x = _number(name, x)
    if not math.isfinite(x) or (positive and x <= 0):
        raise ValueError(f"{name}: got {x!r}; use a finite value{' > 0' if positive else ''}")
    return fits_float32(name, x)


FLOAT32_MAX = torch.finfo(torch.float32).max


def fits_float32(name: str, x: float) -> float:
    """x (finite) within float32's range: the kernels compute every scale and cap in float32,
    where a larger value is inf and turns rows into NaN or zeros."""
    if abs(x) > FLOAT32_MAX:
        raise ValueError(f"{name}: got {x!r}, beyond float32's range (|x| <= {FLOAT32_MAX:.4g}) "
                         "in which the kernel computes it; pass a smaller value")
    return x


def host_scale(name: str, x) -> float:
    """A calibration scale (q_scale, k_scale) given as a float or a one-element tensor. A CPU
    tensor is read on the host (not in a traced call, where it raises); a device tensor would
    need a device read (run() must not do one), so it raises."""
    if x is None:
        return 1.0
    if torch.is_tensor(x):
        if x.numel() != 1:
            raise NotImplementedError(
                f"{name}: got a tensor of shape {tuple(x.shape)}; only a scalar scale is "
                "supported (per-head scales are not): pass a Python float")
        if x.device.type != "cpu":
            raise NotImplementedError(
                f"{name}: got a {x.device.type} tensor; the kernel takes this scale as a host "
                f"float and run() never reads device values: pass float({name}) (or a CPU "
                "tensor) instead")
        if traced():
            raise NotImplementedError(
                f"{name}: got a tensor, which is read on the host, and torch.compile / "
                f"torch.export would make that read a data-dependent guard: pass float({name}) "
                "(read outside the compiled region)")
        x = check_readable(name, x).item()
    x = _number(name, x)
    if not math.isfinite(x):
        raise ValueError(f"{name}: got {x!r}; use a finite float")
    return fits_float32(name, x)


def check_backend(backend, name: str = "backend") -> str:
    if backend in BACKENDS:
        return backend
    if backend in ("cudnn", "trtllm-gen", "cute-dsl", "trtllm", "cutlass", "fmha_v2"):
        raise NotImplementedError(
            f"{name}={backend!r}: compiled_attn runs its own Triton kernel for every backend "
            f"name in {BACKENDS}; for the cuDNN / TRT-LLM entry points call "
            "compiled_attn.cudnn_batch_prefill_with_kv_cache / "
            "compiled_attn.trtllm_fmha_v2_prefill")
    raise ValueError(f"{name}: got {backend!r}; use one of {BACKENDS}")


def traced() -> bool:
    """Whether torch.compile is tracing this call. A wrapper's run() then reads no host number
    of its plan that changes with the lengths (row counts, the largest page index): each would
    become a guard, one recompile per re-plan (past the recompile limit, a failure under
    fullgraph=True). It checks the plan's device tensors by device asserts instead. Also True
    under a FakeTensorMode: an entry point in the graph as one call (op_call.graph_leaf) runs on
    fake tensors outside Dynamo's trace, where torch 2.11 answers is_compiling() False."""
    return torch.compiler.is_compiling() or on_fake_tensors()


def on_fake_tensors(_mode=torch._C._get_dispatch_mode,
                    _fake=torch._C._TorchDispatchModeKey.FAKE) -> bool:
    """Whether a FakeTensorMode is active (torch.compile or torch.export running a call on fake
    tensors, or a caller's own mode)."""
    return _mode(_fake) is not None


def exporting() -> bool:
    """Whether torch.export is tracing this call: the flag torch.export sets while it traces.
    (torch.compiler.is_exporting() does not tell: Dynamo answers it True under every
    torch.compile trace on torch 2.11, as it answers is_compiling().)"""
    return bool(getattr(torch.compiler, "_is_exporting_flag", False))


def device_check(cond: torch.Tensor, msg: str) -> None:
    """A check on device values without a host read (capturable in a CUDA graph): a device-side
    assert under CUDA, which surfaces at the next synchronisation; on CPU it raises at once."""
    torch._assert_async(cond.all(), msg)


def rows_match(what: str, n, indptr_name: str, indptr: torch.Tensor, total: int | None,
               at_least: bool = False) -> bool:
    """Whether argument ``what``'s n rows hold the plan's indptr[-1] rows (its host count
    ``total``; indptr_name names it): exactly, or at least (CUDA-graph buffers). Traced
    (traced()), the host count would be a guard (callers pass None): a device assert on the
    plan's indptr checks it, and this returns True."""
    if traced():
        rows = indptr[-1]
        device_check(rows <= n if at_least else rows == n,
                     f"{what}: rows do not match the plan's {indptr_name}[-1] (at least that "
                     "many for ragged k / v and with use_cuda_graph=True); re-plan for new "
                     "shapes")
        return True
    return n >= total if at_least else n == total


def unsupported(name: str, what: str) -> None:
    """Raise for an accepted argument whose feature is missing (no silent fallback)."""
    raise NotImplementedError(f"{name}: {what}")


def reject_if_set(name: str, value, what: str, default=None) -> None:
    if value is not default and not (default is not None and value == default):
        unsupported(name, what)


def check_enable_pdl(enable_pdl) -> None:
    if enable_pdl:
        unsupported("enable_pdl", "programmatic dependent launch is not implemented for the "
                    "Triton kernel; pass None (auto) or False")


# --------------------------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------------------------
def canonical_dtype(name: str, dt) -> torch.dtype:
    """A torch.dtype from a dtype or its name ('float16', 'torch.bfloat16', ...)."""
    if isinstance(dt, torch.dtype):
        return dt
    if isinstance(dt, str):
        got = getattr(torch, dt.removeprefix("torch."), None)
        if isinstance(got, torch.dtype):
            return got
    raise TypeError(f"{name}: got {dt!r}; pass a torch.dtype or its name, e.g. torch.float16 "
                    "or 'bfloat16'")


def _float_dtypes(device_type: str) -> tuple:
    base = HALF_DTYPES + (torch.float32,)
    return base if device_type == "cuda" else base + (torch.float64,)


def check_q_dtype(name: str, dt: torch.dtype, device_type: str) -> None:
    if dt in FP8_DTYPES:
        unsupported(name, f"{dt} queries (fp8 attention with per-head q/k/v scales) are not "
                    "supported; keep q in fp16/bf16 (fp8 K/V with k_scale/v_scale is supported)")
    ok = _float_dtypes(device_type)
    if dt not in ok:
        raise TypeError(f"{name}: got {dt}; on {device_type} use one of {list(ok)}")
    check_interpreter(name, dt, device_type)


def check_interpreter(name: str, dt: torch.dtype, device_type: str) -> None:
    """Under TRITON_INTERPRET=1 CPU tensors run the Triton kernel in the interpreter, which
    computes bfloat16 dot products and rounds to fp8 wrongly (CI tests float16 / float32
    there): a bfloat16 q (or one computed as bfloat16) or an fp8 output raises instead of
    returning wrong numbers. (fp8 K/V inputs are upcast right and pass.)"""
    if device_type == "cpu":
        refuse_if_miscomputed(name, dt)


def check_kv_dtype(name: str, dt: torch.dtype, device_type: str) -> None:
    ok = _float_dtypes(device_type) + FP8_DTYPES
    if dt not in ok:
        raise TypeError(f"{name}: got {dt}; on {device_type} use one of {list(ok)} (fp8 K/V "
                        "take k_scale / v_scale at run time)")


def check_qkv_dtypes(q_dt: torch.dtype, k_dt: torch.dtype, v_dt: torch.dtype,
                     names: Sequence[str] = ("q", "k", "v")) -> None:
    """K and V share one dtype, and unless it is fp8 it is q's (an fp8 q runs as bf16, so it
    goes with bf16 or fp8 K/V)."""
    if k_dt != v_dt:
        raise TypeError(f"{names[1]} / {names[2]}: dtypes {k_dt} and {v_dt} differ; pass K and "
                        "V in one dtype")
    q_run = torch.bfloat16 if q_dt in FP8_DTYPES else q_dt
    if k_dt not in FP8_DTYPES and k_dt != q_run:
        raise TypeError(f"{names[1]}: dtype {k_dt} differs from {names[0]}'s {q_dt}; use one "
                        "dtype (only fp8 K/V may differ from q)")


def check_out_dtype(name: str, dt: torch.dtype, device_type: str) -> None:
    ok = _float_dtypes(device_type)
    if dt not in ok:
        raise TypeError(f"{name}: got {dt}; on {device_type} the output can be one of "
                        f"{list(ok)}")


# --------------------------------------------------------------------------------------------
# tensors
# --------------------------------------------------------------------------------------------
def check_tensor(name: str, t, *, ndim: int | None = None, shape: Sequence | None = None,
                 dtypes: Sequence[torch.dtype] | None = None, device=None,
                 what: str = "", device_of: str = "the wrapper's workspace buffer / of q"
                 ) -> torch.Tensor:
    """t is a tensor with this ndim / exact shape (None entries are free) / dtype / device.
    what: the expected layout in words, e.g. '[tokens, Hq, D_qk]'; device_of: what sets the
    device (named in the message)."""
    desc = f" {what}" if what else ""
    if not torch.is_tensor(t):
        raise TypeError(f"{name}: expected a tensor{desc}; got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name}: expected a {ndim}-D tensor{desc}; got shape {tuple(t.shape)}")
    if shape is not None:
        # (sizes compared as they are: int() of a traced symbolic size would specialise it)
        if t.dim() != len(shape) or any(s is not None and s != d
                                        for s, d in zip(shape, t.shape)):
            want = tuple("*" if s is None else int(s) for s in shape)
            raise ValueError(f"{name}: expected shape {want}{desc}; got {tuple(t.shape)}")
    if dtypes is not None and t.dtype not in tuple(dtypes):
        raise TypeError(f"{name}: expected dtype {' or '.join(map(str, dtypes))}; got {t.dtype}")
    if device is not None and t.device != torch.device(device):
        raise ValueError(f"{name}: is on {t.device} but must be on {torch.device(device)} "
                         f"(the device of {device_of}); move it with .to()")
    return t


def _is_int_dtype(dt: torch.dtype) -> bool:
    return not dt.is_floating_point and not dt.is_complex and dt != torch.bool


def check_int(name: str, t: torch.Tensor) -> torch.Tensor:
    """t (a tensor) holds integers: a float index would be truncated silently."""
    if not _is_int_dtype(t.dtype):
        raise TypeError(f"{name}: expected an integer dtype (int32); got {t.dtype}; pass "
                        "integer indices / lengths (e.g. .to(torch.int32))")
    return t


def check_readable(name: str, t: torch.Tensor) -> torch.Tensor:
    """t's values can be read: a tensor on the meta device has a shape but no data, so a
    host copy or .item() of it would fail without naming the argument."""
    if t.device.type == "meta":
        raise ValueError(f"{name}: is on the meta device, which holds no values; pass a tensor "
                         "with data (on the CPU or the device the call runs on)")
    return t


def check_writable(name: str, t: torch.Tensor) -> torch.Tensor:
    """t (an output buffer: out=, lse=) has distinct elements: an expanded view (stride 0 along
    a dimension of size > 1) would have several results written to one element."""
    if any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape)):
        raise ValueError(f"{name}: is an expanded view (stride 0 along a dimension of size > 1, "
                         f"strides {tuple(t.stride())}), so results would overwrite each other; "
                         "pass a buffer with one element per result, e.g. torch.empty(...)")
    return t


def lengths(offsets: list) -> list:
    """The segment lengths of an indptr read as a list ([B + 1] offsets -> [B]): the plans
    work on lists (each torch op on a small host tensor costs microseconds)."""
    return list(map(operator.sub, offsets[1:], offsets))


def host_copy(name: str, t: torch.Tensor, hosts: dict | None = None,
              span: tuple[int, int] | None = None) -> torch.Tensor:
    """A host copy of integer argument ``name`` (a device sync when it lives on a GPU): int32
    where t is int32, else int64 (a plan sends its index arrays to the device as int32, and
    each dtype conversion of a small tensor costs microseconds). Always a copy, also of a host
    tensor: a plan's asynchronous copies to the device read it after plan() returns, when the
    caller may already be refilling its own (pinned) buffer. hosts: _host.gather_host's copies
    of a plan's arguments, {id(tensor): copy}; t's is taken from there when it is one of them.
    span: (start, end), only entries start..end-1 of a 1-D t."""
    if hosts and id(t) in hosts:
        h = hosts[id(t)]
        return h if span is None else h[span[0]:span[1]]
    t = check_readable(name, t if span is None else t[span[0]:span[1]]).detach()
    return t.to("cpu", torch.int32 if t.dtype == torch.int32 else torch.int64, copy=True)


def host_indptr(name: str, t, *, length: int | None = None, start_zero: bool = True,
                length_from: str | None = None, hosts: dict | None = None) -> torch.Tensor:
    """A host copy (host_copy's, int32 or int64) of an indptr array, checked: 1-D integer, at
    least one entry, starts at 0 (start_zero; else at 0 or more), non-decreasing, and of
    length `length` when given (batch size + 1; length_from: what set it, named in the error:
    "qo_indptr", "last_page_len's 3 entries"); hosts: host_copy's."""
    if not torch.is_tensor(t):
        raise TypeError(f"{name}: expected a 1-D integer tensor [batch_size + 1]; got "
                        f"{type(t).__name__}")
    if t.dim() != 1 or t.numel() < 1:
        raise ValueError(f"{name}: expected a 1-D tensor [batch_size + 1]; got shape "
                         f"{tuple(t.shape)}")
    check_int(name, t)
    if length is not None and t.numel() != length:
        given = f" (the batch size of {length_from})" if length_from else ""
        raise ValueError(f"{name}: has {t.numel()} entries but batch_size + 1 = {length} are "
                         f"needed{given}: one offset per request plus the end")
    h = host_copy(name, t, hosts=hosts)
    # (checked on a list: a batch's offsets are few, and each torch op on a small host tensor
    # costs microseconds of dispatch; plan() is on a serving step's path)
    v = h.tolist()
    if v[0] != 0 and (start_zero or v[0] < 0):
        raise ValueError(f"{name}: must start at 0{'' if start_zero else ' or more'}; got "
                         f"{name}[0] = {v[0]}")
    if any(map(operator.lt, v[1:], v)):
        i = next(i for i in range(len(v) - 1) if v[i + 1] < v[i])
        raise ValueError(f"{name}: must be non-decreasing; {name}[{i + 1}] = {v[i + 1]} < "
                         f"{name}[{i}] = {v[i]}")
    if v[-1] >= 2 ** 31:
        raise ValueError(f"{name}: last entry {v[-1]} does not fit int32")
    return h


def check_total(name: str, host: torch.Tensor, total: int, what: str) -> None:
    """indptr[-1] equals the size of the tensor it splits."""
    if int(host[-1]) != int(total):
        raise ValueError(f"{name}: ends at {int(host[-1])} but {what} is {int(total)}; "
                         f"{name}[-1] must equal {what}")


class LargestPage:
    """A page table's largest index (``value``), and where it sits in the caller's indices
    (``position()``, found only for an error message: one host op fewer a plan)."""

    __slots__ = ("value", "_table", "_start")

    def __init__(self, value: int, table: torch.Tensor, start: int):
        self.value, self._table, self._start = value, table, start  # table: the host copy

    def position(self) -> int:
        """The first entry holding ``value``, counted in the caller's indices."""
        return self._start + int(torch.argmax(self._table))


def check_page_table(indptr: torch.Tensor, indices, last_page_len, page_size: int, *,
                     names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
                     hosts: dict | None = None) -> tuple:
    """Checks a page table (indptr [B+1] already through host_indptr(start_zero=False), in
    pages).

    indices: integer [>= indptr[-1]]: a pre-allocated buffer may be longer, and indptr may
    start past 0 (as in FlashInfer, whose kernels read entries indptr[b]..indptr[b+1]-1 only);
    entries outside indptr[0]..indptr[-1] are neither read nor checked. The entries used are
    >= 0 (the upper bound is the cache's page count, checked in run() by check_pages_in_cache).
    last_page_len: integer [B], in [1, page_size] for a request with pages, [0, page_size] for
    one without (its kv_len is 0 either way). Returns host copies (host_copy's) of the same table
    from 0 (indptr - indptr[0], indices[indptr[0]:indptr[-1]]), last_page_len, and kv_len, a
    list [B] of (pages - 1) * page_size + last_page_len (0 without pages: the plans read the
    lengths as lists), and the largest page index (a LargestPage; None without pages). hosts:
    host_copy's.
    """
    ind_n, idx_n, last_n = names
    if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size < 1:
        raise ValueError(f"page_size: got {page_size!r}; use a Python int >= 1")
    b = indptr.numel() - 1
    check_int(idx_n, check_tensor(idx_n, indices, ndim=1, what="[total pages]"))
    ind = indptr.tolist()  # (the per-request checks on lists: host_indptr says why)
    start, used = ind[0], ind[-1]
    if indices.numel() < used:
        raise ValueError(f"{ind_n}: ends at {used} but {idx_n} holds only {indices.numel()} "
                         f"entries; {idx_n} needs at least {ind_n}[-1] entries (entries past "
                         "it are ignored)")
    check_int(last_n, check_tensor(last_n, last_page_len, shape=(b,), what="[batch_size]"))
    idx_h = host_copy(idx_n, indices, hosts=hosts, span=(start, used))
    largest = None
    if idx_h.numel():
        lo, hi = map(int, torch.aminmax(idx_h))  # (one host op for both bounds)
        if lo < 0:
            i = int(torch.nonzero(idx_h < 0)[0, 0])
            raise ValueError(f"{idx_n}: entry {start + i} is {int(idx_h[i])}; page indices "
                             "must be >= 0")
        largest = LargestPage(hi, idx_h, start)
    last_h = host_copy(last_n, last_page_len, hosts=hosts)
    npages, lasts = lengths(ind), last_h.tolist()
    # (the per-request check only where the bounds over the batch leave a doubt: a decode
    # batch's plan has hundreds of requests)
    if not (b and min(npages) > 0 and 1 <= min(lasts) and max(lasts) <= page_size):
        for r, (n, last) in enumerate(zip(npages, lasts)):
            if not (1 if n > 0 else 0) <= last <= page_size:
                rng = "[1, page_size]" if n > 0 else "[0, page_size] (it has no pages)"
                raise ValueError(f"{last_n}: entry {r} is {last} but must be in {rng} with "
                                 f"page_size = {page_size}; it counts the tokens in the "
                                 "request's last page")
    kv_len = [(n - 1) * page_size + last if n > 0 else 0 for n, last in zip(npages, lasts)]
    return indptr - start if start else indptr, idx_h, last_h, kv_len, largest


def page_table(names, indptr, indices, last_page_len, page_size: int, *,
               length: int | None = None, length_from: str | None = None,
               hosts: dict | None = None) -> tuple:
    """A page table's checked host copies from 0, its indptr possibly starting past 0 (as
    FlashInfer's): host_indptr (start_zero=False) and check_page_table, with its largest page
    index (a LargestPage, None without pages). names: the indptr, indices and last_page_len
    arguments' names; length / length_from / hosts: host_indptr's. Returns (indptr, indices,
    last_page_len, kv_lens (a list), max_page)."""
    ind = host_indptr(names[0], indptr, length=length, start_zero=False,
                      length_from=length_from, hosts=hosts)
    return check_page_table(ind, indices, last_page_len, page_size, names=names, hosts=hosts)


def check_pages_in_cache(idx_name: str, largest: LargestPage | None, num_pages: int,
                         cache_name: str, indices: torch.Tensor) -> None:
    """Every page index of a plan inside a cache of num_pages pages. largest: the plan's
    largest index (check_page_table's, None without pages); indices: the plan's page table on
    the device. Traced (traced()), the host number would be a guard, so the device table is
    checked by a device assert instead."""
    if traced():
        # (the message names no size: formatting a symbolic one would guard on it)
        device_check((indices >= 0) & (indices < num_pages),
                     f"{idx_name}: an entry is outside {cache_name}'s pages; pass the cache the "
                     "plan's page table indexes, or re-plan with indices inside it")
        return
    if largest is not None and largest.value >= num_pages:
        pos, val = largest.position(), largest.value
        raise ValueError(f"{idx_name}: entry {pos} is {val} but {cache_name} has only "
                         f"{num_pages} pages (valid 0..{num_pages - 1}); pass the cache the plan's "
                         "page table indexes, or re-plan with indices inside it")


def _positive_int(name: str, v) -> None:
    """v a Python int >= 1 (a shape's symbolic int in a traced call)."""
    if isinstance(v, bool) or not isinstance(v, (int, torch.SymInt)) or v < 1:
        raise ValueError(f"{name}: got {v!r}; use a Python int >= 1")


def check_heads(num_qo_heads, num_kv_heads, names=("num_qo_heads", "num_kv_heads")) -> int:
    """Returns the group size Hq / Hkv."""
    qn, kn = names
    for n, v in ((qn, num_qo_heads), (kn, num_kv_heads)):
        _positive_int(n, v)
    if num_qo_heads % num_kv_heads:
        raise ValueError(f"{qn} = {num_qo_heads} is not a multiple of {kn} = {num_kv_heads}; "
                         "each KV head serves a whole group of query heads (GQA), so use a head "
                         "count divisible by the KV head count")
    return num_qo_heads // num_kv_heads


def check_head_dims(head_dim_qk, head_dim_vo, device_type: str,
                    names=("head_dim_qk", "head_dim_vo")) -> None:
    """Positive ints; on CUDA (and on CPU under TRITON_INTERPRET=1, where the kernel runs) each
    one the kernel runs (ops.contracts.KERNEL_HEAD_DIMS: multiples of 8 from 16 to 256, and
    512; any pair of them); on CPU any."""
    qn, vn = names
    for n, v in ((qn, head_dim_qk), (vn, head_dim_vo)):
        _positive_int(n, v)
    if device_type == "cuda" or (INTERPRET and device_type == "cpu"):
        check_kernel_head_dims(head_dim_qk, head_dim_vo, names)


def check_rope_dim(head_dim_qk: int, pos_code: int) -> None:
    if pos_code == POS_ENCODING_CODES["ROPE_LLAMA"] and head_dim_qk % 2:
        raise ValueError(f"pos_encoding_mode='ROPE_LLAMA' needs an even head_dim_qk; got "
                         f"{head_dim_qk}")


def _words(what) -> str:
    """An error message's part given as a string, or as a callable building it only when the
    check fails (a traced call's symbolic sizes formatted into a string would be
    specialised: a recompile for every length)."""
    return what() if callable(what) else what


def mask_bool_length(name: str, mask, expected: int, what) -> None:
    """A custom mask holds exactly `expected` entries (any shape; read flattened): bool, or
    an integer type whose nonzero entries attend (FlashInfer packs ``mask.to(torch.bool)``). A
    floating mask raises: FlashInfer would read its nonzero entries as attend, which inverts
    an additive mask (0 attend, -inf masked)."""
    check_readable(name, check_tensor(name, mask))
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise TypeError(f"{name}: expected a bool (or integer) mask, True / nonzero = attend; "
                        f"got {mask.dtype}. A floating mask is not taken: read as FlashInfer "
                        "reads it (nonzero = attend) an additive mask (0 = attend, -inf = "
                        "masked) would be inverted; pass mask.bool() for a 0/1 mask, or "
                        "mask == 0 for an additive one")
    if mask.numel() != expected:
        raise ValueError(f"{name}: has {mask.numel()} entries but the plan needs {expected} "
                         f"({_words(what)}); a mask of another length would be read out of "
                         "bounds")


def mask_packed_length(name: str, packed, expected_bytes: int | None, what,
                       device_total: torch.Tensor | None = None) -> torch.Tensor:
    """The packed mask, checked (uint8 [expected_bytes]), contiguous: the kernels read it by a
    bare pointer, so a strided view is copied. Traced (traced()) with device_total (a
    one-element device tensor of the plan's byte count; expected_bytes may then be None), a
    device assert checks the length: the host count would be a guard."""
    check_readable(name, check_tensor(name, packed, ndim=1, dtypes=(torch.uint8,)))
    if device_total is not None and traced():
        device_check(device_total == packed.shape[0], f"{name}: its bytes are not the plan's "
                     f"{_words(what)}")
        return packed.contiguous()
    if packed.numel() != expected_bytes:
        raise ValueError(f"{name}: has {packed.numel()} bytes but the plan needs "
                         f"{expected_bytes} ({_words(what)}); pack the bool mask with "
                         "compiled_attn.segment_packbits(mask, indptr, bitorder='little') "
                         "(per-request segments, whole bytes each) or packbits(..., "
                         "bitorder='little') for a single request")
    return packed.contiguous()
