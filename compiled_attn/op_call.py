"""How the public entry points call the ops: ``call_op(name, *args, **kwargs)``.

Every entry point (the wrappers' run(), the single-request function, the cuDNN- and TRT-LLM-style
functions, POD, the transformers attention function) computes through one of the four
``torch.ops.compiled_attn`` ops. Through torch's dispatcher a call of a ``triton_op`` passes
three Python kernels (custom_op's autograd wrapper, its backend wrapper, then ours) and boxes its
~20 arguments at each step. A plain eager call needs none of that: ``call_op`` then runs the op's
implementation (contracts.IMPLEMENTATIONS, the function the op's backend runs) the way the op's
backend runs it, with wrap_triton off, through a bound-launch cache (ops/launch.py): the first
call with a given metadata decides and records its launches, later ones replay them. A wrapper
passes its plan's cache (``launches``), whose fixed plan tensors are keyed by identity.

Plain eager means nothing could observe or transform the op: not compiling or exporting
(Dynamo), no TorchDispatchMode or TorchFunctionMode active (FakeTensorMode, FunctionalTensorMode,
FlopCounterMode, make_fx, debug modes), no functorch transform (vmap, grad), the autograd
profiler off (it records the op by name), and every tensor argument a plain ``torch.Tensor`` on
a device the kernel runs (CUDA; CPU under the Triton interpreter) that does not require grad
while grad is on (the op's autograd kernel is what raises on backward): ops.launch.unobserved.
Any other call goes through the op, unchanged, whose body replays bound launches by the same
rule once the dispatcher has passed it to the implementation (ops.contracts._replaying). Both
paths run the same code and give the same bits.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch._dynamo.exc import Unsupported

from compiled_attn import _validate as V
from compiled_attn.ops import contracts, launch
from compiled_attn.ops.policy import POLICY

try:  # triton_op's own switch for eager launches (private; present in torch 2.11-2.13)
    from torch._library.triton import set_wrap_triton_enabled
except ImportError:  # pragma: no cover - then every call goes through the dispatcher
    set_wrap_triton_enabled = None


def capturing(device: torch.device) -> bool:
    """Whether an eager call on ``device`` runs under CUDA-graph capture (False while tracing:
    a traced call is never captured as itself)."""
    return (not torch.compiler.is_compiling() and device.type == "cuda"
            and torch.cuda.is_current_stream_capturing())


def plain_eager(args: tuple, kwargs: dict | None = None) -> bool:
    """Whether a call with these arguments may skip the dispatcher (module docstring). No
    arguments: the half that does not look at them (launch.unwatched)."""
    return (POLICY.direct and set_wrap_triton_enabled is not None
            and (launch.unobserved(args, kwargs) if args or kwargs else launch.unwatched()))


def call_op(name: str, *args, launches: launch.LaunchCache | None = None, **kwargs):
    """``torch.ops.compiled_attn.<name>(*args, **kwargs)``; a plain eager call runs the op's
    implementation directly, replaying a bound launch where one matches (module docstring).
    launches: the caller's cache (a wrapper's plan), else the shared one."""
    if POLICY.direct and set_wrap_triton_enabled is not None and launch.unwatched():
        impl = contracts.IMPLEMENTATIONS[name]
        if POLICY.bound_launches:  # the cache asks the arguments' half of plain_eager
            out = (launches or launch.DEFAULT).call(impl, name, args, kwargs)
            if out is not launch.NOT_PLAIN:
                return out
        elif launch.unobserved(args, kwargs):
            with set_wrap_triton_enabled(False):
                return impl(*args, **kwargs)
    return getattr(torch.ops.compiled_attn, name)(*args, **kwargs)


def graph_leaf(fn, scalars: tuple[str, ...] = ()):
    """fn as one call in torch.compile's graph (``torch._dynamo.allow_in_graph``): Dynamo does
    not trace fn's Python body; it runs fn on fake tensors for the output and AOTAutograd traces
    through it to the op it calls. The compiled call then guards on fn's arguments, not on
    every global, default and function the body reads: the single prefill's checks made 163
    guards against compiled SDPA's 22, and their evaluation was most of the compiled call's
    extra host time. An error fn raises on the fake tensors (a bad argument) becomes a graph
    break with its message: under fullgraph=True Dynamo raises it so; otherwise the call runs
    eagerly and raises the eager error itself, as when Dynamo traced fn. So does a tensor for
    one of ``scalars`` (fn's number arguments: Dynamo passes a numpy scalar as a 0-d tensor,
    whose value a graph cannot read on the host), where eager takes the number. Eager, the
    wrapper is one more Python frame. (``nonstrict_trace`` would do the same but on torch
    2.13 replaces fn's errors by "unsupported output type" and fails a strict torch.export.)"""
    sig = inspect.signature(fn)
    fake = V.on_fake_tensors

    @functools.wraps(fn)
    def leaf(*args, **kwargs):
        try:
            if scalars and fake():
                bound = sig.bind(*args, **kwargs).arguments
                for name in scalars:
                    if torch.is_tensor(bound.get(name)):
                        raise TypeError(f"{name}: got a tensor (a numpy scalar becomes one "
                                        "under torch.compile) where a Python number is taken")
            return fn(*args, **kwargs)
        except Unsupported:
            raise
        except Exception as e:
            if not fake():  # eager, or Dynamo tracing this frame itself
                raise
            raise Unsupported(f"{fn.__name__}: {type(e).__name__}: {e}") from e

    return torch._dynamo.allow_in_graph(leaf)


def write_rows(dst: torch.Tensor, src: torch.Tensor, end: torch.Tensor | None = None
               ) -> torch.Tensor:
    """src copied into a caller's buffer dst (out= / lse=; src's shape), which is returned.
    end: None (every row), or a one-element int tensor on dst's device (an indptr's last
    entry): only rows (dim 0) before it belong to requests, and the rest keep dst's values,
    as FlashInfer's kernels leave a caller's rows of no request unwritten. No host read, so a
    CUDA graph may capture it."""
    if end is None:
        return dst.copy_(src)
    rows = torch.arange(dst.shape[0], device=dst.device)
    keep = (rows < end.reshape(())).reshape(-1, *[1] * (dst.dim() - 1))
    return dst.copy_(torch.where(keep, src, dst))


def bound_run(memo: launch.Memo, inputs: tuple, options: tuple, full, discard: tuple = ()):
    """An entry point's call as a bound launch: ``full()`` runs the entry point's whole path
    (checks, views, the op) and returns its outputs (a tuple of tensors); a later plain eager
    call with the same inputs' metadata and options replays what that call launched, skipping
    the checks it passed (a call that differs in any checked property has another key and takes
    the whole path, which raises what it raises). inputs: the call's tensors (tuples allowed);
    options: every other argument that the path reads, as plain values; discard: positions of
    outputs the caller drops (an LSE not asked for), which a replay writes into one kept
    tensor instead of allocating them (launch.Bound)."""
    if not (POLICY.bound_launches and plain_eager(())):  # (eager_key asks the tensors' half)
        return full()
    # (the options' types too: True == 1 == 1.0, and the checks a replay skips tell them apart)
    out, kt = memo.find(inputs, (options, tuple(map(type, options)), discard))
    if out is not None:
        return out
    if kt is None or memo.known_unbound(kt[0]):
        return full()
    key, tensors, _, light = kt
    return memo.record(key, tensors, full, discard=discard, light=light)
