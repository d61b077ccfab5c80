"""compiled_attn._host: a plan's index arrays read in one device-to-host copy and its tensors
written in one host-to-device copy. On this CPU machine gather_host is exercised by treating
CPU tensors as device ones; the GPU tier counts a plan's copies (tests/test_api_gpu.py)."""

import pytest
import torch

from compiled_attn import _host
from compiled_attn import _validate as V


def _arrays():
    g = torch.Generator().manual_seed(0)
    return dict(
        qo_indptr=torch.tensor([0, 3, 3, 10], dtype=torch.int64),
        work=torch.randint(0, 100, (7, 2), generator=g, dtype=torch.int32),
        merge=None,
        empty=torch.zeros((0, 4), dtype=torch.int32),
        pages=torch.randint(0, 2 ** 20, (13,), generator=g, dtype=torch.int64),
        small=torch.tensor([1, 2, 255], dtype=torch.uint8),
    )


def test_to_device_gives_int32_tensors_of_their_own():
    arrays = _arrays()
    out = _host.to_device(arrays, torch.device("cpu"), non_blocking=True)
    assert list(out) == list(arrays)
    assert out["merge"] is None
    storages = set()
    for name, t in arrays.items():
        if t is None:
            continue
        d = out[name]
        assert d.dtype == torch.int32 and d.shape == t.shape and d.is_contiguous(), name
        assert torch.equal(d.to(torch.int64), t.to(torch.int64)), name
        if d.numel():
            assert d.storage_offset() == 0, name
            storages.add(d.untyped_storage().data_ptr())
    assert len(storages) == 4  # (no two arrays share a storage: no aliased op inputs)


@pytest.fixture
def cpu_as_device(monkeypatch):
    """gather_host takes CPU tensors as it takes device ones."""
    monkeypatch.setattr(_host, "_ON_HOST", ("meta",))


def test_gather_host_reads_each_tensor_once_in_its_dtype(cpu_as_device):
    a = torch.tensor([0, 4, 9], dtype=torch.int32)
    b = torch.tensor([7, 1, 0, 5], dtype=torch.int32)
    hosts = _host.gather_host(a, b, a, None, 3)
    assert set(hosts) == {id(a), id(b)}
    assert hosts[id(a)].dtype == torch.int32 and hosts[id(a)].tolist() == [0, 4, 9]
    assert hosts[id(b)].tolist() == [7, 1, 0, 5]
    c = torch.tensor([2 ** 40, 1], dtype=torch.int64)  # a wider tensor widens the copy
    hosts = _host.gather_host(a, c)
    assert [hosts[id(t)].dtype for t in (a, c)] == [torch.int64] * 2
    assert hosts[id(c)].tolist() == [2 ** 40, 1] and hosts[id(a)].tolist() == [0, 4, 9]


def test_gather_host_leaves_out_what_its_argument_checks_name(cpu_as_device):
    left_out = [torch.zeros(2, 2, dtype=torch.int32), torch.zeros(3),
                torch.zeros(_host.GATHER_MAX + 1, dtype=torch.int32), [0, 1]]
    assert _host.gather_host(*left_out) == {}


def test_host_copy_takes_the_gathered_copy_and_keeps_int32(cpu_as_device):
    a = torch.tensor([0, 2, 5], dtype=torch.int32)
    hosts = _host.gather_host(a)
    assert V.host_copy("a", a, hosts=hosts) is hosts[id(a)]
    own = V.host_copy("a", a)  # (a copy: the caller may refill its buffer after plan())
    assert own.dtype == torch.int32 and own.data_ptr() != a.data_ptr()
    assert V.host_copy("a", a.to(torch.int16)).dtype == torch.int64
    wide = torch.tensor([1, 2])
    assert V.host_copy("wide", wide).data_ptr() != wide.data_ptr()
    # a page table read through the gathered copies: the same table as without them
    ind = torch.tensor([2, 4, 5], dtype=torch.int32)
    idx = torch.tensor([9, 9, 3, 1, 0, 7], dtype=torch.int32)
    last = torch.tensor([16, 3], dtype=torch.int32)
    hosts = _host.gather_host(ind, idx, last)
    names = ("indptr", "indices", "last_page_len")
    with_hosts = V.page_table(names, ind, idx, last, 16, hosts=hosts)
    without = V.page_table(names, ind, idx, last, 16)
    for x, y in zip(with_hosts[:3], without[:3]):
        assert torch.equal(x, y)
    assert with_hosts[3] == without[3] == [16 + 16, 3]  # (kv lengths, a list)
    # (the largest page index, and its position in the caller's indices)
    assert [(t.value, t.position()) for t in (with_hosts[4], without[4])] == [(3, 2)] * 2
    assert with_hosts[1].tolist() == [3, 1, 0]


def test_to_device_skips_an_array_sent_before_into_its_tensor():
    """sent: an array that is the very host object the previous call sent, or holds its
    values, is not copied again (into's tensor holds them); an array of other values, shape
    or dtype, or one without a tensor in into, is copied."""
    arrays = _arrays()
    dev = torch.device("cpu")
    first = _host.to_device(arrays, dev, non_blocking=True)
    # (the device tensors marked, so that a skipped copy shows)
    marked = {name: t.fill_(-7) if t is not None else None for name, t in first.items()}
    changed = arrays["work"].clone()
    changed[0, 0] += 1
    new = dict(arrays, pages=arrays["pages"].clone(), work=changed,
               small=arrays["small"].to(torch.int32))
    again = _host.to_device(new, dev, True, into=marked, sent=arrays)
    for name in ("qo_indptr", "pages", "empty"):  # (the same object; equal values; empty)
        assert again[name] is marked[name] and (again[name] == -7).all(), name
    for name in ("work", "small"):  # (a value changed; another dtype)
        assert again[name] is marked[name], name
        assert torch.equal(again[name].to(torch.int64), new[name].to(torch.int64)), name
    no_into = _host.to_device(arrays, dev, True, into={}, sent=arrays)
    assert torch.equal(no_into["pages"].to(torch.int64), arrays["pages"])
