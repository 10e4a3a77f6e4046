"""bench: prompts at a chosen input depth (standard library only; runs on the Spark).

The Spark has no tokenizer, so a depth is reached by calibration: the filler text below is sized in
words, one request per depth reads ``usage.prompt_tokens`` from the server, and the word count is
scaled until the server counts the target within the stated tolerance (``calibrate``).

The default filler is generated, not downloaded: ``CORPUS_WORDS`` words drawn by a seeded generator from
our own vocabulary, pinned by ``FILLER_SHA256`` (a test recomputes it). Being word salad, it is harder to
predict than real context, so acceptance on it can understate an agentic session's; ``--depth-text FILE``
(``load_filler``) uses the owner's own text instead (their code, documents, a transcript), recorded by its
sha256 and never sent anywhere but the server. A depth needing more words than the text has is refused:
repeating the text would hand n-gram and MTP drafts an easy copy. Each prompt of the set gets its own
window of the corpus (so prompts do not share a prefix), and every request of a depth run is sent with
its own random ``cache_salt`` (vLLM 0.19.1 ``entrypoints/openai/chat_completion/protocol.py:323``,
hashed into the first KV block in ``v1/core/kv_cache_utils.py:518``): the text stays the same across
methods and repetitions, so outputs are comparable, while the prefix cache cannot answer any request.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sparkllm.bench.client import Endpoint, RequestResult, Sampling, build_payload, stream_request
from sparkllm.bench.common import UsageError, WorkFailed
from sparkllm.bench.prompts import Prompt

_VOCAB = (
    "the", "a", "of", "and", "to", "in", "is", "that", "for", "on", "with", "as", "by", "at", "from",
    "river", "valley", "engine", "garden", "signal", "market", "ledger", "harbor", "bridge", "winter",
    "copper", "window", "orchard", "station", "machine", "letter", "archive", "lantern", "meadow",
    "council", "pattern", "network", "measure", "captain", "journey", "crystal", "factory", "village",
    "quietly", "slowly", "carefully", "often", "rarely", "early", "later", "again", "nearly", "always",
    "builds", "carries", "records", "follows", "changes", "repairs", "counts", "opens", "returns",
    "writes", "describes", "compares", "collects", "observes", "measures", "explains", "remembers",
    "old", "new", "small", "large", "bright", "narrow", "heavy", "careful", "distant", "patient",
    "northern", "simple", "steady", "hidden", "famous", "ordinary", "second", "final", "local",
)
CORPUS_WORDS = 200_000
FILLER_SEED = 23
FILLER_SHA256 = "5bf76c6060a103493d0c617f2875767b65517e16ab38a915fc03f8e73d69ff8c"
DEFAULT_TOLERANCE = 0.05  # the served prompt must be within 5 % of the target depth
CALIBRATION_TRIES = 5


@functools.lru_cache(maxsize=1)
def corpus() -> tuple[str, ...]:
    """The filler words: sentences of 8-15 words, deterministic (seeded), pinned by FILLER_SHA256."""
    rng = random.Random(FILLER_SEED)
    out: list[str] = []
    while len(out) < CORPUS_WORDS:
        n = rng.randint(8, 15)
        words = [rng.choice(_VOCAB) for _ in range(n)]
        words[0] = words[0].capitalize()
        words[-1] += "."
        out.extend(words)
    return tuple(out[:CORPUS_WORDS])


def corpus_sha256() -> str:
    return hashlib.sha256(" ".join(corpus()).encode("utf-8")).hexdigest()


MIN_TEXT_WORDS = 200  # a --depth-text shorter than this is a mistake (an empty or wrong file), not a text


@dataclass(frozen=True)
class Filler:
    """The words a depth is built from, and what they are: ``generated`` or the owner's file (by name).
    Only the generated corpus may wrap around; an owner's text is never repeated."""
    words: tuple[str, ...]
    sha256: str
    source: str
    wraps: bool = False


def generated_filler() -> Filler:
    return Filler(corpus(), FILLER_SHA256, "generated", wraps=True)


def load_filler(path: Path) -> Filler:
    """The owner's text as filler (whitespace-separated words); a usage error names what is wrong with it."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise UsageError(f"--depth-text {path}: cannot read it ({e.strerror or e}); pass a text file") from e
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UsageError(f"--depth-text {path}: not UTF-8 text (byte {e.start}); pass a text file, "
                         "e.g. source code or a document saved as UTF-8") from e
    words = tuple(text.split())
    if len(words) < MIN_TEXT_WORDS:
        raise UsageError(f"--depth-text {path}: {len(words)} words; a depth needs at least "
                         f"{MIN_TEXT_WORDS} (about 0.75 words per token: 8192 tokens are ~6000 words)")
    return Filler(words, hashlib.sha256(data).hexdigest(), path.name)


def check_text_covers(fill: Filler, depths: list[int]) -> None:
    """Before any request: a depth the text cannot fill without repeating itself is a usage error (the
    estimate uses 0.75 words per token, generous for English and code; calibration checks again)."""
    need = {d: int(d * 0.75) for d in depths if d}
    short = [d for d, w in need.items() if w > len(fill.words)]
    if not fill.wraps and short:
        raise UsageError(f"--depth-text {fill.source}: {len(fill.words)} words, too few for --depth "
                         f"{','.join(map(str, short))} (about {need[max(short)]} words needed); "
                         "give a longer text or smaller depths")


def filler(words: int, window: int, fill: Filler | None = None) -> str:
    """``words`` words of the filler starting at a window chosen by ``window``. The generated corpus wraps
    around; an owner's text never repeats (``calibrate`` refuses a depth it cannot fill), so its windows
    start where the remaining words still suffice."""
    fill = fill or generated_filler()
    c = fill.words
    if not fill.wraps:
        if words > len(c):
            raise ValueError(f"{words} words asked of a {len(c)}-word text: it is never repeated")
        room = len(c) - words
        start = (window * 7919) % (room + 1)
        return " ".join(c[start:start + words])
    start = (window * 7919) % len(c)
    return " ".join(c[(start + i) % len(c)] for i in range(words))


def at_depth(p: Prompt, words: int, window: int, fill: Filler | None = None) -> Prompt:
    """The prompt with ``words`` words of background placed before its last user message."""
    last = p.messages[-1]
    content = (f"Background notes (section {window}):\n{filler(words, window, fill)}\n\n"
               f"Set the notes aside and answer this: {last.get('content', '')}")
    return dataclasses.replace(p, messages=[*p.messages[:-1], {"role": "user", "content": content}])


def salted_payload(model: str, prompt: Prompt, s: Sampling, continuous: bool) -> dict[str, Any]:
    body = build_payload(model, prompt, s, continuous)
    body["cache_salt"] = secrets.token_urlsafe(32)
    return body


def served_max_len(models: Any, model: str) -> int | None:
    """max_model_len of the served model from /v1/models (vLLM lists it), None when not given."""
    for m in (models or {}).get("data", []) if isinstance(models, dict) else []:
        if m.get("id") == model and isinstance(m.get("max_model_len"), int):
            return int(m["max_model_len"])
    return None


@dataclass
class Calibration:
    target: int
    words: int
    prompt_tokens: int
    tries: int
    tolerance: float
    fill: Filler

    def as_dict(self) -> dict[str, Any]:
        return {"target_tokens": self.target, "words": self.words,
                "calibrated_prompt_tokens": self.prompt_tokens,
                "tries": self.tries, "tolerance": self.tolerance, "filler_sha256": self.fill.sha256,
                "filler_source": self.fill.source}


def calibrate(ep: Endpoint, model: str, probe: Prompt, target: int, s: Sampling,
              tolerance: float = DEFAULT_TOLERANCE, fill: Filler | None = None) -> Calibration:
    """Scale the filler's word count until the server counts ``target`` prompt tokens (within tolerance)."""
    fill = fill or generated_filler()
    own = not fill.wraps
    words = max(1, int(target / 1.3))
    one = Sampling(max_tokens=1, temperature=s.temperature, seed=s.seed, thinking=s.thinking)
    got = 0
    whole = False  # an own text: the last try sent all of it
    for tries in range(1, CALIBRATION_TRIES + 1):
        if own and words > len(fill.words):
            if whole:
                raise WorkFailed(f"depth {target}: the whole --depth-text {fill.source} ({len(fill.words)} "
                                 f"words) is {got} tokens to the server, about {words} words are needed; "
                                 "give a longer text or a smaller depth (repeating it would make drafts too "
                                 "easy)")
            words = len(fill.words)
        whole = own and words == len(fill.words)
        res = RequestResult(-1, probe.id, probe.category, -1)
        stream_request(ep, salted_payload(model, at_depth(probe, words, 0, fill), one, False), res)
        if not res.ok or not res.prompt_tokens:
            raise WorkFailed(f"depth {target}: the calibration request failed ({res.error or 'no usage'}); "
                             "is the depth above the served maximum (--max-model-len)?")
        got = res.prompt_tokens
        if abs(got - target) <= tolerance * target:
            return Calibration(target, words, got, tries, tolerance, fill)
        words = max(1, round(words * target / got) if got > words * 0.05 else words * 2)
    raise WorkFailed(f"depth {target}: the server counted {got} prompt tokens after {CALIBRATION_TRIES} "
                     f"calibration requests (tolerance {tolerance:.0%}); pass another --depth")


def check_depths(depths: list[int], max_tokens: int, max_len: int | None) -> None:
    if max_len is None:
        return
    over = [d for d in depths if d + max_tokens > max_len]
    if over:
        raise UsageError(f"--depth {','.join(map(str, over))}: with --max-tokens {max_tokens} above "
                         f"the served "
                         f"maximum of {max_len} tokens; pass depths up to {max_len - max_tokens}")
