"""torch's mutation analysis of our Triton kernels, under the installed torch and Triton.

When torch.compile or torch.export trace an op, its Triton launch becomes a
``triton_kernel_wrapper`` node, and torch works out which tensor arguments the kernel writes by
compiling it to TTIR and reading the stores (``torch._higher_order_ops.triton_kernel_wrap``). If
that step fails, torch logs a warning and assumes every tensor argument is written (q / k / v
and the plan tensors then count as outputs of the node). That step calls Triton's compiler
internals, which move between releases. On the H100, torch 2.11 with triton 3.9 (a pairing torch
2.11 does not pin) hit exactly this, and seven Inductor tests of the GPU tier failed after it
(benchmarks/NOTES.md, 2026-11-24). Where it succeeds it is conservative through jit helpers
(a helper's results depend on all its arguments), which once made the work list read as
written. So each launch family is analysed here, for an sm_90 target (no GPU needed), and must
write only its outputs.

The launchers are called on CPU tensors with Triton's launch replaced by a recorder (nothing
runs); the recorded arguments are what wrap_triton would hand torch's analysis. The same
launches also compile from the source Inductor regenerates when it inlines them
(torch.compile, AOTInductor), which carries only some kinds of globals.
"""

from __future__ import annotations

import pytest
import torch

from compiled_attn.ops import choose
from compiled_attn.ops import contracts as C
from compiled_attn.ops import launch as L
from compiled_attn.ops import prefill_kernel as K
from compiled_attn.ops.tiles import ONE_PAGE_SIZE

from .helpers import indptr, make_paged, rand
from .sm90 import (F16, FakeDriver, compile_triton, paged, paged_launch, params, pod_launch, ragged,
                   ragged_launch, single_launch)

twk = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
pytestmark = pytest.mark.skipif(K.INTERPRET, reason="the interpreter's kernels are not traced")

# Outputs a launch may write (the persistent counter is taken by atomic adds); anything else
# written, q_ptr above all, means torch fell back to "every input is mutated".
WRITABLE = {"o_ptr", "lse_ptr", "part_o_ptr", "part_l_ptr", "counter_ptr",
            "o_ptr_p", "lse_ptr_p", "o_ptr_d", "lse_ptr_d"}


class _Recorder:
    """Stands in for wrap_triton(kernel): ``[grid](*args, **kwargs)`` records the call."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((self.fn, args, kwargs))


@pytest.fixture
def launches(monkeypatch):
    from triton.runtime.driver import driver

    calls: list = []
    monkeypatch.setattr(driver, "_active", FakeDriver())
    monkeypatch.setattr(L, "_kernel", lambda fn: _Recorder(fn, calls))
    monkeypatch.setattr(K, "_ensure_allocator", lambda: None)
    # a device of 132 SMs without tensor descriptors (the launch decision's description)
    monkeypatch.setattr(choose, "device_of", lambda device: choose.Device("cpu", 0, 132))
    return calls


CASES = {
    "single pointers": (single_launch, {}),
    # TMA 3: K/V descriptors built per persistent program, as in a traced graph compiled for
    # CUDA-graph replay or ahead of time (a small launch otherwise takes the pointer loads: below)
    "single persistent": (single_launch, {"device_of": lambda device: choose.H100,
                                          "_graph_host_free": lambda: True}),
    "ragged": (lambda: ragged_launch(False), {}),
    "ragged split + merge": (lambda: ragged_launch(True), {}),
    # the row-max output (LSE rows of two) and skip-softmax, split: partial maxima
    "ragged split + merge, row max, skip": (
        lambda: ragged_launch(True, row_max=True, skip_softmax=2.0), {}),
    "paged page 4": (paged_launch, {}),
    # the H100's page-1 tile: 128 rows, D 128, pointer gathers
    "paged page 1 D128": (lambda: paged_launch(1, 128, 128), {}),
    "pod": (pod_launch, {}),
}


def _launch(case, monkeypatch):
    """Run CASES[case]'s launcher with its patches of the launch decision."""
    launch, patches = CASES[case]
    for name, value in patches.items():
        monkeypatch.setattr(choose, name, value)
    launch()


def _written(fn, kwargs) -> set[str]:
    """Names of the tensor arguments torch's analysis finds written (torch 2.13:
    identify_accessed_tensors; 2.11 / 2.12: identify_mutated_tensors)."""
    if hasattr(twk, "identify_accessed_tensors"):
        acc = twk.identify_accessed_tensors(fn, kwargs, {})
        return {dep.name for dep in acc.read_writes.writes}
    return set(twk.identify_mutated_tensors(fn, kwargs, {}))


@pytest.mark.parametrize("case", list(CASES))
def test_torch_finds_only_outputs_written(case, launches, monkeypatch):
    _launch(case, monkeypatch)
    assert launches, "the launcher launched nothing"
    for fn, args, kw in launches:
        kwargs = dict(zip(fn.arg_names, args), **kw)
        assert set(fn.arg_names) <= set(kwargs), f"{fn.fn.__name__}: arguments missing"
        # Triton's compiler as torch drives it: raises here instead of the analysis' fallback
        twk.generate_ttir(fn, dict(kwargs), {})
        written = _written(fn, dict(kwargs))
        tensors = {n for n in fn.arg_names if isinstance(kwargs[n], torch.Tensor)}
        assert written and written <= WRITABLE & tensors, (fn.fn.__name__, sorted(written))
    if case == "single persistent":
        assert launches[0][2]["TMA"] == 3 and "counter_ptr" in written
    if case.startswith("ragged split + merge"):
        assert [c[0] for c in launches] == [K._prefill_fwd, K._merge_fwd]


# What each traced launch family reads beside q, k, v and its outputs; every other pointer is
# passed as None, so Inductor's wrapper passes nothing for it.
READ = {
    "single pointers": set(),
    "single persistent": {"counter_ptr"},
    "ragged": {"work_ptr", "qo_indptr_ptr", "kv_indptr_ptr"},
    "paged page 4": {"work_ptr", "qo_indptr_ptr", "kv_indptr_ptr", "page_idx_ptr",
                     "last_page_len_ptr"},
}


@pytest.mark.parametrize("case", list(READ))
def test_traced_launch_passes_none_for_unread_pointers(case, launches, monkeypatch):
    _launch(case, monkeypatch)
    (fn, args, kw), = launches
    kwargs = dict(zip(fn.arg_names, args), **kw)
    tensors = {n for n, a in kwargs.items() if isinstance(a, torch.Tensor)}
    pointers = {n for n in fn.arg_names if n.endswith("_ptr")}
    assert tensors == {"q_ptr", "k_ptr", "v_ptr", "o_ptr", "lse_ptr"} | READ[case], sorted(tensors)
    assert all(kwargs[n] is None for n in pointers - tensors)


def test_small_traced_launch_takes_pointer_loads(launches, monkeypatch):
    """A traced launch below host_tma_min_flop takes neither whole-tensor descriptor path (no
    persistent counter, no global scratch), unless the graph is compiled for CUDA-graph replay
    or ahead of time; a large one keeps the persistent grid."""
    monkeypatch.setattr(choose, "device_of", lambda device: choose.H100)
    single_launch()  # 40 x 40 keys, 2 heads
    assert launches[-1][2]["TMA"] == 0
    for mode in ({"triton.cudagraphs": True}, {"cpp_wrapper": True}):
        with torch._inductor.config.patch(mode):  # reduce-overhead; C++ wrapper
            single_launch()
        assert launches[-1][2]["TMA"] == 3, mode
    monkeypatch.setattr(choose.POLICY, "host_tma_min_flop", 1e3)
    single_launch()
    assert launches[-1][2]["TMA"] == 3


@pytest.mark.parametrize("case", ["ragged split", "ragged D128 128-row", "paged page 16"])
def test_row_max_and_skip_compile_for_sm90(case, launches):
    """The STATS / SKIP branches (a runtime branch around P.V inside the pipelined key loop)
    compile through ptxas for sm_90 (pointer loads: the launchers see CPU tensors), and the
    merge with STATS too."""
    opts = dict(row_max=True, skip_softmax=2.0)
    if case == "ragged split":
        ragged_launch(True, **opts)
    elif case == "ragged D128 128-row":
        q, k, v, qo = ragged(d=128)
        K.launch_ragged(q, k, v, qo, qo, torch.zeros(6, 2, dtype=torch.int32), None, None, None,
                        None, 128, None, **params(d=128), **opts)
    else:
        K.launch_paged(*paged(d=128, page=16), torch.zeros(6, 2, dtype=torch.int32), None,
                       None, None, None, 64, **params(d=128), **opts)
    assert launches and launches[0][2]["SKIP"] and launches[0][2]["STATS"]
    for fn, args, kw in launches:
        assert "ld.global" in compile_triton(fn, args, kw).asm["ptx"]


# sm_90's shared memory per block (227 KB, the H100's and H200's opt-in limit)
SM90_SHARED = 232448


@pytest.mark.parametrize("d,block_m", [(256, None), (512, None), (128, 64), (128, 128)])
def test_pod_fits_sm90_shared_memory(d, block_m, launches, monkeypatch):
    """POD holds both parts' K/V pipelines in one kernel: at D 512, as the GPU specializes the
    launch, two 32-key stages per part needed 320 KB (choose.choose's POD rule). At D 128 the
    Triton POD launch (here with the Gluon one switched off) on both tile heights a POD plan
    takes (choose.pod_tile: 64 where the Gluon launch would read the pages)."""
    monkeypatch.setattr(choose, "device_of", lambda device: choose.H100)
    monkeypatch.setattr(choose.POLICY, "pod_gluon", False)

    def paged(qo):
        (kc, vc), page_indptr, indices, last, _, _ = make_paged(qo, 2, d, d, 16, fmt="4d",
                                                                dtype=F16)
        return rand(sum(qo), 8, d, dtype=F16), kc, vc, indptr(qo), page_indptr, indices, last

    K.launch_pod(*paged([300, 0, 129]), *paged([1] * 6), torch.zeros(6, 3, dtype=torch.int32),
                 None, None, None, block_m or choose.tile(d, d, 4), params(d=d),
                 params(C.MASK_NONE, d=d))
    (fn, args, kw), = launches
    assert fn is K._pod_fwd
    assert compile_triton(fn, args, kw).metadata.shared <= SM90_SHARED


def test_pod_one_page_prefill_compiles_with_the_fixed_page_size(launches, monkeypatch):
    """PODWithPagedKVCacheWrapper's one-page prefill cache goes to the Triton POD launch with
    the fixed page-size constexpr (tiles.ONE_PAGE_SIZE, not the prefill's length): it
    compiles for sm_90 within the shared memory, its keys on the whole-page path."""
    monkeypatch.setattr(choose, "device_of", lambda device: choose.H100)
    d = 64
    kc, vc = (rand(1, 300, 2, d, seed=s, dtype=F16) for s in (1, 2))
    one_page = (rand(257, 2, d, dtype=F16), kc, vc, indptr([257]),
                torch.tensor([0, 1], dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                torch.tensor([300], dtype=torch.int32))
    K.launch_pod(*one_page, *paged(qo=[1, 1]), torch.zeros(6, 3, dtype=torch.int32), None,
                 None, None, 64, params(), params(C.MASK_NONE))
    (fn, args, kw), = launches
    assert fn is K._pod_fwd and kw["PAGE_SIZE_P"] == ONE_PAGE_SIZE
    assert compile_triton(fn, args, kw).metadata.shared <= SM90_SHARED


def _inductor_module(kernel, path):
    """The kernel re-created as torch.compile / AOTInductor inline it: the source Inductor
    generates for a user-defined Triton kernel (its own transitive-closure source, after its
    generated module's common imports), written to ``path`` and imported from there."""
    import importlib.util

    from torch._inductor.codegen.triton import TritonKernel
    from torch._inductor.codegen.wrapper import (
        user_defined_triton_kernel_transitive_closure_source_code)

    src = "\n".join([TritonKernel.gen_common_triton_imports(), "@triton.jit",
                     user_defined_triton_kernel_transitive_closure_source_code(kernel)])
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)  # (a JITFunction reads its source back from the file)
    return getattr(mod, kernel.fn.__name__)


@pytest.mark.parametrize("case", list(CASES))
def test_inductor_inlined_source_compiles_for_sm90(case, launches, monkeypatch, tmp_path):
    """Inductor inlines a wrap_triton launch by regenerating the kernel's source in a module of
    its own, carrying only the globals it knows (jit and constexpr functions, int / str / bool /
    tl.constexpr values, names imported from triton): every global the kernel family reads must
    be one of those, or the inlined compile fails on a NameError."""
    _launch(case, monkeypatch)
    assert launches, "the launcher launched nothing"
    for i, (fn, args, kw) in enumerate(launches):
        inlined = _inductor_module(fn, tmp_path / f"inlined_{i}.py")
        assert inlined is not fn and inlined.arg_names == fn.arg_names
        assert "ld.global" in compile_triton(inlined, args, kw).asm["ptx"]
