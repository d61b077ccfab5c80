"""The --shard option of tests/conftest.py: the parts of a selection are disjoint and cover it
(the GPU tier is split over machine calls that way)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _ids(*extra) -> list[str]:
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p",
                          "no:cacheprovider", "tests/test_shard.py", *extra],
                         cwd=ROOT, capture_output=True, text=True, check=False)
    return [line for line in out.stdout.splitlines() if "::" in line], out


def test_shards_partition_the_selection():
    whole, _ = _ids()
    parts = [_ids("--shard", f"{i}/3")[0] for i in (1, 2, 3)]
    assert len(whole) == 5  # this file's own tests
    assert sorted(sum(parts, [])) == sorted(whole)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_part_is_in_range(n):
    from tests.conftest import _shard_of

    assert all(0 <= _shard_of(f"tests/x.py::t[{j}]", n) < n for j in range(50))


def test_bad_shard_is_refused():
    _, out = _ids("--shard", "4/3")
    assert out.returncode != 0 and "pass I/N with 1 <= I <= N" in out.stderr + out.stdout
