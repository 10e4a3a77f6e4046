"""HTTP helpers and the long-stream load of tests/gpu/watchdog_real.py (standard library only)."""

from __future__ import annotations

import http.client
import json
import re
import socket
import threading
import time
import urllib.error
import urllib.request

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# ------------------------------------------------------------------ http helpers
def http_get(url: str, timeout: float = 5.0) -> tuple[int | None, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read(4 << 20).decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


def metrics(url: str) -> dict[str, float]:
    status, text = http_get(url + "/metrics")
    out: dict[str, float] = {}
    if status != 200:
        return out
    for line in text.splitlines():
        m = re.match(
            r"^(vllm:(?:num_requests_running|num_requests_waiting|generation_tokens_total|"
            r"request_success_total))(\{[^}]*\})?\s+(\S+)",
            line,
        )
        if m:
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(3))
    return out


def short_metrics(m: dict[str, float]) -> dict[str, float]:
    return {k.split(":")[1].replace("num_requests_", "").replace("_total", ""): v for k, v in m.items()}


def post_json(url: str, body: dict, key: str | None, timeout: float) -> tuple[int | None, str]:
    req = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", **({"Authorization": "Bearer " + key} if key else {})},
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except (OSError, ValueError) as exc:
        return None, f"{type(exc).__name__}: {exc}"


# ------------------------------------------------------------------ load: long streams
class Stream(threading.Thread):
    """One streaming chat completion with a long max_tokens (ignore_eos): counts chunks until done."""

    def __init__(self, host: str, port: int, key: str, model: str, max_tokens: int, chat: bool, no: int):
        super().__init__(daemon=True)
        self.chat = chat
        self.host, self.port, self.key, self.model, self.max_tokens, self.no = (
            host,
            port,
            key,
            model,
            max_tokens,
            no,
        )
        self.chunks = 0
        self.status: int | None = None
        self.error = ""
        self.finished = False
        self.aborted = False
        self.conn: http.client.HTTPConnection | None = None
        self.t_start = time.time()
        self.t_end: float | None = None

    def run(self) -> None:
        text = f"def return import class self {self.no}"
        req = {
            "model": self.model,
            "stream": True,
            "max_tokens": self.max_tokens,
            "ignore_eos": True,
            "temperature": 0,
        }
        req.update({"messages": [{"role": "user", "content": text}]} if self.chat else {"prompt": text})
        body = json.dumps(req)
        try:
            self.conn = http.client.HTTPConnection(self.host, self.port, timeout=900)
            self.conn.request(
                "POST",
                "/v1/chat/completions" if self.chat else "/v1/completions",
                body=body,
                headers={"Content-Type": "application/json", "Authorization": "Bearer " + self.key},
            )
            r = self.conn.getresponse()
            self.status = r.status
            if r.status != 200:
                self.error = r.read(2000).decode("utf-8", "replace")
                return
            while True:
                line = r.readline()
                if not line:
                    break
                if line.startswith(b"data: "):
                    if line.strip() == b"data: [DONE]":
                        self.finished = True
                        break
                    self.chunks += 1
        except Exception as exc:  # noqa: BLE001 - aborted streams end here
            if not self.aborted:
                self.error = f"{type(exc).__name__}: {exc}"
        finally:
            self.t_end = time.time()

    def abort(self) -> None:
        self.aborted = True
        try:
            if self.conn is not None and self.conn.sock is not None:
                self.conn.sock.shutdown(socket.SHUT_RDWR)
                self.conn.sock.close()
        except OSError:
            pass


class Load(threading.Thread):
    """Keeps ``target`` streams open (max_num_seqs running + the rest waiting) while ``replenish``."""

    def __init__(self, host: str, port: int, key: str, model: str, max_tokens: int, chat: bool, target: int):
        super().__init__(daemon=True)
        self.args = (host, port, key, model, max_tokens, chat)
        self.target = target
        self.replenish = True
        self.stop = False
        self.streams: list[Stream] = []

    def alive(self) -> list[Stream]:
        return [s for s in self.streams if s.is_alive()]

    def run(self) -> None:
        while not self.stop:
            if self.replenish and len(self.alive()) < self.target:
                s = Stream(*self.args, no=len(self.streams))
                self.streams.append(s)
                s.start()
            time.sleep(0.1)

    def abort_all(self) -> None:
        self.replenish = False
        self.stop = True
        for s in self.streams:
            if s.is_alive():
                s.abort()

    def report(self) -> list[dict]:
        return [
            {
                "no": s.no,
                "status": s.status,
                "chunks": s.chunks,
                "finished": s.finished,
                "aborted": s.aborted,
                "error": s.error[:300],
                "start_s": round(s.t_start - T0, 1),
                "end_s": None if s.t_end is None else round(s.t_end - T0, 1),
            }
            for s in self.streams
        ]


