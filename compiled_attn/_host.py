"""plan()'s traffic between the host and the device.

A plan reads its index arrays on the host (it checks them and builds the work lists there) and
writes its own index tensors to the device. On a GPU host each small copy costs a serving step
~6-13 us of host time however few its entries (a device-to-host copy also waits for the device;
a copy that converts int64 to int32 is a second op), and a batch plan made two to eight reads
and three to fourteen writes. Here the arrays a plan reads come back in one device-to-host copy
(``gather_host``), in int32 where they are int32, and the tensors it writes (``to_device``) are
int32 on the host already, so each write is one copy. The checks on the values stay with each
argument (compiled_attn._validate), which takes the read copies through its ``hosts`` argument.
"""

from __future__ import annotations

import torch

__all__: list[str] = []  # internal module: nothing is re-exported by compiled_attn

# Entries: a longer array (a page table's pre-allocated buffer, read in its used slice only)
# is copied on its own.
GATHER_MAX = 1 << 16
# (the integer dtypes torch.cat takes on every device; another integer argument is copied on
# its own, as before)
_INT_DTYPES = (torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64)
# device types whose tensors are read where they are (gather_host leaves them out)
_ON_HOST = ("cpu", "meta")


def gather_host(*tensors) -> dict[int, torch.Tensor]:
    """Host copies of the device tensors among ``tensors`` that are 1-D, of an integer dtype
    and at most GATHER_MAX entries, read in one copy per device: {id(tensor): copy}, for
    _validate.host_copy's ``hosts`` (int32 where every tensor of the copy is, else int64).
    Anything else (host tensors, other dtypes or shapes, non-tensors) is left out, so its
    argument's own checks and copy run as before; a tensor given twice is read once. The ids
    hold while the caller holds the tensors (plan()'s arguments)."""
    groups: dict[torch.device, dict[int, torch.Tensor]] = {}
    for t in tensors:
        if (torch.is_tensor(t) and t.device.type not in _ON_HOST and t.dim() == 1
                and t.dtype in _INT_DTYPES and t.numel() <= GATHER_MAX):
            groups.setdefault(t.device, {})[id(t)] = t
    out: dict[int, torch.Tensor] = {}
    for group in groups.values():
        ts = list(group.values())
        wide = any(t.dtype != torch.int32 for t in ts)
        # (integer tensors never require grad: nothing to detach; the parts are slices, each
        # a view cheaper than split's)
        flat = (ts[0] if len(ts) == 1 else torch.cat(ts)).to(
            "cpu", torch.int64 if wide else torch.int32)
        at = 0
        for key, t in group.items():
            n = t.numel()
            out[key] = flat[at:at + n]
            at += n
    return out


def to_device(arrays: dict, device: torch.device, non_blocking: bool,
              into: dict | None = None, sent: dict | None = None) -> dict:
    """int32 copies on ``device`` of host arrays ({name: integer tensor of any shape, or
    None}): {name: device tensor or None}. Each is a tensor of its own, not a view of one
    shared buffer: a compiled run() takes the plan's tensors as inputs, and views of one
    storage would be aliased inputs whose storage offsets (set by the other arrays' sizes)
    torch.compile guards on, a recompile where they move. The host arrays are int32 where they
    can be (host_copy, build_work), so each copy is the copy alone. Values are taken modulo
    2^32 as ``.to(torch.int32)`` takes them (the plan checked their ranges). into: the
    previous plan's tensors by name (on ``device``): where one has the array's shape and is
    int32, the copy goes into it, on the current stream, and it is returned (a re-plan of the
    same shapes keeps its tensors, and with them the launches bound to them). sent: the host
    arrays that into's tensors were last written from, by name (the caller's record of the
    previous call's ``arrays``, which no one writes after): where an array is that very
    object (a plan's cached host lists) or holds the same values (a decode step's page table
    until a request takes a new page), into's tensor already holds it and is returned
    without a copy (each copy costs a GPU host ~6-13 us; comparing a host array a few)."""
    out = {}
    for name, t in arrays.items():
        prev = None if into is None else into.get(name)
        if t is None:
            out[name] = None
        elif prev is not None and sent is not None and _same(sent.get(name), t):
            out[name] = prev
        else:
            out[name] = copy_to(t, device, torch.int32, non_blocking, prev)
    return out


def _same(old: torch.Tensor | None, t: torch.Tensor) -> bool:
    """Whether host array t is old or holds old's values (shape and dtype too)."""
    return old is t or (old is not None and old.shape == t.shape and old.dtype == t.dtype
                        and torch.equal(old, t))


def copy_to(t: torch.Tensor, device: torch.device, dtype: torch.dtype, non_blocking: bool,
            prev: torch.Tensor | None = None) -> torch.Tensor:
    """Host array t on ``device`` as ``dtype``: copied into prev (the previous plan's tensor,
    on the current stream) where prev is a tensor of t's shape and that dtype, else a new
    tensor."""
    if isinstance(prev, torch.Tensor) and prev.shape == t.shape and prev.dtype == dtype:
        return prev.copy_(t, non_blocking=non_blocking)
    return t.to(device, dtype, non_blocking=non_blocking)
