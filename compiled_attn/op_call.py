"""How the public entry points call the ops: ``call_op(name, *args, **kwargs)``.

Every entry point (the wrappers' run(), the single-request function, the cuDNN- and TRT-LLM-style
functions, POD, the transformers attention function) computes through one of the four
``torch.ops.compiled_attn`` ops. Through torch's dispatcher a call of a ``triton_op`` passes
three Python kernels (custom_op's autograd wrapper, its backend wrapper, then ours) and boxes its
~20 arguments at each step. A plain eager call needs none of that: ``call_op`` then runs the op's
implementation (contracts.IMPLEMENTATIONS, the function the op's backend runs) the way the op's
backend runs it, with wrap_triton off: 30-45 us less host time per call of a wrapper's run() or
single_prefill_with_kv_cache on the H100's host (docs/design.md; about a fifth of the call).

Plain eager means nothing could observe or transform the op: not compiling or exporting
(Dynamo), no TorchDispatchMode or TorchFunctionMode active (FakeTensorMode, FunctionalTensorMode,
FlopCounterMode, make_fx, debug modes), no functorch transform (vmap, grad), the autograd
profiler off (it records the op by name), and every tensor argument a plain ``torch.Tensor`` on
a device the kernel runs (CUDA; CPU under the Triton interpreter) that does not require grad
while grad is on (the op's autograd kernel is what raises on backward). Any other call goes
through the op, unchanged. Both paths run the same code and give the same bits.
"""

from __future__ import annotations

import torch

from compiled_attn.ops import contracts

try:  # triton_op's own switch for eager launches (private; present in torch 2.11-2.13)
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - then every call goes through the dispatcher
    set_wrap_triton_enabled = None

# False: every call goes through torch.ops (for A/B timing and debugging).
DIRECT = True


def plain_eager(args: tuple, kwargs: dict | None = None) -> bool:
    """Whether a call with these arguments may skip the dispatcher (module docstring)."""
    if not DIRECT or set_wrap_triton_enabled is None or torch.compiler.is_compiling():
        return False
    if (torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
            or torch._C._autograd._profiler_enabled()
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return False
    grad = torch.is_grad_enabled()
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor) and (type(a) is not torch.Tensor
                                            or (grad and a.requires_grad)
                                            or not (a.is_cuda or contracts._use_kernel(a))):
            return False
    return True


def call_op(name: str, *args, **kwargs):
    """``torch.ops.compiled_attn.<name>(*args, **kwargs)``; a plain eager call runs the op's
    implementation directly (module docstring)."""
    if plain_eager(args, kwargs):
        with set_wrap_triton_enabled(False):
            return contracts.IMPLEMENTATIONS[name](*args, **kwargs)
    return getattr(torch.ops.compiled_attn, name)(*args, **kwargs)
