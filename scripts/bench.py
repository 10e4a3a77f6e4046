#!/usr/bin/env python3
"""Benchmark runner, results store and report for speculative decoding on an OpenAI/vLLM server.

The entry point of ``bench.py {run,import,lookup,report,fetch-prompts}`` (``--help`` for each; the
subcommands, exit codes and ``--meta-json`` keys are described in ``sparkllm/bench/cli.py``).
The code lives in the ``sparkllm`` package, one module per part:

``bench_common``     paths, the usage/failure errors, the clock
``bench_prompts``    prompt sets and the Spec-Bench download (``fetch-prompts``)
``bench_prometheus`` the /metrics text parser and the vLLM counter names
``bench_stats``      percentiles, t-intervals, the i.i.d. acceptance fit
``bench_client``     the HTTP/SSE client and the per-request metrics
``bench_runner``     the run (``run``; metric definitions in its docstring)
``bench_store``      the SQLite results store (``import``, ``lookup``; schema in its docstring)
``bench_report``     the Markdown report and charts (``report``; controller only, imported lazily)
``bench_cli``        the command line

Everything ``run`` imports is standard library only: this file runs on the Spark with its python3.
"""

from __future__ import annotations

import sys

from sparkllm.bench.cli import build_parser, main

__all__ = ["build_parser", "main"]

if __name__ == "__main__":
    sys.exit(main())
