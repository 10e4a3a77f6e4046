"""The identity of a measured cell: the one hash the bench role and scripts/sweep.py both compute.

Pure Python (standard library only); Ansible only needs the ``FilterModule`` at the bottom.

A cell is one served configuration measured with one set of benchmark parameters. Its identity is
``spark_cell_hash`` of a description of it (a JSON-like mapping): sha256 over the canonical JSON (sorted
keys, no spaces), first 16 hex digits. Who describes the cell:

- ``scripts/sweep.py`` describes each cell of its grid with ``spark_sweep_cell`` (method, K, the extra
  vars without the load-point lists, so one served configuration is one cell whatever loads it is
  measured at) and passes that description to the bench role as ``bench_cell``;
- the bench role, run without a sweep, describes what the host serves (the run's meta: argv, image,
  model) plus the benchmark parameters and the label (``roles/bench/vars/main.yml``).

Either way the role computes ``bench_config_hash`` with this filter from the description; nothing
passes a hash in, and the sweep looks its cells up in the store by the same function.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence

# the bench role's load-point lists: what a cell is measured at, not what is served (not in a sweep cell)
LOAD_POINT_VARS = ("bench_concurrency", "bench_request_rate", "bench_depth")


def _plain(value):
    """Plain JSON types (Ansible hands filters its own mapping and string types)."""
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, Sequence) and not isinstance(value, str | bytes):
        return [_plain(v) for v in value]
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        return int(value)
    if isinstance(value, float):
        return float(value)
    return str(value)


def spark_cell_hash(cell: Mapping) -> str:
    """The 16-hex-digit identity of the cell ``cell`` describes."""
    if not isinstance(cell, Mapping) or not cell:
        raise ValueError(f"a cell is described by a non-empty mapping, got {cell!r}")
    canon = json.dumps(_plain(cell), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canon.encode()).hexdigest()[:16]


def spark_sweep_cell(method: str, k: int | None, extra_vars: Mapping) -> dict:
    """The description of one sweep grid cell: method, K and the extra vars minus the load points."""
    extra = {name: v for name, v in (extra_vars or {}).items() if name not in LOAD_POINT_VARS}
    return {"method": method, "k": k, "extra_vars": _plain(extra)}


class FilterModule:
    """Ansible filters: spark_cell_hash, spark_sweep_cell."""

    def filters(self):
        return {"spark_cell_hash": spark_cell_hash, "spark_sweep_cell": spark_sweep_cell}
