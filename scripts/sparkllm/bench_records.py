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

from dataclasses import dataclass
from pathlib import Path

from sparkllm.bench_common import SCRIPTS_DIR

PROFILES = ("decode", "records", "agent")
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
    Record(holder="albond", tok_s=51.58, spread="+- 0.30",
           config="MTP-2, hybrid INT4 (AutoRound) + FP8 shared experts, INT8 LM head",
           vllm="0.19.1.dev",
           harness="bench_qwen35.sh: 5 prompts (Q&A 256, code 512, JSON 1024, math 64, long code 2048 "
                   "tokens), non-streamed, thinking on, first pass discarded, completion tokens / request "
                   "time",
           source="https://github.com/albond/DGX_Spark_Qwen3.5-122B-A10B-AR-INT4 (NVIDIA developer forum "
                  "thread 365639, v2 post #71)",
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
