"""compiled_attn.op_call: when a public entry point's call may skip torch's dispatcher (a plain
eager call) and when it must go through the op (anything that traces, transforms, profiles or
records it). The direct path's results are checked against the op's under the Triton
interpreter (tests/interpret/test_op_call_interp.py)."""

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

import compiled_attn as fi
from compiled_attn import op_call
from compiled_attn.ops import launch
from compiled_attn.ops.policy import POLICY


@pytest.fixture
def kernel_device(monkeypatch):
    # CPU tensors count as a kernel device here (as under the interpreter); the predicate alone
    # is exercised, nothing is launched.
    monkeypatch.setattr(launch, "on_kernel_device", lambda t: True)


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_plain_eager_call_skips_the_dispatcher(kernel_device):
    x = torch.randn(3)
    assert op_call.plain_eager((x, None, 1, 0.5), {"merge": True})
    with torch.no_grad():
        assert op_call.plain_eager((x.requires_grad_(), ))


@pytest.mark.parametrize("why", ["requires_grad", "subclass", "kwarg_subclass", "dispatch_mode",
                                 "function_mode", "profiler", "vmap", "switched_off"])
def test_observed_or_traced_calls_go_through_the_op(kernel_device, monkeypatch, why):
    x = torch.randn(3)
    args, kwargs = (x, ), {}
    if why == "requires_grad":
        args = (torch.randn(3, requires_grad=True), )
    elif why == "subclass":
        args = (torch.nn.Parameter(x), )
    elif why == "kwarg_subclass":
        kwargs = {"sinks": torch.nn.Parameter(x)}
    elif why == "switched_off":
        monkeypatch.setattr(POLICY, "direct", False)
    if why == "dispatch_mode":
        with _Record():
            assert not op_call.plain_eager(args, kwargs)
    elif why == "function_mode":
        with TorchFunctionMode():
            assert not op_call.plain_eager(args, kwargs)
    elif why == "profiler":
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
            assert not op_call.plain_eager(args, kwargs)
    elif why == "vmap":
        seen = []
        torch.func.vmap(lambda t: seen.append(op_call.plain_eager((t, ))) or t)(torch.randn(2, 3))
        assert seen == [False]
    else:
        assert not op_call.plain_eager(args, kwargs)


def test_compiled_calls_go_through_the_op(kernel_device):
    f = torch.compile(lambda t: t + op_call.plain_eager((t, )), backend="eager", fullgraph=True)
    assert torch.equal(f(torch.zeros(2)), torch.zeros(2))


def test_cpu_tensors_take_the_op_and_modes_see_it():
    # Outside the interpreter CPU tensors run the op's reference: through the dispatcher, where
    # a dispatch mode sees the compiled_attn op.
    assert not op_call.plain_eager((torch.randn(2), ))
    q, k, v = (torch.randn(5, 2, 16) for _ in range(3))
    with _Record() as rec:
        fi.single_prefill_with_kv_cache(q, k, v, causal=True)
    assert "compiled_attn.single_prefill.default" in rec.ops


def _dynamo_graph(fn, *args):
    """The FX graph Dynamo hands its backend for fn(*args), and fn's compiled output."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend=backend)(*args)
    return graphs, out


def _single_inputs(qo=9, kv=13, d=16):
    g = torch.Generator().manual_seed(qo * kv)
    return (torch.randn(qo, 4, d, generator=g), torch.randn(kv, 2, d, generator=g),
            torch.randn(kv, 2, d, generator=g))


def test_single_prefill_is_one_call_in_the_compiled_graph():
    """Dynamo puts the single prefill in its graph as one call (op_call.graph_leaf) instead of
    tracing its checks: the compiled call then guards on the arguments alone. A POLICY read or
    a check's function would each be a guard evaluated at every compiled call."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    q, k, v = _single_inputs()

    def f(q, k, v):
        return fi.single_prefill_with_kv_cache(q, k, v, causal=True, window_left=5)

    graphs, out = _dynamo_graph(f, q, k, v)
    calls = [n for gm in graphs for n in gm.graph.nodes if n.op == "call_function"]
    assert [n.target for n in calls] == [fi.single_prefill_with_kv_cache]
    assert calls[0].kwargs == {"causal": True, "window_left": 5}
    torch.testing.assert_close(out, fi.single_prefill_with_kv_cache(q, k, v, causal=True,
                                                                    window_left=5))
    guards = str(_debug_get_cache_entry_list(f.__code__)[0].guard_manager)
    assert "POLICY" not in guards and "_validate" not in guards


def test_single_prefill_errors_keep_their_message_under_compile():
    """A bad argument found while torch.compile runs the call on fake tensors reaches the user
    with the eager call's message."""
    q, k, v = _single_inputs()
    k = k[..., :8]
    msg = "k: head dim 8 differs from q's 16"
    with pytest.raises(ValueError, match=msg):
        fi.single_prefill_with_kv_cache(q, k, v)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=msg):
        torch.compile(lambda q, k, v: fi.single_prefill_with_kv_cache(q, k, v),
                      fullgraph=True, backend="eager")(q, k, v)


@pytest.mark.parametrize("strict", [True, False])
def test_single_prefill_exports(strict):
    """torch.export (strict: through Dynamo, where the call is one graph node; non-strict)
    records the op, and the exported program computes the eager call's numbers."""
    q, k, v = _single_inputs()

    class M(torch.nn.Module):
        def forward(self, q, k, v):
            return fi.single_prefill_with_kv_cache(q, k, v, causal=True)

    ep = torch.export.export(M(), (q, k, v), strict=strict)
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    assert torch.ops.compiled_attn.single_prefill.default in targets
    torch.testing.assert_close(ep.module()(q, k, v), M()(q, k, v))


@pytest.mark.parametrize("arg", ["k_scale", "v_scale"])
def test_single_prefill_tensor_scale_under_compile_names_the_argument(arg):
    """A one-element CPU tensor scale is read on the host eagerly; a traced call cannot read it
    (a data-dependent guard) and says so, naming the argument."""
    q, k, v = _single_inputs()
    s = torch.tensor([0.5])
    eager = fi.single_prefill_with_kv_cache(q, k, v, **{arg: s})
    torch.testing.assert_close(eager, fi.single_prefill_with_kv_cache(q, k, v, **{arg: 0.5}))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=f"{arg}: got a tensor, which is read on the host"):
        torch.compile(lambda q, k, v, s: fi.single_prefill_with_kv_cache(q, k, v, **{arg: s}),
                      fullgraph=True, backend="eager")(q, k, v, s)


def test_single_prefill_errors_keep_their_type_without_fullgraph():
    """Without fullgraph a bad argument found on the fake tensors is a graph break: the call
    runs eagerly and raises the eager error (its type too, as when Dynamo traced the checks)."""
    q, k, v = _single_inputs(qo=13, kv=9)
    torch._dynamo.reset()
    with pytest.raises(ValueError, match="causal=True needs kv_len >= qo_len"):
        torch.compile(lambda q, k, v: fi.single_prefill_with_kv_cache(q, k, v, causal=True),
                      backend="eager")(q, k, v)


def test_single_prefill_numpy_scalars_under_compile():
    """Dynamo passes a numpy scalar as a 0-d tensor: the number arguments graph-break on it
    and the call runs eagerly with the scalar, as it does uncompiled."""
    np = pytest.importorskip("numpy")
    q, k, v = _single_inputs()
    kw = dict(sm_scale=np.float64(0.3), window_left=np.int64(3), causal=True)
    want = fi.single_prefill_with_kv_cache(q, k, v, **kw)
    torch._dynamo.reset()
    got = torch.compile(lambda q, k, v, s, w: fi.single_prefill_with_kv_cache(
        q, k, v, sm_scale=s, window_left=w, causal=True), backend="eager")(
        q, k, v, kw["sm_scale"], kw["window_left"])
    torch.testing.assert_close(got, want)
