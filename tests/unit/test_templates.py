"""The user-customisable templates in templates/: each role takes its template through a variable that
defaults there, and each template renders (with Ansible's filters, the role's defaults and the values
its tasks compute) to what the Spark needs: the vLLM unit runs the image with the exact argv, the
Ray unit runs `ray start` with its arguments, the netplan file is valid YAML, and so on."""

from __future__ import annotations

import re
import shlex
import stat
import subprocess
from pathlib import Path
from typing import Any

import jinja2
import pytest
import yaml
from ansible.plugins.filter.core import FilterModule as CoreFilters
from ansible.plugins.filter.mathstuff import FilterModule as MathFilters
from ansible.plugins.test.core import TestModule as CoreTests
from spark_methods import FilterModule as SparkMethodFilters

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = ROOT / "templates"
ROLES = ROOT / "roles"
MANAGED = "Ansible managed"

# role -> its template variables -> the file under templates/ each defaults to
TEMPLATE_VARS = {
    "serve": {
        "serve_unit_template": "sparkllm-vllm.service.j2",
        "serve_env_template": "sparkllm-vllm.env.j2",
        "serve_proxy_site_template": "sparkllm-proxy.nginx.conf.j2",
    },
    "ray_cluster": {"ray_cluster_unit_template": "sparkllm-ray.service.j2"},
    "spark_link": {
        "spark_link_netplan_template": "netplan-link.yaml.j2",
        "spark_link_env_template": "cluster.env.j2",
        "spark_link_firewall_template": "sparkllm-link-firewall.nft.j2",
    },
    "vllm_build": {"vllm_build_dockerfile_template": "Dockerfile.j2"},
    "spark_monitoring": {"spark_monitoring_prometheus_template": "prometheus.yml.j2",
                         "spark_monitoring_alert_rules_template": "prometheus-alerts.yml.j2"},
}


def env() -> jinja2.Environment:
    # Ansible's template settings: trim_blocks on, the file's trailing newline kept.
    e = jinja2.Environment(trim_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined)
    e.filters.update(CoreFilters().filters())
    e.filters.update(MathFilters().filters())
    e.filters.update(SparkMethodFilters().filters())
    e.tests.update(CoreTests().tests())
    return e


def defaults(role: str) -> dict[str, Any]:
    """The role's defaults over the shared facts of group_vars/all/shared.yml (as Ansible gives both to the
    role) that are plain values (templated ones are given by each test)."""
    doc = yaml.safe_load((ROOT / "group_vars" / "all" / "shared.yml").read_text())
    doc.update(yaml.safe_load((ROLES / role / "defaults" / "main.yml").read_text()))
    return {k: v for k, v in doc.items() if not (isinstance(v, str) and "{{" in v)}


def render(name: str, **ctx: Any) -> str:
    return env().from_string((TEMPLATES / name).read_text()).render(ansible_managed=MANAGED, **ctx)


def catalogue() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "group_vars" / "all" / "methods.yml").read_text())["spark_method_catalogue"]


# ------------------------------------------------------------------ the variables and the files


@pytest.mark.parametrize(
    ("role", "var", "name"), [(r, v, n) for r, vs in TEMPLATE_VARS.items() for v, n in vs.items()]
)
def test_role_template_variable_defaults_to_an_existing_file(role: str, var: str, name: str) -> None:
    raw = yaml.safe_load((ROLES / role / "defaults" / "main.yml").read_text())[var]
    assert raw == "{{ role_path }}/../../templates/" + name, (
        f"roles/{role}/defaults/main.yml: {var} = {raw!r}"
    )
    path = Path(raw.replace("{{ role_path }}", str(ROLES / role))).resolve()
    assert path == TEMPLATES / name and path.is_file(), path
    spec = yaml.safe_load((ROLES / role / "meta" / "argument_specs.yml").read_text())["argument_specs"][
        "main"
    ]
    assert var in spec["options"], f"roles/{role}/meta/argument_specs.yml does not declare {var}"
    tasks = "".join(p.read_text() for p in (ROLES / role / "tasks").glob("*.yml"))
    assert f"{{{{ {var} }}}}" in tasks, f"no task of roles/{role} renders {var}"
    assert name not in tasks, f"a task of roles/{role} names {name} directly instead of {var}"


def test_every_template_belongs_to_a_role_variable() -> None:
    named = {n for vs in TEMPLATE_VARS.values() for n in vs.values()}
    present = {p.name for p in TEMPLATES.glob("*.j2")}
    assert present == named, (
        f"templates/ holds {sorted(present - named)} that no role takes; missing {sorted(named - present)}"
    )
    for role in TEMPLATE_VARS:  # a copy left behind in the role would be the one a relative src finds
        leftovers = {p.name for p in (ROLES / role / "templates").glob("*.j2")} & named
        assert not leftovers, f"roles/{role}/templates still holds {leftovers}"


# ------------------------------------------------------------------ serve: unit + argument file


ARGV = [
    "/model",
    "--served-model-name",
    "qwen3.5-122b",
    "--port",
    "8000",
    "--speculative-config",
    '{"method": "mtp", "num_speculative_tokens": 2}',
    "--chat-template-kwargs",
    'it\'s $HOME `and` "quotes" \\ back',
]
IMAGE = "sparkllm/vllm:v0.19.1-0123456789ab"
DOCKER_OPTS = ["--gpus", "all", "--volume=/srv/model:/model:ro", "--env=VLLM_LOGGING_LEVEL=INFO"]


MODEL_SHA = "5e" * 32


def serve_ctx(tmp_path: Path, method: str = "mtp", cluster_env: str = "") -> dict[str, Any]:
    ctx = defaults("serve")
    cat = catalogue()
    home = ctx["serve_container_home"]
    ctx.update(
        spark_method_catalogue=cat,
        spec_method=method,
        serve_unit_method=method,
        serve_cluster_env_file=cluster_env,
        serve_ray_env_exclude_file="/etc/sparkllm/vllm-ray-env-exclude.json",
        serve_ray_auth_token_file="/var/lib/sparkllm/ray/auth-token",
        _serve_ray_backend=bool(cluster_env),
        spark_cluster_rdma=True,
        serve_config_dir=str(tmp_path),
        serve_docker_bin=str(tmp_path / "docker"),
        _serve_methods=list(cat),
        _serve_unit=f"{ctx['serve_unit_prefix']}-{method}.service",
        _serve_secrets_file=str(tmp_path / "secrets.env"),
        _serve_hf_token_file=str(tmp_path / "hf-token"),
        _serve_cache_mounts={"vllm": f"{home}/.cache/vllm", "triton": f"{home}/.triton"},
        _serve_image=IMAGE,
        _serve_docker_opts=DOCKER_OPTS,
        _serve_argv=ARGV,
        _serve_model_manifest_sha256=MODEL_SHA,
    )
    return ctx


def unit_value(unit: str, key: str) -> list[str]:
    return [line.split("=", 1)[1] for line in unit.splitlines() if line.startswith(key + "=")]


def test_vllm_unit_runs_the_image_with_the_exact_argv(tmp_path: Path) -> None:
    """Render the unit and its argument file, then run the unit's ExecStart as systemd would (after
    sourcing the EnvironmentFile with /bin/sh, as the role's validate step does) against a fake docker
    that prints its argv: the container gets the image, `serve` and every argument unchanged."""
    ctx = serve_ctx(tmp_path)
    unit = render("sparkllm-vllm.service.j2", **ctx)
    envfile = tmp_path / "mtp.env"
    envfile.write_text(render("sparkllm-vllm.env.j2", **ctx))
    assert unit_value(unit, "EnvironmentFile") == [str(envfile)]
    assert unit.startswith(f"# {MANAGED}\n")
    others = {f"sparkllm-vllm-{m}.service" for m in catalogue() if m != "mtp"}
    assert set(unit_value(unit, "Conflicts")[0].split()) == others
    assert unit_value(unit, "ExecStop") == [
        f"{tmp_path}/docker stop -t {ctx['serve_stop_timeout']} sparkllm-vllm-mtp"
    ]
    # no container outlives its unit: a stop between docker run's create and start leaves it Created
    assert unit_value(unit, "ExecStopPost") == [f"-{tmp_path}/docker rm -f sparkllm-vllm-mtp"]

    docker = tmp_path / "docker"
    docker.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done\n')
    docker.chmod(docker.stat().st_mode | stat.S_IXUSR)
    (exec_start,) = unit_value(unit, "ExecStart")
    # systemd turns $$ into $ and splits the line like a shell: /bin/sh -c '<script>'
    sh, dash_c, script = shlex.split(exec_start.replace("$$", "$"))
    assert (sh, dash_c) == ("/bin/sh", "-c")
    out = subprocess.run(
        ["/bin/sh", "-c", 'set -a && . "$1" && exec /bin/sh -c "$2"', "sh", str(envfile), script],
        capture_output=True,
        check=True,
    ).stdout
    got = out.decode().split("\0")[:-1]
    assert got[:4] == ["run", "--rm", "--init", "--pull"]
    assert got[got.index("--entrypoint") : got.index("--entrypoint") + 2] == ["--entrypoint", "vllm"]
    tail = got[got.index("--entrypoint") + 2 :]
    assert tail == [*DOCKER_OPTS, IMAGE, "serve", *ARGV]
    assert got[got.index("--env-file") + 1] == f"{tmp_path}/secrets.env"
    assert f"{ctx['serve_cache_dir']}/vllm:/root/.cache/vllm" in got


def test_vllm_unit_reads_the_cluster_env_when_there_is_one(tmp_path: Path) -> None:
    unit = render("sparkllm-vllm.service.j2", **serve_ctx(tmp_path, "dflash", "/etc/sparkllm/cluster.env"))
    assert unit_value(unit, "EnvironmentFile") == [f"{tmp_path}/dflash.env", "/etc/sparkllm/cluster.env"]
    assert "Wants=sparkllm-ray-head.service" in unit
    assert "--env-file /etc/sparkllm/cluster.env" in unit_value(unit, "ExecStart")[0]
    single = render("sparkllm-vllm.service.j2", **serve_ctx(tmp_path, "dflash"))
    assert "cluster.env" not in single and "ray" not in single.lower()


def test_head_server_keeps_vllm_from_copying_the_heads_link_settings(tmp_path: Path) -> None:
    """vLLM reads VLLM_CONFIG_ROOT/ray_non_carry_over_env_vars.json (default ~/.config/vllm) in the server's
    process; the head's container gets the cluster stage's list there, read-only, only on the Ray backend."""
    ctx = serve_ctx(tmp_path, "mtp", "/etc/sparkllm/cluster.env")
    got = container_args(tmp_path, ctx)
    mounts = [got[i + 1] for i, a in enumerate(got) if a == "--volume"]
    assert ("/etc/sparkllm/vllm-ray-env-exclude.json:/root/.config/vllm/ray_non_carry_over_env_vars.json:ro"
            in mounts)
    # and vLLM's Ray driver (ray.init in the server) authenticates with the cluster's token file
    assert "/var/lib/sparkllm/ray/auth-token:/run/secrets/ray_auth_token:ro" in mounts
    assert _follows(got, ["--env", "RAY_AUTH_MODE=token"])
    assert _follows(got, ["--env", "RAY_AUTH_TOKEN_PATH=/run/secrets/ray_auth_token"])
    ctx.update(_serve_ray_backend=False)  # multi-node mp: no Ray propagation, no file written
    assert not any("ray_non_carry_over" in m for m in
                   [a for a in container_args(tmp_path, ctx) if ":" in a])


def container_args(tmp_path: Path, ctx: dict[str, Any]) -> list[str]:
    """The docker argv the unit runs (fake docker, env file sourced by /bin/sh as systemd's unit does)."""
    unit = render("sparkllm-vllm.service.j2", **ctx)
    envfile = tmp_path / f"{ctx['spec_method']}.env"
    envfile.write_text(render("sparkllm-vllm.env.j2", **ctx))
    docker = tmp_path / "docker"
    docker.write_text('#!/bin/sh\nfor a in "$@"; do printf \'%s\\0\' "$a"; done\n')
    docker.chmod(docker.stat().st_mode | stat.S_IXUSR)
    (exec_start,) = unit_value(unit, "ExecStart")
    _, _, script = shlex.split(exec_start.replace("$$", "$"))
    out = subprocess.run(
        ["/bin/sh", "-c", 'set -a && . "$1" && exec /bin/sh -c "$2"', "sh", str(envfile), script],
        capture_output=True, check=True,
    ).stdout
    return out.decode().split("\0")[:-1]


@pytest.mark.parametrize("value", [True, "true", False, None])
def test_vllm_lm_head_int8_reaches_the_container_only_when_true(tmp_path: Path, value: Any) -> None:
    """vllm_lm_head_int8 -> SPARKLLM_LM_HEAD_INT8=1 in the container's environment (patch 0002 reads
    it); false or unset renders nothing, so the env file (and the serve hash) stay as they were."""
    ctx = serve_ctx(tmp_path)
    if value is not None:
        ctx["vllm_lm_head_int8"] = value
    got = container_args(tmp_path, ctx)
    tail = got[got.index("--entrypoint") + 2 :]
    if value in (True, "true"):
        assert tail == [*DOCKER_OPTS, "--env=SPARKLLM_LM_HEAD_INT8=1", IMAGE, "serve", *ARGV]
    else:
        assert tail == [*DOCKER_OPTS, IMAGE, "serve", *ARGV]
        assert "SPARKLLM_LM_HEAD_INT8" not in (tmp_path / "mtp.env").read_text().replace(
            "vllm_lm_head_int8", "")


@pytest.mark.parametrize("method", sorted(catalogue()))
def test_method_server_env_reaches_only_that_methods_container(tmp_path: Path, method: str) -> None:
    """dflash (vLLM 0.26.0, mixed sliding-window drafter) runs with VLLM_USE_V2_MODEL_RUNNER=1 in the
    container's environment, from its catalogue entry's server_env; no other method gets it."""
    ctx = serve_ctx(tmp_path, method)
    got = container_args(tmp_path, ctx)  # also writes <method>.env
    tail = got[got.index("--entrypoint") + 2 :]
    if method == "dflash":
        assert tail == [*DOCKER_OPTS, "--env=VLLM_USE_V2_MODEL_RUNNER=1", IMAGE, "serve", *ARGV]
    else:
        assert tail == [*DOCKER_OPTS, IMAGE, "serve", *ARGV]
        assert "VLLM_USE_V2_MODEL_RUNNER" not in (tmp_path / f"{method}.env").read_text()


def _role_expr(role: str, name: str, **ctx: Any) -> Any:
    """A role's vars/main.yml expression rendered as Ansible does (native types, Ansible's filters)."""
    import jinja2.nativetypes
    e = jinja2.nativetypes.NativeEnvironment(undefined=jinja2.StrictUndefined)
    e.filters.update(CoreFilters().filters())
    e.filters.update(SparkMethodFilters().filters())
    expr = yaml.safe_load((ROLES / role / "vars" / "main.yml").read_text())[name]
    return e.from_string(expr.strip()).render(**ctx)


def ray_unit_env(unit: str, runtime: str) -> set[str]:
    """The NAME=VALUE pairs a rendered Ray unit gives its processes: the container's --env arguments, or
    the unit's Environment= lines on the host."""
    if runtime == "container":
        argv = shlex.split(unit_value(unit, "ExecStart")[0])
        return {argv[i + 1] for i, a in enumerate(argv) if a == "--env"}
    return set(unit_value(unit, "Environment"))


@pytest.mark.parametrize("runtime", ["container", "venv"])
@pytest.mark.parametrize("conf", ["shipped", ""])
def test_the_pytorch_allocator_setting_reaches_the_server_and_the_ray_processes(tmp_path: Path, conf: str,
                                                                                 runtime: str) -> None:
    """Issue 45: spark_pytorch_cuda_alloc_conf (group_vars/all/memory.yml, expandable_segments:False) is in
    the server container's environment, as the rendered unit runs it, and in every Ray process's (the model
    runs there with the Ray backend, and vLLM copies no PYTORCH_ variable to it); "" sets nothing (PyTorch's
    default)."""
    memory = yaml.safe_load((ROOT / "group_vars/all/memory.yml").read_text())
    shipped = memory["spark_pytorch_cuda_alloc_conf"]
    assert shipped == "expandable_segments:False"
    value = shipped if conf == "shipped" else ""
    knobs = {"spark_pytorch_cuda_alloc_conf": value, "spark_cuda_cache_max_bytes": 4294967296,
             "vllm_lm_head_int8": False, "serve_container_env": {"VLLM_LOGGING_LEVEL": "INFO"}}
    opts = _role_expr("serve", "_serve_docker_opts", serve_container_gpus="all", spark_model_dir="/srv/model",
                      serve_model_path="/model", _serve_mount_hf_token=False,
                      serve_flashinfer_jit_verbose=False, serve_container_extra_args=[], **knobs)
    ctx = serve_ctx(tmp_path, "mtp", "/etc/sparkllm/cluster.env")
    ctx["_serve_docker_opts"] = opts
    got = container_args(tmp_path, ctx)
    server = [a for a in got[got.index("--entrypoint") + 2:got.index(IMAGE)] if a.startswith("--env=")]
    want = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False"
    assert server.count(f"--env={want}") == (1 if value else 0)
    assert value or not any("PYTORCH_CUDA_ALLOC_CONF" in a for a in got)

    ray = ray_ctx(runtime, head=False)
    ray["_ray_cluster_server_env"] = _role_expr("ray_cluster", "_ray_cluster_server_env", spec_method="mtp",
                                                spark_method_catalogue=catalogue(), **knobs)
    unit = render("sparkllm-ray.service.j2", **ray)
    ray_env = ray_unit_env(unit, runtime)
    assert (want in ray_env) is bool(value)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in unit or value


def test_vllm_env_file_names_the_method_and_no_secret(tmp_path: Path) -> None:
    text = render("sparkllm-vllm.env.j2", **serve_ctx(tmp_path, "ngram"))
    assert "SPARKLLM_SERVE_METHOD=ngram\n" in text
    # the model's identity is in the unit's environment: a new model changes the file, so the server restarts
    assert f"SPARKLLM_MODEL_MANIFEST_SHA256={MODEL_SHA}\n" in text
    assert f'SPARKLLM_SERVE_IMAGE="{IMAGE}"\n' in text
    assert catalogue()["ngram"]["description"] in text
    assert "HF_TOKEN" not in text and "VLLM_API_KEY" not in text


# ------------------------------------------------------------------ Ray unit


def ray_ctx(runtime: str, head: bool) -> dict[str, Any]:
    ctx = defaults("ray_cluster")
    role = "head" if head else "worker"
    args = ["start", "--block", "--node-ip-address", "${VLLM_HOST_IP}"] + (
        ["--head", "--port", "6379"] if head else ["--address", "192.168.100.1:6379"]
    )
    ctx.update(
        ray_cluster_runtime=runtime,
        ray_cluster_env_file="/etc/sparkllm/cluster.env",
        ray_cluster_temp_dir="/var/lib/sparkllm/ray/tmp",
        ray_cluster_container_volumes=["/srv/model:/model:ro"],
        _ray_cluster_role=role,
        _ray_cluster_is_head=head,
        _ray_cluster_nodes=["spark-a", "spark-b"],
        _ray_cluster_head="spark-a",
        _ray_cluster_address="192.168.100.1:6379",
        _ray_cluster_env_checksum="abc123",
        _ray_cluster_container=f"sparkllm-ray-{role}",
        _ray_cluster_image=IMAGE,
        _ray_cluster_start_args=args,
        _ray_cluster_server_env={},
        _ray_cluster_rdma_args=["--device", "/dev/infiniband", "--ulimit", "memlock=-1:-1"],
        _ray_cluster_hf_token=False,
        _ray_cluster_hf_token_file="/var/lib/sparkllm/ray/hf-token",
        _ray_cluster_hf_token_path=("/run/secrets/hf_token" if runtime == "container"
                                    else "/var/lib/sparkllm/ray/hf-token"),
        spark_ray_auth_token_file="/var/lib/sparkllm/ray/auth-token",
        _ray_cluster_auth_token_path=("/run/secrets/ray_auth_token" if runtime == "container"
                                      else "/var/lib/sparkllm/ray/auth-token"),
    )
    return ctx


@pytest.mark.parametrize("runtime", ["container", "venv"])
@pytest.mark.parametrize("head", [True, False])
def test_every_ray_unit_runs_ray_with_the_clusters_token_file(runtime: str, head: bool) -> None:
    """Ray 2.60 checks a token when RAY_AUTH_MODE=token, read from RAY_AUTH_TOKEN_PATH: every node's Ray
    names the root-only file (mounted read-only in the container); the token itself is in no unit."""
    ctx = ray_ctx(runtime, head)
    unit = render("sparkllm-ray.service.j2", **ctx)
    path = ctx["_ray_cluster_auth_token_path"]
    argv = shlex.split(unit_value(unit, "ExecStart")[0])
    if runtime == "container":
        i = argv.index(IMAGE)
        assert _follows(argv[:i], ["--volume", f"/var/lib/sparkllm/ray/auth-token:{path}:ro"])
        assert _follows(argv[:i], ["--env", "RAY_AUTH_MODE=token"])
        assert _follows(argv[:i], ["--env", f"RAY_AUTH_TOKEN_PATH={path}"])
    else:
        assert {"RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN_PATH={path}"} <= set(unit_value(unit, "Environment"))


def test_ray_unit_container_runs_ray_start_in_the_image() -> None:
    ctx = ray_ctx("container", head=True)
    unit = render("sparkllm-ray.service.j2", **ctx)
    (exec_start,) = unit_value(unit, "ExecStart")
    argv = shlex.split(exec_start)
    assert argv[0] == ctx["ray_cluster_docker_bin"] and argv[1] == "run"
    i = argv.index(IMAGE)
    assert argv[i - 2 : i] == ["--entrypoint", "ray"]
    assert argv[i + 1 :] == ctx["_ray_cluster_start_args"]
    assert "--volume" in argv and "/srv/model:/model:ro" in argv
    assert unit_value(unit, "EnvironmentFile") == ["/etc/sparkllm/cluster.env"]
    assert "sha256 abc123" in unit  # a changed environment changes the unit, hence restarts Ray
    name = ctx["_ray_cluster_container"]
    assert unit_value(unit, "ExecStopPost") == [f"-{ctx['ray_cluster_docker_bin']} rm -f {name}"]
    assert unit_value(unit, "ExecStartPre") == [f"-{ctx['ray_cluster_docker_bin']} rm -f {name}"]


@pytest.mark.parametrize("runtime", ["container", "venv"])
def test_ray_units_read_the_hf_token_from_a_file_only_when_a_drafter_downloads(runtime: str) -> None:
    """A Hub drafter (DFlash's) is downloaded by every node's rank: the Ray unit names the root-only token
    file (HF_TOKEN_PATH, the server container's path inside the Ray container); the token is in no unit."""
    ctx = ray_ctx(runtime, head=False)
    assert "HF_TOKEN" not in render("sparkllm-ray.service.j2", **ctx)
    ctx["_ray_cluster_hf_token"] = True
    unit = render("sparkllm-ray.service.j2", **ctx)
    path = ctx["_ray_cluster_hf_token_path"]
    assert f"HF_TOKEN_PATH={path}" in unit_value(unit, "Environment")
    argv = shlex.split(unit_value(unit, "ExecStart")[0])
    if runtime == "container":
        assert _follows(argv, ["--volume", f"/var/lib/sparkllm/ray/hf-token:{path}:ro"])
        assert _follows(argv, ["--env", f"HF_TOKEN_PATH={path}"]) and argv.index("--env") < argv.index(IMAGE)
    else:
        assert path == "/var/lib/sparkllm/ray/hf-token"


def test_ray_unit_venv_worker() -> None:
    ctx = ray_ctx("venv", head=False)
    unit = render("sparkllm-ray.service.j2", **ctx)
    (exec_start,) = unit_value(unit, "ExecStart")
    assert shlex.split(exec_start) == [
        f"{ctx['ray_cluster_venv_dir']}/bin/ray",
        *ctx["_ray_cluster_start_args"],
        "--temp-dir",
        ctx["ray_cluster_temp_dir"],
    ]
    assert "docker" not in unit and "keep trying to join" in unit


RDMA_ARGS = ["--device", "/dev/infiniband", "--ulimit", "memlock=-1:-1"]


def _follows(argv: list[str], words: list[str]) -> bool:
    return any(argv[i:i + len(words)] == words for i in range(len(argv)))


def test_cluster_containers_get_the_rdma_devices_and_unlimited_memlock(tmp_path: Path) -> None:
    """Two Sparks: the server and the Ray containers get /dev/infiniband and memlock=-1:-1 (NCCL's RoCE
    transport registers pinned memory); a single Spark's server and spark_cluster_rdma=false get neither."""
    ctx = serve_ctx(tmp_path, "mtp", "/etc/sparkllm/cluster.env")
    got = container_args(tmp_path, ctx)
    assert _follows(got, RDMA_ARGS), got
    assert not _follows(container_args(tmp_path, serve_ctx(tmp_path)), ["--device", "/dev/infiniband"])
    ctx["spark_cluster_rdma"] = False
    assert "/dev/infiniband" not in container_args(tmp_path, ctx)
    ray = ray_ctx("container", head=False)
    (exec_start,) = unit_value(render("sparkllm-ray.service.j2", **ray), "ExecStart")
    assert _follows(shlex.split(exec_start), RDMA_ARGS)
    ray["_ray_cluster_rdma_args"] = []
    assert "/dev/infiniband" not in render("sparkllm-ray.service.j2", **ray)


@pytest.mark.parametrize("method", sorted(catalogue()))
@pytest.mark.parametrize("runtime", ["container", "venv"])
def test_every_server_env_setting_reaches_the_ray_processes(tmp_path: Path, method: str,
                                                             runtime: str) -> None:
    """With the Ray backend the model runs in Ray's workers, and vLLM copies only its own prefixes to them
    (vllm/ray/ray_env.py): the Ray units carry exactly the server container's own settings (the method's
    server_env and SPARKLLM_LM_HEAD_INT8), from the same filter."""
    from spark_methods import spark_server_env
    ctx = serve_ctx(tmp_path, method, "/etc/sparkllm/cluster.env")
    ctx["vllm_lm_head_int8"] = True
    got = container_args(tmp_path, ctx)
    server = {a.split("=", 1)[1] for a in got[got.index("--entrypoint") + 2:] if a.startswith("--env=")}
    assert "SPARKLLM_LM_HEAD_INT8=1" in server
    ray = ray_ctx(runtime, head=False)
    # DOCKER_OPTS carries the owner's serve_container_env {VLLM_LOGGING_LEVEL: INFO}
    ray["_ray_cluster_server_env"] = spark_server_env(method, catalogue(), True,
                                                      {"VLLM_LOGGING_LEVEL": "INFO"})
    unit = render("sparkllm-ray.service.j2", **ray)
    ray_env = ray_unit_env(unit, runtime)
    ray_own = {"RAY_AUTH_MODE=token", f"RAY_AUTH_TOKEN_PATH={ray['_ray_cluster_auth_token_path']}"}
    assert ray_env - ray_own == server - {"HF_TOKEN_PATH=/run/secrets/hf_token"}


# ------------------------------------------------------------------ link: netplan + cluster env


def test_netplan_file_is_the_link_configuration() -> None:
    ctx = defaults("spark_link")
    ctx["spark_link_addresses"] = ["192.168.100.1/24", "192.168.101.1/24"]
    doc = yaml.safe_load(render("netplan-link.yaml.j2", **ctx))
    eths = doc["network"]["ethernets"]
    assert list(eths) == ctx["spark_link_interfaces"]
    first = eths[ctx["spark_link_interfaces"][0]]
    assert first == {
        "dhcp4": False,
        "dhcp6": False,
        "link-local": [],
        "mtu": 9000,
        "addresses": ["192.168.100.1/24"],
    }
    assert eths[ctx["spark_link_interfaces"][1]]["addresses"] == ["192.168.101.1/24"]


def test_cluster_env_lists_every_variable_sorted() -> None:
    env_ = {"NCCL_SOCKET_IFNAME": "enp1s0f0np0", "VLLM_HOST_IP": "192.168.100.1", "NCCL_IB_HCA": "rocep1s0f0"}
    text = render(
        "cluster.env.j2", inventory_hostname="spark-a", _spark_link_iface="enp1s0f0np0", _spark_link_env=env_
    )
    lines = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert lines == [f"{k}={v}" for k, v in sorted(env_.items())]


def _link_env(**settings: Any) -> dict[str, str]:
    """roles/spark_link's _spark_link_env (vars/main.yml) evaluated for one node's settings."""
    expr = yaml.safe_load((ROLES / "spark_link" / "vars" / "main.yml").read_text())["_spark_link_env"]
    ctx = {**defaults("spark_link"), "_spark_link_iface": "enp1s0f0np0", "_spark_link_hcas": ["rocep1s0f1"],
           "spark_cluster_rdma": True, "spark_link_host_ip": "192.168.100.10", "spark_vllm_dist_port": 29600,
           **settings}
    return env().compile_expression(expr.strip().removeprefix("{{").removesuffix("}}"))(**ctx)


@pytest.mark.parametrize("rdma", [True, False])
def test_cluster_env_carries_the_nodes_gid_index_only_when_set(rdma: bool) -> None:
    """spark_link_nccl_ib_gid_index: "" leaves NCCL_IB_GID_INDEX out (NCCL's own choice, its default -1:
    NVIDIA/nccl v2.31.2-1 src/transport/net_ib/connect.cc, NCCL_PARAM(IbGidIndex, "IB_GID_INDEX", -1));
    a node's value, 0 included, is written as it is."""
    assert "NCCL_IB_GID_INDEX" not in _link_env(spark_cluster_rdma=rdma)
    for value, text in ((5, "5"), ("3", "3"), (0, "0")):
        got = _link_env(spark_cluster_rdma=rdma, spark_link_nccl_ib_gid_index=value)
        assert got["NCCL_IB_GID_INDEX"] == text
        lines = render("cluster.env.j2", inventory_hostname="spark-a", _spark_link_iface="enp1s0f0np0",
                       _spark_link_env=got).splitlines()
        assert f"NCCL_IB_GID_INDEX={text}" in lines
    # the owner's spark_link_env_extra still has the last word
    assert _link_env(spark_link_nccl_ib_gid_index=5,
                     spark_link_env_extra={"NCCL_IB_GID_INDEX": "7"})["NCCL_IB_GID_INDEX"] == "7"


# ------------------------------------------------------------------ Dockerfile


def dockerfile_ctx(extra_prs: list[dict]) -> dict[str, Any]:
    ctx = defaults("vllm_build")
    ctx["_vllm_build_buildkit"] = False
    methods = yaml.safe_load((ROOT / "group_vars" / "all" / "methods.yml").read_text())
    ctx["_vllm_build_cfg"] = {
        "ref": "v0.20.0",
        "version": "0.20.0",
        "extra_prs": extra_prs,
        "base_image": ctx["vllm_build_base_image"],
        "build_requirements": ["requirements/build.txt"],  # that release's own path (spark_vllm_variants)
        "toolchain": methods["spark_vllm_variants"]["v0_26_dflash"]["toolchain"],
    }
    from tests.unit.test_dockerfile import lock_files  # (it imports this module)

    ctx["_vllm_build_lock"] = lock_files("v0_26_dflash", from_source=True)  # what build.yml reads
    return ctx


def test_dockerfile_stages_pins_and_prs() -> None:
    sha = "0123456789abcdef0123456789abcdef01234567"
    ctx = dockerfile_ctx([{"pr": 40898, "sha": sha}])
    text = render("Dockerfile.j2", **ctx)
    assert text.startswith("# vLLM v0.20.0 + PR 40898 for the DGX Spark")  # the Jinja comment renders nothing
    assert re.findall(r"(?m)^FROM (\S+) AS (\w+)$", text) == [
        (ctx["vllm_build_base_image"], "base"),
        ("base", "flashinfer_aot"),  # its own stage: runtime rebuilds reuse its kernels
        ("base", "build"),
        ("base", "runtime"),
        ("runtime", "patched"),
    ]
    assert "TORCH_CUDA_ARCH_LIST=12.1a" in text and "git checkout --detach v0.20.0" in text
    assert f"for spec in 40898={sha} ; do" in text and "refs/pull" not in text
    base = text.split("FROM base AS build")[0]
    assert "--require-hashes" in base  # base installs the lock (test_image_lock.py holds its content)
    for _name, version in ctx["_vllm_build_cfg"]["toolchain"].items():
        assert f"=={version}" not in text  # pins live in the lock files, not the Dockerfile
    assert "for spec in" not in render("Dockerfile.j2", **dockerfile_ctx([]))


def test_dockerfile_blocks_can_be_overridden() -> None:
    """A user's Dockerfile can extend the project's and replace one stage."""
    loader = jinja2.DictLoader(
        {
            "Dockerfile.j2": (TEMPLATES / "Dockerfile.j2").read_text(),
            "mine.j2": (
                '{% extends "Dockerfile.j2" %}{% block runtime %}'
                'FROM base AS runtime\nRUN echo mine\n{% endblock %}'
            ),
        }
    )
    e = env()
    e.loader = loader
    text = e.get_template("mine.j2").render(**dockerfile_ctx([]))
    assert "RUN echo mine" in text and "vllm-*.whl" not in text and "FROM base AS build" in text


def test_molecule_serve_renders_the_one_unit_template() -> None:
    """molecule/serve overrides serve_unit_template with a user's copy that its prepare.yml makes from
    templates/sparkllm-vllm.service.j2 (plus two marker lines): no second unit template is kept in the
    tree, so the scenario always tests the real unit."""
    scenario = ROOT / "molecule" / "serve"
    copies = [p for p in scenario.rglob("*.j2")]
    assert not copies, f"{copies}: molecule/serve keeps a copy of a template; derive it in prepare.yml"
    host_vars = yaml.safe_load((scenario / "host_vars" / "spark-serve.yml").read_text())
    target = "/user-templates/sparkllm-vllm.service.j2"
    assert host_vars["serve_unit_template"].endswith(target)
    assert "MOLECULE_EPHEMERAL_DIRECTORY" in host_vars["serve_unit_template"]
    plays = yaml.safe_load((scenario / "prepare.yml").read_text())
    tasks = [t for p in plays if p["hosts"] == "localhost" for t in p["tasks"]]
    copy = next(t["ansible.builtin.copy"] for t in tasks if "ansible.builtin.copy" in t)
    assert copy["src"].endswith("/templates/sparkllm-vllm.service.j2")
    assert copy["dest"] == "{{ _user_templates }}/sparkllm-vllm.service.j2"
    marks = next(t for t in tasks if "ansible.builtin.lineinfile" in t)
    assert [m["line"] for m in marks["loop"]] == [
        "# User unit template (molecule serve: serve_unit_template points here, not at templates/).",
        "Environment=SPARKLLM_UNIT_TEMPLATE=molecule-serve-override",
    ]
    assert "[Service]" in (TEMPLATES / "sparkllm-vllm.service.j2").read_text().splitlines()
