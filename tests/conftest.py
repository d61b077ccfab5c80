"""Session-wide pytest hooks.

- Tests marked ``slow`` run first, so that under pytest-xdist (make test) the long builds start
  at once and the short tests fill in around them instead of one long test finishing alone.
- A one-line legend under the summary says what the skipped and deselected counts are (the
  tiers that run elsewhere), so that neither reads as a problem."""

from __future__ import annotations

from collections import Counter


def pytest_collection_modifyitems(config, items):
    # A stable sort: the same order in every xdist worker, as xdist requires.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    stats = terminalreporter.stats
    deselected = len(stats.get("deselected", []))
    skipped = [r for r in stats.get("skipped", []) if getattr(r, "when", "") in ("setup", "call")]
    if not deselected and not skipped:
        return
    parts = []
    if deselected:
        parts.append(f"{deselected} deselected = outside this run's -m / -k selection (by "
                     "default the GPU tier, @pytest.mark.gpu: make test-gpu on a CUDA machine)")
    if skipped:
        reasons = Counter(_reason(r) for r in skipped)
        parts.append(f"{len(skipped)} skipped = " + "; ".join(
            f"{n} {why}" for why, n in reasons.most_common()))
    terminalreporter.write_line("legend: " + ", ".join(parts))


def _reason(report) -> str:
    """A skip's reason without pytest's 'file:line: Skipped: ' prefix."""
    longrepr = report.longrepr
    text = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    return text.removeprefix("Skipped: ")
