"""Behaviour of the serve stage on the systemd test host, with the stand-in server image.

Order matters (every test takes the ``host`` fixture so pytest keeps file order): the module
starts with mtp converged, switches to ngram, then makes mtp fail (rollback to ngram), then
exercises the bind/API-key rules.
"""

from __future__ import annotations

import http.server
import json
import re
import threading
from pathlib import Path

import pytest
import yaml
from playbook_runner import run_playbook

PORT = 18431
METHODS = ["baseline", "ngram", "mtp", "eagle3", "dflash"]
UNIT = "sparkllm-vllm-{}.service"
CONTAINER = "molserve-vllm-{}"
CONF = "/etc/sparkllm/serve"
SECRETS = f"{CONF}/secrets.env"
HF_TOKEN_FILE = f"{CONF}/hf-token"
HASH_KEY = f"{CONF}/config-hash.key"
FACT = "/etc/ansible/facts.d/spark_serve.fact"
TOKEN = "hf_MOLECULEserveFAKEtoken0123456789"  # host_vars/spark-serve.yml
KEY_FILE = "/etc/sparkllm-test-api-key"  # prepare.yml
API_KEY = "sk-molecule-serve-KEY-9f3a"
ROLLBACK_MSG = "mtp failed to become ready; rolled back to ngram, which is serving"
CATALOGUE = yaml.safe_load((Path(__file__).resolve().parents[3] / "group_vars/all/methods.yml")
                           .read_text())["spark_method_catalogue"]


def _models(host, key: str = "") -> list[str]:
    auth = f" -H 'Authorization: Bearer {key}'" if key else ""
    out = host.check_output(f"curl -sf --max-time 5{auth} http://127.0.0.1:{PORT}/v1/models")
    return [m["id"] for m in json.loads(out)["data"]]


def _inspect(host, method: str) -> dict:
    return json.loads(host.check_output(f"docker inspect {CONTAINER.format(method)}"))[0]


def _container_exists(host, method: str) -> bool:
    return host.run(f"docker inspect {CONTAINER.format(method)}").rc == 0


def _fact(host) -> dict:
    return json.loads(host.file(FACT).content_string)


def _env_words(host, method: str, var: str) -> list[str]:
    """Read the method's env file the way its unit does (systemd quoting, then /bin/sh words)."""
    script = (f'set -a; . {CONF}/{method}.env; eval "set -- ${var}"; '
              'for a in "$@"; do printf "%s\\0" "$a"; done')
    out = host.check_output("sh -c %s", script)
    return [w for w in out.split("\0") if w]


def _option(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


def _assert_only_active(host, method: str) -> None:
    for m in METHODS:
        svc = host.service(UNIT.format(m))
        if m == method:
            assert svc.is_running, f"{m} should be running"
            assert svc.is_enabled, f"{m} should be enabled"
        else:
            assert not svc.is_running, f"{m} should be stopped"
            assert not svc.is_enabled, f"{m} should be disabled"
            assert not _container_exists(host, m)
    assert _inspect(host, method)["State"]["Running"]


def test_mtp_unit_runs_alone_and_answers(host):
    _assert_only_active(host, "mtp")
    assert _models(host) == ["qwen3.5-122b"]


def test_speculative_config_survives_env_file_and_systemd(host):
    args = _inspect(host, "mtp")["Args"]
    assert args[0] == "serve"
    assert json.loads(_option(args, "--speculative-config")) == {"method": "mtp", "num_speculative_tokens": 2}
    assert _option(args, "--speculative-config") == '{"method":"mtp","num_speculative_tokens":2}'
    assert _option(args, "--attention-backend") == "FLASHINFER"
    assert _option(args, "--port") == str(PORT)
    assert _option(args, "--host") == "127.0.0.1"
    assert "--no-enable-prefix-caching" in args
    assert "--disable-log-stats" not in args
    # tool calling on by default, with Qwen3.5's parser
    assert "--enable-auto-tool-choice" in args
    assert _option(args, "--tool-call-parser") == "qwen3_coder"
    # the env file says the same thing as what the container got
    assert ["serve"] + _env_words(host, "mtp", "SPARKLLM_SERVE_ARGS") == args


def test_container_runs_with_host_ipc_network_and_mounts(host):
    hc = _inspect(host, "mtp")["HostConfig"]
    assert hc["NetworkMode"] == "host"
    assert hc["IpcMode"] == "host"
    assert hc["Init"] is True
    binds = set(hc["Binds"])
    assert "/tmp/molecule-serve/model:/model:ro" in binds
    for sub, path in [("vllm", "/root/.cache/vllm"), ("flashinfer", "/root/.cache/flashinfer"),
                      ("triton", "/root/.triton"), ("huggingface", "/root/.cache/huggingface"),
                      ("nv", "/root/.nv")]:
        assert f"/tmp/molecule-serve/cache/{sub}:{path}" in binds
    # the CUDA driver's JIT cache (~/.nv/ComputeCache) is the host's, sized for an image's PTX-only kernels
    assert "CUDA_CACHE_MAXSIZE=4294967296" in _inspect(host, "mtp")["Config"]["Env"]
    # the INT8 LM head is the default (group_vars/all/main.yml); patch 0002 caches its autotuned tiles in
    # the persisted vllm cache
    env = _inspect(host, "mtp")["Config"]["Env"]
    assert "SPARKLLM_LM_HEAD_INT8=1" in env
    assert "SPARKLLM_LM_HEAD_INT8_TUNE_DIR=/root/.cache/vllm/sparkllm-lm-head-int8" in env


@pytest.mark.parametrize("method", METHODS)
def test_unit_passes_systemd_analyze_verify(host, method):
    res = host.run(f"systemd-analyze verify /etc/systemd/system/{UNIT.format(method)}")
    assert res.rc == 0, res.stderr
    assert res.stdout.strip() == "" and res.stderr.strip() == "", res.stdout + res.stderr


@pytest.mark.parametrize("method", METHODS)
def test_unit_conflicts_with_every_other_method(host, method):
    conflicts = set(host.check_output(f"systemctl show -p Conflicts --value {UNIT.format(method)}").split())
    others = {UNIT.format(m) for m in METHODS if m != method}
    assert others <= conflicts
    props = host.check_output(f"systemctl show -p Type -p Restart -p TimeoutStartUSec {UNIT.format(method)}")
    assert "Type=exec" in props and "Restart=on-failure" in props and "TimeoutStartUSec=20min" in props


@pytest.mark.parametrize("method", METHODS)
def test_units_come_from_the_user_template(host, method):
    """serve_unit_template (host_vars) points at molecule/serve/templates/: every unit is rendered from
    that copy, not from the project's templates/, and systemd loaded it as written."""
    unit = host.file(f"/etc/systemd/system/{UNIT.format(method)}").content_string
    assert "# User unit template (molecule serve" in unit
    env = host.check_output(f"systemctl show -p Environment --value {UNIT.format(method)}")
    assert "SPARKLLM_UNIT_TEMPLATE=molecule-serve-override" in env.split()


def test_hf_token_only_in_its_root_only_file_and_not_in_mtp(host):
    hits = host.run(f"grep -rl {TOKEN} /etc/systemd/system /etc/sparkllm /etc/ansible").stdout.split()
    assert hits == [HF_TOKEN_FILE]
    for path in (HF_TOKEN_FILE, SECRETS, HASH_KEY):
        f = host.file(path)
        assert (f.user, f.group, f.mode) == ("root", "root", 0o600), path
    info = _inspect(host, "mtp")
    # mtp downloads nothing: neither the token nor its file reaches its container
    assert TOKEN not in json.dumps(info)
    assert not any(e.startswith(("HF_TOKEN=", "HF_TOKEN_PATH=")) for e in info["Config"]["Env"])
    assert not any("hf-token" in b for b in info["HostConfig"]["Binds"])
    assert TOKEN not in host.check_output("ps -eo args")


def test_config_hash_is_an_hmac_under_the_root_only_key(host):
    """The 0644 fact holds an HMAC: without the 0600 key nobody can test API key guesses against it."""
    import hashlib
    import hmac

    sums = [host.file(p).sha256sum for p in (f"/etc/systemd/system/{UNIT.format('mtp')}", f"{CONF}/mtp.env",
                                             SECRETS)]
    key = host.file(HASH_KEY).content_string
    assert len(key) == 64
    expected = hmac.new(key.encode(), "\n".join(sums).encode(), hashlib.sha256).hexdigest()
    assert _fact(host)["config_hash"] == expected
    assert _fact(host)["config_hash"] != hashlib.sha256(":".join(sums).encode()).hexdigest()
    # what benchmarks key on: unit and env file only, no secret, the same on a rebuilt host
    assert _fact(host)["settings_hash"] == hashlib.sha256(",".join(sums[:2]).encode()).hexdigest()


def test_fact_remembers_method_hash_and_image(host):
    fact = _fact(host)
    assert fact["active_method"] == "mtp"
    assert (fact["scheme"], fact["host"], fact["port"]) == ("http", "127.0.0.1", PORT)
    assert fact["base_url"] == f"http://127.0.0.1:{PORT}"
    assert fact["image"] == "serve-standin:test"
    assert len(fact["config_hash"]) == 64
    assert host.file(FACT).mode == 0o644


MODEL_MANIFEST = "/tmp/molecule-serve/model/sparkllm-manifest.json"  # prepare.yml


def test_env_file_and_fact_carry_the_model_manifest_sha_and_the_image_id(host):
    sha = host.file(MODEL_MANIFEST).sha256sum
    env = host.file(f"{CONF}/mtp.env").content_string
    assert f"\nSPARKLLM_MODEL_MANIFEST_SHA256={sha}\n" in env
    fact = _fact(host)
    assert fact["model_manifest_sha256"] == sha
    image_id = host.check_output("docker image inspect --format '{{.Id}}' serve-standin:test").strip()
    assert fact["image_id"] == image_id == _inspect(host, "mtp")["Image"]


def test_a_new_model_manifest_restarts_the_server(host):
    """Re-merging the model changes its manifest: the config hash changes and the server restarts."""
    before, old_hash = _inspect(host, "mtp")["Id"], _fact(host)["config_hash"]
    host.check_output(f"cp {MODEL_MANIFEST} {MODEL_MANIFEST}.orig && echo ' ' >> {MODEL_MANIFEST}")
    try:
        res = run_playbook("playbooks/serve.yml", {"spec_method": "mtp"})
        assert res.rc == 0, res.output[-3000:]
        sha = host.file(MODEL_MANIFEST).sha256sum
        assert _fact(host)["model_manifest_sha256"] == sha and _fact(host)["config_hash"] != old_hash
        assert _inspect(host, "mtp")["Id"] != before
        _assert_only_active(host, "mtp")
    finally:
        host.check_output(f"mv {MODEL_MANIFEST}.orig {MODEL_MANIFEST}")


def test_switch_to_ngram_stops_mtp(host):
    assert host.service(UNIT.format("mtp")).is_running
    res = run_playbook("playbooks/serve.yml", {"spec_method": "ngram"})
    assert res.rc == 0, res.output[-3000:]
    assert TOKEN not in res.output


def test_ngram_is_the_only_server_after_switch(host):
    _assert_only_active(host, "ngram")
    assert _models(host) == ["qwen3.5-122b"]
    spec = json.loads(_option(_inspect(host, "ngram")["Args"], "--speculative-config"))
    assert spec["method"] == "ngram" and spec["num_speculative_tokens"] == 5
    assert _option(_inspect(host, "ngram")["Args"], "--attention-backend") == "FLASHINFER"  # catalogue
    assert _fact(host)["active_method"] == "ngram"


def test_failing_method_rolls_back_to_ngram(host):
    res = run_playbook("playbooks/serve.yml",
                       {"spec_method": "mtp", "serve_container_env": {"STANDIN_FAIL": "1"}})
    assert res.rc != 0
    assert ROLLBACK_MSG in res.output
    assert "journalctl -u sparkllm-vllm-mtp.service" in res.output
    assert "STANDIN_FAIL=1, refusing to start" in res.output  # the failed unit's journal was printed
    # the failure message carries the post-mortem: the first EngineCore traceback (its cause, without
    # the log prefixes; not the API server's traceback that follows it) and /proc/meminfo figures
    fail = res.output[res.output.rindex(ROLLBACK_MSG):]
    assert "First EngineCore traceback (journalctl -u sparkllm-vllm-mtp.service" in fail
    cause = r"^\s*torch\.OutOfMemoryError: stand-in: CUDA out of memory \(STANDIN_FAIL=1\)$"
    assert re.search(cause, fail, re.M)
    # the post-mortem's traceback is the EngineCore's, not the API server's that follows it (the wait's own
    # "Cause:" may quote the API server's last lines: that is the phase's tail, not the post-mortem)
    postmortem = fail[fail.index("First EngineCore traceback"):]
    assert "Engine core initialization failed" not in postmortem
    assert re.search(r"Memory at the failure \(/proc/meminfo\): MemTotal [\d.]+ GiB, MemAvailable", fail)
    assert TOKEN not in res.output
    _assert_only_active(host, "ngram")
    assert _models(host) == ["qwen3.5-122b"]
    fact = _fact(host)
    assert fact["active_method"] == "ngram"


# vLLM's start phases at seconds scale (the stand-in prints real vLLM lines every 0.5 s): 25 s in all,
# longer than the old fixed window (serve_ready_retries 20 x serve_ready_delay 1 s, host_vars).
SLOW_START = "engine=3,weights=6,compile=6,kv_cache=2,cuda_graphs=6,api=2"
PHASE_LINES = ["phase container start and imports took", "phase engine init took",
               "phase weights loading took", "phase profile run, torch.compile and kernel JIT took",
               "phase KV cache allocation took",
               "phase CUDA-graph capture took", "phase API server start took"]


def test_a_stalled_start_is_reported_with_its_phase_and_last_lines_and_rolled_back(host):
    res = run_playbook("playbooks/serve.yml", {"spec_method": "mtp", "serve_container_env": {
        "STANDIN_PHASES": "engine=1,weights=1,compile=1,kv_cache=1,cuda_graphs=1,api=1",
        "STANDIN_STALL": "cuda_graphs"}})
    assert res.rc != 0
    out = " ".join(res.output.split())
    assert "the server stalled in phase CUDA-graph capture (cuda_graphs): its log was silent for" in out
    assert "over the phase's budget of 5 s (serve_phase_budgets.cuda_graphs)" in out
    assert re.search(r"Last lines of the phase: \(EngineCore pid=907\) INFO [^|]*Capturing CUDA graphs", out)
    assert "Graph capturing finished" not in out.split("Last lines of the phase:")[1]
    assert ROLLBACK_MSG in out
    # the phases it passed were printed as it went, in order
    pos = [res.output.find(p) for p in PHASE_LINES[:5]]
    assert -1 not in pos and pos == sorted(pos), pos
    _assert_only_active(host, "ngram")
    assert not _container_exists(host, "mtp")


def test_a_slow_start_whose_log_advances_is_not_killed(host):
    res = run_playbook("playbooks/serve.yml", {"spec_method": "ngram",
                                               "serve_container_env": {"STANDIN_PHASES": SLOW_START}})
    assert res.rc == 0, res.output[-3000:]
    pos = [res.output.find(p) for p in PHASE_LINES]
    assert -1 not in pos and pos == sorted(pos), pos
    out = " ".join(res.output.split())  # the callback wraps a long msg over lines
    took = re.search(r"sparkllm-vllm-ngram\.service ready after (\d+) s: start \d+ s, engine (\d+) s, "
                     r"weights (\d+) s, compile (\d+) s, kv_cache \d+ s, cuda_graphs (\d+) s, api \d+ s",
                     out)
    assert took, res.output[-3000:]
    assert int(took.group(1)) > 20  # beyond the old fixed 20 x 1 s window, yet not stopped
    assert all(5 <= int(took.group(i)) <= 9 for i in (3, 4, 5)), took.group(0)  # the 6 s phases
    _assert_only_active(host, "ngram")
    assert _models(host) == ["qwen3.5-122b"]


def test_non_loopback_bind_without_key_is_refused(host):
    before = _inspect(host, "ngram")["Id"]
    res = run_playbook("playbooks/serve.yml", {"spec_method": "ngram", "vllm_host": "0.0.0.0"})
    assert res.rc != 0
    assert "vllm_host='0.0.0.0'" in res.output
    assert "vllm_api_key_file" in res.output and "vllm_allow_unauthenticated_bind" in res.output
    assert _inspect(host, "ngram")["Id"] == before  # nothing was touched


def test_open_bind_opt_out_is_warned_about_in_check_mode(host):
    res = run_playbook("playbooks/serve.yml", {"spec_method": "ngram", "vllm_host": "0.0.0.0",
                                               "vllm_allow_unauthenticated_bind": True},
                       extra_args=["--check", "--diff"])
    assert res.rc == 0, res.output[-3000:]
    assert "WARNING: vllm_host=0.0.0.0 exposes the API" in res.output
    assert TOKEN not in res.output
    assert _inspect(host, "ngram")["State"]["Running"]


UPSTREAM = PORT + 10000  # vllm_proxy_upstream_port's default: vLLM's own port behind the proxy
PROXY_SITE = "/etc/nginx/conf.d/sparkllm-vllm.conf"
PROXY_KEY = "/etc/nginx/sparkllm-vllm-key.conf"
# Every route vLLM 0.19.1 and 0.26.0 can register (tests/contract/test_proxy_routes_contract.py keeps
# it current from their sources); the stand-in answers the non-/v1 ones of a real default server, keyless.
ROUTES = json.loads((Path(__file__).resolve().parents[3] / "tests" / "contract" / "data" / "vllm_routes.json")
                    .read_text())


def _status(host, url: str, method: str = "GET", key: str = "", body: str = "") -> int:
    auth = f" -H 'Authorization: Bearer {key}'" if key else ""
    data = f" -H 'Content-Type: application/json' --data '{body}'" if body else ""
    out = host.run(f"curl -s -o /dev/null -w '%{{http_code}}' --max-time 5 -X {method}{auth}{data} '{url}'")
    return int(out.stdout.strip() or 0)


def _lan_address(host) -> str:
    addrs = [a for a in host.check_output("hostname -I").split() if "." in a and not a.startswith("127.")]
    assert addrs, "the test host has no non-loopback IPv4 address"
    return addrs[0]


def test_non_loopback_bind_with_key_file(host):
    res = run_playbook("playbooks/serve.yml", {"spec_method": "ngram", "vllm_host": "0.0.0.0",
                                               "vllm_api_key_file": KEY_FILE})
    assert res.rc == 0, res.output[-3000:]
    assert API_KEY not in res.output and TOKEN not in res.output
    info = _inspect(host, "ngram")
    # vLLM itself stays on loopback; nginx serves the LAN address (issue 29)
    assert _option(info["Args"], "--host") == "127.0.0.1"
    assert _option(info["Args"], "--port") == str(UPSTREAM)
    assert API_KEY not in json.dumps(info["Args"])
    assert f"VLLM_API_KEY={API_KEY}" in info["Config"]["Env"]
    where = "/etc/systemd/system /etc/sparkllm /etc/ansible /etc/nginx /var/log/nginx"
    hits = host.run(f"grep -rl {API_KEY} {where}")
    assert sorted(hits.stdout.split()) == sorted([SECRETS, PROXY_KEY])
    key_file = host.file(PROXY_KEY)
    assert (key_file.user, key_file.group, key_file.mode) == ("root", "root", 0o600)
    assert host.file(PROXY_SITE).mode == 0o644
    assert host.service("nginx.service").is_running and host.service("nginx.service").is_enabled
    assert _models(host, key=API_KEY) == ["qwen3.5-122b"]
    assert host.run(f"curl -sf --max-time 5 http://127.0.0.1:{PORT}/v1/models").rc != 0
    # the fact records where vLLM answers on the Spark (bench, watchdog, metrics) and the LAN face
    fact = _fact(host)
    assert (fact["scheme"], fact["host"], fact["port"]) == ("http", "127.0.0.1", UPSTREAM)
    assert fact["proxy_url"] == f"http://0.0.0.0:{PORT}"


def test_the_lan_address_answers_v1_with_the_key_only(host):
    lan = f"http://{_lan_address(host)}:{PORT}"
    assert _status(host, f"{lan}/v1/models") == 401
    assert _status(host, f"{lan}/v1/models", key="sk-wrong") == 401
    assert _status(host, f"{lan}/v1/models", key=API_KEY) == 200
    # vLLM lets OPTIONS through without the key; the proxy does not
    assert _status(host, f"{lan}/v1/models", method="OPTIONS") == 401


@pytest.mark.parametrize("release", sorted(ROUTES))
def test_every_non_v1_route_is_404_on_the_lan_address(host, release):
    lan = f"http://{_lan_address(host)}:{PORT}"
    others = [p.replace("{", "").replace("}", "") for p in ROUTES[release] if not p.startswith("/v1/")]
    assert "/invocations" in others and "/metrics" in others
    curl = (f"curl -s -o /dev/null -w '%{{http_code}}\\n' --max-time 5 -H 'Authorization: Bearer {API_KEY}'"
            f" -X $m {lan}$p")
    paths = " ".join(others)
    script = f"for p in {paths}; do for m in GET POST; do printf '%s %s ' $m $p; {curl}; done; done"
    answers = dict(line.rsplit(" ", 1) for line in host.check_output("sh -c %s", script).splitlines())
    assert len(answers) == 2 * len(others)
    assert {k: v for k, v in answers.items() if v != "404"} == {}


def test_invocations_is_refused_on_the_lan_but_open_on_vllm_itself(host):
    body = json.dumps({"model": "qwen3.5-122b", "prompt": "hi", "max_tokens": 1})
    lan = f"http://{_lan_address(host)}:{PORT}"
    assert _status(host, f"{lan}/invocations", method="POST", body=body) == 404
    # behind the proxy the stand-in, like vLLM, generates for anyone: the proxy is what protects it
    assert _status(host, f"http://127.0.0.1:{UPSTREAM}/invocations", method="POST", body=body) == 200
    assert _status(host, f"http://127.0.0.1:{UPSTREAM}/tokenize", method="POST", body=body) == 200
    assert _status(host, f"http://127.0.0.1:{UPSTREAM}/v1/models") == 401


def test_back_on_loopback_the_proxy_is_taken_away(host):
    res = run_playbook("playbooks/serve.yml", {"spec_method": "ngram"})
    assert res.rc == 0, res.output[-3000:]
    assert not host.file(PROXY_SITE).exists and not host.file(PROXY_KEY).exists
    info = _inspect(host, "ngram")
    assert (_option(info["Args"], "--host"), _option(info["Args"], "--port")) == ("127.0.0.1", str(PORT))
    assert _models(host) == ["qwen3.5-122b"]
    assert _status(host, f"http://{_lan_address(host)}:{PORT}/v1/models") == 0  # nothing listens there
    assert _fact(host)["proxy_url"] is None


class _StubHub:
    """The Hub's model-info endpoint, as huggingface_hub calls it, answering one commit per repo."""

    def __init__(self) -> None:
        self.sha = "a" * 40
        self.requests: list[tuple[str, str]] = []
        stub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802
                stub.requests.append((self.path, self.headers.get("Authorization", "")))
                m = re.fullmatch(r"/api/models/(.+)/revision/([^/?]+)(\?.*)?", self.path)
                if not m or m.group(1) != DRAFTER:
                    self.send_response(404)
                    self.send_header("X-Error-Code", "RepoNotFound")
                    self.end_headers()
                    return
                body = json.dumps({"id": DRAFTER, "modelId": DRAFTER, "sha": stub.sha,
                                   "siblings": []}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


DRAFTER = "z-lab/Qwen3.5-122B-A10B-DFlash"


@pytest.fixture(scope="module")
def hub():
    stub = _StubHub()
    yield stub
    stub.httpd.shutdown()


def _spec(host, method: str) -> dict:
    return json.loads(_option(_env_words(host, method, "SPARKLLM_SERVE_ARGS"), "--speculative-config"))


def test_dflash_alone_gets_the_hf_token_file(host, hub):
    """The drafter download needs the token: dflash's container gets the 0600 file, never the value."""
    res = run_playbook("playbooks/serve.yml", {"spec_method": "dflash", "serve_hub_endpoint": hub.url,
                                               "spec_dflash_drafter_revision": "main"})
    assert res.rc == 0, res.output[-3000:]
    assert TOKEN not in res.output
    _assert_only_active(host, "dflash")
    info = _inspect(host, "dflash")
    assert f"{HF_TOKEN_FILE}:/run/secrets/hf_token:ro" in info["HostConfig"]["Binds"]
    assert "HF_TOKEN_PATH=/run/secrets/hf_token" in info["Config"]["Env"]
    assert TOKEN not in json.dumps(info)  # docker inspect shows the path, not the token
    # The file the bind names holds the token (0600). Its content inside the container is not checked
    # here: the test host drives the CI machine's engine, which resolves bind sources on that machine.
    token_file = host.file(HF_TOKEN_FILE)
    assert token_file.is_file and token_file.mode == 0o600 and token_file.content_string.strip() == TOKEN


def test_dflash_drafter_is_served_at_the_commit_locked_at_first_deploy(host, hub):
    """issue 15: the drafter's branch was resolved once (above) to a commit, recorded, and passed to vLLM;
    a moved branch changes nothing until an update is asked for."""
    first = "a" * 40
    assert _spec(host, "dflash")["revision"] == first
    assert _fact(host)["drafter_revisions"] == {f"{DRAFTER}@main": first}
    assert hub.requests and hub.requests[0][0].startswith(f"/api/models/{DRAFTER}/revision/main")
    assert hub.requests[0][1] == f"Bearer {TOKEN}"  # the token reached the Hub, not the output
    hub.sha, seen = "b" * 40, len(hub.requests)
    res = run_playbook("playbooks/serve.yml", {"spec_method": "dflash", "serve_hub_endpoint": hub.url,
                                               "spec_dflash_drafter_revision": "main",
                                               "spark_stage_force": True})
    assert res.rc == 0, res.output[-3000:]
    assert len(hub.requests) == seen, "a locked drafter asked the Hub again"
    assert _spec(host, "dflash")["revision"] == first
    before = _inspect(host, "dflash")["Id"]
    res = run_playbook("playbooks/serve.yml", {"spec_method": "dflash", "serve_hub_endpoint": hub.url,
                                               "spec_dflash_drafter_revision": "main",
                                               "serve_drafter_update": True})
    assert res.rc == 0, res.output[-3000:]
    assert _spec(host, "dflash")["revision"] == "b" * 40
    assert _fact(host)["drafter_revisions"] == {f"{DRAFTER}@main": "b" * 40}
    assert _inspect(host, "dflash")["Id"] != before, "the new drafter commit did not restart the server"
    assert TOKEN not in res.output


def test_dflash_drafter_defaults_to_the_catalogues_commit_without_asking_the_hub(host, hub):
    """issue 44: left at "", the knob serves the commit methods.yml pins (the April weights)."""
    pinned = CATALOGUE["dflash"]["speculative_config"]["revision"]
    seen = len(hub.requests)
    res = run_playbook("playbooks/serve.yml", {"spec_method": "dflash", "serve_hub_endpoint": hub.url})
    assert res.rc == 0, res.output[-3000:]
    assert len(hub.requests) == seen, "a pinned drafter asked the Hub"
    assert _spec(host, "dflash")["revision"] == pinned
    assert _fact(host)["drafter_revisions"][f"{DRAFTER}@{pinned}"] == pinned


def test_an_unknown_drafter_repo_fails_naming_the_revision_knob(host, hub):
    res = run_playbook("playbooks/serve.yml", {"spec_method": "dflash", "serve_hub_endpoint": hub.url,
                                               "spec_dflash_drafter": "z-lab/no-such-drafter"})
    assert res.rc != 0
    out = " ".join(res.output.split())
    assert "could not resolve the Hub revision z-lab/no-such-drafter@main to a commit" in out
    assert "spec_dflash_drafter_revision to a commit SHA" in out
    assert TOKEN not in res.output
    _assert_only_active(host, "dflash")  # nothing was touched: the running drafter keeps serving
