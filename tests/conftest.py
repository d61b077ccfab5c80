"""Pytest hooks for the whole test run.

- Modules with tests marked ``slow`` run first, so that under pytest-xdist (make test) the long
  builds start at once and the short tests fill in around them instead of one long test
  finishing alone.
- A one-line legend under the summary says what the skipped and deselected counts are (the
  tiers that run elsewhere), so that neither reads as a problem.
- On a machine with several GPUs, each pytest-xdist worker makes a different GPU its current
  device (worker i takes GPU i mod count), so the GPU tier spreads over all of them; tests that
  start their own ranks (tests/test_cp_gpu.py) name their devices themselves.
- On a CUDA machine each pytest-xdist worker keeps its share of the CPU cores for torch's
  intra-op threads (cores / workers, at least one): with every worker at torch's default (all
  cores) the GPU tier's float64 oracles, many small CPU ops, wait on oversubscribed thread
  pools (row-by-row oracles of a few hundred rows did not finish in 280 s with 4 workers on 16
  cores). The CPU suite keeps the default: there its compile-heavy tests ran faster with it
  (311 s against 362 s for make test's first part on 2 cores, 2026-11-29).
- ``--shard I/N`` keeps the I-th of N parts of the selection (by a hash of each test's id), for
  a GPU tier that must be split over several machine calls.
- The ``pod_calls`` fixture records the ops the POD wrappers call; ``pod_launch`` runs a POD
  test under each launch choice of the policy (one fused launch, or the parts apart:
  ops.choose.pod_apart) with that record.
- A last garbage collection before the interpreter exits, so that no reference cycle holding
  Triton IR objects (its code generator and builder reference each other) is left for the
  interpreter's teardown, after which Triton's nanobind module prints a page of "leaked
  instance" lines at exit."""

from __future__ import annotations

import gc
import os
import zlib
from collections import Counter

import pytest


def pytest_configure(config):
    shard = config.getoption("--shard", None)
    # parsed here, so that a bad value stops the run before collection
    config._shard = _parse_shard(shard) if shard else None
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        import torch

        if torch.cuda.is_available():
            workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, workers)))
            if torch.cuda.device_count() > 1:
                torch.cuda.set_device(int(worker[2:]) % torch.cuda.device_count())


def pytest_addoption(parser):
    parser.addoption("--shard", default=None, metavar="I/N",
                     help="run the I-th of N parts of the selected tests (1-based; a test's part "
                          "is fixed by a hash of its id), so that a tier longer than one "
                          "machine call splits over N calls: make test-gpu GPU_SHARD=1/3")


def _parse_shard(shard: str) -> tuple[int, int]:
    import pytest

    try:
        i, n = (int(x) for x in shard.split("/"))
    except ValueError:
        i = n = 0
    if not 1 <= i <= n:
        raise pytest.UsageError(f"--shard {shard!r}: pass I/N with 1 <= I <= N, e.g. 2/3")
    return i, n


def _shard_of(nodeid: str, n: int) -> int:
    return zlib.crc32(nodeid.encode()) % n


def pytest_collection_modifyitems(config, items):
    if config._shard:
        i, n = config._shard
        keep = [it for it in items if _shard_of(it.nodeid, n) == i - 1]
        config.hook.pytest_deselected(items=[it for it in items if it not in keep])
        items[:] = keep

    # Whole modules move, so a module's tests stay together and its module-scoped fixtures are
    # built once; a stable sort gives every xdist worker the same order, as xdist requires.
    slow_modules = {item.module.__name__ for item in items
                    if item.get_closest_marker("slow") is not None}
    items.sort(key=lambda item: item.module.__name__ not in slow_modules)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stats = terminalreporter.stats
    # Under pytest-xdist the workers deselect, and the count does not reach this summary.
    deselected = len(stats.get("deselected", []))
    gpu_out = "not gpu" in (config.getoption("markexpr", "") or "")
    skipped = [r for r in stats.get("skipped", []) if getattr(r, "when", "") in ("setup", "call")]
    parts = []
    if gpu_out:
        parts.append("the GPU tier (@pytest.mark.gpu) is deselected"
                     + (f" ({deselected} tests)" if deselected else "")
                     + ": make test-gpu runs it on a CUDA machine")
    elif deselected:
        parts.append(f"{deselected} deselected by this run's -m / -k selection")
    if skipped:
        reasons = Counter(_reason(r) for r in skipped)
        parts.append(f"{len(skipped)} skipped: " + "; ".join(
            f"{n} {why}" for why, n in reasons.most_common()))
    if parts:
        terminalreporter.write_line("legend: " + ", ".join(parts))


def _reason(report) -> str:
    """A skip's reason without pytest's 'file:line: Skipped: ' prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")


def pytest_unconfigure(config):
    gc.collect()


@pytest.fixture
def pod_calls(monkeypatch):
    """The names of the ops the POD wrappers call, in order (a spy on compiled_attn.pod's
    call_op); a test may clear it between calls."""
    import compiled_attn.pod as pod_mod

    called = []
    real = pod_mod.call_op

    def spy(name, *args, **kwargs):
        called.append(name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(pod_mod, "call_op", spy)
    return called


@pytest.fixture
def pod_merges(monkeypatch):
    """The calls of the merge of POD's decode key chunks (a spy on compiled_attn.pod's
    decode_chunks.merge_chunks: one per call that cut its decodes, as it ran or was recorded;
    a bound replay launches the recorded merge without it)."""
    import compiled_attn.pod as pod_mod

    calls = []
    real = pod_mod._chunks.merge_chunks
    monkeypatch.setattr(pod_mod._chunks, "merge_chunks",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.fixture(params=["apart", "fused"])
def pod_launch(request, pod_calls):
    """(launch choice, the names of the ops the POD wrapper called): tests/helpers.py's
    check_pod_launch reads it."""
    from compiled_attn.ops.policy import override
    from tests.helpers import POD_LAUNCHES

    with override(**POD_LAUNCHES[request.param]):
        yield request.param, pod_calls
