"""What the launch path asks of a CUDA device: its properties, queried once per device (a query
costs ~5 us on the H100's host). A leaf module: the launch decision (choose.device_of, which
the Triton and Gluon launchers ask) and the split-KV planner (schedule) read it.
"""

from __future__ import annotations

import functools

import torch

__all__ = ["sm_count"]


@functools.lru_cache(maxsize=None)
def _device_properties(index: int):
    """CUDA device ``index``'s properties, queried once (_props)."""
    return torch.cuda.get_device_properties(index)


def _props(index: int | None):
    """The properties of CUDA device ``index`` (None: the current device)."""
    return _device_properties(torch.cuda.current_device() if index is None else index)


def sm_count(index: int | None = None) -> int:
    """Multiprocessors of CUDA device ``index`` (default: the current one), queried once."""
    return _props(index).multi_processor_count
