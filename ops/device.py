"""What the launchers ask of a CUDA device: its properties, queried once per device (a query
costs ~5 us on the H100's host, and a launch asks twice). A leaf module: the Triton launcher
(prefill_kernel), the Gluon launcher (prefill_gluon) and the work-list builders (schedule) all
read it, so neither launcher imports the other for it.
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
    """The properties of CUDA device ``index`` (None: the current device): the one source of
    its compute capability (_sm_major) and multiprocessor count (sm_count, and through it the
    Gluon launcher's persistent grid)."""
    return _device_properties(torch.cuda.current_device() if index is None else index)


def _sm_major(device: torch.device) -> int:
    return _props(device.index).major


def sm_count(index: int | None = None) -> int:
    """Multiprocessors of CUDA device ``index`` (default: the current one), queried once."""
    return _props(index).multi_processor_count
