"""bench: the ``records`` and ``agent`` profiles' own work and figures (standard library only; runs on the
Spark). The profiles themselves are described in ``sparkllm.bench.records``.

records: every request is timed whole (``RequestResult.e2e_tok_s`` = completion tokens / request wall time);
the figure of a pass is the mean over its prompts, and the run's figure is the mean of its passes with a
95 % t-interval over them (``records_summary``), as the public records report "mean +- spread" over runs.

agent: each prompt line is a conversation: its messages, then its ``followups`` one by one, each sent after
the previous answer was appended as the assistant's turn, so every turn's prompt begins with the previous
turn's prompt (what prefix caching can reuse). The first turn gets ``context_words`` words of background (the
pinned generated filler of ``sparkllm.bench.depth``, a window of its own per conversation). Every
conversation instance (conversation x pass) carries one random ``cache_salt``: its own turns can share the
cache, another pass of the same conversation cannot (its first turn would otherwise be answered from the
previous pass's cache and look like a later turn).
"""

from __future__ import annotations

import dataclasses
import secrets
from typing import Any

from sparkllm.bench.client import (
    Endpoint,
    RequestResult,
    Sampling,
    UnsupportedOption,
    build_payload,
    send_request,
)
from sparkllm.bench.depth import filler
from sparkllm.bench.prompts import Prompt
from sparkllm.bench.stats import describe


def with_context(p: Prompt, words: int, window: int) -> Prompt:
    """The conversation's first user message with ``words`` words of background before it."""
    if words <= 0:
        return p
    last = p.messages[-1]
    content = (f"Project notes for this session (part {window}):\n{filler(words, window)}\n\n"
               f"{last.get('content', '')}")
    return dataclasses.replace(p, messages=[*p.messages[:-1], {"role": "user", "content": content}])


def turn_ids(p: Prompt) -> list[str]:
    return [f"{p.id}#t{t}" for t in range(1, len(p.followups) + 2)]


def run_conversation(ep: Endpoint, model: str, p: Prompt, s: Sampling, continuous: bool, repeat: int,
                     first_idx: int, step: Any = None) -> list[RequestResult]:
    """Send one conversation's turns in order; a turn that fails ends it (the rest are failed, not sent)."""
    salt = secrets.token_hex(16)
    messages = list(p.messages)
    out: list[RequestResult] = []
    answer: str | None = None
    failed: str | None = None
    for t, (pid, follow) in enumerate(zip(turn_ids(p), (None, *p.followups), strict=True), 1):
        res = RequestResult(first_idx + t - 1, pid, f"turn-{t}", repeat)
        res.turn = t
        out.append(res)
        if failed is not None:
            res.error = f"not sent: turn {t - 1} of {p.id} failed ({failed[:80]})"
            continue
        if follow is not None:
            messages = [*messages, {"role": "assistant", "content": answer or ""},
                        {"role": "user", "content": follow}]
        body = build_payload(model, dataclasses.replace(p, messages=messages, followups=()), s, continuous)
        body["cache_salt"] = salt
        try:
            send_request(ep, body, res)
        except UnsupportedOption as exc:
            res.error = f"server rejected stream options: {exc}"
        if step:
            step(res)
        if not res.ok:
            failed = res.error or "failed"
        answer = res.answer
    return out


def run_agent(ep: Endpoint, model: str, prompts: list[Prompt], s: Sampling, continuous: bool, repeats: int,
              step: Any = None) -> list[RequestResult]:
    """Every conversation once per pass, passes in order (single stream)."""
    results: list[RequestResult] = []
    for r in range(repeats):
        for p in prompts:
            results.extend(run_conversation(ep, model, p, s, continuous, r, len(results), step))
    return results


def records_summary(results: list[RequestResult]) -> dict[str, Any]:
    """The records' figure: per prompt (mean over passes), per pass (mean over prompts), and the mean of
    the passes with its 95 % t-interval. A pass with a failed request has no figure (the run is invalid
    anyway)."""
    passes: dict[int, list[RequestResult]] = {}
    prompts: dict[str, list[float]] = {}
    for r in results:
        passes.setdefault(r.repeat, []).append(r)
        if r.e2e_tok_s is not None:
            prompts.setdefault(r.prompt_id, []).append(r.e2e_tok_s)
    pass_means = []
    for _rep, rs in sorted(passes.items()):
        xs = [r.e2e_tok_s for r in rs]
        if xs and all(x is not None for x in xs):
            pass_means.append(sum(xs) / len(xs))  # type: ignore[arg-type]
    d = describe(pass_means)
    return {"tok_s_mean": d["mean"], "ci95_low": d["ci95_low"], "ci95_high": d["ci95_high"],
            "stdev": d["stdev"], "passes": len(pass_means), "pass_means": pass_means,
            "per_prompt": {k: sum(v) / len(v) for k, v in sorted(prompts.items())},
            "definition": "completion_tokens / request wall time (prefill included), mean over prompts per "
                          "pass, mean over passes with a 95 % t-interval"}


def agent_summary(results: list[RequestResult]) -> dict[str, Any]:
    """TTFT and e2e tok/s of first turns against later turns (the prefix the cache can reuse)."""
    first = [r for r in results if r.ok and r.turn == 1]
    later = [r for r in results if r.ok and (r.turn or 0) > 1]
    by_turn: dict[int, list[RequestResult]] = {}
    for r in results:
        if r.ok and r.turn:
            by_turn.setdefault(r.turn, []).append(r)
    t1, tl = describe(r.ttft_s for r in first)["median"], describe(r.ttft_s for r in later)["median"]
    return {"ttft_s_first_turn_median": t1, "ttft_s_later_turns_median": tl,
            "later_over_first_ttft": tl / t1 if t1 and tl is not None else None,
            "e2e_tok_s": describe(r.e2e_tok_s for r in results if r.ok),
            "by_turn": {str(t): {"requests": len(rs),
                                 "ttft_s_median": describe(r.ttft_s for r in rs)["median"],
                                 "prompt_tokens_median": describe(r.prompt_tokens for r in rs)["median"],
                                 "e2e_tok_s_median": describe(r.e2e_tok_s for r in rs)["median"]}
                        for t, rs in sorted(by_turn.items())}}
