"""Every vllm:* metric the dashboards query exists in vLLM 0.19.1 with the kind the query assumes.

Read from the installed release's own sources (vllm/v1/metrics/loggers.py and
vllm/v1/spec_decode/metrics.py): each metric is created there as ``self._gauge_cls(name=...)``,
``self._counter_cls(...)`` or ``self._histogram_cls(...)``. A counter is queried with its ``_total``
suffix, a histogram through ``_bucket`` (or ``_sum``/``_count``), a gauge bare. Label ``position`` of the
per-position counter is checked too (the acceptance-per-position panel groups by it).
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "templates" / "grafana" / "dashboards").glob("*.json"))
KINDS = {"_gauge_cls": "gauge", "_counter_cls": "counter", "_histogram_cls": "histogram"}


def vllm_metrics(vllm_module) -> dict[str, tuple[str, list[str]]]:
    """{name: (kind, extra label names written literally)} from the two source files."""
    base = Path(vllm_module.__file__).parent
    out: dict[str, tuple[str, list[str]]] = {}
    for rel in ("v1/metrics/loggers.py", "v1/spec_decode/metrics.py"):
        for node in ast.walk(ast.parse((base / rel).read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in KINDS):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            name = kw.get("name")
            if isinstance(name, ast.Constant) and str(name.value).startswith("vllm:"):
                out[name.value] = (KINDS[node.func.attr], [])
        src = (base / rel).read_text()
        if 'pos_labelnames = labelnames + ["position"]' in src:
            per_pos = out.setdefault("vllm:spec_decode_num_accepted_tokens_per_pos", ("counter", []))
            per_pos[1].append("position")
    return out


def queried() -> set[str]:
    names = set()
    for d in DASHBOARDS:
        for p in json.loads(d.read_text())["panels"]:
            for t in p["targets"]:
                names |= set(re.findall(r"\b(vllm:[a-z_]+)", t["expr"]))
    return names


def test_every_queried_vllm_metric_exists_with_its_kind(vllm_module) -> None:
    real = vllm_metrics(vllm_module)
    assert "vllm:kv_cache_usage_perc" in real and real["vllm:generation_tokens"][0] == "counter"
    wanted = queried()
    assert len(wanted) >= 10
    for name in sorted(wanted):
        for suffix, kind in (("_total", "counter"), ("_bucket", "histogram"), ("_sum", "histogram"),
                             ("_count", "histogram"), ("", "gauge")):
            if name.endswith(suffix) and name[: len(name) - len(suffix)] in real:
                base = name[: len(name) - len(suffix)]
                assert real[base][0] == kind, f"{name}: vLLM 0.19.1 has {base} as a {real[base][0]}"
                break
        else:
            pytest.fail(f"{name} is not a metric of vLLM 0.19.1 (loggers.py, spec_decode/metrics.py)")
    assert "position" in real["vllm:spec_decode_num_accepted_tokens_per_pos"][1]
