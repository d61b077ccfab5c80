"""Bound launches: an eager op call's kernel launches, decided once and replayed.

An eager call spends its host time deciding what to launch (the launch policy: kernel, tile,
K/V path, grid; views and tensor descriptors) and in Triton's JIT dispatch (binding the
arguments, the specialisation key, the kernel-cache lookup). All of it depends only on the
call's metadata: shapes, strides, dtypes, devices, pointer alignment and which tensors alias,
the plain-number arguments, the current device and the launch policy's state. So the first
call with a given metadata runs the full path under a ``Recorder``, which notes every kernel
launch (the compiled kernel, its grid, each argument) and where each tensor argument comes
from: one of the call's tensors (or a view starting at its pointer), one of the call's outputs,
or a scratch buffer the launch path allocated through ``scratch`` / ``counter``. Later calls
with the same metadata replay that: allocate the outputs and scratch, substitute the new
pointers, and call each compiled kernel's own launcher (``CompiledKernel.run``, the call
Triton's JIT makes last; the same on triton 3.6 to 3.9).

Invariants:
- A call whose launches the recorder cannot explain (a tensor argument of unknown origin, an
  argument of a type it does not know) is never bound: every call with its key takes the full
  path. Nothing is guessed.
- The launch path reads no device value on the host (the op contract), so metadata decides
  everything a launch depends on; the key holds all of it, including the policy's version
  (``policy.version``: a scoped override bumps it) and the programs cap in force
  (``programs_cap``).
- A call under CUDA-graph capture, with a launch hook installed (profilers) or under any mode
  that observes ops never replays (``unobserved`` decides the latter).
- A call launches on the stream current when it began, or also on one second stream that it
  forks from that stream and joins back inside ``two_streams`` (POD's parts side by side): a
  replay redoes the fork, each launch on its stream, and the join, in the recorded order. A
  launch on any other stream makes the call unbound.
- Under the Triton interpreter a replay calls the interpreted kernel with views rebuilt from the
  recorded geometry, so CI runs the same record / replay logic on the real kernel code; on a GPU
  it passes pointers as integers, which Triton's launchers accept.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import operator
import threading

import torch

from .modes import INTERPRET
from .policy import Policy

try:  # whether wrap_triton traces (private; torch 2.11-2.13)
    from torch._library.triton import is_wrap_triton_enabled, set_wrap_triton_enabled
except ImportError:  # pragma: no cover - no bound launches then
    is_wrap_triton_enabled = set_wrap_triton_enabled = None

try:  # the per-tensor half of a key checked in C++ (Dynamo's tensor guards: Python type,
    # dispatch keys under the thread's dispatch state, dtype, device index, requires_grad,
    # sizes, strides; private; torch 2.11-2.13): Memo.replay_fast. Tried once here: a torch
    # whose guards take other arguments keys every call in Python, as without them.
    from torch._C._dynamo.guards import TensorGuards as _TensorGuards

    _probe = torch.empty(2, 3)
    if not _TensorGuards(_probe, dynamic_dims_sizes=[[2, 3]],
                         dynamic_dims_strides=[[3, 1]]).check(_probe):
        _TensorGuards = None
    del _probe
except Exception:  # noqa: BLE001  (pragma: no cover - another torch)
    _TensorGuards = None

try:  # Triton's launch hooks (profilers); replays are skipped while one is set
    from triton import knobs as _knobs
except ImportError:  # pragma: no cover
    _knobs = None


# ---------------------------------------------------------------------------------------------
# the recorder and the launch path's hooks
# ---------------------------------------------------------------------------------------------
class _Unbindable(Exception):
    """A recorded call cannot be replayed (the message says why; kept for tests)."""


class Recorder:
    """What one call launched: its launches in order, and the scratch buffers the launch path
    asked for (by pointer: how to allocate each again). It holds those buffers until the call
    is bound: one freed inside the call (a launcher's own scratch) could otherwise hand its
    address to a later allocation of the same call (an output), and the binding would take a
    launch's scratch argument for that output."""

    def __init__(self):
        self.launches: list = []   # (fn, grid, bound args (list), options (dict), compiled)
        self.scratch: dict = {}    # data_ptr -> (kind "empty" / "zeros" / "reset", shape, dtype)
        self.held: list = []       # the scratch tensors, alive while the call is recorded
        self.problem: str | None = None
        self.stream = _stream_now()  # the call's stream (role 0)
        # two_streams: (the second stream's handle, the getter of a thread's second stream)
        self.side: tuple | None = None
        self.roles: list = []      # each launch's stream: 0 the call's, 1 the second
        self.waits: list = []      # (launches before it, waiting role, role waited on)
        self.side_counters: set = set()  # counter slots taken on the second stream (data_ptr)


def _stream_now():
    """The current CUDA stream's handle (of the current device), None without CUDA."""
    if not torch.cuda.is_available():
        return None
    return torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())


class _Local(threading.local):
    """Per thread (threads record apart). The defaults are class attributes: a missing
    attribute of a thread-local costs a raised AttributeError (about a microsecond) at each
    read."""

    rec: Recorder | None = None  # the recorder of the call this thread is recording, if any
    cap: int = 0                 # programs_cap's value in force
    streams: dict | None = None  # two-stream replays: _stream_object's and _events' own
    events: dict | None = None


_TLS = _Local()


def _recorder() -> Recorder | None:
    return _TLS.rec


@contextlib.contextmanager
def programs_cap(programs: int):
    """Persistent Gluon launches made inside run at most ``programs`` programs at once, each
    a SM of its own where programs <= SMs (choose then runs the 64-row D 128 paged tile's
    decode rows on the swapped products, or deepens its K / V ring): POD's decodes side by
    side with its prefill (compiled_attn.pod), which takes the other SMs.
    Part of every launch key made inside (Memo.eager_key), so a bound call replays its own
    grid. 0: the launch's own grid. Per thread."""
    saved = _TLS.cap
    _TLS.cap = int(programs)
    try:
        yield
    finally:
        _TLS.cap = saved


def programs_cap_now() -> int:
    """programs_cap's value in force (0: none)."""
    return _TLS.cap


def scratch(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """An uninitialised buffer the launch path needs beside its outputs (split-KV partials)."""
    t = torch.empty(shape, dtype=dtype, device=device)
    rec = _recorder()
    if rec is not None:
        rec.scratch[t.data_ptr()] = ("empty", tuple(shape), dtype)
        rec.held.append(t)
    return t


def adopt_scratch(t: torch.Tensor) -> None:
    """Mark a tensor the launch path allocated itself (an op's output that a later launch of
    the same call reads) as scratch of the call being recorded, so that a replay allocates it
    again; nothing outside a recording."""
    rec = _recorder()
    if rec is not None:
        if not t.is_contiguous():  # (a replay allocates scratch contiguous)
            rec.problem = rec.problem or "an adopted scratch tensor is not contiguous"
        rec.scratch[t.data_ptr()] = ("empty", tuple(t.shape), t.dtype)
        rec.held.append(t)


# Work counters of eager launches come from a zeroed pool per (device, stream): a slot a launch,
# the whole pool zeroed again (one memset, ordered after every launch that used it) when spent.
# A launch being captured into a CUDA graph takes a fresh zeroed tensor instead (the graph's
# memset re-zeroes it at every replay), unless its kernel leaves the counter 0 (below).
POOL_SLOTS = 4096
_POOLS: dict = {}


def _pool_slot(device: torch.device, stream: int | None = None) -> tuple[torch.Tensor, int]:
    """A slot of the zeroed counters of a stream of device: ``stream`` (a raw handle), the
    current one by default. A spent pool is zeroed again in its stream's order."""
    if stream is None:
        stream = torch._C._cuda_getCurrentRawStream(device.index)
    key = (device.index, stream)
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = [torch.zeros(POOL_SLOTS, dtype=torch.int32, device=device), 0]
    t, i = pool
    if i == POOL_SLOTS:
        if stream == torch._C._cuda_getCurrentRawStream(device.index):
            t.zero_()
        else:  # (a replay's second stream, two_streams: zeroed in that stream's order)
            with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=device)):
                t.zero_()
        i = 0
    pool[1] = i + 1
    return t, i


# Counters of captured launches whose kernel puts its counter back to 0 when it ends
# (counter(resets=True): the Gluon kernel's persistent programs): slots of a buffer per device,
# zeroed outside any capture, one slot per captured launch and never handed out again (so
# graphs replayed at once, on any streams, never share one), and the graph holds no memset
# before the launch (about 1.5-2 us a replay of a small decode batch, benchmarks/NOTES.md,
# 2026-11-29). Made by the device's first eager launch of such a kernel (torch.cuda.graph
# synchronizes the device before it captures, so the zeroing has run by then); a capture before
# any, or past GRAPH_SLOTS captured launches, takes a fresh zeroed tensor, as other kernels' do.
GRAPH_SLOTS = 1 << 16
_GRAPH_POOLS: dict = {}
_GRAPH_LOCK = threading.Lock()  # (two threads capturing on one device take distinct slots)


def _launch_real() -> bool:
    """Whether the launch path runs on real tensors (untraced, and not wrap_triton's tracing):
    only then may a launch's counter come from a pool (a traced graph must own its counter)."""
    return untraced() and not (is_wrap_triton_enabled is not None and is_wrap_triton_enabled())


def _graph_slot(index: int) -> torch.Tensor | None:
    """A slot of the device's graph counters never handed out before, or None (no buffer yet,
    or every slot taken)."""
    with _GRAPH_LOCK:
        pool = _GRAPH_POOLS.get(index)
        if pool is None or pool[1] >= GRAPH_SLOTS:
            return None
        i = pool[1]
        pool[1] = i + 1
    return pool[0][i:i + 1]


def counter(device, resets: bool = False) -> torch.Tensor:
    """A zeroed int32 [1] work counter (persistent grids claim items from it). resets: the
    launch leaves it 0 again, so a CUDA graph capturing it may take a slot zeroed once
    (_GRAPH_POOLS) instead of a tensor its every replay zeroes."""
    device = torch.device(device)
    t = None
    if device.type == "cuda" and _launch_real():
        index = torch.cuda.current_device() if device.index is None else device.index
        device = torch.device("cuda", index)
        if not torch.cuda.is_current_stream_capturing():
            if resets and index not in _GRAPH_POOLS:
                with _GRAPH_LOCK:
                    _GRAPH_POOLS.setdefault(index, [torch.zeros(
                        GRAPH_SLOTS, dtype=torch.int32, device=device), 0])
            if resets and _recorder() is not None:
                # (a recording takes the stream's own slot, as its replays do: one address,
                # one alignment, so that every recording of the launch specializes its
                # pointer alike and two of them compare equal, Bound.same_but_sizes)
                t = _reset_slot(device, torch._C._cuda_getCurrentRawStream(index))[0]
            else:
                t, i = _pool_slot(device)
                t = t[i:i + 1]
        elif resets:
            t = _graph_slot(index)
    if t is None:
        t = torch.zeros(1, dtype=torch.int32, device=device)
    rec = _recorder()
    if rec is not None:
        # (a counter its launch leaves 0: a replay passes its stream's own slot, _reset_slot)
        rec.scratch[t.data_ptr()] = ("reset" if resets else "zeros", (1,), torch.int32)
        if rec.side is not None and _stream_now() == rec.side[0]:
            rec.side_counters.add(t.data_ptr())
    return t


@contextlib.contextmanager
def two_streams(side_of, device):
    """Launches of a call on two CUDA streams at once: on entry the second stream,
    ``side_of(device)`` (a thread's own stream, made once by the caller's getter), waits for
    the current one (the fork); inside, launches made under ``torch.cuda.stream(<yielded
    stream>)`` run on it and the others on the current stream; on exit (also when the body
    raises, so that a CUDA graph's capture stays joined) the current stream waits for the
    second (the join). A recording call notes the fork, each launch's stream and the join, and
    its replay redoes them in order on the replaying thread's streams (Bound). One second
    stream a call: a nested use makes the call unbound."""
    side = side_of(device)
    cur = torch.cuda.current_stream(device)
    rec = _recorder()
    if rec is not None:
        if rec.side is not None or cur.cuda_stream != rec.stream:
            rec.problem = rec.problem or "two_streams nested, or not on the call's stream"
        else:
            rec.side = (side.cuda_stream, side_of)
    _wait(rec, side, cur, (1, 0))
    try:
        yield side
    finally:
        _wait(rec, cur, side, (0, 1))


def _wait(rec: Recorder | None, waiter, on, roles: tuple[int, int]) -> None:
    """waiter waits for the work queued on ``on`` so far (stream.wait_stream); a recording
    notes it between its launches, by the streams' roles (two_streams)."""
    waiter.wait_stream(on)
    if rec is not None:
        rec.waits.append((len(rec.launches), *roles))


_PARAMS: dict = {}


def _bound_args(fn, args: tuple, kwargs: dict):
    """The kernel's arguments in parameter order (constexprs included, defaults filled: what
    Triton's JIT passes to CompiledKernel.run) and the launch options (the other keywords)."""
    params = _PARAMS.get(fn)
    if params is None:
        params = _PARAMS[fn] = list(inspect.signature(fn.fn).parameters.values())
    names = [p.name for p in params]
    vals = list(args)
    for p in params[len(args):]:
        if p.name in kwargs:
            vals.append(kwargs[p.name])
        elif p.default is not p.empty:
            vals.append(p.default)
        else:
            raise _Unbindable(f"{fn.fn.__name__}: no value for {p.name}")
    options = {k: v for k, v in kwargs.items() if k not in names}
    return vals, options


def _kernel(fn):
    """Triton kernel fn as the op implementations launch it: through wrap_triton (a traced call
    becomes a kernel node Inductor inlines; an eager one runs it), the bare kernel under the
    interpreter."""
    if INTERPRET:
        return fn
    from torch.library import wrap_triton

    return wrap_triton(fn)


def run(fn, grid, *args, **kwargs):
    """Launch Triton kernel ``fn`` over ``grid`` (_kernel): every Triton launch of the op
    implementations goes through here; a recording call also notes the launch."""
    if _recorder() is None:
        return _kernel(fn)[grid](*args, **kwargs)
    return _record(fn, grid, args, kwargs)


def run_direct(fn, grid, *args, **kwargs):
    """Launch a kernel that is never traced (the Gluon kernel: eager launches only) over grid;
    a recording call also notes the launch."""
    if _recorder() is None:
        return fn[grid](*args, **kwargs)
    return _record(fn, grid, args, kwargs)


def _record(fn, grid, args, kwargs):
    rec = _recorder()
    stream = _stream_now()
    if stream == rec.stream:
        rec.roles.append(0)
    elif rec.side is not None and stream == rec.side[0]:
        rec.roles.append(1)
    else:
        rec.roles.append(0)
        rec.problem = rec.problem or "a launch on another stream than the call's"
    try:
        vals, options = _bound_args(fn, args, kwargs)
    except _Unbindable as e:
        rec.problem = rec.problem or str(e)
        vals, options = None, None
    compiled = fn[grid](*args, **kwargs)  # eager: wrap_triton is off while recording
    rec.launches.append((fn, tuple(grid), vals, options, compiled))
    return compiled


# ---------------------------------------------------------------------------------------------
# keys
# ---------------------------------------------------------------------------------------------
def _flatten(values, out: list) -> list:
    """values with tuples / lists (a (k, v) cache) flattened, in order."""
    for a in values:
        if isinstance(a, (tuple, list)):
            _flatten(a, out)
        else:
            out.append(a)
    return out


def _flat_values(values) -> list | None:
    """A key's values with its tuple and list arguments (a (k, v) cache) flattened, or None
    where one is empty (no key: the checks name it)."""
    if any(isinstance(a, (tuple, list)) and not a for a in values):
        return None
    return _flatten(values, [])


def _distinct(tensors: list) -> list:
    """tensors with each object once, in order (Dynamo's tensor guards refuse one passed
    twice; the key's aliasing pattern says where it was)."""
    return list({id(t): t for t in tensors}.values())


def _alias_pattern(ptrs: list) -> tuple:
    """For each tensor, the first tensor with the same pointer (aliasing is part of the key:
    the recorded sources of pointer arguments assume it)."""
    return tuple(ptrs.index(p) for p in ptrs)


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last + 1) bytes of t's elements (non-negative strides; empty: an empty span)."""
    lo = t.data_ptr()
    if t.numel() == 0 or any(st < 0 for st in t.stride()):
        return lo, lo
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride()))
    return lo, lo + (last + 1) * t.element_size()


# ---------------------------------------------------------------------------------------------
# a bound call
# ---------------------------------------------------------------------------------------------
class _Ptr:
    """A pointer for a replayed descriptor's base: Triton's launchers read data_ptr()."""

    __slots__ = ("p",)

    def __init__(self, p: int):
        self.p = p

    def data_ptr(self) -> int:
        return self.p


def _is_descriptor(a) -> bool:
    return dataclasses.is_dataclass(a) and hasattr(a, "base") and hasattr(a, "block_shape")


# the plain constants' types; their exact types (most launch arguments) are checked first, by
# one set lookup
_CONSTANT_BASES = (bool, int, float, str, torch.dtype)
_CONSTANT_TYPES = frozenset({*_CONSTANT_BASES, type(None)})
_Tensor = torch.Tensor  # (the hot paths' exact-type test, one global lookup)


# tuples found constant (the Gluon kernels' bundles: a launch passes the same few again), by
# value; at most CONSTANT_TUPLES, then cleared
_CONSTANT_TUPLE_SET: set = set()
CONSTANT_TUPLES = 1024


def _is_constant(a) -> bool:
    """A launch argument fixed by the key: numbers, flags, dtypes, constexprs, layouts, and
    tuples of these (the Gluon kernels' named bundles; a tuple holding a tensor is not one, so a
    launch passing one is never bound)."""
    if type(a) in _CONSTANT_TYPES:
        return True
    if isinstance(a, tuple):
        try:
            if a in _CONSTANT_TUPLE_SET:
                return True
        except Exception:  # noqa: BLE001  (unhashable, or an element's == that raises)
            return all(_is_constant(x) for x in a)
        if not all(_is_constant(x) for x in a):
            return False
        if len(_CONSTANT_TUPLE_SET) >= CONSTANT_TUPLES:
            _CONSTANT_TUPLE_SET.clear()
        _CONSTANT_TUPLE_SET.add(a)
        return True
    # (subclasses of the plain types: an IntEnum, a bool-like flag)
    return (isinstance(a, _CONSTANT_BASES)
            or type(a).__name__ == "constexpr" or hasattr(a, "__mangle__"))


def _rebased(desc, ptr: int):
    """A copy of a recorded tensor descriptor over base pointer ptr (its checks skipped: the
    key fixed its shape, strides and alignment)."""
    d = object.__new__(type(desc))
    d.__dict__.update(desc.__dict__)
    d.base = _Ptr(ptr)
    return d


# Base pointers a bound launch keeps a descriptor's expansion for, per descriptor argument: a
# model's layers' caches (each its own allocation) and the few addresses the caching allocator
# cycles q through. A tensor map is 128 bytes.
DESC_BASES = 64


# Descriptor expansions shared by every bound launch of the process: (the expander, the
# descriptor's type, the launch's metadata for it, its fields but the base) -> (its expansion
# after the first element, {base pointer: first element}, at most DESC_BASES). A new recording
# over descriptors seen before (a serving step's next call on the same layers' caches) then
# encodes none of them again. At most DESC_SIGNATURES signatures, then cleared.
_DESC_EXPANSIONS: dict = {}
DESC_SIGNATURES = 256


def _kept(cache: dict, key, value, cap: int):
    """cache[key] = value, the cache emptied first where it holds cap entries (a bounded
    memo); returns value."""
    if len(cache) >= cap:
        cache.clear()
    cache[key] = value
    return value


def _frozen(v):
    """v as a hashable key: lists, tuples and dicts as tuples, unhashable others by repr."""
    if isinstance(v, (list, tuple)):
        if all(type(x) is int for x in v):  # (a shape, strides: most of them)
            return tuple(v)
        return tuple(map(_frozen, v))
    if isinstance(v, dict):
        return tuple(sorted((k, _frozen(x)) for k, x in v.items()))
    try:
        hash(v)
    except TypeError:
        return repr(v)
    return v


# a descriptor type's fields but its base, and each launch metadata's key (_frozen), kept (a
# compiled kernel's metadata lives as long as the kernel; held here, its id stays its own)
_DESC_FIELDS: dict = {}
_META_KEYS: dict = {}


def _desc_key(make, desc, meta) -> tuple:
    """_DESC_EXPANSIONS' key of descriptor desc expanded by make with metadata meta."""
    names = _DESC_FIELDS.get(type(desc))
    if names is None:
        names = _DESC_FIELDS[type(desc)] = tuple(
            f.name for f in dataclasses.fields(desc) if f.name != "base")
    m = _META_KEYS.get(id(meta))
    if m is None or m[0] is not meta:
        m = _kept(_META_KEYS, id(meta), (meta, _frozen(meta)), DESC_SIGNATURES)
    return (make, type(desc), m[1], *(_frozen(getattr(desc, n)) for n in names))


class _Direct:
    """A compiled kernel's C launcher called directly, with its tensor descriptors expanded
    ahead (Triton's own wrapper expands every descriptor argument and re-encodes its tensor map
    at every call): the expansion of a descriptor is kept by base pointer, up to DESC_BASES
    bases a position (the map is copied into the launch's parameters, so one encoding serves
    many launches; a serving engine's layers each pass their own K / V cache, so one call
    after another the base changes and comes back a step later).
    The launcher's arguments are one gather (operator.itemgetter, in C) over the fixed
    arguments, the call's pointers and what is computed per call (a pointer at an offset
    inside a tensor, a descriptor's first element): a descriptor's expansion depends on its
    base only in its first element (the tensor map, or the base itself where the kernel takes
    no map), the rest being the shape and strides the key fixed (checked at each new base).
    Built only where the launcher has triton 3.6's shape (CudaLauncher(gridX, gridY, gridZ,
    stream, function, *args) over a launcher taking 13 base arguments, descriptors expanded by
    make_tensordesc_arg(arg, metadata)) and needs no scratch; else None and the replay calls
    CompiledKernel.run (the same on every version; triton 3.9's launcher has another shape).
    A tuple argument (a bundle of constants: _is_constant) goes to the launcher as it is: triton
    3.6's parses it in place (its format's "(...)" for a tuple of the signature) and its wrapper
    expands only top-level descriptors, which the template expands likewise; a tuple holding
    anything else, or a descriptor position that is not a descriptor, gives None."""

    # launcher classes' __call__ (and descriptor expanders) seen: their parameter names
    # (inspect.signature costs tens of microseconds; asked once each)
    _SHAPES: dict = {}

    @staticmethod
    def _params(fn) -> list:
        known = _Direct._SHAPES.get(fn)
        if known is None:
            known = _Direct._SHAPES[fn] = list(inspect.signature(fn).parameters)
        return known

    @staticmethod
    def of(compiled, template: list, patches: list, slots: int, rows: dict | None = None):
        try:
            from triton.backends.nvidia import driver as nvd

            L = compiled.run
            if (type(L).__name__ != "CudaLauncher" or L.global_scratch_size
                    or L.profile_scratch_size or getattr(nvd, "_BASE_ARGS_FORMAT_LEN", 0) != 13
                    or _Direct._params(type(L).__call__) != ["self", "gridX", "gridY", "gridZ",
                                                             "stream", "function", "args"]
                    or len(_Direct._params(nvd.make_tensordesc_arg)) != 2):
                return None
            if any(isinstance(a, tuple) and not _is_constant(a) for a in template):
                return None
            launch = L.launch
            code = getattr(launch, "__code__", None)
            if code is None:  # no descriptor argument: the C launcher itself
                return _Direct(L, launch, set(), [], nvd, template, patches, slots, rows)
            cells = dict(zip(code.co_freevars, (c.cell_contents for c in launch.__closure__)))
            if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
                return None
            if not all(_is_descriptor(template[i]) for i in cells["tensordesc_indices"]):
                return None
            return _Direct(L, cells["launcher"], set(cells["tensordesc_indices"]),
                           list(cells["tensordesc_meta"]), nvd, template, patches, slots, rows)
        except Exception:  # noqa: BLE001  (another Triton: the portable replay)
            return None

    def __init__(self, L, launcher, td: set, metas: list, nvd, template: list, patches: list,
                 slots: int, rows: dict | None = None):
        """template: the launch's arguments (patched positions hold a descriptor over the
        recorded base, or None); patches: Bound's (position, descriptor?, source) of the
        launch; slots: the length of the pointer list a replay passes (Bound.launch); rows:
        descriptor position -> the index in that list of its first dimension's size (a free
        size: Memo's free), for descriptors whose rows a replay gives (their whole expansion
        then kept by (base, rows), DESC_BASES of them)."""
        rows = rows or {}
        self.launcher, self.coop, self.pdl = launcher, L.launch_cooperative_grid, L.launch_pdl
        self.make = nvd.make_tensordesc_arg
        self.desc = {}      # descriptor position -> (its recorded descriptor, metadata)
        self.rest = {}      # descriptor position -> its expansion after the first element
        self.cache = {}     # descriptor position -> {base pointer: first element}
        at = []             # position -> first expanded position
        fixed = []
        k = 0
        for i, a in enumerate(template):
            at.append(len(fixed))
            if i in td:
                meta = metas[k] if k < len(metas) else None
                k += 1
                self.desc[i] = (a, meta)
                key = _desc_key(self.make, a, meta)
                known = _DESC_EXPANSIONS.get(key)
                if known is None:
                    e = list(self.make(a, meta))
                    known = _kept(_DESC_EXPANSIONS, key, (e[1:], {a.base.data_ptr(): e[0]}),
                                  DESC_SIGNATURES)
                self.rest[i], self.cache[i] = known
                fixed.extend((self._first(i, a.base.data_ptr()), *known[0]))
            else:
                fixed.append(a)
        # the gather's source: fixed + the call's pointers + shifted pointers + descriptors
        self.shifted = []   # (pointer index, byte offset)
        self.descs = []     # (descriptor position, pointer index, byte offset)
        self.sized = []     # (descriptor position, pointer index, byte offset, rows index)
        self.by_rows = {}   # descriptor position -> {(base pointer, rows): its expansion}
        into = {}           # expanded position -> (part, index in it)
        width = 0           # the sized descriptors' expansions, one after another
        for pos, desc, (kind, j, delta, _g) in patches:
            if desc and pos in rows:
                n = 1 + len(self.rest[pos])
                for e in range(n):
                    into[at[pos] + e] = ("sized", width + e)
                width += n
                self.sized.append((pos, j, delta, rows[pos]))
                self.by_rows[pos] = {}
            elif desc and kind == "static":  # a base fixed while the memo holds it
                fixed[at[pos]] = self._first(pos, j + delta)
            elif desc:
                into[at[pos]] = ("desc", len(self.descs))
                self.descs.append((pos, j, delta))
            elif delta:
                into[at[pos]] = ("shift", len(self.shifted))
                self.shifted.append((j, delta))
            else:
                into[at[pos]] = ("ptr", j)
        base = {"ptr": len(fixed), "shift": len(fixed) + slots,
                "desc": len(fixed) + slots + len(self.shifted)}
        base["sized"] = base["desc"] + len(self.descs)
        order = [base[into[e][0]] + into[e][1] if e in into else e for e in range(len(fixed))]
        self.fixed = fixed
        self.gather = (operator.itemgetter(*order) if len(order) > 1
                       else lambda src, o=tuple(order): tuple(src[i] for i in o))

    def _first(self, pos: int, ptr: int):
        """The first element of position pos's descriptor expanded over base ptr (kept, for
        every bound launch of a descriptor of this signature: _DESC_EXPANSIONS)."""
        known = self.cache[pos]
        first = known.get(ptr)
        if first is None:
            desc, meta = self.desc[pos]
            e = list(self.make(_rebased(desc, ptr), meta))
            if e[1:] != self.rest[pos]:  # (make_tensordesc_arg of another shape)
                raise RuntimeError(f"launch: descriptor {pos}'s expansion depends on its base "
                                   "beyond its first element; this Triton needs the portable "
                                   "replay")
            first = _kept(known, ptr, e[0], DESC_BASES)
        return first

    def _expanded(self, pos: int, ptr: int, rows: int) -> list:
        """Position pos's descriptor expanded over base ptr with ``rows`` rows (its first
        dimension; kept by both, DESC_BASES of them)."""
        known = self.by_rows[pos]
        e = known.get((ptr, rows))
        if e is None:
            desc, meta = self.desc[pos]
            d = _rebased(desc, ptr)
            d.shape = type(desc.shape)([rows, *desc.shape[1:]])
            e = _kept(known, (ptr, rows), list(self.make(d, meta)), DESC_BASES)
        return e

    def __call__(self, g, stream, compiled, ptrs: list):
        src = self.fixed + ptrs
        for f, delta in self.shifted:
            src.append(ptrs[f] + delta)
        for pos, f, delta in self.descs:
            ptr = ptrs[f] + delta
            first = self.cache[pos].get(ptr)
            src.append(first if first is not None else self._first(pos, ptr))
        for pos, f, delta, r in self.sized:
            src.extend(self._expanded(pos, ptrs[f] + delta, ptrs[r]))
        self.launcher(g[0], g[1], g[2], stream, compiled.function, self.coop, self.pdl, None,
                      None, compiled.packed_metadata, None, None, None, *self.gather(src))


def _pool_ptr(device: torch.device, stream: int | None = None) -> int:
    """The address of a zeroed counter slot (_pool_slot)."""
    t, i = _pool_slot(device, stream)
    return t.data_ptr() + 4 * i


# A counter slot per (device index, stream) that replays of launches leaving their counter 0
# (counter(resets=True)) share: one launch after another in the stream's order, each finding it
# 0 (the invariant a captured graph's slot rests on, _GRAPH_POOLS). Its own tensor, never a
# pool's: a pool hands its slots on to launches that leave them counted.
_RESET_SLOTS: dict = {}


def _reset_slot(device: torch.device, stream: int) -> tuple:
    """(stream ``stream``'s counter slot for launches that leave it 0, its address): made
    zeroed on the current stream, whose work a second stream's launches wait for
    (two_streams' fork). Recordings (counter) and replays (Bound.scratch_pointers) take it."""
    slot = _RESET_SLOTS.get((device.index, stream))
    if slot is None:  # (two threads at once: both keep the first one's)
        t = torch.zeros(1, dtype=torch.int32, device=device)
        slot = _RESET_SLOTS.setdefault((device.index, stream), (t, t.data_ptr()))
    return slot


def _sizes(tensors: list, free) -> list:
    """The free sizes of a call's tensors: the first dimension of those at positions free
    (Memo's free)."""
    return [tensors[i].shape[0] for i in free]


def pointers(tensors: list, outs: list, tmps: list, ptrs: list | None = None) -> list:
    """Bound.launch's pointers: the data_ptr() of a call's tensors (ptrs where the caller has
    them), then of its outputs, then its scratch's (tmps: their addresses), in order."""
    return ((ptrs if ptrs is not None else [t.data_ptr() for t in tensors])
            + [t.data_ptr() for t in outs] + tmps)


# The largest dropped output a bound call keeps (Bound.held): an LSE of 2048 rows x 32 heads
HELD_MAX_BYTES = 256 << 10


_PROTOS: dict = {}


def _proto(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty tensor of dtype on device (no memory), kept: a replay allocates each output
    as ``proto.new_empty_strided`` (fewer arguments to parse than torch.empty_strided's)."""
    t = _PROTOS.get((dtype, device))
    if t is None:
        t = _PROTOS[dtype, device] = torch.empty(0, dtype=dtype, device=device)
    return t


class Bound:
    """One recorded call, replayable for calls with the same key.

    Each tensor argument of a launch (or a descriptor's base) has a source (kind, index,
    delta, geometry): the pointer at that index of what a replay passes (pointers(): the
    call's tensors, then its outputs, then its scratch buffers; kind "in", "out", "tmp") plus
    delta bytes (0, or a view inside one of the call's tensors alone), or ("static", t) a
    tensor the caller keeps alive and unchanged (a plan's); with the view geometry (size,
    stride, dtype) the interpreter's replay rebuilds."""

    def __init__(self, rec: Recorder, tensors: list, outputs: tuple, static=None, discard=(),
                 free=()):
        if rec.problem:
            raise _Unbindable(rec.problem)
        # free: the positions of the call's tensors whose first dimension is a free size (Memo's
        # free); sizes: theirs in this call. A replay passes the call's sizes after its
        # pointers; a descriptor over such a tensor is expanded with them (_Direct's rows). The
        # bound call is ``generic`` (replays any sizes) once Memo.record found a recording at
        # other sizes the same but for them (same_but_sizes).
        self.sizes = _sizes(tensors, free)
        self.generic = False
        self._ptrs = [t.data_ptr() for t in tensors]
        self._spans = None  # (each tensor's span, made where a pointer is none of theirs)
        self._tensors = tensors  # (recording only; dropped below)
        self._static = {} if static is None else static  # (Memo's: pointer -> tensor; read only)
        self.outputs = []
        self._out_ptr = {}
        for o in outputs:
            if not isinstance(o, torch.Tensor):
                raise _Unbindable("an output is not a tensor")
            self._out_ptr.setdefault(o.data_ptr(), len(self.outputs))
            self.outputs.append((tuple(o.shape), o.stride(), o.dtype))
        if not self.outputs:
            raise _Unbindable("no outputs")
        # Outputs the caller drops (an LSE not asked for): every replay writes them into the
        # recorded call's own tensor, kept here, instead of a fresh allocation. Nothing reads
        # them: a launch path never reads an output it wrote (what a later launch of the call
        # reads is scratch, adopt_scratch), so replays sharing the tensor, on one stream or
        # several, cannot change what the caller gets. Only small ones (HELD_MAX_BYTES): a
        # memo of MAX keys then holds at most MAX times that, and a call large enough to
        # hold more waits on its kernel, not on one allocation's host time. Only on the stream
        # that recorded them (their allocation stream): when the memo lets one go, the caching
        # allocator reuses its memory in that stream's order, after every launch that wrote it
        # there; a replay on another stream allocates its own.
        self.held = {j: outputs[j] for j in discard
                     if outputs[j].numel() * outputs[j].element_size() <= HELD_MAX_BYTES}
        self.device = outputs[0].device
        self._alloc = [(j, _proto(dt, self.device), s, st)
                       for j, (s, st, dt) in enumerate(self.outputs)]
        self.cuda = self.device.type == "cuda"
        self._held_stream = (torch._C._cuda_getCurrentRawStream(self.device.index)
                             if self.cuda else None)
        self.scratch = []
        self._tmp = {}
        for p, spec in rec.scratch.items():
            self._tmp[p] = len(self.scratch)
            self.scratch.append(spec)
        # two_streams: (the recorded second stream's handle, the getter of a thread's second
        # stream), each launch's stream role, the fork / join waits by the launches they
        # precede, and each scratch buffer's role (a counter slot comes from its stream's pool)
        self._two = rec.side
        self._roles = rec.roles
        self._waits: dict = {}
        for at, waiter, on in rec.waits:
            self._waits.setdefault(at, []).append((waiter, on))
        self._scratch_roles = [int(p in rec.side_counters) for p in rec.scratch]
        # a source's first index in the pointers a replay passes (pointers(), then the sizes)
        self._first_out = len(tensors)
        slots = len(tensors) + len(self.outputs) + len(self.scratch) + len(free)
        size_at = {i: slots - len(free) + k for k, i in enumerate(free)}
        self.launches = []
        for fn, grid, vals, options, compiled in rec.launches:
            patches = []
            for pos, a in enumerate(vals):
                if type(a) in _CONSTANT_TYPES:  # (most arguments: the cheapest test first)
                    continue
                if isinstance(a, torch.Tensor):
                    patches.append((pos, False, self._source(a)))
                elif _is_descriptor(a):
                    if not isinstance(a.base, torch.Tensor):
                        raise _Unbindable("a descriptor over a non-tensor")
                    patches.append((pos, True, self._source(a.base)))
                elif not _is_constant(a):
                    raise _Unbindable(f"argument {pos} of {fn.fn.__name__}: {type(a).__name__}")
            if not INTERPRET:
                # A static tensor's pointer is fixed while the memo holds it: bound into the
                # template once (the interpreter's replay rebuilds views, so it keeps them).
                vals = list(vals)
                for pos, desc, (kind, j, delta, _g) in patches:
                    if kind == "static" and not desc:
                        vals[pos] = j.data_ptr() + delta
                patches = [(pos, desc, (kind, j.data_ptr() if kind == "static" else j, delta, g))
                           for pos, desc, (kind, j, delta, g) in patches
                           if kind != "static" or desc]
            # Every patched position is written at each replay: the template keeps no tensor
            # of the recorded call (a bound call would otherwise hold its first call's inputs,
            # outputs and scratch alive, a KV cache among them, while the memo holds it), and
            # a descriptor's base only as its pointer.
            vals = list(vals)
            for pos, desc, _src in patches:
                vals[pos] = _rebased(vals[pos], vals[pos].base.data_ptr()) if desc else None
            rows = {pos: size_at[j] for pos, desc, (kind, j, _d, _g) in patches
                    if desc and kind == "in" and j in size_at}
            direct = None if INTERPRET else _Direct.of(compiled, list(vals), patches, slots,
                                                        rows)
            self.launches.append((fn, grid + (1,) * (3 - len(grid)), list(vals), patches,
                                  options, compiled, direct))
        # (only launches through _Direct expand descriptors with a call's sizes)
        self._sizable = bool(free) and self._two is None and all(
            entry[6] is not None for entry in self.launches)
        self._free = tuple(free)
        del self._tensors, self._spans, self._ptrs, self._static

    def same_but_sizes(self, other: "Bound") -> bool:
        """Whether this bound call and ``other``, recorded under one key at other free sizes,
        launch the same but for those sizes: the same kernels, grids, options and arguments,
        every argument equal but the descriptors over the free tensors, which differ only in
        their first dimension, that call's free size in each (their expansions are what a
        replay makes of the call's sizes: _Direct's rows). A launch whose arguments read a
        size any other way (a number, a constexpr, another grid) differs, and both keep their
        sizes."""
        if not (self._sizable and other._sizable and self._free == other._free
                and self.outputs == other.outputs and self.scratch == other.scratch
                and set(self.held) == set(other.held)
                and len(self.launches) == len(other.launches)):
            return False
        free = {i: k for k, i in enumerate(self._free)}
        for a, b in zip(self.launches, other.launches):
            fn, grid, vals, patches, options, compiled, _d = a
            if not (fn is b[0] and grid == b[1] and compiled is b[5] and options == b[4]
                    and len(vals) == len(b[2]) and len(patches) == len(b[3])):
                return False
            descs = {}  # descriptor position -> its free size's index, or None
            for p, q in zip(patches, b[3]):
                # (the sources' geometry aside: a view of a free tensor has its size)
                (pos, desc), (kind, j, delta) = p[:2], p[2][:3]
                if (pos, desc, kind, j, delta) != (q[0], q[1], *q[2][:3]):
                    return False
                if desc:
                    descs[pos] = free.get(j) if kind == "in" else None
            for pos, (x, y) in enumerate(zip(vals, b[2])):
                if pos not in descs:  # (a patched tensor's position holds None in both)
                    if not (x is y or (type(x) is type(y) and x == y)):
                        return False
                    continue
                k = descs[pos]  # (the bases are patched: compared by their sources above)
                fields = [f.name for f in dataclasses.fields(x)
                          if f.name not in ("base", "shape")]
                shapes = ((list(x.shape[1:]) == list(y.shape[1:]) and x.shape[0] == self.sizes[k]
                           and y.shape[0] == other.sizes[k]) if k is not None
                          else list(x.shape) == list(y.shape))
                if not (type(x) is type(y) and shapes
                        and all(getattr(x, n) == getattr(y, n) for n in fields)):
                    return False
        return True

    def _source(self, t: torch.Tensor):
        p = t.data_ptr()
        geom = (tuple(t.shape), t.stride(), t.dtype)
        if p in self._out_ptr:
            return ("out", self._first_out + self._out_ptr[p], 0, geom)
        if p in self._tmp:
            return ("tmp", self._first_out + len(self.outputs) + self._tmp[p], 0, geom)
        if p in self._static and p not in self._ptrs:
            return ("static", self._static[p], 0, geom)
        hits = [i for i, q in enumerate(self._ptrs) if q == p]
        if not hits:  # a view inside exactly one of the call's tensors (or its aliases: the
            # key holds which tensors share a pointer, so any of them gives the same address)
            if self._spans is None:
                self._spans = [_span(t) for t in self._tensors]
            hits = [i for i, (lo, hi) in enumerate(self._spans) if lo <= p < hi]
            if len({self._ptrs[i] for i in hits}) != 1:
                raise _Unbindable("a tensor argument of unknown origin")
        i = hits[0]
        src = self._tensors[i]
        delta = p - self._ptrs[i]
        if t.dtype != src.dtype or delta % src.element_size():
            raise _Unbindable("a view of another dtype or alignment")
        return ("in", i, delta, geom)

    def replay(self, tensors: list, ptrs: list | None = None, sizes: list | None = None):
        """Launch for a call with this key (tensors: its tensors in order; ptrs: their
        data_ptr(), where the caller has them; sizes: its free sizes, where the memo has
        any); returns the outputs."""
        dev = self.device
        stream = torch._C._cuda_getCurrentRawStream(dev.index) if self.cuda else None
        if self._two is not None and not INTERPRET:
            return self._replay_two(tensors, ptrs, stream, sizes)
        held = self.held if stream == self._held_stream else {}
        outs = [held[j] if j in held else proto.new_empty_strided(s, st)
                for j, proto, s, st in self._alloc]
        if INTERPRET:
            tmps = [torch.empty(s, dtype=dt, device=dev) if kind == "empty"
                    else torch.zeros(s, dtype=dt, device=dev) for kind, s, dt in self.scratch]
            self._replay_interpreted(tensors, outs, tmps)
            return tuple(outs)
        tmps, addrs = self.scratch_pointers(stream)  # (tmps alive until the launches queue)
        at = pointers(tensors, outs, addrs, ptrs)
        self.launch(at + sizes if sizes else at, stream)
        return tuple(outs)

    def _replay_two(self, tensors: list, ptrs: list | None, stream: int,
                    sizes: list | None = None):
        """replay() of a call recorded on two streams (two_streams): the outputs and scratch
        allocated on the current stream (the second stream uses them only between the fork,
        which follows their allocation, and the join, which precedes their release), the
        fork, the launches each on its stream and the join in the recorded order, on this
        thread's second stream. The dropped outputs are kept only where both streams are the
        recording's (Bound.held)."""
        dev = self.device
        streams = (_stream_object(dev, stream), self._two[1](dev))
        handles = (stream, streams[1].cuda_stream)
        held = self.held if handles == (self._held_stream, self._two[0]) else {}
        outs = [held[j] if j in held else proto.new_empty_strided(s, st)
                for j, proto, s, st in self._alloc]
        tmps, addrs = self.scratch_pointers(stream, handles[1])
        ptrs = pointers(tensors, outs, addrs, ptrs) + (sizes or [])
        waits, events = self._waits, _events(dev)
        for i, entry in enumerate(self.launches):
            for waiter, on in waits.get(i, ()):
                _wait_on(events[on], streams[waiter], streams[on])
            _launch_entry(entry, handles[self._roles[i]], ptrs)
        for waiter, on in waits.get(len(self.launches), ()):
            _wait_on(events[on], streams[waiter], streams[on])
        del tmps  # (released after the join is queued)
        return tuple(outs)

    def scratch_pointers(self, stream: int | None,
                         side: int | None = None) -> tuple[list, list]:
        """(the scratch tensors a replay allocates, the addresses of every scratch buffer in
        order: a zeroed counter slot of ``stream``'s pool (``side``'s for a slot the recording
        took on its second stream: two_streams), or a fresh tensor's)."""
        tmps, addrs = [], []
        for (kind, s, dt), role in zip(self.scratch, self._scratch_roles):
            if kind == "reset":
                addrs.append(_reset_slot(self.device, side if role else stream)[1])
            elif kind == "zeros":
                addrs.append(_pool_ptr(self.device, side if role else stream))
            else:
                tmps.append(torch.empty(s, dtype=dt, device=self.device))
                addrs.append(tmps[-1].data_ptr())
        return tmps, addrs

    def launch(self, ptrs: list, stream: int) -> None:
        """The recorded launches on CUDA stream ``stream`` with the pointers ptrs (as
        ``pointers`` gives them: the call's tensors', its outputs', its scratch's)."""
        for entry in self.launches:
            _launch_entry(entry, stream, ptrs)

    def _replay_interpreted(self, tensors, outs, tmps):
        pools = [*tensors, *outs, *tmps]  # (in the order of pointers())
        for fn, grid, template, patches, options, _, _d in self.launches:
            a = template.copy()
            for pos, desc, (kind, j, delta, (size, stride, dtype)) in patches:
                src = j if kind == "static" else pools[j]
                view = src.as_strided(size, stride,
                                      src.storage_offset() + delta // src.element_size())
                a[pos] = dataclasses.replace(a[pos], base=view) if desc else view
            fn[grid](*a, **options)


def _stream_object(device: torch.device, handle: int):
    """The torch.cuda.Stream of raw handle ``handle``, the current stream of device, kept per
    thread (a handle names one CUDA stream while it lives: torch's pooled streams are never
    destroyed; the null stream's handle 0 is per device, hence the key)."""
    known = _TLS.streams
    if known is None:
        known = _TLS.streams = {}
    s = known.get((device.index, handle))
    if s is None:
        s = known[device.index, handle] = torch.cuda.current_stream(device)
    return s


def _events(device: torch.device) -> tuple:
    """Two CUDA events of this thread on device for a two-stream replay's waits, one per
    stream role waited on (a wait takes the event's latest record when it is queued, so the
    next record may reuse the event)."""
    known = _TLS.events
    if known is None:
        known = _TLS.events = {}
    pair = known.get(device.index)
    if pair is None:
        pair = known[device.index] = (torch.cuda.Event(), torch.cuda.Event())
    return pair


def _wait_on(event, waiter, on) -> None:
    """Stream waiter waits for the work queued on stream ``on`` so far, through event."""
    event.record(on)
    event.wait(waiter)


def _launch_entry(entry: tuple, stream: int, ptrs: list) -> None:
    """One of a Bound's launches (its ``launches`` entry) on CUDA stream ``stream`` with the
    pointers ptrs (as ``pointers`` gives them: the call's tensors', its outputs', its
    scratch's)."""
    _fn, g, template, patches, _, compiled, direct = entry
    if direct is not None:
        direct(g, stream, compiled, ptrs)
        return
    a = template.copy()
    for pos, desc, (kind, j, delta, _g) in patches:
        ptr = (j if kind == "static" else ptrs[j]) + delta
        if desc:
            a[pos] = _rebased(a[pos], ptr)
        else:
            a[pos] = ptr
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata,
                 None, None, None, *a)


def kernel_device(device: torch.device) -> bool:
    """Whether the kernels run on device: CUDA, or CPU under the Triton interpreter."""
    return device.type == "cuda" or (INTERPRET and device.type == "cpu")


def on_kernel_device(t: torch.Tensor) -> bool:
    """Whether t is on a device the kernels run (kernel_device)."""
    return kernel_device(t.device)


def untraced() -> bool:
    """Whether a call runs eagerly on real tensors: not compiling or exporting, no dispatch
    mode, no functorch transform (a profiler or function mode may still watch it: unwatched)."""
    return not (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
                or torch._C._functorch.peek_interpreter_stack() is not None)


def unwatched() -> bool:
    """unobserved's half that does not look at the arguments: untraced, no function mode, the
    autograd profiler off."""
    return untraced() and not (torch._C._is_torch_function_mode_enabled()
                               or torch._C._autograd._profiler_enabled())


def plain_tensors(values) -> bool:
    """unobserved's half that looks at the arguments: every tensor among values a plain
    ``torch.Tensor`` on a device the kernels run that does not require grad while grad is on."""
    grad = torch.is_grad_enabled()
    for a in values:
        if isinstance(a, torch.Tensor) and (
                type(a) is not torch.Tensor or (grad and a.requires_grad)
                or not (a.is_cuda or on_kernel_device(a))):
            return False
    return True


def unobserved(args: tuple, kwargs: dict | None = None) -> bool:
    """Whether nothing could observe or transform a call with these arguments, so that a bound
    launch may stand in for it: not compiling or exporting (Dynamo), no TorchDispatchMode or
    TorchFunctionMode active, no functorch transform, the autograd profiler off, and every
    tensor argument a plain ``torch.Tensor`` on a device the kernels run (CUDA; CPU under the
    Triton interpreter) that does not require grad while grad is on. (Traced calls see fake or
    functional tensors, subclasses, and fail the last test.)"""
    return unwatched() and plain_tensors((*args, *(kwargs or {}).values()))


# ---------------------------------------------------------------------------------------------
# memos of bound calls
# ---------------------------------------------------------------------------------------------
_UNBOUND = object()
# LaunchCache.call's answer for a call whose arguments are not plain eager (eager_key: a
# subclass, a tensor requiring grad, one on another device) or hold no tensor
NOT_PLAIN = object()
_PLAIN_VALUES = _CONSTANT_TYPES  # (a key's plain values: a launch's plain constants' types)


class Memo:
    """Bound calls by key. static: tensors the caller passes unchanged to every call (a plan's
    index arrays; keyed by identity, their pointers fixed): the memo holds them alive, so an
    identity is never reused while keyed.
    free: positions of a call's tensors (flattened, never the first) whose first dimension the
    keys leave out, a free size (POD's contiguous prefill keys, which a chunked prefill grows
    every step): a key's bound call replays at its own sizes until a recording at other sizes
    launches the same but for them (Bound.same_but_sizes), then at any sizes (generic); where
    they differ, each stays bound under (key, *its sizes) and the newest is compared with the
    next (Memo._file_sizes)."""

    MAX = 256

    # tensor guards kept under one light key (replay_fast), the newest: one a dispatch state a
    # call comes in (inference mode or not), a few layouts or other tensors' shapes (a chunked
    # prefill's keys growing under queries of one length)
    GUARDS = 4

    def __init__(self, static=(), free=()):
        if 0 in free:
            raise ValueError("Memo: the first tensor's shape is in the light key; it is never free")
        self._free = tuple(free)
        self._static_refs = [t for t in static if isinstance(t, torch.Tensor)]
        self._static = frozenset(id(t) for t in self._static_refs)
        # the static tensors by pointer, for Bound (made once: every recording reads them)
        self._static_ptrs = {t.data_ptr(): t for t in self._static_refs}
        self._bound: dict = {}
        # light key -> [(tensor guards, Bound)] of bound calls (a key's Bound is replaced only
        # where none replays: unbound, and clear() empties both)
        self._fast: dict = {}
        self.hits = self.records = self.refused = 0

    def clear(self) -> None:
        self._bound.clear()
        self._fast.clear()

    def eager_key(self, values, extra=()):
        """(key, tensors, pointers, light key) of a plain eager call with these arguments
        (tuples flattened) and the caller's plain extra values (its options), or None for a
        call that is not plain eager (unobserved's per-tensor half: plain tensors on a device
        the kernels run, none requiring grad while grad is on) or has no tensor. A tensor the
        memo holds as static is keyed by identity; others by shape, strides, dtype, device,
        storage offset and pointer alignment; plain values with their types; the policy's
        version and programs_cap's value. (The aliasing pattern is added only where two
        tensors share a pointer: the two kinds of key differ in length.) pointers: the tensors'
        data_ptr(), in order (a replay patches them in: lookup). The light key is the key
        without the tensors' strides, dtypes, devices and shapes but the first's (_light_key's;
        None without Dynamo's tensor guards, which are all it is kept for: replay_fast)."""
        flat = values
        if any(isinstance(a, (tuple, list)) for a in values):
            flat = _flat_values(values)
            if flat is None:
                return None
        sig = [Policy._version, extra, _TLS.cap]
        tensors = []
        ptrs = []
        grad = torch.is_grad_enabled()
        static = self._static
        free = self._free
        cuda = False
        for a in flat:
            kind = type(a)
            if kind is torch.Tensor:
                if grad and a.requires_grad:
                    return None
                if a.is_cuda:
                    d, cuda = a.get_device(), True
                elif INTERPRET and a.device.type == "cpu":
                    d = -1
                else:
                    return None
                p = a.data_ptr()
                shape = a.shape[1:] if free and len(tensors) in free else a.shape
                tensors.append(a)
                ptrs.append(p)
                sig.append(id(a) if static and id(a) in static
                           else (shape, a.stride(), a.dtype, d, a.storage_offset(), p & 15))
            elif kind in _PLAIN_VALUES:  # most other arguments: options and flags (by type
                sig.append((kind, a))  # too: True == 1 == 1.0, and the checks tell them apart)
            elif isinstance(a, torch.Tensor):  # a subclass: traced or wrapped
                return None
            else:
                sig.append(a)
        if not tensors:
            return None
        if len(set(ptrs)) != len(ptrs):
            sig.append(_alias_pattern(ptrs))
        if cuda:  # (CUDA is initialized: a tensor is on it)
            sig.append(torch._C._cuda_getDevice())
        # (the light key only where guards are kept: computed on the way to a lookup or a
        # recording, never on a replay's hot path)
        light = None if _TensorGuards is None else self._light_key(values, extra)[0]
        return tuple(sig), tensors, ptrs, light

    def _light_key(self, values, extra):
        """(light key, tensors, pointers, the tensors the guards take) of a call whose tensors
        are plain torch.Tensors not requiring grad while grad is on, else None: the key
        without what replay_fast's guards check (eager_key gives it for the guards it keeps).
        The hot path of every replay: one pass, a tuple argument (a (k, v) cache) flattened
        where it is met."""
        sig = [Policy._version, extra, _TLS.cap]
        tensors = []
        ptrs = []
        grad = torch.is_grad_enabled()
        static = self._static
        for a in values:
            kind = type(a)
            if kind is _Tensor:
                if grad and a.requires_grad:
                    return None
                p = a.data_ptr()
                tensors.append(a)
                ptrs.append(p)
                # (static: its identity; else the storage offset and the pointer's alignment
                # as one number)
                sig.append(id(a) if static and id(a) in static
                           else a.storage_offset() << 4 | p & 15)
            elif kind in _PLAIN_VALUES:
                sig.append((kind, a))
            elif isinstance(a, (tuple, list)):  # (rare: then from the start, flattened)
                values = _flat_values(values)
                return None if values is None else self._light_key(values, extra)
            elif isinstance(a, torch.Tensor):
                return None
            else:
                sig.append(a)
        if not tensors:
            return None
        # (the light key holds the first tensor's shape: the rows of a call's queries, which
        # differ call to call in a serving engine, then key apart instead of lining up
        # guards that fail in turn)
        sig.append(tensors[0].shape)
        guarded = tensors  # (the guards take each tensor object once)
        if len(set(ptrs)) != len(ptrs):
            sig.append(_alias_pattern(ptrs))
            guarded = _distinct(tensors)
        if tensors[0].is_cuda:  # (the guards fix each tensor's device)
            sig.append(torch._C._cuda_getDevice())
        return tuple(sig), tensors, ptrs, guarded

    def replay_fast(self, values, extra=()):
        """The replayed outputs of a call that matches a bound call by its light key and the
        tensor guards kept with it (made where eager_key's key found or recorded that call:
        they check what the light key leaves out), or None (then eager_key and lookup decide,
        as without this path). Costs a few microseconds less than eager_key: the guards check
        five tensors in C++ in about a microsecond."""
        if not self._fast:
            return None
        kt = self._light_key(values, extra)
        if kt is None:
            return None
        try:
            entries = self._fast.get(kt[0])
        except TypeError:  # an argument that is no tensor and no plain value: unhashable
            return None
        if entries:
            guarded = kt[3]
            for guards, bound in reversed(entries):  # (the newest first)
                if guards.check(*guarded):
                    return self._replay(bound, kt[1], kt[2])
        return None

    def find(self, values, extra=()):
        """(outputs, None) of a call replayed through replay_fast, or (the replayed outputs or
        None, eager_key's answer) after the full key's lookup; eager_key's answer None: the
        call is not plain eager (nothing replayed)."""
        out = self.replay_fast(values, extra)
        if out is not None:
            return out, None
        kt = self.eager_key(values, extra)
        if kt is None:
            return None, None
        key, tensors, ptrs, light = kt
        return self.lookup(key, tensors, ptrs, light), kt

    def _guard(self, light, bound, tensors) -> None:
        """Keep tensor guards of this call's tensors beside its bound call, under its light
        key, for replay_fast (the GUARDS newest a light key; none without Dynamo's guards)."""
        if _TensorGuards is None:
            return
        entries = self._fast.setdefault(light, [])
        if len(entries) >= self.GUARDS:
            del entries[0]
        # (a generic bound call's free sizes unguarded: a None size is left unchecked)
        free = {id(tensors[i]) for i in self._free} if bound.generic else ()
        tensors = _distinct(tensors)
        entries.append((_TensorGuards(
            *tensors, dynamic_dims_sizes=[[None, *t.shape[1:]] if id(t) in free
                                          else list(t.shape) for t in tensors],
            dynamic_dims_strides=[list(t.stride()) for t in tensors]), bound))

    def lookup(self, key, tensors, ptrs=None, light=None):
        """The replayed outputs of a call with this key, or None (unbound, refused, not
        replayable now, or inside another call's recording: a replay launches around the
        recorder, whose Bound would then lack these launches and replay without them).
        ptrs: the tensors' data_ptr() where the caller has them (eager_key); light: the
        call's light key, under which a replay keeps the call's tensor guards (replay_fast)."""
        try:
            bound = self._bound.get(key)
        except TypeError:  # an argument that is no tensor and no plain value: unhashable
            return None
        sizes = _sizes(tensors, self._free) if self._free else None
        if isinstance(bound, Bound) and sizes is not None and sizes != bound.sizes \
                and not bound.generic:
            # (the key's newest bound call is at other sizes: this call's own, if bound)
            bound = self._bound.get((key, *sizes))
        if bound is None or bound is _UNBOUND:
            return None
        out = self._replay(bound, tensors, ptrs, sizes)
        if out is not None and light is not None:
            self._guard(light, bound, tensors)
        return out

    def _replay(self, bound: Bound, tensors: list, ptrs: list | None, sizes=None):
        """bound's replay for these tensors, or None where none may replay now (sizes: their
        free sizes, where the caller has them)."""
        if _recorder() is not None or not _replayable(bound.cuda):
            return None
        if self._free:
            if sizes is None:
                sizes = _sizes(tensors, self._free)
            if sizes != bound.sizes and not bound.generic:
                return None
        self.hits += 1
        return bound.replay(tensors, ptrs, sizes)

    def _file_sizes(self, key, bound: Bound) -> None:
        """Before a new bound call of a memo with free sizes goes under key (the key's
        newest): where the key holds one at other sizes, the new one is generic if the two
        launch the same but for the sizes; else the old one stays bound under (key, *its
        sizes), where lookup finds a call of those sizes (two recordings may differ once, a
        kernel compiled for the first call's pointers, and agree after: the new one is
        compared with the next size)."""
        old = self._bound.get(key)
        if isinstance(old, Bound) and old.sizes != bound.sizes and not old.generic:
            if bound.same_but_sizes(old):
                bound.generic = True
            else:
                self._bound[(key, *old.sizes)] = old

    def known_unbound(self, key) -> bool:
        """Whether a call with this key takes the full path unrecorded: refused before, or
        unhashable (an argument that is no tensor and no plain value; the checks say so)."""
        try:
            return self._bound.get(key) is _UNBOUND
        except TypeError:
            return True

    def record(self, key, tensors, fn, args=(), kwargs=None, discard=(), light=None):
        """fn(*args, **kwargs) (eager, wrap_triton off) with its launches recorded and bound
        under key; returns fn's result, whose tensors (a tuple, or one) are the outputs.
        discard: the positions of outputs the caller drops (Bound keeps one tensor for each;
        the key must say which); light: the call's light key (lookup)."""
        kwargs = kwargs or {}
        if _recorder() is not None or not _replayable(tensors[0].is_cuda):
            with set_wrap_triton_enabled(False):
                return fn(*args, **kwargs)
        rec = Recorder()
        _RECORDINGS[0] += 1
        _TLS.rec = rec
        try:
            with set_wrap_triton_enabled(False):
                result = fn(*args, **kwargs)
        finally:
            _TLS.rec = None
        outputs = result if isinstance(result, tuple) else (result,)
        try:
            bound = Bound(rec, tensors, outputs, self._static_ptrs, discard, self._free)
            self.records += 1
        except _Unbindable:
            bound = _UNBOUND
            self.refused += 1
        if len(self._bound) >= self.MAX:
            self.clear()
        if self._free and bound is not _UNBOUND:
            self._file_sizes(key, bound)
        self._bound[key] = bound
        if bound is not _UNBOUND and light is not None:
            self._guard(light, bound, tensors)
        return result


# calls recorded in this process, by every memo (recordings())
_RECORDINGS = [0]


def recordings() -> int:
    """How many calls this process has recorded (bound or refused), by every memo: each took
    the whole path under the recorder. A benchmark's count of how often a serving step's calls
    are not replays (benchmarks.host)."""
    return _RECORDINGS[0]


class LaunchCache(Memo):
    """The op-level memo: calls of one op implementation, keyed by the op's own arguments."""

    def call(self, impl, name: str, args: tuple, kwargs: dict):
        """impl(*args, **kwargs) (an op implementation, eager, wrap_triton off), replayed where
        a call with the same key was bound; NOT_PLAIN, with nothing run, where the arguments
        are not those of a plain eager call (unobserved's per-tensor half, asked here so that
        the caller, having asked unwatched(), need not loop over them twice)."""
        values = (*args, *kwargs.values())
        if _recorder() is not None:
            # inside a caller's recording (an entry point's bound call) nothing replays and
            # nothing is recorded here: the op runs under that recording, unkeyed
            flat = _flatten(values, [])
            if not (plain_tensors(flat) and any(isinstance(a, torch.Tensor) for a in flat)):
                return NOT_PLAIN
            with set_wrap_triton_enabled(False):
                return impl(*args, **kwargs)
        out, kt = self.find(values, (name, tuple(kwargs)))
        if out is not None:
            return out
        if kt is None:
            return NOT_PLAIN
        key, tensors, _, light = kt
        if self.known_unbound(key):
            with set_wrap_triton_enabled(False):
                return impl(*args, **kwargs)
        return self.record(key, tensors, impl, args, kwargs, light=light)


def _idle(hook) -> bool:
    """A launch hook that calls nothing: None, or an empty HookChain (triton 3.6-3.9)."""
    return hook is None or not getattr(hook, "calls", True)


def _replayable(cuda: bool) -> bool:
    """Whether a replay may stand in for the full path now (cuda: the call's tensors are on a
    CUDA device): no CUDA-graph capture (captured launches keep the full path, whose choices
    differ there) and no Triton launch hook."""
    if _knobs is not None:
        rt = _knobs.runtime
        if not (_idle(rt.launch_enter_hook) and _idle(rt.launch_exit_hook)):
            return False
    return not cuda or not torch.cuda.is_current_stream_capturing()


# calls without a caller's memo (single prefill, the cuDNN / TRT-LLM-style functions)
DEFAULT = LaunchCache()
