"""The kernel tests under the Triton interpreter run in their own process (make test sets
TRITON_INTERPRET=1 for this directory): the ops must be registered in interpreter mode from the
first import."""

import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    # Collection hooks see every collected item: mark only this directory's.
    if os.environ.get("TRITON_INTERPRET") != "1":
        skip = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (make test runs it so)")
        for item in items:
            if HERE in Path(str(item.path)).resolve().parents:
                item.add_marker(skip)
