"""compiled_attn.ops.launch._Direct: a bound launch's arguments for Triton's C launcher, gathered
in one step. The launcher here is a stand-in with triton 3.6's shape (the real one needs a GPU:
tests/test_launch_gpu.py replays through it); what it receives is checked against the plain
assembly (each recorded argument, each patched pointer, each descriptor expanded over its new
base), over several calls, bases and offsets."""

import dataclasses
import sys

import pytest

from compiled_attn.ops import launch


@dataclasses.dataclass
class _Desc:
    base: object
    shape: list
    strides: list
    block_shape: list


def _expand(arg, meta):
    # the tensor map stands in as a tuple of what it encodes; shape and strides follow
    return [("map", arg.base.data_ptr(), meta), *arg.shape, *arg.strides]


class CudaLauncher:  # (the name and call signature _Direct.of checks)
    global_scratch_size = 0
    profile_scratch_size = 0
    launch_cooperative_grid = False
    launch_pdl = True

    def __init__(self, launch_fn):
        self.launch = launch_fn

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        raise AssertionError("the direct path calls the C launcher itself")


def _wrapped(launcher, tensordesc_indices, tensordesc_meta):
    def launch_fn(*args):  # (triton 3.6's wrapper: a closure over these three)
        return launcher, tensordesc_indices, tensordesc_meta
    return launch_fn


class _Compiled:
    function = 1234
    packed_metadata = ("meta",)

    def __init__(self, run):
        self.run = run


@pytest.fixture
def nvd(monkeypatch):
    nvd = pytest.importorskip("triton.backends.nvidia.driver")
    monkeypatch.setattr(nvd, "_BASE_ARGS_FORMAT_LEN", 13, raising=False)
    monkeypatch.setattr(nvd, "make_tensordesc_arg", _expand)
    monkeypatch.setattr(launch, "_DESC_EXPANSIONS", {})  # (shared by a process's launches)
    return nvd


def _setup():
    """A launch of 7 arguments: a descriptor over the call's tensor 0, an output's pointer, a
    constant, a descriptor 32 bytes into tensor 1, a pointer 16 bytes into tensor 1, a bundle
    of constants, a descriptor over a static base; pointers: 2 tensors, 1 output, 1 scratch."""
    seen = []

    def c_launcher(*args):
        seen.append(args)
    recorded = [_Desc(launch._Ptr(1000), [8, 4], [4, 1], [2, 4]), None, 5,
                _Desc(launch._Ptr(2032), [6, 2], [2, 1], [2, 2]), None, (1, 2.5, True),
                _Desc(launch._Ptr(9000), [3, 3], [3, 1], [1, 3])]
    patches = [(0, True, ("in", 0, 0, None)), (1, False, ("out", 2, 0, None)),
               (3, True, ("in", 1, 32, None)), (4, False, ("in", 1, 16, None)),
               (6, True, ("static", 9000, 0, None))]
    L = CudaLauncher(_wrapped(c_launcher, {0, 3, 6}, ["m0", "m3", None]))
    compiled = _Compiled(L)
    direct = launch._Direct.of(compiled, recorded, patches, 4)
    assert direct is not None
    return direct, compiled, recorded, seen


def _plain(recorded, ptrs):
    """What the launcher should receive after its 13 base arguments."""
    t0, t1, out = ptrs[0], ptrs[1], ptrs[2]
    d0, d3, d6 = recorded[0], recorded[3], recorded[6]
    return (("map", t0, "m0"), *d0.shape, *d0.strides, out, 5,
            ("map", t1 + 32, "m3"), *d3.shape, *d3.strides, t1 + 16, (1, 2.5, True),
            ("map", 9000, None), *d6.shape, *d6.strides)


def test_direct_gathers_what_the_plain_expansion_gives(nvd, monkeypatch):
    direct, compiled, recorded, seen = _setup()
    for ptrs in ([1000, 2000, 3000, 77], [5008, 2000, 3016, 77], [1000, 6400, 3000, 78],
                 [5008, 2000, 3016, 77]):
        direct((3, 2, 1), 99, compiled, ptrs)
        args = seen[-1]
        assert args[:13] == (3, 2, 1, 99, 1234, False, True, None, None, ("meta",), None, None,
                             None)
        assert args[13:] == _plain(recorded, ptrs)
    # each new base encoded once, then kept (the static one at construction)
    assert sorted(direct.cache[0]) == [1000, 5008]
    assert sorted(direct.cache[3]) == [2032, 6432]


def test_direct_descriptor_cache_is_bounded(nvd, monkeypatch):
    monkeypatch.setattr(launch, "DESC_BASES", 2)
    direct, compiled, recorded, seen = _setup()
    for base in (1000, 1016, 1032, 1000):
        ptrs = [base, 2000, 3000, 77]
        direct((1, 1, 1), 0, compiled, ptrs)
        assert seen[-1][13:] == _plain(recorded, ptrs)
        assert len(direct.cache[0]) <= 2


def test_direct_launches_share_their_descriptor_expansions(nvd, monkeypatch):
    # a new recording over descriptors seen before (a serving step's next call on the same
    # layers' caches) encodes none again; a descriptor of another shape, or the same launch
    # with another expander, has expansions of its own
    made = []

    def counting(arg, meta):
        made.append(arg.base.data_ptr())
        return _expand(arg, meta)
    monkeypatch.setattr(nvd, "make_tensordesc_arg", counting)
    first, compiled, recorded, seen = _setup()
    assert sorted(made) == [1000, 2032, 9000]
    first((1, 1, 1), 0, compiled, [5008, 2000, 3000, 77])
    assert made[-1] == 5008
    made.clear()
    second, compiled, recorded, seen = _setup()
    for ptrs in ([1000, 2000, 3000, 77], [5008, 2000, 3000, 77]):
        second((1, 1, 1), 0, compiled, ptrs)
        assert seen[-1][13:] == _plain(recorded, ptrs)
    assert made == []
    assert second.cache[0] is first.cache[0]
    L = compiled.run
    wider = [_Desc(launch._Ptr(1000), [16, 4], [4, 1], [2, 4]), *recorded[1:]]
    third = launch._Direct.of(_Compiled(L), wider, [(0, True, ("in", 0, 0, None))], 4)
    assert made == [1000] and third.cache[0] is not first.cache[0]
    monkeypatch.setattr(nvd, "make_tensordesc_arg", _expand)
    fourth, *_ = _setup()
    assert fourth.cache[0] is not first.cache[0]


def test_direct_refuses_an_expansion_that_moves_with_its_base(nvd, monkeypatch):
    direct, compiled, recorded, seen = _setup()
    monkeypatch.setattr(direct, "make", lambda arg, meta: [arg.base.data_ptr(),
                                                           arg.base.data_ptr() % 7])
    with pytest.raises(RuntimeError, match="depends on its base"):
        direct((1, 1, 1), 0, compiled, [1008, 2000, 3000, 77])


def test_direct_needs_triton_36s_launcher(nvd, monkeypatch):
    monkeypatch.setattr(nvd, "_BASE_ARGS_FORMAT_LEN", 14, raising=False)
    L = CudaLauncher(_wrapped(lambda *a: None, {0}, [None]))
    assert launch._Direct.of(_Compiled(L), [_Desc(launch._Ptr(16), [1], [1], [1])],
                             [(0, True, ("in", 0, 0, None))], 1) is None
    assert "triton.backends.nvidia.driver" in sys.modules


def test_constant_bundles_are_kept_by_value(monkeypatch):
    # a launch's constant bundles (named tuples of constants) are tested once by value; a
    # tuple holding a tensor or another object is never taken for one, before or after
    import torch
    monkeypatch.setattr(launch, "_CONSTANT_TUPLE_SET", set())
    bundle = (1, 2.5, True, ("a", torch.float16, None))
    assert launch._is_constant(bundle) and bundle in launch._CONSTANT_TUPLE_SET
    assert launch._is_constant((1, 2.5, True, ("a", torch.float16, None)))
    for other in ((1, torch.ones(1)), (1, (2, object())), (torch.ones(2), 2.5)):
        assert not launch._is_constant(other) and not launch._is_constant(other)
    assert len(launch._CONSTANT_TUPLE_SET) == 2  # (the bundle and the one inside it)
    monkeypatch.setattr(launch, "CONSTANT_TUPLES", 1)
    assert launch._is_constant((3,)) and launch._CONSTANT_TUPLE_SET == {(3,)}


def test_direct_expands_sized_descriptors_with_the_calls_rows(nvd, monkeypatch):
    # a descriptor over a tensor with a free size (launch.Memo's free): its whole expansion
    # made over each (base, rows) the call passes after its pointers, and kept by both
    seen = []

    def c_launcher(*args):
        seen.append(args)
    recorded = [_Desc(launch._Ptr(1000), [8, 4], [4, 1], [2, 4]), None,
                _Desc(launch._Ptr(2000), [5, 4], [4, 1], [2, 4])]
    patches = [(0, True, ("in", 0, 0, None)), (1, False, ("out", 1, 0, None)),
               (2, True, ("in", 2, 0, None))]
    L = CudaLauncher(_wrapped(c_launcher, {0, 2}, ["m0", "m2"]))
    compiled = _Compiled(L)
    direct = launch._Direct.of(compiled, recorded, patches, 4, {0: 3})
    assert direct is not None
    for t0, rows in ((1000, 8), (1000, 11), (4000, 11), (1000, 8)):
        direct((1, 1, 1), 0, compiled, [t0, 3000, 2000, rows])
        assert seen[-1][13:] == (("map", t0, "m0"), rows, 4, 4, 1, 3000,
                                 ("map", 2000, "m2"), 5, 4, 4, 1)
    assert sorted(direct.by_rows[0]) == [(1000, 8), (1000, 11), (4000, 11)]
