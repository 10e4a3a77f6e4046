#!/usr/bin/env python3
"""Real GPU, real vLLM: the serve role's LAN proxy (nginx) in front of a real server.

    python3 tests/gpu/proxy_real.py --out DIR [--nginx PATH] [--work DIR] [--budget S]
    python3 tests/gpu/proxy_real.py --out DIR --nginx PATH --upstream URL   (any running server)

Starts one patched vLLM baseline server (our tiny hybrid, e2e.build_models) as the serve role does when
``vllm_host`` is a LAN address: bound to 127.0.0.1 with its key in ``VLLM_API_KEY``. Renders the role's
own proxy templates (templates/sparkllm-proxy.nginx.conf.j2 and roles/serve/templates/proxy-key.conf.j2,
plain Jinja2: they use no Ansible filter) and runs the given nginx binary on the host's first non-loopback
address (127.0.0.2 where there is none), with a main configuration holding only what a distribution's
nginx.conf adds around a conf.d site (events, temp paths, logs).

Routes: the server's own /openapi.json, joined with tests/contract/data/vllm_routes.json for the release.
Checks, each through the proxy: every route outside /v1 answers 404 to GET and POST (with and without
the key); every /v1 route answers 401 without the key; /v1/models 401 without or with a wrong key and
200 with it; a greedy chat completion through the proxy equals the one asked of vLLM directly; a streamed
one arrives as several server-sent events ending in [DONE]. Figures, not checks: what vLLM itself answers
on loopback without a key (/invocations, /tokenize, /metrics, ...), the reason the proxy exists.

Writes DIR/summary.json, DIR/vllm-proxy.log, DIR/nginx/ (rendered files, error and access logs).
Exit 0 every check passed, 1 one failed, 2 usage or no vLLM/GPU/nginx.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: tests.* when run as a script
from tests.gpu import e2e  # noqa: E402

log = e2e.logger("proxy_real")

ROOT = Path(__file__).resolve().parents[2]
SITE_TEMPLATE = ROOT / "templates" / "sparkllm-proxy.nginx.conf.j2"
KEY_TEMPLATE = ROOT / "roles" / "serve" / "templates" / "proxy-key.conf.j2"
ROUTES = ROOT / "tests" / "contract" / "data" / "vllm_routes.json"
KEY = "sparkllm-gpu-proxy-key"
UPSTREAM_PORT = 8311
LISTEN_PORT = 8300
MAIN_CONF = """\
# what a distribution's nginx.conf sets around its conf.d sites, in the work directory
{user}worker_processes 2;
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 256; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/tmp/body;
    proxy_temp_path {d}/tmp/proxy;
    fastcgi_temp_path {d}/tmp/fastcgi;
    uwsgi_temp_path {d}/tmp/uwsgi;
    scgi_temp_path {d}/tmp/scgi;
    include {site};
}}
"""


def role_default(name: str) -> str:
    """A serve role default (roles/serve/defaults/main.yml), read as YAML."""
    import yaml

    return yaml.safe_load((ROOT / "roles/serve/defaults/main.yml").read_text())[name]


def render(nginx_dir: Path, listen: str, upstream_port: int) -> Path:
    import jinja2

    env = jinja2.Environment(undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    key_file = nginx_dir / "sparkllm-vllm-key.conf"
    site_file = nginx_dir / "sparkllm-vllm.conf"
    values = {"ansible_managed": "rendered by tests/gpu/proxy_real.py", "serve_proxy_key_file": str(key_file),
              "_serve_proxy_listen": listen, "_serve_api_port": upstream_port, "_serve_api_key": KEY,
              "serve_proxy_max_body_size": role_default("serve_proxy_max_body_size"),
              "serve_proxy_read_timeout": role_default("serve_proxy_read_timeout")}
    key_file.write_text(env.from_string(KEY_TEMPLATE.read_text()).render(**values))
    key_file.chmod(0o600)
    site_file.write_text(env.from_string(SITE_TEMPLATE.read_text()).render(**values))
    for sub in ("body", "proxy", "fastcgi", "uwsgi", "scgi"):
        (nginx_dir / "tmp" / sub).mkdir(parents=True, exist_ok=True)
    main = nginx_dir / "nginx.conf"
    user = ""
    if os.geteuid() == 0:  # the build's default worker user/group may not exist on this host
        import grp
        import pwd

        user = f"user {pwd.getpwuid(0).pw_name} {grp.getgrgid(os.getegid()).gr_name};\n"
    main.write_text(MAIN_CONF.format(d=nginx_dir, site=site_file, user=user))
    return main


def lan_address() -> str:
    """The host's first non-loopback IPv4 address (a Spark's LAN face), else 127.0.0.2."""
    try:
        out = subprocess.run(["hostname", "-I"], capture_output=True, text=True, timeout=5).stdout.split()
    except (OSError, subprocess.SubprocessError):
        out = []
    for a in out:
        if re.fullmatch(r"\d+\.\d+\.\d+\.\d+", a) and not a.startswith("127."):
            return a
    try:
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        s.connect(("10.255.255.255", 1))
        a = s.getsockname()[0]
        s.close()
        if not a.startswith("127."):
            return a
    except OSError:
        pass
    return "127.0.0.2"


def ask(url: str, method: str = "GET", key: str | None = None, body: dict | None = None,
        timeout: float = 60) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else (b"{}" if method == "POST" else None)
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode(errors="replace")
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")
    except (urllib.error.URLError, OSError) as e:
        return -1, f"{type(e).__name__}: {e}"


def stream(url: str, key: str, body: dict, timeout: float = 60) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
    req.add_header("Content-Type", "application/json")
    req.add_header("Authorization", f"Bearer {key}")
    events, t_first, t0, text = [], None, time.monotonic(), ""
    with urllib.request.urlopen(req, timeout=timeout) as r:
        status = r.status
        for raw in r:
            line = raw.decode(errors="replace").strip()
            if not line.startswith("data:"):
                continue
            t_first = t_first or time.monotonic() - t0
            payload = line[5:].strip()
            events.append(payload)
            if payload != "[DONE]":
                for ch in json.loads(payload).get("choices") or []:
                    delta = ch.get("delta") or {}
                    text += (delta.get("content") or "") + (delta.get("reasoning_content")
                                                            or delta.get("reasoning") or "")
    return {"status": status, "events": len(events), "done": bool(events) and events[-1] == "[DONE]",
            "first_event_s": round(t_first or 0, 3), "all_s": round(time.monotonic() - t0, 3), "text": text}


def concrete(path: str) -> str:
    return re.sub(r"\{[^}]*\}", "x", path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="proxy_real.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--nginx", default="nginx",
                    help="the nginx binary to run (a distribution's package; default: nginx on PATH)")
    ap.add_argument("--work", type=Path, default=Path("/tmp/sparkllm-gpu-proxy"))
    ap.add_argument("--budget", type=float, default=420, help="seconds for the server's start (default 420)")
    ap.add_argument("--upstream", default="", help="an already running vLLM (its URL): start none")
    a = ap.parse_args(argv)
    rec = e2e.Record(a.out, a.work, log, figures={})
    t0, summary, failures, check = rec.t0, rec.summary, rec.failures, rec.check

    nginx_dir = a.out.resolve() / "nginx"  # nginx reads relative paths from its own prefix
    nginx_dir.mkdir(exist_ok=True)
    try:
        ver = subprocess.run([a.nginx, "-v"], capture_output=True, text=True)
    except OSError as e:
        print(f"proxy_real.py: no nginx at {a.nginx!r} ({e.strerror}); install the distribution's nginx "
              "or give --nginx PATH", file=sys.stderr)
        return 2
    if ver.returncode:
        print(f"proxy_real.py: {a.nginx} does not run here: {ver.stderr.strip()[-300:]}", file=sys.stderr)
        return 2
    summary["nginx"] = ver.stderr.strip()
    server = None
    nginx = None
    try:
        if a.upstream:
            upstream = a.upstream.rstrip("/")
            upstream_port = int(upstream.rsplit(":", 1)[1])
            summary["host"] = {"upstream": upstream}
        else:
            host = rec.host("proxy_real.py")
            if host is None:
                return 2
            models = e2e.build_models(a.work)
            patched, pp = rec.patched(a.work, host)
            extra = list(e2e.HOST_SETTINGS["vllm_serve_extra_args"])
            if not host["vllm"].startswith("0.20"):  # 0.26.0 refuses triton for WNA16 MoE (dflash_bench.py)
                i = extra.index("--moe-backend")
                del extra[i:i + 2]
            upstream_port = UPSTREAM_PORT
            server = e2e.Server("proxy", "baseline", models["dirs"]["hybrid"], upstream_port, pp, a.out,
                                extra_env={"VLLM_API_KEY": KEY},
                                extra_settings={"vllm_serve_extra_args": extra, "vllm_host": "127.0.0.1"})
            summary["argv"] = server.argv
            server.start()
            while time.monotonic() - t0 < a.budget and server.poll() == "starting":
                time.sleep(1)
            state = server.poll()
            check("vLLM serves on loopback", state == "up",
                  {"state": state, "ready_s": round(server.healthy_after or 0, 1), "exit": server.exit_code})
            if state != "up":
                summary["tail"] = server.log_text().splitlines()[-40:]
                return 1
            upstream = server.url
        listen_addr = lan_address()
        listen = f"{listen_addr}:{LISTEN_PORT}"
        main_conf = render(nginx_dir, listen, upstream_port)
        t = subprocess.run([a.nginx, "-t", "-q", "-c", str(main_conf), "-e", str(nginx_dir / "error.log")],
                           capture_output=True, text=True)
        check("nginx -t accepts the rendered site", t.returncode == 0, t.stderr.strip()[-400:])
        if t.returncode:
            return 1
        nginx = subprocess.Popen([a.nginx, "-c", str(main_conf), "-e", str(nginx_dir / "error.log"),
                                  "-g", "daemon off;"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        proxy = f"http://{listen}"
        for _ in range(50):
            if ask(proxy + "/")[0] != -1:
                break
            time.sleep(0.1)
        summary["listen"] = listen

        # the routes: the real server's schema, joined with the contract data of the release
        st, body = ask(upstream + "/openapi.json")
        schema = sorted(json.loads(body).get("paths", {})) if st == 200 else []
        st_v, ver_body = ask(upstream + "/version")
        release = json.loads(ver_body).get("version", "") if st_v == 200 else ""
        summary["figures"]["vllm_version_route"] = release
        listed = json.loads(ROUTES.read_text()).get(release, [])
        listed = [r["path"] if isinstance(r, dict) else r for r in listed]
        routes = sorted(set(schema) | set(listed))
        summary["figures"]["routes"] = {"openapi": len(schema), "contract_data": len(listed),
                                        "joined": len(routes)}
        outside = [r for r in routes if not r.startswith("/v1/") and r != "/v1"]
        inside = [r for r in routes if r.startswith("/v1/")]
        check("routes known (openapi.json answered)", bool(schema) and bool(outside) and bool(inside),
              summary["figures"]["routes"])

        bad = []
        for r in outside:
            for m in ("GET", "POST"):
                for k in (None, KEY):
                    st, _ = ask(proxy + concrete(r), m, k, timeout=10)
                    if st != 404:
                        bad.append([m, r, "key" if k else "no key", st])
        check(f"every route outside /v1 is 404 through the proxy ({len(outside)} routes, GET/POST, "
              "key/none)", not bad, bad[:20])
        open_direct = {}
        for r in outside:
            st, _ = ask(upstream + concrete(r), "GET", None, timeout=10)
            open_direct[r] = st
        summary["figures"]["vllm_loopback_without_key"] = open_direct
        st_inv, _ = ask(upstream + "/invocations", "POST", None, body={"model": "tiny", "prompt": "hi",
                                                                       "max_tokens": 1}, timeout=30)
        summary["figures"]["vllm_loopback_invocations_without_key"] = st_inv
        st_pinv, _ = ask(proxy + "/invocations", "POST", None, body={"model": "tiny", "prompt": "hi",
                                                                     "max_tokens": 1}, timeout=30)
        check("/invocations without a key is refused through the proxy", st_pinv == 404,
              {"proxy": st_pinv, "vllm_loopback": st_inv})

        bad = []
        for r in inside:
            st, _ = ask(proxy + concrete(r), "GET", None, timeout=10)
            if st != 401:
                bad.append([r, st])
        check(f"every /v1 route is 401 through the proxy without the key ({len(inside)} routes)",
              not bad, bad)
        codes = {"none": ask(proxy + "/v1/models")[0], "wrong": ask(proxy + "/v1/models", key="wrong")[0]}
        st, body = ask(proxy + "/v1/models", key=KEY)
        codes["right"] = st
        served = [m.get("id") for m in json.loads(body).get("data", [])] if st == 200 else []
        check("/v1/models: 401 without or with a wrong key, 200 with it",
              codes["none"] == 401 and codes["wrong"] == 401 and st == 200 and "tiny" in served,
              {"codes": codes, "served": served})

        req = {"model": "tiny", "messages": [{"role": "user", "content": "Spark owners serve Qwen"}],
               "max_tokens": 24, "temperature": 0, "seed": 0}
        st_p, via_proxy = ask(proxy + "/v1/chat/completions", "POST", KEY, body=req)
        st_d, direct = ask(upstream + "/v1/chat/completions", "POST", KEY, body=req)

        def content(text: str) -> str | None:
            try:
                msg = json.loads(text)["choices"][0]["message"]
                # the qwen3 reasoning parser moves an unterminated think block out of content
                thought = msg.get("reasoning_content") or msg.get("reasoning") or ""
                return (msg.get("content") or "") + "|" + thought
            except (ValueError, KeyError, IndexError, TypeError):
                return None
        check("greedy chat completion through the proxy = asked of vLLM directly",
              st_p == st_d == 200 and content(via_proxy) is not None
              and content(via_proxy) == content(direct),
              {"proxy": st_p, "direct": st_d, "text": (content(via_proxy) or via_proxy)[:200]})
        s = stream(proxy + "/v1/chat/completions", KEY, req | {"stream": True})
        d = stream(upstream + "/v1/chat/completions", KEY, req | {"stream": True})
        check("streamed chat completion through the proxy: several events, then [DONE], as asked directly",
              s["status"] == 200 and s["events"] >= 3 and s["done"] and s["text"] == d["text"],
              {k: v for k, v in s.items() if k != "text"}
              | {"text": s["text"][:200], "direct_events": d["events"]})
    finally:
        if nginx is not None:
            nginx.terminate()
            try:
                nginx.wait(10)
            except subprocess.TimeoutExpired:
                nginx.kill()
        if server is not None:
            server.stop()
        rec.save()
    print("PROXY_REAL SUMMARY " + json.dumps({"host": summary.get("host"), "failed": failures,
                                             "seconds": summary["seconds"]}), flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
