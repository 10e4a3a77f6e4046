#!/usr/bin/python3
"""Long streaming chat requests against the served model (test host only; the watchdog's busy test).

usage: ops-load URL MODEL N MAX_TOKENS KEY_FILE [PROMPT_WORDS] - N requests at once, each asking for
MAX_TOKENS tokens; PROMPT_WORDS: a prompt of that many words (a long prefill) instead of the short one;
errors (a restarted server cutting a stream) end that request quietly.
"""

import json
import sys
import threading
import urllib.request


def one(url: str, model: str, tokens: int, key: str, words: int = 0) -> None:
    content = " ".join(["word"] * words) if words else "a long answer please"
    body = json.dumps({"model": model, "stream": True, "max_tokens": tokens,
                       "messages": [{"role": "user", "content": content}]}).encode()
    req = urllib.request.Request(url.rstrip("/") + "/v1/chat/completions", data=body, method="POST",
                                 headers={"Content-Type": "application/json",
                                          "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            while r.read(4096):
                pass
    except OSError as exc:
        print(f"ops-load: request ended: {exc}", flush=True)


def main() -> int:
    url, model, n, tokens, key_file = sys.argv[1:6]
    words = int(sys.argv[6]) if len(sys.argv) > 6 else 0
    with open(key_file, encoding="utf-8") as f:
        key = f.read().strip()
    threads = [threading.Thread(target=one, args=(url, model, int(tokens), key, words))
               for _ in range(int(n))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
