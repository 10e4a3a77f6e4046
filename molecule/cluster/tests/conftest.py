import os
import sys
from pathlib import Path

import pytest
import testinfra

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "_shared"))


def _node(name: str):
    return testinfra.get_host(f"ansible://{name}", ansible_inventory=os.environ["MOLECULE_INVENTORY_FILE"])


@pytest.fixture(scope="module")
def head():
    return _node("cluster-head")


@pytest.fixture(scope="module")
def worker():
    return _node("cluster-worker")
