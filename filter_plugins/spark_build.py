"""Build parallelism of the vLLM compile (roles/vllm_build): how many nvcc processes fit the memory.

``spark_build_jobs(meminfo, cores, gib_per_thread, nvcc_threads, reserve_gib, fixed_max_jobs=0)``

- ``meminfo``: the text of /proc/meminfo (MemAvailable is used: what the compile can take without pushing
  out a running server or the model download beside it; MemTotal when a kernel has no MemAvailable);
- ``cores``: the CPUs the build may use (nproc);
- ``gib_per_thread``: peak memory of one nvcc compilation thread (GiB);
- ``nvcc_threads``: NVCC_THREADS, threads per nvcc process (vLLM passes ``--threads`` to nvcc);
- ``reserve_gib``: memory left to everything else (GiB);
- ``fixed_max_jobs``: a MAX_JOBS the user fixed (> 0), used as it is.

Returns ``{"max_jobs", "nvcc_threads", "processes", "mem_available_gib", "bound"}``:

    processes = max(1, min(cores // nvcc_threads,
                           floor((mem_available_gib - reserve_gib) / (gib_per_thread * nvcc_threads))))
    max_jobs  = processes * nvcc_threads

``max_jobs`` is what the build passes as MAX_JOBS: vLLM's setup.py (``compute_num_jobs``, 0.19.1
setup.py:158-195, the same in 0.26.0) divides MAX_JOBS by NVCC_THREADS to get ninja's job count, so
MAX_JOBS counts threads, not processes. ``bound`` says which limit decided (``cores``, ``memory`` or
``fixed``). Bad input raises a one-line error naming the knob.

The build's checks before anything is built (roles/vllm_build/tasks/validate.yml asserts each list is empty);
each returns a list of one-line problems, and a wrong type among its inputs is one of them, not a crash:

- ``spark_build_requirement_errors(method_variants, ...)``: a requested method's variant is undefined, not
  allowed on this host, older than the method's ``min_version`` or missing one of its ``prs``;
- ``spark_build_pin_errors(variants_to_build, ...)``: a variant built here whose ref, extra PRs, toolchain
  or the base image is not pinned, or whose extra PRs a wheel install would silently drop;
- ``spark_build_hybrid_errors(variants_to_build, ...)``: with the hybrid checkpoint served, a variant built
  here whose patch series has no hybrid INT4+FP8 loading patch.

A variant's settings are ``spark_vllm_variants[v]`` with ``vllm_build_variant_overrides[v]`` merged over
them key by key (Ansible's ``combine``); a variant listed in ``vllm_build_images`` is pulled, not built.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path

from ansible.errors import AnsibleFilterError
from packaging.version import InvalidVersion, Version

_KB = re.compile(r"^(MemAvailable|MemTotal):\s+(\d+)\s+kB\s*$", re.M)


def _positive(value, name: str, kind=float, minimum=0.0, strict=True):
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise AnsibleFilterError(
            f"spark_build_jobs: {name}={value!r} is not a number; set it to a positive value") from None
    too_small = number <= minimum if strict else number < minimum
    if isinstance(value, bool) or not math.isfinite(number) or too_small:
        raise AnsibleFilterError(
            f"spark_build_jobs: {name}={value!r} must be {'>' if strict else '>='} {minimum}")
    return number


def mem_available_gib(meminfo: str) -> float:
    """MemAvailable (else MemTotal) of a /proc/meminfo text, in GiB."""
    if not isinstance(meminfo, str):
        raise AnsibleFilterError("spark_build_jobs: meminfo must be the text of /proc/meminfo")
    found = dict(_KB.findall(meminfo))
    kb = found.get("MemAvailable", found.get("MemTotal"))
    if kb is None:
        raise AnsibleFilterError("spark_build_jobs: no MemAvailable or MemTotal line in the meminfo given "
                                 "(expected the text of /proc/meminfo)")
    return int(kb) / (1024 * 1024)


def spark_build_jobs(meminfo, cores, gib_per_thread, nvcc_threads, reserve_gib, fixed_max_jobs=0) -> dict:
    available = mem_available_gib(meminfo)
    cores = int(_positive(cores, "cores (processor_nproc)", int, 0))
    per_thread = _positive(gib_per_thread, "vllm_build_gib_per_job")
    threads = int(_positive(nvcc_threads, "vllm_build_nvcc_threads", int, 0))
    reserve = _positive(reserve_gib, "vllm_build_memory_reserve_gib", float, 0.0, strict=False)
    fixed = int(_positive(fixed_max_jobs, "vllm_build_max_jobs", int, 0.0, strict=False))
    if fixed > 0:
        return {"max_jobs": fixed, "nvcc_threads": threads, "processes": max(1, fixed // threads),
                "mem_available_gib": round(available, 1), "bound": "fixed"}
    by_cores = max(1, cores // threads)
    by_memory = max(1, math.floor(max(0.0, available - reserve) / (per_thread * threads)))
    processes = min(by_cores, by_memory)
    return {"max_jobs": processes * threads, "nvcc_threads": threads, "processes": processes,
            "mem_available_gib": round(available, 1), "bound": "cores" if by_cores <= by_memory else "memory"}


# ------------------------------------------------------------------ the build's checks

_RELEASE_TAG_OR_COMMIT = re.compile(r"v[0-9]+[.][0-9]+[.][0-9]+([.a-z0-9]*)?|[0-9a-f]{40}")
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-f]{64}")
_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_VERSION_TAG = re.compile(r":[^/:@]*[0-9]+[.][0-9]+[^/:@]*$")
_PIN_FORM = "{pr: N, sha: <40-hex commit>}"


def _type(value) -> str:
    return type(value).__name__


def _is_list(value) -> bool:
    return isinstance(value, (list, tuple))


def _truthy(value) -> bool:
    """Ansible's ``bool`` filter: yes/on/1/true (any case) and 1 are true, anything else false."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        value = value.strip().lower()
    return value in ("yes", "on", "1", "true", 1)


def _mappings(errors: list[str], **named) -> bool:
    """Record each argument that is not a mapping; True when all are."""
    for name, value in named.items():
        if not isinstance(value, Mapping):
            errors.append(f"{name} must be a mapping (by variant or method), not {_type(value)}")
    return len(errors) == 0


def _conf(errors: list[str], variant, variants: Mapping, overrides: Mapping) -> dict | None:
    """The variant's settings with its overrides merged over them (Ansible's combine: key by key)."""
    base, over = variants.get(variant, {}), overrides.get(variant, {})
    for name, value in (("spark_vllm_variants", base), ("vllm_build_variant_overrides", over)):
        if not isinstance(value, Mapping):
            errors.append(f"{name}.{variant} must be a mapping of the variant's settings, not {_type(value)}")
            return None
    return {**base, **over}


def _pinned_prs(conf: Mapping) -> list:
    """The extra PRs as the requirement check reads them: all of them when each is a {pr, sha} mapping, none
    otherwise (the pin check reports the malformed entry)."""
    prs = conf.get("extra_prs", [])
    if not _is_list(prs) or not all(isinstance(p, Mapping) and "sha" in p for p in prs):
        return []
    return list(prs)


def _pr_numbers(prs) -> list:
    return [p.get("pr") if isinstance(p, Mapping) else p for p in prs]


def _hashes(items) -> str:
    return ", #".join(str(i) for i in items)


def _release(value) -> Version | None:
    try:
        return Version(str(value))
    except InvalidVersion:
        return None


def _not_allowed(method, variant, conf: Mapping, why: str, allowed) -> str:
    merged = _pr_numbers(_pinned_prs(conf))
    build = f"vLLM {conf.get('version')}" + (f" + PR #{_hashes(merged)}" if merged else "")
    return (f"spec_method/vllm_build_methods asks for {method}, which needs the vLLM build {variant} "
            f"({build}){why}, but this configuration only allows {', '.join(map(str, allowed))} "
            "(vllm_build_variants_allowed)")


def _too_old(method, variant, conf: Mapping, req: Mapping, why: str) -> str | None:
    need, have, version = _release(req["min_version"]), _release(conf.get("version")), conf.get("version")
    if need is None:
        return (f"vllm_build_method_requirements.{method}.min_version {req['min_version']!r} "
                "is not a version number (e.g. 0.26.0)")
    if have is None:
        return (f"method {method} needs vLLM >= {req['min_version']}{why}, but its variant {variant} has "
                f"version {version!r}, not a version number (set spark_vllm_variants.{variant}.version)")
    if have < need:
        return (f"method {method} needs vLLM >= {req['min_version']}{why}, but its variant {variant} is "
                f"vLLM {version} (ref {conf.get('ref')})")
    return None


def _requirement_error(method, variant, conf: Mapping, req: Mapping, pulled: bool, allowed) -> str | None:
    why = f" ({req['why']})" if req.get("why") else ""
    if allowed and variant not in allowed:
        return _not_allowed(method, variant, conf, why, allowed)
    old = _too_old(method, variant, conf, req, why) if req.get("min_version") else None
    if old:
        return old
    wanted = req.get("prs", [])
    if not _is_list(wanted):
        return (f"vllm_build_method_requirements.{method}.prs must be a list of PR numbers, "
                f"not {_type(wanted)}")
    merged = _pr_numbers(_pinned_prs(conf))
    missing = list(dict.fromkeys(p for p in wanted if p not in merged))
    if not pulled and missing:
        return (f"method {method} needs vLLM PR #{_hashes(missing)}{why}, but variant {variant} merges only "
                f"[{', '.join(map(str, merged))}]")
    return None


def spark_build_requirement_errors(method_variants, variants, overrides, requirements, images,
                                   allowed) -> list[str]:
    """Problems with the requested methods (``method_variants``: method -> its vllm_variant, in request
    order) and the variants they need; empty when all is well."""
    errors: list[str] = []
    if not _mappings(errors, spark_vllm_variants=variants, vllm_build_variant_overrides=overrides,
                     vllm_build_method_requirements=requirements, vllm_build_images=images,
                     method_variants=method_variants):
        return errors
    if not _is_list(allowed):
        return [f"vllm_build_variants_allowed must be a list of variant names, not {_type(allowed)}"]
    for method, variant in method_variants.items():
        if variant not in variants:
            errors.append(f"method {method} names vLLM variant {variant}, "
                          "which spark_vllm_variants does not define")
            continue
        conf = _conf(errors, variant, variants, overrides)
        req = requirements.get(method, {})
        if not isinstance(req, Mapping):
            errors.append(f"vllm_build_method_requirements.{method} must be a mapping "
                          f"(min_version, prs, why), not {_type(req)}")
        elif conf is not None:
            error = _requirement_error(method, variant, conf, req, variant in images, allowed)
            errors += [error] if error else []
    return errors


def _rewrite_ok(rewrite) -> bool:
    return _is_list(rewrite) and all(
        _is_list(pair) and len(pair) == 2 and all(isinstance(s, str) and s for s in pair) for pair in rewrite)


def _pr_entry_error(variant, p, diff_args) -> str | None:
    pr = p.get("pr") if isinstance(p, Mapping) else None
    numbered = isinstance(pr, (int, float)) and not isinstance(pr, bool)
    if not (numbered and _COMMIT.fullmatch(str(p.get("sha")))):
        return f"{variant}: extra_prs entry {p} must be {_PIN_FORM} (a refs/pull/N/head ref moves)"
    if "diff_sha256" in p and not _SHA256.fullmatch(str(p["diff_sha256"])):
        args = " ".join(map(str, diff_args)) if _is_list(diff_args) else str(diff_args)
        return (f"{variant}: extra_prs entry of PR #{pr} has diff_sha256 {p['diff_sha256']}, not a sha256 "
                f"(64 hex): take it from `git diff {args} <sha>^1 <sha> | sha256sum`")
    if "rewrite" in p and "diff_sha256" not in p:
        return (f"{variant}: extra_prs entry of PR #{pr} has rewrite but no diff_sha256: a merged PR is not "
                "rewritten; pin its diff to rewrite it")
    if "rewrite" in p and not _rewrite_ok(p["rewrite"]):
        return (f"{variant}: extra_prs entry of PR #{pr} has rewrite {p['rewrite']}; it must be a list of "
                "[from, to] pairs of non-empty strings")
    return None


def _wheel_drops_prs(variant, conf: Mapping, prs: list) -> str:
    return (f"{variant} installs the prebuilt vLLM {conf.get('version')} wheel (install: wheel), which its "
            f"extra_prs (PR #{_hashes(_pr_numbers(prs))}) cannot change: they patch the source before the "
            "compile. Compile it (install: source, or vllm_build_from_source: true) or build it without them "
            f"(vllm_build_variant_overrides: {{{variant}: {{extra_prs: []}}}})")


def _variant_pin_errors(variant, conf: Mapping, from_source, diff_args) -> list[str]:
    errors = []
    ref = conf.get("ref")
    if not _RELEASE_TAG_OR_COMMIT.fullmatch(str(ref)):
        errors.append(f"{variant}: ref {ref} is neither a release tag (vX.Y.Z) nor a 40-hex commit; "
                      "a branch moves under the build")
    prs = conf.get("extra_prs", [])
    if not _is_list(prs):
        errors.append(f"{variant}: extra_prs {prs} must be a list of {_PIN_FORM} entries")
        prs = []
    errors += [e for e in (_pr_entry_error(variant, p, diff_args) for p in prs) if e]
    if prs and not (_truthy(from_source) or conf.get("install", "source") == "source"):
        errors.append(_wheel_drops_prs(variant, conf, prs))
    toolchain = conf.get("toolchain", {})
    if not isinstance(toolchain, Mapping) or "torch" not in toolchain:
        errors.append(f"{variant}: no toolchain with a torch pin (spark_vllm_variants.{variant}.toolchain)")
    return errors


def _built(errors: list[str], build_variants, variants, images) -> list:
    """The variants this run builds from source: requested, defined and not pulled."""
    if not _is_list(build_variants):
        errors.append(f"the variants to build must be a list of names, not {_type(build_variants)}")
        return []
    return [v for v in build_variants if v in variants and v not in images]


def spark_build_pin_errors(build_variants, variants, overrides, images, from_source, base_image,
                           diff_args) -> list[str]:
    """Variants built from source whose vLLM source, extra PRs or toolchain are not pinned, and a base
    image without a digest or version tag; empty when all is well."""
    errors: list[str] = []
    if not _mappings(errors, spark_vllm_variants=variants, vllm_build_variant_overrides=overrides,
                     vllm_build_images=images):
        return errors
    for variant in _built(errors, build_variants, variants, images):
        conf = _conf(errors, variant, variants, overrides)
        errors += _variant_pin_errors(variant, conf, from_source, diff_args) if conf is not None else []
    image = str(base_image)
    if not _DIGEST.search(image) and not _VERSION_TAG.search(image):
        errors.append(f"vllm_build_base_image {image} has neither a digest (@sha256:...) nor a version tag")
    return errors


def _series_names(series: Path) -> list[str]:
    """The patch names a series file lists (comments and blank lines dropped); none when there is no file."""
    if not series.is_file():
        return []
    lines = (re.sub(r"#.*$", "", line).strip() for line in series.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line]


def _no_hybrid_patch(variant, version, users: str, series: str, patch_regex) -> str:
    where = (f"{series} lists none matching {patch_regex}" if Path(series).is_file()
             else f"there is no {series}")
    return (f"{variant} (vLLM {version}, for {users}) has no hybrid INT4+FP8 loading patch: {where}. "
            f"Served the hybrid checkpoint, vLLM {version} would load its FP8 shared experts as INT4 "
            "(wrong weights, no error)")


def spark_build_hybrid_errors(build_variants, method_variants, variants, overrides, images, serves_hybrid,
                              patches_root, patch_regex) -> list[str]:
    """Variants built from source whose patch series (``patch_dir``, else ``<patches_root>/vllm-<version>``)
    lists no patch matching ``patch_regex``, when the served checkpoint is the hybrid one; empty when all is
    well. Pulled images are not ours to patch."""
    errors: list[str] = []
    if not _truthy(serves_hybrid):
        return errors
    if not _mappings(errors, spark_vllm_variants=variants, vllm_build_variant_overrides=overrides,
                     vllm_build_images=images, method_variants=method_variants):
        return errors
    try:
        regex = re.compile(str(patch_regex))
    except re.error as err:
        return [f"vllm_build_hybrid_patch_regex {patch_regex!r} is not a regular expression ({err})"]
    for variant in _built(errors, build_variants, variants, images):
        conf = _conf(errors, variant, variants, overrides)
        if conf is None:
            continue
        version = conf.get("version")
        series = f"{conf.get('patch_dir', f'{patches_root}/vllm-{version}')}/series"
        if not any(regex.search(name) for name in _series_names(Path(series))):
            users = ", ".join(str(m) for m, v in method_variants.items() if v == variant)
            errors.append(_no_hybrid_patch(variant, version, users, series, patch_regex))
    return errors


class FilterModule:
    def filters(self):
        return {"spark_build_jobs": spark_build_jobs,
                "spark_build_requirement_errors": spark_build_requirement_errors,
                "spark_build_pin_errors": spark_build_pin_errors,
                "spark_build_hybrid_errors": spark_build_hybrid_errors}
