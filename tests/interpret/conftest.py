"""The kernel tests under the Triton interpreter run in their own process (make test sets
TRITON_INTERPRET=1 for this directory): the ops must be registered in interpreter mode from the
first import."""

import os

import pytest


def pytest_collection_modifyitems(config, items):
    if os.environ.get("TRITON_INTERPRET") != "1":
        skip = pytest.mark.skip(reason="needs TRITON_INTERPRET=1 (make test runs it so)")
        for item in items:
            item.add_marker(skip)
