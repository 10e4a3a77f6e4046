#!/usr/bin/python3
"""Mixed load for the ops soak (test host only, standard library; molecule/ops/tests/test_soak.py).

usage: ops-soak URL MODEL KEY_FILE --out JSON [--duration S] [--max-num-seqs N] [--long-words W]
                [--short-workers N] [--short-tokens N] [--burst-tokens N]

For --duration seconds, streaming chat requests (stream_options.include_usage) of four kinds:
  long    one request at the start whose prompt is --long-words words (a long prefill), 16 tokens;
  short   --short-workers clients, each sending --short-tokens-token streams one after another;
  cancel  one client at a quarter of the duration that reads 20 content chunks of a long stream
          and closes its connection (the one request allowed not to end);
  burst   at 40 % of the duration, 2 x --max-num-seqs + 1 requests at once (above max_num_seqs:
          the server queues them), --burst-tokens tokens each.
No new request starts after --duration; the ones in flight are waited for. A request is completed when
its stream ends with [DONE], a finish_reason and usage.completion_tokens equal to its max_tokens;
cancelled for the cancel client's; lost otherwise (an error, a cut stream, a short count).
--out gets the counts, token totals and every lost request's reason as JSON (written atomically).
Exit status: 0 nothing lost and one cancelled, 1 a request lost (or the cancel did not happen), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
import urllib.request

CANCEL_AFTER_CHUNKS = 20  # content chunks the cancel client reads before it hangs up
CANCEL_TOKENS = 5000  # far more than it reads: the stream is cut mid-way
LONG_TOKENS = 16
READ_TIMEOUT_S = 300.0  # the longest silence a stream may have (a long prefill, a queue)


def classify(lines: list[str], max_tokens: int) -> dict:
    """What a finished stream's ``data:`` lines say: completed, or lost with the reason."""
    done = False
    finish, usage_tokens, content_chunks = None, None, 0
    for line in lines:
        if not line.startswith("data: "):
            continue
        payload = line[len("data: "):].strip()
        if payload == "[DONE]":
            done = True
            continue
        try:
            obj = json.loads(payload)
        except ValueError:
            return {"status": "lost", "reason": f"unparsable chunk {payload[:80]!r}"}
        for choice in obj.get("choices") or []:
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
            if (choice.get("delta") or {}).get("content"):
                content_chunks += 1
        if obj.get("usage") and not obj.get("choices"):
            usage_tokens = obj["usage"].get("completion_tokens")
    rec = {"finish_reason": finish, "completion_tokens": usage_tokens, "content_chunks": content_chunks}
    if not done:
        rec.update(status="lost", reason="the stream ended without [DONE]")
    elif finish is None:
        rec.update(status="lost", reason="no finish_reason")
    elif usage_tokens != max_tokens:
        rec.update(status="lost", reason=f"{usage_tokens} of {max_tokens} tokens")
    else:
        rec.update(status="completed")
    return rec


def _has_content(line: str) -> bool:
    """True for a ``data:`` line whose choice carries text (the role chunk and empty ones do not)."""
    if not line.startswith("data: ") or line.strip() == "data: [DONE]":
        return False
    try:
        obj = json.loads(line[len("data: "):])
    except ValueError:
        return False
    return any((c.get("delta") or {}).get("content") for c in obj.get("choices") or [])


class Soak:
    def __init__(self, args: argparse.Namespace, key: str) -> None:
        self.args = args
        self.key = key
        self.lock = threading.Lock()
        self.records: list[dict] = []
        self.t0 = time.monotonic()
        self.deadline = self.t0 + args.duration

    def _request(self, kind: str, words: int, max_tokens: int) -> urllib.request.Request:
        content = " ".join(f"w{i % 97}" for i in range(words))
        body = json.dumps({"model": self.args.model, "stream": True, "max_tokens": max_tokens,
                           "stream_options": {"include_usage": True},
                           "messages": [{"role": "user", "content": f"{kind}: {content}"}]}).encode()
        return urllib.request.Request(self.args.url.rstrip("/") + "/v1/chat/completions", data=body,
                                      method="POST", headers={"Content-Type": "application/json",
                                                              "Authorization": f"Bearer {self.key}"})

    def one(self, kind: str, max_tokens: int, words: int = 8, cancel_after: int = 0) -> None:
        """One streaming request; its record is kept (cancel_after > 0: hang up after that many chunks)."""
        t = time.monotonic()
        rec: dict = {"kind": kind, "max_tokens": max_tokens, "prompt_words": words}
        lines: list[str] = []
        try:
            with urllib.request.urlopen(self._request(kind, words, max_tokens), timeout=READ_TIMEOUT_S) as r:
                chunks = 0
                while True:
                    raw = r.readline()
                    if not raw:
                        break
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    lines.append(line)
                    if cancel_after and _has_content(line):
                        chunks += 1
                        if chunks >= cancel_after:
                            rec.update(status="cancelled", content_chunks=chunks)
                            break  # leaving the with block closes the connection mid-stream
        except (OSError, ValueError) as exc:  # URLError, HTTPError, a reset, a timeout, http.client errors
            rec.update(status="lost", reason=f"{type(exc).__name__}: {exc}")
        if "status" not in rec:
            rec.update(classify(lines, max_tokens))
            if cancel_after:  # the cancel client's stream ended before it hung up
                why = rec.get("reason", "it completed")
                rec.update(status="lost", reason=f"ended before {cancel_after} chunks: {why}")
        rec["seconds"] = round(time.monotonic() - t, 3)
        rec["started_s"] = round(t - self.t0, 3)
        with self.lock:
            self.records.append(rec)

    def _short_worker(self) -> None:
        while time.monotonic() < self.deadline:
            self.one("short", self.args.short_tokens)

    def _at(self, share: float, target, *args) -> threading.Thread:
        def run() -> None:
            time.sleep(max(0.0, self.t0 + share * self.args.duration - time.monotonic()))
            target(*args)
        return threading.Thread(target=run, daemon=True)

    def _burst(self) -> None:
        n = 2 * self.args.max_num_seqs + 1
        threads = [threading.Thread(target=self.one, args=("burst", self.args.burst_tokens), daemon=True)
                   for _ in range(n)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()

    def run(self) -> dict:
        threads = [threading.Thread(target=self.one, args=("long", LONG_TOKENS, self.args.long_words),
                                    daemon=True)]
        threads += [threading.Thread(target=self._short_worker, daemon=True)
                    for _ in range(self.args.short_workers)]
        threads.append(self._at(0.25, self.one, "cancel", CANCEL_TOKENS, 8, CANCEL_AFTER_CHUNKS))
        threads.append(self._at(0.40, self._burst))
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return self.summary(time.monotonic() - self.t0)

    def summary(self, seconds: float) -> dict:
        recs = list(self.records)
        kinds: dict[str, dict[str, int]] = {}
        for r in recs:
            kinds.setdefault(r["kind"], {}).setdefault(r["status"], 0)
            kinds[r["kind"]][r["status"]] += 1
        done = [r for r in recs if r["status"] == "completed"]
        return {"requests": len(recs), "completed": len(done),
                "cancelled": sum(r["status"] == "cancelled" for r in recs),
                "lost": sum(r["status"] == "lost" for r in recs),
                "tokens": sum(r["completion_tokens"] for r in done),
                "duration_s": round(seconds, 1), "kinds": kinds,
                "long_prefill_s": next((r["seconds"] for r in recs if r["kind"] == "long"), None),
                "lost_detail": [r for r in recs if r["status"] == "lost"][:20]}


def write_json(path: str, obj: dict) -> None:
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".soak.")
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="ops-soak", description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("key_file")
    p.add_argument("--out", required=True, help="where the summary JSON goes")
    p.add_argument("--duration", type=float, default=140.0, help="seconds new requests start (default 140)")
    p.add_argument("--max-num-seqs", type=int, default=4, help="the server's max_num_seqs (burst: 2N+1)")
    p.add_argument("--long-words", type=int, default=6000, help="words of the long prompt (default 6000)")
    p.add_argument("--short-workers", type=int, default=2)
    p.add_argument("--short-tokens", type=int, default=40)
    p.add_argument("--burst-tokens", type=int, default=600, help="tokens a burst request asks (default 600)")
    args = p.parse_args(argv)
    for name in ("duration", "max_num_seqs", "long_words", "short_workers", "short_tokens", "burst_tokens"):
        if not getattr(args, name) > 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        p.error(f"--out {args.out}: its directory does not exist; create it or give another path")
    try:
        with open(args.key_file, encoding="utf-8") as f:
            key = f.read().strip()
    except OSError as exc:
        p.error(f"cannot read the API key file {args.key_file}: {exc.strerror}; give the server's key file")
    result = Soak(args, key).run()
    write_json(args.out, result)
    print(f"ops-soak: {result['requests']} requests, {result['completed']} completed, "
          f"{result['cancelled']} cancelled, {result['lost']} lost, {result['tokens']} tokens in "
          f"{result['duration_s']} s", flush=True)
    return 0 if result["lost"] == 0 and result["cancelled"] == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
