"""Pytest hooks for the whole test run.

- Modules with tests marked ``slow`` run first, so that under pytest-xdist (make test) the long
  builds start at once and the short tests fill in around them instead of one long test
  finishing alone.
- A one-line legend under the summary says what the skipped and deselected counts are (the
  tiers that run elsewhere), so that neither reads as a problem.
- On a machine with several GPUs, each pytest-xdist worker makes a different GPU its current
  device (worker i takes GPU i mod count), so the GPU tier spreads over all of them; tests that
  start their own ranks (tests/test_cp_gpu.py) name their devices themselves.
- A last garbage collection before the interpreter exits, so that no reference cycle holding
  Triton IR objects (its code generator and builder reference each other) is left for the
  interpreter's teardown, after which Triton's nanobind module prints a page of "leaked
  instance" lines at exit."""

from __future__ import annotations

import gc
import os
from collections import Counter


def pytest_configure(config):
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw"):
        import torch

        if torch.cuda.is_available() and torch.cuda.device_count() > 1:
            torch.cuda.set_device(int(worker[2:]) % torch.cuda.device_count())


def pytest_collection_modifyitems(config, items):
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
