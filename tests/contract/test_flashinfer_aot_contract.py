"""Issue 22 item 4 (FlashInfer): the image's AOT step (templates/Dockerfile.j2, runtime stage) against the
FlashInfer release each variant installs (the pinned flashinfer-python wheel, cached; flashinfer_sources.py).

- ``python -m flashinfer.aot`` exists in that release and its own argument parser (built from its aot.py
  main(), run for real) accepts our arguments with the meaning we give them;
- the source-tree paths aot.py compiles from (relative to the directory above the package) resolve, through
  the links the step makes, to directories the wheel ships;
- what it writes (``--out-dir``/<name>/<name>.so) is where that release loads prebuilt modules from before it
  JIT-compiles (jit/env.py's AOT directory without flashinfer-jit-cache, jit/core.py build_and_load);
- it compiles for our arch (FLASHINFER_CUDA_ARCH_LIST, set in the base stage; SM121 detected from it) with
  the build's MAX_JOBS;
- the reason it is needed: no FlashInfer package on PyPI carries SM12x kernels for our versions
  (data/flashinfer_packages.json ``evidence``: flashinfer-cubin's cubins, flashinfer-jit-cache's absence).
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
from pathlib import Path

import pytest
import yaml

from tests.contract import flashinfer_sources

pytestmark = pytest.mark.vllm_contract

ROOT = Path(__file__).resolve().parents[2]
VARIANTS = yaml.safe_load((ROOT / "group_vars/all/methods.yml").read_text())["spark_vllm_variants"]
DEFAULTS = yaml.safe_load((ROOT / "roles/vllm_build/defaults/main.yml").read_text())
AOT_ARGS = DEFAULTS["vllm_build_flashinfer_aot_args"]
DOCKERFILE = (ROOT / "templates/Dockerfile.j2").read_text()
EVIDENCE = json.loads(flashinfer_sources.DATA.read_text())["evidence"]
VERSIONS = sorted({str(c["toolchain"]["flashinfer-python"]) for c in VARIANTS.values()})


def _tree(version: str) -> Path:
    try:
        return flashinfer_sources.package_tree(version)
    except (OSError, RuntimeError) as exc:
        pytest.fail(f"flashinfer-python {version}: {exc}; run tests/contract/setup_vllm_env.sh")


def _source(version: str, member: str) -> str:
    return (_tree(version) / member).read_text()


def _parser(version: str) -> argparse.ArgumentParser:
    """aot.py main()'s own ArgumentParser: its statements up to parse_args(), run with its parse_* helpers."""
    mod = ast.parse(_source(version, "flashinfer/aot.py"))
    funcs = {n.name: n for n in mod.body if isinstance(n, ast.FunctionDef)}
    body = []
    for stmt in funcs["main"].body:
        if "parse_args" in ast.unparse(stmt):
            break
        body.append(stmt)
    helpers = [funcs[n] for n in ("parse_bool", "parse_head_dim")]
    ns: dict = {"argparse": argparse, "Path": Path, "Tuple": tuple}
    exec(compile(ast.Module(body=[*helpers, *body], type_ignores=[]), "aot.py", "exec"), ns)  # noqa: S102
    return ns["parser"]


def _aot_command() -> str:
    flat = " ".join(DOCKERFILE.split())
    return re.search(r"python3 /opt/sparkllm/flashinfer_aot\.py ([^;]*);", flat).group(1)


def test_the_dockerfile_passes_the_role_s_aot_arguments():
    cmd = _aot_command()
    assert cmd.startswith("--out-dir /opt/sparkllm/flashinfer-aot --build-dir /tmp/flashinfer-aot ")
    assert "{{ vllm_build_flashinfer_aot_args | join(' ') }}" in cmd
    # its own stage's output lands where the installed package looks (test below: <package>/data/aot)
    copy = "COPY --from=flashinfer_aot /opt/sparkllm/flashinfer-aot {{ _site }}/flashinfer/data/aot"
    assert copy in DOCKERFILE


@pytest.mark.parametrize("version", VERSIONS)
def test_flashinfer_aot_is_a_module_entry_point_of_the_release(version):
    src = _source(version, "flashinfer/aot.py")
    assert re.search(r'(?m)^if __name__ == "__main__":\n\s+main\(\)', src), "-m flashinfer.aot runs main()"


@pytest.mark.parametrize("version", VERSIONS)
def test_its_own_parser_accepts_our_arguments_as_meant(version):
    args = _parser(version).parse_args(["--out-dir", "/o", "--build-dir", "/b", *AOT_ARGS])
    assert (args.out_dir, args.build_dir) == (Path("/o"), Path("/b"))
    assert args.f16_dtype == ["bfloat16"]
    assert args.use_sliding_window == ["false"] and args.use_logits_soft_cap == ["false"]
    assert (args.add_comm, args.add_gemma, args.add_oai_oss, args.add_moe, args.add_xqa) == (False,) * 5
    assert (args.add_act, args.add_misc) == (True, True)
    # main() maps each --add-* onto the config key compile_and_package_modules reads
    src = _source(version, "flashinfer/aot.py")
    for key in ("add_comm", "add_gemma", "add_oai_oss", "add_moe", "add_act", "add_misc", "add_xqa"):
        assert f'"{key}"' in src.split("def main", 1)[1] and f'config["{key}"]' in src


@pytest.mark.parametrize("version", VERSIONS)
def test_a_bad_argument_is_refused_by_its_parser(version):
    with pytest.raises(SystemExit):
        _parser(version).parse_args(["--add-moe=maybe"])
    with pytest.raises(SystemExit):
        _parser(version).parse_args(["--no-such-option"])


def _links() -> dict[str, str]:
    """{path under site-packages: its link target} of the AOT step's `ln -s` commands."""
    found = {link: target for target, link in re.findall(r'ln -s (\S+) "\$site/([^"]+)"', DOCKERFILE)}
    assert found, "no links in the AOT step"
    return found


def _through_links(rel: str) -> str:
    """A path under site-packages resolved through the step's links (relative targets, as ln -s has them)."""
    for link, target in sorted(_links().items(), key=lambda kv: -len(kv[0])):
        if rel == link or rel.startswith(link + "/"):
            return os.path.normpath(os.path.join(os.path.dirname(link), target)) + rel[len(link):]
    return rel


@pytest.mark.parametrize("version", VERSIONS)
def test_the_source_layout_aot_reads_resolves_into_the_wheel(version):
    src = _source(version, "flashinfer/aot.py")
    assert "project_root = Path(__file__).resolve().parents[1]" in src  # site-packages for an installed wheel
    chains = re.findall(r'project_root((?: / "[^"]+")+)', src)
    rels = sorted({"/".join(re.findall(r'"([^"]+)"', g)) for g in chains})
    assert {"csrc", "include", "3rdparty/cutlass/include", "3rdparty/spdlog/include"} <= set(rels), rels
    names = json.loads((_tree(version) / "names.json").read_text())
    dirs = {n.rsplit("/", 1)[0] for n in names}
    missing = [r for r in rels if not any(d == _through_links(r) or d.startswith(_through_links(r) + "/")
                                          for d in dirs)]
    assert missing == [], f"flashinfer {version}: {missing} do not resolve into the wheel through {_links()}"


@pytest.mark.parametrize("version", VERSIONS)
def test_the_output_is_where_the_release_loads_prebuilt_modules(version):
    aot, env, core = (_source(version, f"flashinfer/{m}") for m in ("aot.py", "jit/env.py", "jit/core.py"))
    assert 'dst = out_dir / jit_spec.name / f"{jit_spec.name}.so"' in aot
    assert 'return _package_root / "data" / "aot"' in env  # without flashinfer-jit-cache installed
    assert "_package_root: pathlib.Path = pathlib.Path(__file__).resolve().parents[1]" in env
    assert 'return jit_env.FLASHINFER_AOT_DIR / self.name / f"{self.name}.so"' in core
    first = r"def build_and_load\(self\):\n\s+if self\.is_aot:\n\s+return self\.load\(self\.aot_path\)"
    assert re.search(first, core), "build_and_load no longer loads the AOT module first"


@pytest.mark.parametrize("version", VERSIONS)
def test_it_compiles_for_our_arch_with_the_build_s_jobs(version):
    aot = _source(version, "flashinfer/aot.py")
    ctx = _source(version, "flashinfer/compilation_context.py")
    cpp = _source(version, "flashinfer/jit/cpp_ext.py")
    arch = DEFAULTS["vllm_build_cuda_arch_list"]
    base = DOCKERFILE.split("{% block build %}")[0]
    assert "FLASHINFER_CUDA_ARCH_LIST={{ vllm_build_cuda_arch_list }}" in base
    assert 'if "FLASHINFER_CUDA_ARCH_LIST" not in os.environ:' in aot
    major, minor = arch.split(".")
    assert 'os.environ["FLASHINFER_CUDA_ARCH_LIST"].split(" ")' in ctx
    assert 'major, minor = arch.split(".")' in ctx
    assert f'"sm{major}{minor.rstrip("af")}": has_sm("compute_{major}{minor.rstrip("af")}"' in aot
    assert 'os.environ.get("MAX_JOBS")' in cpp


@pytest.mark.parametrize("version", VERSIONS)
def test_no_flashinfer_package_on_pypi_carries_sm12x_kernels_for_the_version(version):
    """The reason for the AOT step (the evidence, flashinfer_sources.py --listing)."""
    assert EVIDENCE["flashinfer-jit-cache"]["on_pypi"] is False
    cubin = EVIDENCE["flashinfer-cubin"][version]
    if cubin["on_pypi"]:
        assert not [a for a in cubin["archs_in_names"] if a.startswith("12")], cubin["archs_in_names"]
        assert not [k for k in cubin["cuobjdump_sample"]["listed"] if "sm_12" in k], cubin
    else:
        assert version not in cubin["versions_on_pypi"]


def _jit_debug(version: str, environ: dict[str, str]) -> bool:
    """The release's own rule for a debug JIT build (-O0 -G): its statements in jit/core.py that read
    FLASHINFER_JIT_DEBUG / FLASHINFER_JIT_VERBOSE, executed against ``environ``."""
    lines = _source(version, "flashinfer/jit/core.py").splitlines()
    start = next(i for i, ln in enumerate(lines) if 'os.environ.get("FLASHINFER_JIT_DEBUG")' in ln)
    end = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("debug ="))
    code = "\n".join(ln.strip() for ln in lines[start:end + 1])
    scope = {"os": argparse.Namespace(environ=environ)}
    exec(code, scope)  # noqa: S102 - the release's three assignments, nothing else
    return scope["debug"]


def _serve_container_env() -> dict[str, str]:
    """The FLASHINFER_* variables the serve role gives the server (serve_flashinfer_jit_verbose on)."""
    text = (ROOT / "roles/serve/vars/main.yml").read_text()
    return dict(re.findall(r"'--env=(FLASHINFER_JIT_[A-Z]+)=([^']*)'", text))


@pytest.mark.parametrize("version", VERSIONS)
def test_verbose_jit_logs_are_not_debug_builds(version):
    # issue 29: VERBOSE=1 alone makes every JIT module a -O0 -G debug build in these releases
    assert _jit_debug(version, {"FLASHINFER_JIT_VERBOSE": "1"}) is True
    env = _serve_container_env()
    assert env.get("FLASHINFER_JIT_VERBOSE") == "1"
    assert _jit_debug(version, env) is False, env


DRIVER = ROOT / "roles/vllm_build/files/flashinfer_aot.py"
EXCLUDE = DEFAULTS["vllm_build_flashinfer_aot_exclude"]


@pytest.mark.parametrize("version", VERSIONS)
def test_the_driver_s_hook_is_the_release_s_own_module_list(version):
    """flashinfer_aot.py wraps aot.gen_all_modules: main() must reach it through compile_and_package_modules
    by its module-level name, and copy the modules that list holds (so a module left out is neither built nor
    copied); and aot.py's own options cannot leave out what the exclusions do."""
    src = _source(version, "flashinfer/aot.py")
    body = src.split("def compile_and_package_modules", 1)[1].split("\ndef ", 1)[0]
    assert "jit_specs = gen_all_modules(" in body
    assert "build_jit_specs(jit_specs" in body and "copy_built_kernels(jit_specs, out_dir)" in body
    assert "compile_and_package_modules(" in src.split("def main", 1)[1]
    assert "if args.f8_dtype:" in src  # `--f8-dtype` with no value keeps the FP8-KV default
    assert "yield gen_batch_mla_module(" in src.split("def gen_attention", 1)[1].split("\ndef ", 1)[0]


def test_the_driver_leaves_out_only_the_excluded_modules(monkeypatch, capsys, tmp_path):
    """Run for real against the FlashInfer installed in the contract env (vLLM 0.19.1's 0.6.6), with the
    build and the copy replaced by recorders: the role's arguments and exclusions give 27 of 55 modules."""
    # FlashInfer's compilation context reads the arch list when flashinfer.jit is first imported
    monkeypatch.setenv("FLASHINFER_CUDA_ARCH_LIST", DEFAULTS["vllm_build_cuda_arch_list"])
    aot = pytest.importorskip("flashinfer.aot")
    from importlib.metadata import version as dist_version

    if dist_version("flashinfer-python") != str(VARIANTS["v0_19_1"]["toolchain"]["flashinfer-python"]):
        pytest.skip("the contract env's FlashInfer is not v0_19_1's")
    built: list[str] = []
    monkeypatch.setattr(aot, "build_jit_specs", lambda specs, **kw: built.extend(s.name for s in specs))
    monkeypatch.setattr(aot, "copy_built_kernels", lambda specs, out: None)
    monkeypatch.setattr(aot, "detect_sm_capabilities", lambda: {"sm121": True})
    # the source layout beside the package, linked as the image's step links it (project_root = parents[1])
    data = Path(aot.__file__).resolve().parent / "data"
    for link, target in _links().items():
        (tmp_path / link).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / link).symlink_to(data / Path(target).name)
    monkeypatch.setattr(aot, "__file__", str(tmp_path / "flashinfer" / "aot.py"))
    monkeypatch.setenv("SPARKLLM_FLASHINFER_AOT_EXCLUDE", " ".join(EXCLUDE))
    monkeypatch.setattr("sys.argv", ["flashinfer_aot.py", "--out-dir", "/nonexistent", *AOT_ARGS])
    scope: dict = {"__name__": "sparkllm_flashinfer_aot"}
    exec(compile(DRIVER.read_text(), str(DRIVER), "exec"), scope)  # noqa: S102 - our own driver
    monkeypatch.setattr(aot, "gen_all_modules", aot.gen_all_modules)  # undone after the test: main() wraps it
    assert scope["main"]() == 0
    said = capsys.readouterr().out
    assert "sparkllm: FlashInfer AOT: 27 of 55 modules; left to the JIT: 28" in said
    assert len(built) == 27 and not [n for n in built if any(re.search(p, n) for p in EXCLUDE)]
    assert "norm" in built and "sampling" in built  # what vLLM 0.19.1 calls beside attention
    assert any(n.startswith("batch_decode_with_kv_cache_dtype_q_bf16_dtype_kv_bf16_") for n in built)
