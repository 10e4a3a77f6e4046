"""The CUDA-graph capture sizes our default --max-num-seqs gives, computed by each release's own code.

vLLM derives the capture sizes from max_num_seqs and the speculative tokens per step (0.19.1
vllm/config/vllm.py:1392-1401, 0.26.0 :1789-1797: max = min(max_num_seqs x (1 + k) x 2, 512), capped by
max_num_batched_tokens), so the serve role sets only --max-num-seqs (vllm_max_num_seqs) and lets each
release size the graphs. These tests hold that to account: every method's full decode step
(max_num_seqs x (1 + k) tokens) has a graph, on both releases, and the list stays short (the
server-class default, 1024 sequences, captures 51 sizes up to 512).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from spark_methods import SETTING_DEFAULTS, spark_speculative_config

pytestmark = pytest.mark.vllm_contract

CONTRACT_DIR = Path(__file__).resolve().parent
ROOT = CONTRACT_DIR.parents[1]


def _probe(requests: list[dict], overlay: Path | None) -> list[dict]:
    paths = ([str(overlay)] if overlay else []) + [str(CONTRACT_DIR)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
    proc = subprocess.run([sys.executable, str(CONTRACT_DIR / "cudagraph_probe.py")],
                          input=json.dumps(requests), env=env, capture_output=True, text=True, timeout=600,
                          check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("CUDAGRAPH_PROBE_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def _cases(catalogue: dict, variant: str) -> list[tuple[str, dict]]:
    out = []
    for method, entry in catalogue.items():
        if entry["vllm_variant"] != variant:
            continue
        s = dict(SETTING_DEFAULTS, spec_method=method, spec_eagle3_drafter="/drafters/e3")
        spec = spark_speculative_config(s, catalogue) or {}
        out.append((method, {"max_num_seqs": SETTING_DEFAULTS["vllm_max_num_seqs"],
                             "k": int(spec.get("num_speculative_tokens", 0)),
                             "max_num_batched_tokens": entry["serve_flags"].get("max_num_batched_tokens",
                                                                                  8192)}))
    return out


@pytest.mark.parametrize("variant", ["v0_19_1", "v0_26_dflash"])
def test_default_max_num_seqs_captures_every_methods_full_decode_step(vllm_module, catalogue, variants,
                                                                      variant):
    if variant not in variants:
        pytest.skip(f"no variant {variant} in group_vars")
    version = variants[variant]["version"]
    overlay = None
    if version != vllm_module.__version__.split("+")[0]:
        overlay = ROOT / ".cache" / f"vllm-{version}-py"
        if not (overlay / ".complete").exists():
            pytest.skip(f"{overlay} is missing: run tests/contract/setup_vllm_env.sh")
    cases = _cases(catalogue, variant)
    assert cases, variant
    seqs = SETTING_DEFAULTS["vllm_max_num_seqs"]
    assert isinstance(seqs, int) and seqs >= 1
    answers = _probe([c for _, c in cases] + [{"max_num_seqs": 1024, "k": 0, "max_num_batched_tokens": 8192}],
                     overlay)
    for (method, case), got in zip(cases, answers, strict=False):
        assert got["version"].split("+")[0] == version
        step = seqs * (1 + case["k"])  # tokens of one decode step of every sequence
        assert got["max"] >= step, (method, got)
        assert max(got["full_decode_sizes"]) >= step, (method, got)
        assert len(got["sizes"]) <= 12, (method, got)
    server_class = answers[-1]
    assert server_class["max"] == 512 and len(server_class["sizes"]) == 51
