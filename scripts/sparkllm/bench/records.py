"""bench: the benchmark's profiles and the public single-Spark records they are set beside (standard
library only; runs on the Spark for ``bench.py run``, on the controller for the report).

Profiles (``bench.py run --profile``):

- ``decode`` (the default): streamed requests, decode tok/s per request ((n-1) / decode time), thinking off,
  one token limit for every prompt, a few warm-up requests. What a speculative method changes, isolated.
- ``records``: the protocol of the public records for this model on one Spark (albond's
  ``bench_qwen35.sh`` harness, which Entrpi's DFlash figure was also measured on): non-streamed chat
  completions, the chat template's default (thinking on for Qwen3.5), a token limit per prompt, the first
  pass over the prompts discarded, tok/s = completion tokens / request wall time (prefill included), per
  prompt and the mean with its 95 % interval over the measured passes.
- ``agent``: multi-turn conversations whose turns share a growing prefix (each answer is carried into the
  next turn), streamed, so the TTFT of later turns shows what prefix caching saves; e2e tok/s as above.

The figures of ``RECORDS`` are quoted from their public sources with their harness; they are never
measured by this toolkit. Only records timed with the records profile's protocol are set beside a
``records`` run: a figure from another protocol (e.g. streamed decode-only) is not comparable.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkllm.bench.common import SCRIPTS_DIR

PROFILES = ("decode", "records", "agent")
PROTOCOL = ("non-streamed chat completions, the chat template's thinking default, a token limit per "
            "prompt, the first pass discarded, tok/s = completion tokens / request wall time (prefill "
            "included), mean over prompts per pass, mean over passes")
RECORDS_PROMPTS = SCRIPTS_DIR / "prompts" / "records.jsonl"
AGENT_PROMPTS = SCRIPTS_DIR / "prompts" / "agent.jsonl"


@dataclass(frozen=True)
class ProfileDefaults:
    """What a profile changes when the command line does not say otherwise."""

    stream: bool
    thinking: str  # on / off / default (the chat template's own)
    prompts: Path | None  # None: the decode profile's set (bench_common.DEFAULT_PROMPTS)
    warmup_pass: bool  # the first pass over every prompt is discarded (instead of --warmup requests)


PROFILE_DEFAULTS = {
    "decode": ProfileDefaults(stream=True, thinking="off", prompts=None, warmup_pass=False),
    "records": ProfileDefaults(stream=False, thinking="default", prompts=RECORDS_PROMPTS, warmup_pass=True),
    # agent turns carry their answers forward; with thinking on most of a short turn is reasoning that the
    # chat template drops from the next turn, so the default is off (--thinking on measures it with)
    "agent": ProfileDefaults(stream=True, thinking="off", prompts=AGENT_PROMPTS, warmup_pass=True),
}


@dataclass(frozen=True)
class Record:
    holder: str
    tok_s: float
    spread: str  # as published (e.g. "+- 0.30"), "" when none was given
    config: str  # method, K, quantization, head
    vllm: str
    harness: str
    source: str
    published: str  # date or the earliest public mention we could place


RECORDS: tuple[Record, ...] = (
    # 51.58: as Entrpi's docs/FINDINGS.md quotes albond's figure on his harness (albond's README, read at
    # commit 280011f2, gives "51 tok/s"); a spread of +- 0.30 was reported to us but not found in a source we
    # could read, so none is shown
    Record(holder="albond", tok_s=51.58, spread="",
           config="MTP-2, hybrid INT4 (AutoRound) + FP8 shared experts, INT8 LM head",
           vllm="0.19.1.dev",
           harness="bench_qwen35.sh: 5 prompts (Q&A 256, code 512, JSON 1024, math 64, long code 2048 "
                   "tokens), non-streamed, thinking on, first pass discarded, completion tokens / request "
                   "time",
           source="https://github.com/albond/DGX_Spark_Qwen3.5-122B-A10B-AR-INT4 (README: 51 tok/s; NVIDIA "
                  "developer forum thread 365639, v2 post #71); 51.58 as quoted in Entrpi's docs/FINDINGS.md",
           published="2026-05 (teardown blog of 2026-05-07 quotes 51 tok/s)"),
    Record(holder="Entrpi", tok_s=59.0, spread="",
           config="DFlash K=12 (z-lab drafter), hybrid INT4 + FP8, INT8 LM head",
           vllm="0.23",
           harness="albond's bench_qwen35.sh (as above); ~81 tok/s median decode on real agent turns is a "
                   "different protocol and not shown here",
           source="https://github.com/Entrpi/qwen3.5-122B-A10B-on-spark",
           published="2026 (read 2026-12)"),
)


def best_record() -> Record:
    return max(RECORDS, key=lambda r: r.tok_s)


# --- the report's section (controller; standard library) -----------------------------------------------

def _profile(m: Any) -> str:
    return str(json.loads(m.context).get("profile") or "decode")


def _figure(m: Any) -> tuple[float | None, float | None, float | None]:
    """(mean, 95 % low, 95 % high) of a records row: the mean over its runs' figures, with the interval over
    runs, or a single run's own interval over its passes."""
    if len(m.runs) == 1:
        rec = m.runs[0].doc.get("records") or {}
        return rec.get("tok_s_mean"), rec.get("ci95_low"), rec.get("ci95_high")
    rm = m.run_medians
    return rm.get("mean"), rm.get("ci95_low"), rm.get("ci95_high")


def _f(v: float | None, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def table_lines(stats: Sequence[Any]) -> list[str]:
    """The owner's records-profile rows beside the published records (same protocol), then the records."""
    rows = [m for m in stats if _profile(m) == "records"]
    best = best_record()
    lines = ["## Against the public records (one Spark, this model)", ""]
    if rows:
        lines += [f"Measured with the records profile (`bench.py run --profile records`): {PROTOCOL}. "
                  f"Ratio = your mean / the record's figure.", "",
                  "| your row | tok/s mean [95% CI] | per prompt | mean acceptance length | "
                  + " | ".join(f"vs {r.holder} {r.tok_s:g}" for r in RECORDS) + " |",
                  "|---|---|---|---|" + "---|" * len(RECORDS)]
        for m in rows:
            mean, lo, hi = _figure(m)
            per = {}
            for r in m.runs:
                for pid, v in ((r.doc.get("records") or {}).get("per_prompt") or {}).items():
                    per.setdefault(pid, []).append(v)
            per_txt = ", ".join(f"{pid.removeprefix('records-')} {sum(v) / len(v):.1f}"
                                for pid, v in sorted(per.items())) or "-"
            ci = f" [{_f(lo)}-{_f(hi)}]" if lo is not None else ""
            ratios = " | ".join(f"{mean / r.tok_s:.2f}x" if mean else "-" for r in RECORDS)
            lines.append(f"| {m.label} | {_f(mean)}{ci} | {per_txt} | {_f(m.acc_len)} | {ratios} |")
    else:
        lines.append("No run of the records profile in this store, so nothing here can be set beside the "
                     "records (decode tok/s is another measure): `bench.py run --profile records` (the "
                     "deploy's default, `bench_profile: records`) measures one.")
    lines += ["", "| record | tok/s | configuration | vLLM | harness | source | published |",
              "|---|---|---|---|---|---|---|"]
    lines += [f"| {r.holder}{' (best)' if r is best else ''} | {r.tok_s:g} {r.spread} | {r.config} "
              f"| {r.vllm} | {r.harness} | {r.source} | {r.published} |" for r in RECORDS]
    lines += ["", "The records are quoted from their sources, not measured here; a Spark's own figure "
              "differs with its driver, image and prompts, so read the ratio as a rough position, not a "
              "verdict.", ""]
    return lines


def summary_lines(stats: Sequence[Any]) -> list[str]:
    """One printed line per records row: its mean beside the best record."""
    best = best_record()
    out = []
    for m in stats:
        if _profile(m) != "records":
            continue
        mean, lo, hi = _figure(m)
        ci = f" [{_f(lo)}-{_f(hi)}]" if lo is not None else ""
        ratio = f" = {mean / best.tok_s:.2f}x" if mean else ""
        out.append(f"records profile {m.label}: {_f(mean)}{ci} tok/s end to end; best public record "
                   f"{best.holder} {best.tok_s:g} tok/s ({best.config}, vLLM {best.vllm}){ratio}")
    return out
