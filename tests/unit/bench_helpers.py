"""Shared helpers for the bench/sweep unit tests (not a test module)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from sparkllm.bench import client as bench_client
from sparkllm.bench import runner as bench_runner
from sparkllm.bench import stats as bench_stats

from tests.fixtures.standin_server import Config, StandinServer


def write_prompts(path: Path, n_per_cat: int = 2, cats: tuple[str, ...] = ("code", "chat_qa")) -> Path:
    with path.open("w") as fh:
        for c in cats:
            for i in range(n_per_cat):
                fh.write(json.dumps({"id": f"{c}-{i}", "category": c,
                                     "messages": [{"role": "user", "content": f"{c} question {i}"}]}) + "\n")
    return path


def run_against(cfg: Config, tmp: Path, *, label: str = "x", max_tokens: int = 13, repeats: int = 1,
                concurrency: int = 1, warmup: int = 1, meta: dict[str, Any] | None = None,
                sample_interval: float = 0.05, n_per_cat: int = 2) -> tuple[dict[str, Any], StandinServer]:
    prompts = write_prompts(tmp / "p.jsonl", n_per_cat=n_per_cat)
    with StandinServer(cfg) as srv:
        opts = bench_runner.RunOptions(base_url=srv.base_url, model=cfg.model, label=label, out=tmp / "out",
                                       prompts=prompts, repeats=repeats, warmup=warmup,
                                       concurrency=concurrency, meta=meta or {},
                                       sampling=bench_client.Sampling(max_tokens=max_tokens),
                                       sample_interval=sample_interval, progress=False)
        doc = bench_runner.execute_run(opts)
    return doc, srv


def fake_doc(label: str, rep: int, decode: list[float], *, valid: bool = True, started: str | None = None,
             cat: str = "code", per_position: list[float] | None = None, method: str | None = None,
             config_hash: str | None = None, run_id: str | None = None) -> dict[str, Any]:
    """A minimal but complete run document with chosen per-request decode speeds; every label answers
    a prompt with the same text (a lossless method)."""
    reqs = [{"idx": i, "prompt_id": f"{cat}-{i}", "category": cat if i % 2 == 0 else "math", "repeat": 0,
             "ok": True, "error": None, "output_tokens": 11, "chunks": 6, "ttft_s": 0.1, "decode_s": 10 / d,
             "e2e_s": 0.1 + 10 / d, "decode_tok_s": d, "tpot_ms": 100.0 / d, "tokens_per_chunk": 2.0,
             "continuous_usage": True, "output_text": f"the answer to {cat}-{i}"}
            for i, d in enumerate(decode)]
    summary = bench_runner.summarise([], 1.0)
    summary["decode_tok_s"] = bench_stats.describe(decode)
    summary["ttft_s"] = bench_stats.describe([0.1] * len(decode))
    summary["requests"] = summary["ok"] = len(decode)
    spec = {"acceptance_rate": None, "mean_acceptance_length": None, "per_position": per_position,
            "effective_tokens_per_step": None}
    if per_position:
        spec["mean_acceptance_length"] = 1 + sum(per_position)
    return {"schema": 1, "run_id": run_id or f"2026-{label}-{rep}", "label": label, "valid": valid,
            "problems": [] if valid else ["1 request(s) failed"], "summary": summary, "spec": spec,
            "categories": {}, "requests": reqs,
            "meta": {"method": method or label, "repetition": rep, "config_hash": config_hash,
                     "started_utc": started or f"2026-01-01T00:0{rep}:00.000000Z", "finished_utc": None,
                     "concurrency": 1}}


def run_sweep_cell(tmp: Path, site_yml: str, method: str = "mtp", k: int = 2):
    """Run one sweep cell through the real ansible-runner against ``site_yml`` (a tiny project
    on localhost); returns (cell config, outcome)."""
    import sweep

    project = tmp / "project"
    project.mkdir(exist_ok=True)
    (project / "site.yml").write_text(site_yml)
    inv = tmp / "hosts.ini"
    inv.write_text(f"localhost ansible_connection=local ansible_python_interpreter={sys.executable}\n")
    cfg = sweep.CellConfig(method, k)
    sw = sweep.Sweep([cfg], 1, tmp / "res", project_dir=project, inventory=str(inv))
    return cfg, sweep.ansible_runner_run(sw.request(sweep.Cell(cfg, 1)))
