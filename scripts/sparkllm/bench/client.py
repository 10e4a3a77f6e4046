"""bench: the HTTP/SSE client for an OpenAI-compatible server (standard library only)."""

from __future__ import annotations

import hashlib
import http.client
import json
import time
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

from sparkllm.bench.prometheus import MetricsSnapshot
from sparkllm.bench.prompts import Prompt


@dataclass
class Endpoint:
    base_url: str
    api_key: str | None = None
    timeout: float = 600.0
    watch: Any = None  # a measured phase's sparkllm.bench.stall.StallWatch: told of every request and token

    def _conn(self) -> http.client.HTTPConnection:
        u = urllib.parse.urlsplit(self.base_url)
        cls = http.client.HTTPSConnection if u.scheme == "https" else http.client.HTTPConnection
        return cls(u.hostname or "127.0.0.1", u.port, timeout=self.timeout)

    def path(self, p: str) -> str:
        prefix = urllib.parse.urlsplit(self.base_url).path.rstrip("/")
        if prefix.endswith("/v1") and p.startswith("/v1/"):
            prefix = prefix[:-3]
        return prefix + p

    def headers(self) -> dict[str, str]:
        h = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.api_key:
            h["Authorization"] = f"Bearer {self.api_key}"
        return h

    def get(self, p: str, timeout: float = 10.0) -> tuple[int, bytes]:
        conn = self._conn()
        conn.timeout = timeout
        try:
            conn.request("GET", self.path(p), headers=self.headers())
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def metrics(self) -> MetricsSnapshot:
        t = time.monotonic()
        try:
            status, body = self.get("/metrics")
        except OSError:
            return MetricsSnapshot({}, t, ok=False)
        if status != 200:
            return MetricsSnapshot({}, t, ok=False)
        return MetricsSnapshot.parse(body.decode("utf-8", "replace"), t)

    def get_json(self, p: str) -> Any:
        try:
            status, body = self.get(p)
            return json.loads(body) if status == 200 else None
        except (OSError, ValueError):
            return None


@dataclass
class RequestResult:
    idx: int
    prompt_id: str
    category: str
    repeat: int
    ok: bool = False
    error: str | None = None
    t0: float = 0.0
    token_times: list[float] = field(default_factory=list)  # arrival of chunks that carried tokens
    output_tokens: int | None = None
    prompt_tokens: int | None = None
    continuous_usage: bool = False
    raw_chunks: int = 0
    text: str = ""  # the output (content and reasoning deltas, concatenated)
    answer: str = ""  # the content alone (no reasoning): what a client carries into the next turn
    arrival_s: float | None = None  # rate mode: planned send time, seconds after the measured phase began
    lag_s: float | None = None  # rate mode: how late the request was dispatched
    t_end: float | None = None  # a whole (non-streamed) request: when its response was read in full
    turn: int | None = None  # agent profile: the turn of its conversation (1 = the first request)

    # ---- derived per-request metrics (definitions: the docstring of sparkllm/bench/runner.py)
    @property
    def m(self) -> int:
        return len(self.token_times)

    @property
    def ttft_s(self) -> float | None:
        return self.token_times[0] - self.t0 if self.ok and self.token_times else None

    @property
    def decode_s(self) -> float | None:
        return self.token_times[-1] - self.token_times[0] if self.ok and self.m > 1 else None

    @property
    def e2e_s(self) -> float | None:
        if self.t_end is not None:  # a whole (non-streamed) request: send to the response's last byte
            return self.t_end - self.t0 if self.ok else None
        return self.token_times[-1] - self.t0 if self.ok and self.token_times else None

    @property
    def e2e_tok_s(self) -> float | None:
        """The public records' figure: completion tokens / request wall time, prefill included."""
        n, e = self.output_tokens, self.e2e_s
        return n / e if n and e else None

    @property
    def decode_tok_s(self) -> float | None:
        n, d = self.output_tokens, self.decode_s
        return (n - 1) / d if n and n > 1 and d else None

    @property
    def tpot_ms(self) -> float | None:
        n, d = self.output_tokens, self.decode_s
        return 1000.0 * d / (n - 1) if n and n > 1 and d else None

    @property
    def tokens_per_chunk(self) -> float | None:
        n = self.output_tokens
        return (n - 1) / (self.m - 1) if n and n > 1 and self.m > 1 else None

    @property
    def icl_s(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    @property
    def output_sha256(self) -> str | None:
        return hashlib.sha256(self.text.encode("utf-8")).hexdigest() if self.ok else None

    @property
    def prefill_tok_s(self) -> float | None:
        t = self.ttft_s
        return self.prompt_tokens / t if self.prompt_tokens and t else None

    def row(self) -> dict[str, Any]:
        return {"idx": self.idx, "prompt_id": self.prompt_id, "category": self.category,
                "repeat": self.repeat, "ok": self.ok, "error": self.error,
                "output_tokens": self.output_tokens, "chunks": self.m, "ttft_s": self.ttft_s,
                "decode_s": self.decode_s, "e2e_s": self.e2e_s, "decode_tok_s": self.decode_tok_s,
                "tpot_ms": self.tpot_ms, "tokens_per_chunk": self.tokens_per_chunk,
                "continuous_usage": self.continuous_usage, "prompt_tokens": self.prompt_tokens,
                "prefill_tok_s": self.prefill_tok_s, "output_sha256": self.output_sha256,
                "output_text": self.text if self.ok else None, "arrival_s": self.arrival_s,
                "lag_s": self.lag_s, "e2e_tok_s": self.e2e_tok_s, "turn": self.turn}


@dataclass
class Sampling:
    max_tokens: int = 256
    temperature: float = 0.0
    seed: int | None = 0
    thinking: str = "off"  # on / off (sent as enable_thinking), default (the chat template's own: not sent)
    stream: bool = True  # False: one whole response per request (the records profile)


def build_payload(model: str, prompt: Prompt, s: Sampling, continuous: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": model, "messages": prompt.messages, "stream": s.stream,
                            "max_tokens": prompt.max_tokens or s.max_tokens, "temperature": s.temperature}
    if s.stream:
        opts: dict[str, Any] = {"include_usage": True}
        if continuous:
            opts["continuous_usage_stats"] = True
        body["stream_options"] = opts
    if s.thinking in ("on", "off"):
        body["chat_template_kwargs"] = {"enable_thinking": s.thinking == "on"}
    if s.seed is not None:
        body["seed"] = s.seed
    return body


def _chunk_has_content(obj: dict[str, Any]) -> bool:
    for ch in obj.get("choices") or []:
        delta = ch.get("delta") or {}
        for key in ("content", "reasoning_content", "reasoning"):
            if delta.get(key):
                return True
        if delta.get("tool_calls"):
            return True
    return False


def _chunk_text(obj: dict[str, Any], part: str = "delta") -> str:
    """The output text of a stream chunk's ``delta``s (or a whole response's ``message``s): reasoning,
    content and tool calls, in the order a stream sends them."""
    out = []
    for ch in obj.get("choices") or []:
        delta = ch.get(part) or {}
        for key in ("reasoning_content", "reasoning", "content"):
            v = delta.get(key)
            if isinstance(v, str):
                out.append(v)
        if delta.get("tool_calls"):
            out.append(json.dumps(delta["tool_calls"], sort_keys=True))
    return "".join(out)


class UnsupportedOption(Exception):
    """The server rejected continuous_usage_stats."""


def whole_request(ep: Endpoint, payload: dict[str, Any], res: RequestResult) -> None:
    """Send one non-streamed request and time it whole (send to the response's last byte), as the public
    records' harnesses do; fills res.output_tokens/text/t_end; never raises for HTTP errors."""
    conn = ep._conn()
    if ep.watch is not None and not ep.watch.begin(res, conn, streamed=False):
        return  # the run gave up on a stalled engine: not sent
    try:
        body = json.dumps(payload).encode()
        res.t0 = time.monotonic()
        conn.request("POST", ep.path("/v1/chat/completions"), body=body, headers=ep.headers())
        r = conn.getresponse()
        raw = r.read()
        t_end = time.monotonic()
        if r.status != 200:
            res.error = f"HTTP {r.status}: {raw[:300].decode('utf-8', 'replace')}"
            return
        obj = json.loads(raw)
        usage = obj.get("usage") or {}
        if usage.get("completion_tokens") is None:
            res.error = "no usage in the response (not an OpenAI-compatible server?)"
            return
        res.output_tokens = int(usage["completion_tokens"])
        if usage.get("prompt_tokens") is not None:
            res.prompt_tokens = int(usage["prompt_tokens"])
        res.text = _chunk_text(obj, "message")
        res.answer = "".join(str((ch.get("message") or {}).get("content") or "")
                             for ch in obj.get("choices") or [])
        res.t_end = t_end
        res.ok = True
    except (OSError, http.client.HTTPException, ValueError, TypeError, AttributeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        if ep.watch is not None:
            ep.watch.end(res)


def send_request(ep: Endpoint, payload: dict[str, Any], res: RequestResult) -> None:
    """The payload's way: streamed (stream_request) or whole (whole_request)."""
    (stream_request if payload.get("stream") else whole_request)(ep, payload, res)


def stream_request(ep: Endpoint, payload: dict[str, Any], res: RequestResult) -> None:
    """Send one streaming request, filling res.token_times/output_tokens; never raises for HTTP errors."""
    conn = ep._conn()
    watch = ep.watch
    if watch is not None and not watch.begin(res, conn, streamed=True):
        return  # the run gave up on a stalled engine: not sent
    try:
        body = json.dumps(payload).encode()
        res.t0 = time.monotonic()
        conn.request("POST", ep.path("/v1/chat/completions"), body=body, headers=ep.headers())
        r = conn.getresponse()
        if r.status != 200:
            text = r.read()[:300].decode("utf-8", "replace")
            if r.status == 400 and "continuous_usage_stats" in text:
                raise UnsupportedOption(text)
            res.error = f"HTTP {r.status}: {text}"
            return
        _consume_sse(r, res, watch.token if watch is not None else None)
    except UnsupportedOption:
        raise
    except (OSError, http.client.HTTPException, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        conn.close()
        if watch is not None:
            watch.end(res)


def _consume_sse(r: http.client.HTTPResponse, res: RequestResult, on_token: Any = None) -> None:
    last_count = 0
    final_usage: int | None = None
    content_times: list[float] = []
    usage_times: list[float] = []
    parts: list[str] = []
    answer: list[str] = []
    done = False
    while True:
        line = r.readline()
        if not line:
            break
        t = time.monotonic()
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            done = True
            break
        obj = json.loads(data)
        if "error" in obj and not obj.get("choices"):
            res.error = f"server error in stream: {str(obj['error'])[:200]}"
            return
        res.raw_chunks += 1
        usage = obj.get("usage") or None
        has_choices = bool(obj.get("choices"))
        if usage is not None and usage.get("completion_tokens") is not None:
            count = int(usage["completion_tokens"])
            if has_choices:
                res.continuous_usage = True
                if count > last_count:
                    usage_times.append(t)
                    last_count = count
                    if on_token:
                        on_token(res)
            final_usage = count
            if usage.get("prompt_tokens") is not None:
                res.prompt_tokens = int(usage["prompt_tokens"])
        if has_choices and _chunk_has_content(obj):
            content_times.append(t)
            if on_token:
                on_token(res)
            parts.append(_chunk_text(obj))
            answer.extend(str((ch.get("delta") or {}).get("content") or "") for ch in obj["choices"])
    if not done:
        res.error = "stream ended without [DONE]"
        return
    res.token_times = usage_times if res.continuous_usage else content_times
    if final_usage is None:
        res.error = "no usage in stream (server ignored stream_options.include_usage)"
        return
    res.output_tokens = final_usage
    res.text = "".join(parts)
    res.answer = "".join(answer)
    res.ok = True
