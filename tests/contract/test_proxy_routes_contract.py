"""The LAN proxy (roles/serve tasks/proxy.yml) lets exactly the /v1 routes of the real vLLM through.

vLLM checks ``--api-key`` on /v1 only (0.19.1) or /v1, /v2, /inference (0.26.0); /invocations,
/tokenize, /metrics, /version, ... answer anyone (issue 29). So a non-loopback ``vllm_host`` puts
nginx in front, and this proves, against each release's own code:

* the routes: every path a release's API server can register (tests/contract/vllm_routes.py reads
  the routers from the source; for 0.19.1 the FastAPI app a real ``vllm serve`` builds is checked to
  be covered by that reading), kept in tests/contract/data/vllm_routes.json for the serve scenario;
* the site the role renders (templates/sparkllm-proxy.nginx.conf.j2 with the role's defaults), read
  with nginx's location rules, forwards every /v1 route after the key check and answers 404 for
  every other one;
* the key rule itself, by running each release's AuthenticationMiddleware;
* the stand-in server answers the non-/v1 routes of a real default server, without the key.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest
import yaml

from tests.contract import vllm_routes

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
CONTRACT_DIR = ROOT / "tests" / "contract"
DATA = CONTRACT_DIR / "data" / "vllm_routes.json"
RELEASES = {
    "0.19.1": ROOT / ".venv-vllm" / "lib" / "python3.11" / "site-packages" / "vllm",
    "0.26.0": ROOT / ".cache" / "vllm-0.26.0-py" / "vllm",
}
UPSTREAM = 18000
KEY = "sk-contract-KEY-1"


def _release_dir(release: str) -> Path:
    d = RELEASES[release]
    if not (d / "entrypoints").is_dir():
        pytest.fail(f"{d} missing; run tests/contract/setup_vllm_env.sh")
    return d


def _scan(release: str) -> dict[str, set[str]]:
    return vllm_routes.release_routes(_release_dir(release))


@pytest.fixture(scope="module")
def built_routes() -> list[list]:
    proc = subprocess.run([sys.executable, str(CONTRACT_DIR / "vllm_routes.py")], capture_output=True,
                          text=True, timeout=600, check=False, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("VLLM_ROUTES ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def test_the_source_scan_covers_the_app_a_real_0_19_1_server_builds(built_routes):
    scanned = set(_scan("0.19.1"))
    built = {p for p, _ in built_routes}
    assert "/invocations" in built and "/v1/chat/completions" in built  # the scan of the app works
    assert built - scanned == set(), f"routes of the built app the source scan misses: {built - scanned}"


def test_the_route_list_the_serve_scenario_reads_is_current():
    current = {r: sorted(_scan(r)) for r in RELEASES}
    recorded = json.loads(DATA.read_text())
    assert recorded == current, (
        f"{DATA.relative_to(ROOT)} is stale; rewrite it with: PYTHONPATH=tests/contract "
        f".venv-vllm/bin/python -c \"import test_proxy_routes_contract as t; t.write_data()\"")


def write_data() -> None:
    DATA.write_text(json.dumps({r: sorted(_scan(r)) for r in RELEASES}, indent=1) + "\n")


# --- the nginx site the role renders, read as nginx matches locations ---------------------------------

def _render(name: str, path: Path, **extra) -> str:
    defaults = yaml.safe_load((ROOT / "roles" / "serve" / "defaults" / "main.yml").read_text())
    ctx = {k: v for k, v in defaults.items() if not (isinstance(v, str) and "{{" in v)}
    ctx.update(ansible_managed="Ansible managed", _serve_api_port=UPSTREAM,
               _serve_proxy_listen="0.0.0.0:8000", **extra)
    env = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    return env.from_string((path / name).read_text()).render(**ctx)


def _locations(conf: str) -> list[tuple[str, str, str]]:
    """(modifier, uri, body) of every location block (nested braces allowed)."""
    out = []
    for m in re.finditer(r"^\s*location\s+(=|\^~|~\*|~)?\s*(\S+)\s*\{", conf, re.M):
        depth, i = 1, m.end()
        while depth:
            depth += {"{": 1, "}": -1}.get(conf[i], 0)
            i += 1
        out.append((m.group(1) or "", m.group(2), conf[m.end():i - 1]))
    return out


def _match(locations, uri: str) -> tuple[str, str, str]:
    """nginx's choice: an exact match, else the longest prefix (regex locations are refused above)."""
    exact = [loc for loc in locations if loc[0] == "=" and loc[1] == uri]
    if exact:
        return exact[0]
    prefixes = [loc for loc in locations if loc[0] in ("", "^~") and uri.startswith(loc[1])]
    assert prefixes, f"no location matches {uri}: nginx would answer 404 from its root, not from the site"
    return max(prefixes, key=lambda loc: len(loc[1]))


@pytest.fixture(scope="module")
def site() -> list[tuple[str, str, str]]:
    locations = _locations(_render("sparkllm-proxy.nginx.conf.j2", ROOT / "templates"))
    assert not [loc for loc in locations if loc[0].startswith("~")], "a regex location: extend _match"
    return locations


@pytest.mark.parametrize("release", RELEASES)
def test_the_proxy_forwards_exactly_the_v1_routes_of_the_release(site, release):
    routes = _scan(release)
    assert "/invocations" in routes and "/tokenize" in routes and "/v1/models" in routes
    forwarded, refused = [], []
    for path in sorted(routes):
        uri = re.sub(r"\{[^}]+\}", "x", path)
        _, _, body = _match(site, uri)
        if f"proxy_pass http://127.0.0.1:{UPSTREAM}" in body:
            assert re.search(r"if \(\$sparkllm_vllm_denied\)\s*\{\s*return 401", body), body
            forwarded.append(path)
        else:
            assert re.fullmatch(r"\s*return 404;\s*", body), f"{path}: {body}"
            refused.append(path)
    assert forwarded == sorted(p for p in routes if p.startswith("/v1/")), forwarded
    assert refused == sorted(p for p in routes if not p.startswith("/v1/"))


def test_the_key_check_holds_the_key_and_refuses_everything_else():
    key_dir = ROOT / "roles" / "serve" / "templates"
    with_key = _render("proxy-key.conf.j2", key_dir, _serve_api_key=KEY)
    assert re.search(r"map \$http_authorization \$sparkllm_vllm_denied \{\s*default 1;\s*"
                     rf"\"Bearer {KEY}\" 0;\s*\}}", with_key), with_key
    open_api = _render("proxy-key.conf.j2", key_dir, _serve_api_key="")
    assert "default 0;" in open_api and "Bearer" not in open_api.replace("Bearer <the key>", "")
    assert KEY not in _render("sparkllm-proxy.nginx.conf.j2", ROOT / "templates")


# --- where each release checks the key: its own middleware, run --------------------------------------

MIDDLEWARE_PROBE = r"""
import asyncio, json, sys
try:
    from vllm.entrypoints.serve.utils.server_utils import AuthenticationMiddleware
except ImportError:
    from vllm.entrypoints.openai.server_utils import AuthenticationMiddleware

async def inner(scope, receive, send):
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b""})

async def status(path, method="GET", auth=None):
    mw = AuthenticationMiddleware(inner, tokens=["k"])
    headers = [(b"authorization", auth.encode())] if auth else []
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(), "root_path": "",
             "query_string": b"", "headers": headers, "scheme": "http", "server": ("x", 80)}
    sent = []
    async def receive():
        return {"type": "http.request", "body": b""}
    async def send(msg):
        sent.append(msg)
    await mw(scope, receive, send)
    return sent[0]["status"]

paths = json.loads(sys.stdin.read())
print("MW " + json.dumps({p: asyncio.run(status(p)) for p in paths}
                         | {"/v1/models+key": asyncio.run(status("/v1/models", auth="Bearer k"))}))
"""

PROBE_PATHS = ["/v1/models", "/v1/chat/completions", "/invocations", "/tokenize", "/metrics", "/version",
               "/health", "/v2/embed", "/inference/v1/generate"]
GUARDED = {"0.19.1": ("/v1",), "0.26.0": ("/v1", "/v2", "/inference")}


@pytest.mark.parametrize("release", RELEASES)
def test_the_release_checks_its_key_only_on_its_guarded_prefixes(release):
    env = dict(os.environ)
    if release != "0.19.1":
        env["PYTHONPATH"] = str(_release_dir(release).parent)
    proc = subprocess.run([sys.executable, "-c", MIDDLEWARE_PROBE], input=json.dumps(PROBE_PATHS), env=env,
                          capture_output=True, text=True, timeout=600, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("MW ")]
    assert proc.returncode == 0 and lines, proc.stderr[-3000:]
    got = json.loads(lines[-1][3:])
    expected = {p: 401 if p.startswith(GUARDED[release]) else 200 for p in PROBE_PATHS}
    assert got == expected | {"/v1/models+key": 200}
    assert got["/invocations"] == 200  # a generation endpoint open to anyone: why the proxy exists


def test_the_standin_answers_the_real_default_server_s_other_routes_without_a_key(built_routes):
    from tests.fixtures.standin_server import routes

    real = {(m, p) for p, methods in built_routes if not p.startswith("/v1")
            for m in (methods or ["GET"]) if m != "HEAD"}
    assert set(routes.DEFAULT_ROUTES) == real
