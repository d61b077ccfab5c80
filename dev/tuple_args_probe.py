"""Dev probe: does torch.compile take a Triton kernel whose arguments are tuples?

The launched Triton kernels (prefill_kernel._prefill_fwd, _pod_fwd) keep flat signatures
(docs/design.md, "Arguments") because torch.compile and AOTInductor inline them through
wrap_triton. This probe checks that reason on the installed torch: a two-line kernel taking
(pointers) and (strides) tuples, launched three ways:

- eager, through a ``torch.library.triton_op`` (Triton itself accepts tuple arguments);
- the same op under ``torch.compile(fullgraph=True)``, default and reduce-overhead;
- ``wrap_triton`` called directly inside a compiled function.

Each line prints True (the result matches), False (wrong numbers) or FAILED with torch's reason.
On torch 2.11 (H200, 2026-11-28): wrap_triton inside a compiled function FAILED in Dynamo, which
takes only tensors and SymInts as a user kernel's non-constant arguments ("Unexpected argument
type for a Triton kernel: TupleVariable"); the triton_op under reduce-overhead printed False,
after torch's mutation analysis had failed on the fake tensors inside the tuple ("Cannot access
data pointer of Tensor"). torch 2.13's Dynamo has the same check. When every line prints True,
the launched kernels can take their bundles as arguments. Needs a CUDA GPU:

    python -m dev.tuple_args_probe
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.library import triton_op, wrap_triton


@triton.jit
def _double(ptrs, strides, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(ptrs[1] + i * strides[1], tl.load(ptrs[0] + i * strides[0]) * 2)


def _launch(x: torch.Tensor) -> torch.Tensor:
    y = torch.empty_like(x)
    wrap_triton(_double)[(1,)]((x, y), (x.stride(0), y.stride(0)), N=x.numel())
    return y


@triton_op("compiled_attn_probe::double", mutates_args=())
def double(x: torch.Tensor) -> torch.Tensor:
    return _launch(x)


def _try(label: str, fn, x: torch.Tensor, want: torch.Tensor) -> None:
    torch._dynamo.reset()
    try:
        print(label, torch.equal(fn(x), want))
    except Exception as e:  # noqa: BLE001  (the probe reports what torch says)
        print(label, "FAILED", type(e).__name__, str(e).splitlines()[0][:300])


def main() -> None:
    x = torch.randn(16, device="cuda")
    _try("eager triton_op", double, x, x * 2)
    for mode in ("default", "reduce-overhead"):
        _try(f"compiled triton_op ({mode})",
             torch.compile(lambda t: double(t) + 1, fullgraph=True, mode=mode), x, x * 2 + 1)
    _try("compiled wrap_triton", torch.compile(_launch, fullgraph=True), x, x * 2)


if __name__ == "__main__":
    main()
