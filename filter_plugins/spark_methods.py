"""Method catalogue + user settings -> vLLM serve arguments, and validation of those settings.

Pure Python (PyYAML, which Ansible itself needs); Ansible only needs the ``FilterModule`` at the bottom.

``settings`` is a mapping of the user knobs by their variable names. The knobs and their defaults are
``group_vars/all/main.yml``, read at import (``SETTING_DEFAULTS``: a key that is missing from
``settings`` takes that default; nothing here repeats a name or a value of main.yml). ``catalogue``
is ``spark_method_catalogue`` from ``group_vars/all/methods.yml``.

A few settings are not user knobs in main.yml; roles add them when they apply:

- ``vllm_model_path``: the model path *inside the container*, default ``/model`` (the serve role
  mounts ``spark_model_dir`` there read-only).
- multi-node ``mp`` backend: ``spark_nnodes`` (default 1), ``spark_node_rank`` (default 0),
  ``spark_master_addr`` (required when ``spark_nnodes`` > 1), ``spark_master_port`` (optional).
  Nodes with rank > 0 get ``--headless`` (they run workers only, no API server).

Example (a playbook)::

    spark_settings: "{{ hostvars[inventory_hostname] | spark_settings }}"
    vllm_serve_argv: "{{ spark_settings | spark_serve_argv(spark_method_catalogue) }}"
"""

from __future__ import annotations

import ipaddress
import json
import math
import re
import sys
from collections.abc import Mapping
from pathlib import Path

import yaml

# The memory fraction's one bound and computation live in the memory filter beside this one (Ansible loads a
# filter plugin by its path, so its directory is put on the import path for it).
_PLUGINS = str(Path(__file__).resolve().parent)
if _PLUGINS not in sys.path:
    sys.path.append(_PLUGINS)

from spark_memory import GPU_MEMORY_MAX, spark_memory_utilization, utilization_error  # noqa: E402


class CatalogueError(ValueError):
    """The catalogue itself (methods.yml) is malformed: a bug in the project, not user input."""


# The user knobs and their defaults are read from group_vars/all/main.yml, their one home (a knob added
# there is a setting here, with the same default). A name missing from ``settings`` takes that default.
MAIN_YML = Path(__file__).resolve().parents[1] / "group_vars" / "all" / "main.yml"
# Settings that are not user knobs in main.yml (see the module docstring): the roles add them.
ROLE_SETTING_DEFAULTS: dict[str, object] = {
    "vllm_model_path": "/model",
    "spark_nnodes": 1,
    "spark_node_rank": 0,
    "spark_master_addr": "",
    "spark_master_port": None,
}


# A knob whose default is the selected model's value (group_vars/all/models.yml, spark_model_entry): here it
# takes the default model's value, the one Ansible resolves when no -e model= is given.
_MODEL_DEFAULT_RE = re.compile(r"\{\{\s*spark_model_entry\.([A-Za-z0-9_.]+)\s*\}\}")
# spark_model_dir's default: the model's directory under spark_model_root (group_vars/all/storage.yml).
_MODEL_DIR_RE = re.compile(r"\{\{\s*spark_model_root\s*\}\}/(\{\{\s*spark_model_entry\.model_dir\s*\}\})")


MODELS_YML = MAIN_YML.parent / "models.yml"


def _model_defaults(knobs: dict, path: Path) -> dict:
    """``knobs`` with each ``{{ spark_model_entry.<path> }}`` default replaced by the default model's
    value (group_vars/all/models.yml)."""
    if not any(isinstance(v, str) and (_MODEL_DEFAULT_RE.fullmatch(v) or _MODEL_DIR_RE.fullmatch(v))
               for v in knobs.values()):
        return knobs
    models = yaml.safe_load(MODELS_YML.read_text(encoding="utf-8"))
    entry = models["spark_model_catalogue"][models["model"]]
    out = dict(knobs)
    for name, value in knobs.items():
        under_root = _MODEL_DIR_RE.fullmatch(value) if isinstance(value, str) else None
        if under_root:
            storage = yaml.safe_load((MAIN_YML.parent / "storage.yml").read_text(encoding="utf-8"))
            root = storage["spark_model_root"]
            out[name] = f"{root}/{entry['model_dir']}"
            continue
        match = _MODEL_DEFAULT_RE.fullmatch(value) if isinstance(value, str) else None
        if not match:
            continue
        node = entry
        for key in match.group(1).split("."):
            if not isinstance(node, dict) or key not in node:
                raise CatalogueError(f"{path}: {name} reads spark_model_entry.{match.group(1)}, which the "
                                     f"default model {models['model']} of {MODELS_YML} lacks")
            node = node[key]
        out[name] = node
    return out


def main_yml_defaults(path: Path = MAIN_YML) -> dict[str, object]:
    """The knobs of main.yml with the values Ansible gives them when nothing overrides them (a default read
    from the model's entry is the default model's value)."""
    knobs = yaml.safe_load(path.read_text(encoding="utf-8"))
    if not isinstance(knobs, dict) or not knobs:
        raise CatalogueError(f"{path}: expected a mapping of user knobs to their defaults")
    return _model_defaults(knobs, path)


def _load_knob_defaults(path: Path = MAIN_YML) -> dict[str, object]:
    """The knobs of main.yml with their defaults (``main_yml_defaults``), plus ROLE_SETTING_DEFAULTS (a name
    in both is refused: it would have two defaults)."""
    knobs = main_yml_defaults(path)
    both = sorted(set(knobs) & set(ROLE_SETTING_DEFAULTS))
    if both:
        raise CatalogueError(f"{path} defines {both}, which ROLE_SETTING_DEFAULTS in {__file__} defines too")
    return {**knobs, **ROLE_SETTING_DEFAULTS}


SETTING_DEFAULTS: dict[str, object] = _load_knob_defaults()

DISTRIBUTED_BACKENDS = (None, "ray", "mp")
# A Hub revision: a commit SHA, a branch or a tag (no spaces, no "..", not starting with a dash).
_REVISION_RE = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")

# Options the toolkit renders itself, by the knob that sets them: vllm_serve_extra_args may not
# repeat them (argparse would silently take the last one, and the unit, the health probe and the
# benchmark would disagree with the server). The API key never goes into argv.
_MANAGED_OPTIONS = {
    "--served-model-name": "vllm_served_model_name",
    "--host": "vllm_host",
    "--port": "vllm_port",
    "--max-model-len": "vllm_max_model_len",
    "--gpu-memory-utilization": "vllm_gpu_memory_utilization",
    "--enable-prefix-caching": "vllm_enable_prefix_caching",
    "--no-enable-prefix-caching": "vllm_enable_prefix_caching",
    "--mamba-cache-mode": "vllm_enable_prefix_caching (methods.yml prefix_caching.mamba_cache_mode)",
    "--enable-auto-tool-choice": "vllm_enable_auto_tool_choice",
    "--no-enable-auto-tool-choice": "vllm_enable_auto_tool_choice",
    "--tool-call-parser": "vllm_tool_call_parser",
    "--max-num-seqs": "vllm_max_num_seqs",
    "--load-format": "vllm_load_format",
    "--reasoning-parser": "vllm_reasoning_parser",
    "--speculative-config": "spec_method and the spec_* knobs",
    "--tensor-parallel-size": "spark_tensor_parallel_size",
    "--distributed-executor-backend": "spark_distributed_backend",
    "--nnodes": "the cluster stage", "--node-rank": "the cluster stage",
    "--master-addr": "the cluster stage", "--master-port": "the cluster stage",
    "--headless": "the cluster stage",
    "--api-key": "vllm_api_key_file (the key is passed in the environment, never in argv)",
    "--disable-log-stats": "a fixed choice: speculative decoding metrics need stats logging",
}
# vllm_load_format values: vLLM's loaders that read a safetensors checkpoint like ours ("" = leave
# --load-format out, vLLM's "auto"). The contract suite checks each is registered in 0.19.1 and 0.20.0.
LOAD_FORMATS = ("auto", "safetensors", "fastsafetensors", "instanttensor", "runai_streamer")
SPEC_TOKENS_RANGE = (1, 16)
# vllm_enable_prefix_caching: "auto" = the method's catalogue choice (prefix_caching.default), or a boolean.
PREFIX_CACHING_AUTO = "auto"
# methods.yml prefix_caching.mamba_cache_mode: vLLM's MambaCacheMode values that cache (0.19.1
# config/cache.py:109, "none" is what vLLM sets with prefix caching off); null = leave it to vLLM.
MAMBA_CACHE_MODES = ("align", "all")

# serve_flags key -> vLLM option (value rendered with str()).
_FLAG_OPTIONS = {
    "attention_backend": "--attention-backend",
    "max_num_batched_tokens": "--max-num-batched-tokens",
}
_KNOWN_SERVE_FLAGS = set(_FLAG_OPTIONS) | {"gpu_memory_utilization_cap"}
# spark_bad_driver_enforce_eager renders --enforce-eager for every method (a 590.x driver deadlocks in
# CUDA-graph capture on GB10); then vllm_serve_extra_args may not repeat or undo it.
_EAGER_OPTIONS = ("--enforce-eager", "--no-enforce-eager")
# Names and values of a server environment variable (catalogue server_env, the INT8 head switch): they
# land unquoted in docker --env words and in systemd Environment= lines of the Ray units.
_ENV_NAME_RE = re.compile(r"[A-Z_][A-Z0-9_]*")
_ENV_VALUE_RE = re.compile(r"[A-Za-z0-9_.,:/=+-]*")

_JSON_HINT = "pass numbers and booleans as JSON, e.g. -e '{{\"{name}\": {example}}}'"


def _get(settings: Mapping, name: str):
    value = settings.get(name, SETTING_DEFAULTS.get(name)) if settings is not None else None
    return value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(float(value)))


def _type_hint(name: str, value, example) -> str:
    if isinstance(value, str):
        return (f" (a string: values given as -e {name}=... arrive as strings; "
                + _JSON_HINT.format(name=name, example=example) + ")")
    return ""


def _check_int(errors: list[str], name: str, value, lo: int | None, hi: int | None, example) -> bool:
    """Append an error unless value is an int in [lo, hi]; return True when it is valid."""
    bounds = (f"between {lo} and {hi}" if hi is not None else f">= {lo}")
    if not _is_int(value):
        errors.append(f"{name}={value!r} is not an integer{_type_hint(name, value, example)}; "
                      f"set {name} to an integer {bounds}, e.g. {example}")
        return False
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        errors.append(f"{name}={value!r} is out of range; set {name} to an integer {bounds}, e.g. {example}")
        return False
    return True


def _entry(catalogue: Mapping, method) -> Mapping | None:
    if not isinstance(catalogue, Mapping) or not isinstance(method, str):
        return None
    entry = catalogue.get(method)
    return entry if isinstance(entry, Mapping) else None


def _valid_methods(catalogue) -> str:
    return ", ".join(catalogue) if isinstance(catalogue, Mapping) else "(no catalogue)"


def _is_loopback(host: str) -> bool:
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def _merged_speculative_config(settings: Mapping, entry: Mapping) -> dict | None:
    base = entry.get("speculative_config")
    if base is None:
        return None
    if not isinstance(base, Mapping) or "method" not in base:
        raise CatalogueError(f"speculative_config {base!r} must be a mapping with a 'method' key")
    config = dict(base)
    overridden = set()
    for key, setting in (entry.get("setting_overrides") or {}).items():
        value = _get(settings, setting)
        if value is not None and value != "":
            config[key] = value
            overridden.add(key)
    # The catalogue's revision is a commit of the catalogue's drafter repo: another drafter (a path, or
    # another repo) does not get it; its own revision knob still applies.
    if "revision" not in overridden and config.get("model") != base.get("model"):
        config.pop("revision", None)
    # A null in the catalogue means "no default": leave it out rather than sending null to vLLM.
    return {k: v for k, v in config.items() if v is not None}


def spark_method_settings_errors(settings: Mapping, catalogue: Mapping) -> list[str]:
    """Every problem with the user settings, as messages naming the variable, its value and the fix.

    An empty list means the settings are valid for the selected method.
    """
    errors: list[str] = []
    if not isinstance(settings, Mapping):
        return [f"settings must be a mapping of knob names to values, got {type(settings).__name__}"]
    if not isinstance(catalogue, Mapping) or not catalogue:
        return ["spark_method_catalogue is missing or empty; it is defined in "
                "group_vars/all/methods.yml"]

    method = _get(settings, "spec_method")
    entry = _entry(catalogue, method)
    if entry is None:
        errors.append(f"spec_method={method!r} is not a known method; set spec_method to one of: "
                      f"{_valid_methods(catalogue)}")

    tokens = _get(settings, "spec_num_speculative_tokens")
    if tokens is not None:
        _check_int(errors, "spec_num_speculative_tokens", tokens, *SPEC_TOKENS_RANGE, example=2)

    lookup_ok = True
    for name in ("spec_ngram_lookup_min", "spec_ngram_lookup_max"):
        value = _get(settings, name)
        if value is not None:
            lookup_ok &= _check_int(errors, name, value, 1, None, example=3)

    if entry is not None:
        try:
            config = _merged_speculative_config(settings, entry)
        except CatalogueError as exc:
            return errors + [f"method {method!r} in spark_method_catalogue: {exc}"]
        for requirement in entry.get("requires") or []:
            value = _get(settings, requirement)
            if value is None or (isinstance(value, str) and not value.strip()):
                errors.append(f"spec_method={method!r} requires {requirement}, which is "
                              f"{value!r}; set {requirement} to the drafter model (a path inside "
                              f"the container or a Hugging Face repo id)")
            elif not isinstance(value, str):
                errors.append(f"{requirement}={value!r} must be a string (a model path or repo id)")
        rev_knob = (entry.get("setting_overrides") or {}).get("revision")
        if rev_knob:
            rev = _get(settings, rev_knob)
            drafter = (config or {}).get("model")
            if rev is not None and not isinstance(rev, str):
                errors.append(f"{rev_knob}={rev!r} must be a string (a commit SHA, branch or tag)")
            elif rev and not _REVISION_RE.fullmatch(rev):
                errors.append(f"{rev_knob}={rev!r} is not a Hub revision; set a commit SHA (40 hex digits), "
                              f"a branch or a tag")
            elif rev and isinstance(drafter, str) and drafter.startswith("/"):
                errors.append(f"{rev_knob}={rev!r} applies to a Hub repo id, but the drafter is the path "
                              f"{drafter!r}; clear {rev_knob} or name the drafter by its repo id")
        if config and config.get("method") == "ngram" and lookup_ok:
            lo, hi = config.get("prompt_lookup_min"), config.get("prompt_lookup_max")
            if _is_int(lo) and _is_int(hi) and lo > hi:
                errors.append(f"spec_ngram_lookup_min={lo!r} is greater than spec_ngram_lookup_max="
                              f"{hi!r}; set spec_ngram_lookup_min <= spec_ngram_lookup_max")

    gpu = _get(settings, "vllm_gpu_memory_utilization")
    if not _is_number(gpu):
        errors.append(f"vllm_gpu_memory_utilization={gpu!r} is not a number"
                      f"{_type_hint('vllm_gpu_memory_utilization', gpu, 0.85)}; set it to a fraction "
                      f"in (0, {GPU_MEMORY_MAX}], e.g. 0.85")
    elif utilization_error(gpu):
        errors.append(utilization_error(gpu))

    if _check_int(errors, "vllm_max_model_len", _get(settings, "vllm_max_model_len"), 1, None,
                  example=262144):
        _check_context(errors, settings)
    _check_int(errors, "vllm_port", _get(settings, "vllm_port"), 1, 65535, example=8000)
    tp_ok = _check_int(errors, "spark_tensor_parallel_size", _get(settings, "spark_tensor_parallel_size"),
                       1, None, example=2)

    for name in ("vllm_served_model_name", "vllm_model_path"):
        value = _get(settings, name)
        if not isinstance(value, str) or not value.strip():
            errors.append(f"{name}={value!r} must be a non-empty string; set {name}")
    _check_method_guess(errors, settings, catalogue)
    parser = _get(settings, "vllm_reasoning_parser")
    if parser is not None and not isinstance(parser, str):
        errors.append(f"vllm_reasoning_parser={parser!r} must be a string; set it to a parser name "
                      f"such as 'qwen3', or '' to disable reasoning parsing")
    model_dir = _get(settings, "spark_model_dir")
    if not isinstance(model_dir, str) or not model_dir.startswith("/"):
        errors.append(f"spark_model_dir={model_dir!r} must be an absolute path; set spark_model_dir "
                      f"to the checkpoint directory on the Spark")

    backend = _get(settings, "spark_distributed_backend")
    if backend == "":
        backend = None
    if backend not in DISTRIBUTED_BACKENDS:
        errors.append(f"spark_distributed_backend={backend!r} is not valid; set it to null "
                      f"(single node), 'ray' or 'mp'")
    nnodes = _get(settings, "spark_nnodes")
    if _check_int(errors, "spark_nnodes", nnodes, 1, None, example=2) and nnodes > 1:
        if backend != "mp":
            errors.append(f"spark_nnodes={nnodes!r} needs spark_distributed_backend='mp' (got "
                          f"{backend!r}); with 'ray' the Ray cluster spans the nodes, so leave "
                          f"spark_nnodes at 1 and set spark_tensor_parallel_size instead")
        rank = _get(settings, "spark_node_rank")
        _check_int(errors, "spark_node_rank", rank, 0, nnodes - 1, example=0)
        addr = _get(settings, "spark_master_addr")
        if not isinstance(addr, str) or not addr.strip():
            errors.append(f"spark_master_addr={addr!r} is required when spark_nnodes > 1; set it to "
                          f"the head node's address on the ConnectX-7 link")
        port = _get(settings, "spark_master_port")
        if port is not None:
            _check_int(errors, "spark_master_port", port, 1, 65535, example=29501)
        if tp_ok:
            tp = _get(settings, "spark_tensor_parallel_size")
            if tp % nnodes:
                errors.append(f"spark_tensor_parallel_size={tp!r} is not a multiple of spark_nnodes="
                              f"{nnodes!r}; set it to GPUs per node x nodes")

    backend_override = _get(settings, "vllm_attention_backend")
    if backend_override is not None and not _is_backend_name(backend_override, allow_empty=True):
        errors.append(f"vllm_attention_backend={backend_override!r} is not a backend name; set it to "
                      f"'' (the method's choice in methods.yml) or a vLLM backend such as FLASH_ATTN, "
                      f"FLASHINFER or TRITON_ATTN")
    _check_backends_per_method(errors, _get(settings, "vllm_attention_backends"), catalogue)
    drafter_backend = _get(settings, "spec_dflash_attention_backend")
    if drafter_backend is not None and not _is_backend_name(drafter_backend, allow_empty=True):
        errors.append(f"spec_dflash_attention_backend={drafter_backend!r} is not a backend name; set it "
                      f"to '' (the catalogue's TRITON_ATTN) or a vLLM backend that supports non-causal "
                      f"attention, e.g. TRITON_ATTN or FLEX_ATTENTION")
    _check_serving_features(errors, settings)
    _check_extra_args(errors, _get(settings, "vllm_serve_extra_args"),
                      eager_forced=_get(settings, "spark_bad_driver_enforce_eager") is True)

    host = _get(settings, "vllm_host")
    key_file = _get(settings, "vllm_api_key_file")
    opt_out = _get(settings, "vllm_allow_unauthenticated_bind")
    if not isinstance(opt_out, bool):
        errors.append(f"vllm_allow_unauthenticated_bind={opt_out!r} is not a boolean"
                      f"{_type_hint('vllm_allow_unauthenticated_bind', opt_out, 'true')}; set it to "
                      f"true or false")
        opt_out = False
    if key_file is None:
        key_file = ""
    if not isinstance(key_file, str) or (key_file and not key_file.startswith("/")):
        errors.append(f"vllm_api_key_file={key_file!r} must be an absolute path or ''; set it to the "
                      f"file on the Spark that holds the API key")
    if not isinstance(host, str) or not host.strip():
        errors.append(f"vllm_host={host!r} must be an address; set vllm_host, e.g. 127.0.0.1")
    elif not _is_loopback(host) and not key_file and not opt_out:
        errors.append(f"vllm_host={host!r} exposes the API beyond this machine without an API key; "
                      f"set vllm_api_key_file to a file holding the key, or set "
                      f"vllm_allow_unauthenticated_bind=true to accept an open endpoint")
    return errors


# Substrings of a draft model's path from which vLLM guesses the speculative method when the configured
# method is not one it takes as given (0.19.1 config/speculative.py: eagle-, eagle3; 0.26.0 adds dflash,
# dspark). A method without a drafter of its own (mtp) drafts from the target's path, so a target served
# from, say, /tmp/sparkllm-dflash/model is switched to dflash by vLLM and fails at start (issue 34).
METHOD_GUESS_SUBSTRINGS = ("eagle-", "eagle3", "dflash", "dspark")


def _check_method_guess(errors: list[str], settings: Mapping, catalogue: Mapping) -> None:
    entry = catalogue.get(_get(settings, "spec_method")) if isinstance(catalogue, Mapping) else None
    spec = (entry or {}).get("speculative_config") if isinstance(entry, Mapping) else None
    # vLLM takes eagle3 and dflash as given and builds ngram without a draft model
    if not isinstance(spec, Mapping) or spec.get("method") in ("ngram", "eagle3", "dflash"):
        return
    path = _get(settings, "vllm_model_path")
    if not isinstance(path, str):
        return
    hits = [w for w in METHOD_GUESS_SUBSTRINGS if w in path.lower()]
    if hits:
        errors.append(f"vllm_model_path={path!r} contains {hits[0]!r}: vLLM drafts {spec.get('method')} "
                      f"from the target's path and guesses the method from it, so it would serve "
                      f"{hits[0].rstrip('-')} instead; serve the model from a "
                      f"path without {', '.join(repr(h) for h in METHOD_GUESS_SUBSTRINGS)}")


def _is_backend_name(value, allow_empty: bool = False) -> bool:
    if not isinstance(value, str):
        return False
    if not value:
        return allow_empty
    return value.replace("_", "").isalnum()


def _is_parser_name(value) -> bool:
    return isinstance(value, str) and bool(value) and value.replace("_", "").isalnum()


def _check_backends_per_method(errors: list[str], backends, catalogue: Mapping) -> None:
    name = "vllm_attention_backends"
    example = '{"dflash": "TRITON_ATTN"}'
    if backends is None:
        return
    if not isinstance(backends, Mapping):
        errors.append(f"{name}={backends!r} is not a mapping{_type_hint(name, backends, example)}; set it "
                      f"to a mapping of method -> backend, e.g. {example}, or {{}}")
        return
    for method, backend in backends.items():
        if method not in catalogue:
            errors.append(f"{name} names method {method!r}, which is not a known method; use one of: "
                          f"{_valid_methods(catalogue)}")
        elif not _is_backend_name(backend):
            errors.append(f"{name}[{method!r}]={backend!r} is not a backend name; set it to a vLLM "
                          f"backend such as FLASHINFER, FLASH_ATTN or TRITON_ATTN, or remove the entry "
                          f"to use the method's choice in methods.yml")


# Qwen3.5-122B-A10B's max_position_embeddings (its config.json; the public model cards say "Context
# length: 262,144 tokens" natively). vLLM refuses a longer --max-model-len unless
# VLLM_ALLOW_LONG_MAX_MODEL_LEN is set (vllm/config/model.py:2155-2182 of 0.19.1) - after the build and
# the download, at the serve stage; a RoPE scaling override (--hf-overrides) is what may lengthen it.
MODEL_MAX_POSITIONS = 262144


def _check_context(errors: list[str], settings: Mapping) -> None:
    length = _get(settings, "vllm_max_model_len")
    extra = " ".join(str(x) for x in (_get(settings, "vllm_serve_extra_args") or []))
    if length > MODEL_MAX_POSITIONS and "hf-overrides" not in extra.replace("_", "-"):
        errors.append(f"vllm_max_model_len={length!r} is above {MODEL_MAX_POSITIONS}, the model's "
                      f"max_position_embeddings (vLLM refuses it at the serve stage); set vllm_max_model_len "
                      f"to at most {MODEL_MAX_POSITIONS}, e.g. 262144")


def _check_serving_features(errors: list[str], settings: Mapping) -> None:
    """Tool calling, prefix caching, --max-num-seqs, --load-format, the INT8 LM head (an env var
    of the container, patch 0002; no argv)."""
    for name in ("vllm_enable_auto_tool_choice", "vllm_lm_head_int8", "spark_bad_driver_enforce_eager"):
        value = _get(settings, name)
        if not isinstance(value, bool):
            errors.append(f"{name}={value!r} is not a boolean{_type_hint(name, value, 'false')}; set it "
                          f"to true or false")
    prefix = _get(settings, "vllm_enable_prefix_caching")
    if not isinstance(prefix, bool) and prefix != PREFIX_CACHING_AUTO:
        errors.append(f"vllm_enable_prefix_caching={prefix!r} is not true, false or {PREFIX_CACHING_AUTO!r}"
                      f"{_type_hint('vllm_enable_prefix_caching', prefix, 'false')}; set it to "
                      f"{PREFIX_CACHING_AUTO!r} (each method's choice in methods.yml) or true/false to "
                      f"force it")
    tools = _get(settings, "vllm_enable_auto_tool_choice")
    parser = _get(settings, "vllm_tool_call_parser")
    if tools is True and not _is_parser_name(parser):
        errors.append(f"vllm_tool_call_parser={parser!r} is not a parser name, and tool calling is on "
                      f"(vllm_enable_auto_tool_choice=true); set vllm_tool_call_parser to a tool-call "
                      f"parser vLLM registers (qwen3_coder for Qwen3.5), or set "
                      f"vllm_enable_auto_tool_choice=false to turn tool calling off")
    seqs = _get(settings, "vllm_max_num_seqs")
    if seqs is not None:
        _check_int(errors, "vllm_max_num_seqs", seqs, 1, None, example=8)
    load_format = _get(settings, "vllm_load_format")
    if load_format is None:
        load_format = ""
    if load_format != "" and load_format not in LOAD_FORMATS:
        errors.append(f"vllm_load_format={load_format!r} is not a supported load format; set it to '' "
                      f"(vLLM's default) or one of: {', '.join(LOAD_FORMATS)}")


def _option_name(arg: str) -> str:
    """'--max_model_len=4' -> '--max-model-len' (vLLM's parser accepts both spellings)."""
    return arg.split("=", 1)[0].replace("_", "-")


def _check_extra_args(errors: list[str], extra, eager_forced: bool = False) -> None:
    name = "vllm_serve_extra_args"
    if extra is None:
        return
    example = '["--seed", "1"]'
    if not isinstance(extra, list | tuple):
        errors.append(f"{name}={extra!r} is not a list{_type_hint(name, extra, example)}; set it to a "
                      f"list of strings, one argv word each, e.g. {example}")
        return
    for i, arg in enumerate(extra):
        if not isinstance(arg, str) or not arg.strip():
            errors.append(f"{name}[{i}]={arg!r} must be a non-empty string (one argv word; numbers "
                          f"as strings, e.g. {example})")
            continue
        option = _option_name(arg) if arg.startswith("--") else None
        if option in _MANAGED_OPTIONS:
            errors.append(f"{name}[{i}]={arg!r} repeats an option the toolkit sets itself "
                          f"(from {_MANAGED_OPTIONS[option]}); remove it from {name}")
        elif option in _EAGER_OPTIONS and eager_forced:
            errors.append(f"{name}[{i}]={arg!r} repeats or undoes the --enforce-eager the toolkit sets "
                          f"(spark_bad_driver_enforce_eager=true: CUDA graphs deadlock on a 590.x driver); "
                          f"remove it from {name}")
        elif option in _FLAG_OPTIONS.values():
            errors.append(f"{name}[{i}]={arg!r} repeats a flag the method catalogue sets "
                          f"(serve_flags in methods.yml); change it there instead")


def spark_speculative_config(settings: Mapping, catalogue: Mapping) -> dict | None:
    """The --speculative-config for the selected method: catalogue default + user overrides.

    None for a method without speculation (baseline). Raises ValueError for an unknown method.
    """
    method = _get(settings, "spec_method")
    entry = _entry(catalogue, method)
    if entry is None:
        raise ValueError(f"spec_method={method!r} is not a known method; set spec_method to one of: "
                         f"{_valid_methods(catalogue)}")
    return _merged_speculative_config(settings, entry)


def _speculative_json(config: Mapping) -> str:
    """Compact, deterministic JSON (sorted keys, no spaces) so an unchanged config renders the same."""
    return json.dumps(dict(config), sort_keys=True, separators=(",", ":"))


def _fmt_number(value) -> str:
    return repr(float(value)) if isinstance(value, float) else str(value)


def spark_serve_argv(settings: Mapping, catalogue: Mapping) -> list[str]:
    """The arguments that follow ``vllm serve`` for the selected method, as a list of strings.

    Validates first and raises ValueError listing every problem. The API key is deliberately NOT
    part of the argument list (argv is world-readable via /proc and shows up in ``ps`` and the
    journal): the serve role writes ``VLLM_API_KEY=<key>`` into a 0600 environment file that the
    unit passes to the container, and vLLM reads the key from that variable.

    Never emits ``--disable-log-stats`` (speculative decoding metrics are only counted with stats
    logging on). Prefix caching is always stated explicitly (hybrids default to off in vLLM 0.19.1 and
    to on in 0.26.0): ``--enable-prefix-caching --mamba-cache-mode <mode>`` or
    ``--no-enable-prefix-caching``, as ``spark_prefix_caching`` decides.
    Tool calling (``--enable-auto-tool-choice --tool-call-parser <vllm_tool_call_parser>``) is on
    unless ``vllm_enable_auto_tool_choice`` is false.
    """
    errors = spark_method_settings_errors(settings, catalogue)
    if errors:
        raise ValueError("invalid serve settings:\n- " + "\n- ".join(errors))
    method = _get(settings, "spec_method")
    entry = catalogue[method]
    flags = dict(entry.get("serve_flags") or {})
    unknown = set(flags) - _KNOWN_SERVE_FLAGS
    if unknown:
        raise CatalogueError(f"method {method!r}: unknown serve_flags {sorted(unknown)}; known: "
                             f"{sorted(_KNOWN_SERVE_FLAGS)}")

    flags["attention_backend"] = spark_attention_backend(settings, catalogue)
    gpu = spark_memory_utilization(_get(settings, "vllm_gpu_memory_utilization"), catalogue, method)

    argv = [
        _get(settings, "vllm_model_path"),
        "--served-model-name", _get(settings, "vllm_served_model_name"),
        "--host", _get(settings, "vllm_host"),
        "--port", str(_get(settings, "vllm_port")),
        "--max-model-len", str(_get(settings, "vllm_max_model_len")),
        "--gpu-memory-utilization", _fmt_number(gpu),
    ]
    prefix = spark_prefix_caching(settings, catalogue)
    if not prefix["enabled"]:
        argv.append("--no-enable-prefix-caching")
    else:
        argv.append("--enable-prefix-caching")
        if prefix["mamba_cache_mode"]:
            argv += ["--mamba-cache-mode", prefix["mamba_cache_mode"]]
    parser = _get(settings, "vllm_reasoning_parser")
    if parser:
        argv += ["--reasoning-parser", parser]
    if _get(settings, "vllm_enable_auto_tool_choice"):
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", _get(settings, "vllm_tool_call_parser")]
    if _get(settings, "vllm_max_num_seqs") is not None:
        argv += ["--max-num-seqs", str(_get(settings, "vllm_max_num_seqs"))]
    if _get(settings, "vllm_load_format"):
        argv += ["--load-format", _get(settings, "vllm_load_format")]
    if _get(settings, "spark_bad_driver_enforce_eager"):
        argv.append("--enforce-eager")
    config = spark_speculative_config(settings, catalogue)
    if config:
        argv += ["--speculative-config", _speculative_json(config)]
    for key, option in _FLAG_OPTIONS.items():
        if flags.get(key) is not None:
            argv += [option, str(flags[key])]

    tp = _get(settings, "spark_tensor_parallel_size")
    backend = _get(settings, "spark_distributed_backend") or None
    if tp > 1:
        argv += ["--tensor-parallel-size", str(tp)]
    if backend:
        argv += ["--distributed-executor-backend", backend]
    nnodes = _get(settings, "spark_nnodes")
    if nnodes > 1:
        rank = _get(settings, "spark_node_rank")
        argv += ["--nnodes", str(nnodes), "--node-rank", str(rank),
                 "--master-addr", _get(settings, "spark_master_addr")]
        if _get(settings, "spark_master_port") is not None:
            argv += ["--master-port", str(_get(settings, "spark_master_port"))]
        if rank > 0:
            argv.append("--headless")
    argv += list(_get(settings, "vllm_serve_extra_args") or [])
    return [str(a) for a in argv]


def spark_prefix_caching(settings: Mapping, catalogue: Mapping) -> dict:
    """Prefix caching for the selected method: ``{"enabled": bool, "mamba_cache_mode": str | None,
    "source": "knob" | "catalogue"}``.

    ``vllm_enable_prefix_caching`` true/false forces it; "auto" takes the method's ``prefix_caching``
    entry in methods.yml (``default``, with the evidence beside it). ``mamba_cache_mode`` is the
    catalogue's (how vLLM caches the hybrid's DeltaNet state) when prefix caching is on, else None.
    Raises CatalogueError for a malformed entry, ValueError for an unknown method or a bad knob.
    """
    method = _get(settings, "spec_method")
    entry = _entry(catalogue, method)
    if entry is None:
        raise ValueError(f"spec_method={method!r} is not a known method; set spec_method to one of: "
                         f"{_valid_methods(catalogue)}")
    spec = entry.get("prefix_caching")
    if (not isinstance(spec, Mapping) or not isinstance(spec.get("default"), bool)
            or spec.get("mamba_cache_mode") not in (None, *MAMBA_CACHE_MODES)):
        raise CatalogueError(f"method {method!r}: prefix_caching must be a mapping with a boolean 'default' "
                             f"and 'mamba_cache_mode' one of {MAMBA_CACHE_MODES} or null; got {spec!r}")
    knob = _get(settings, "vllm_enable_prefix_caching")
    if isinstance(knob, bool):
        enabled, source = knob, "knob"
    elif knob == PREFIX_CACHING_AUTO:
        enabled, source = spec["default"], "catalogue"
    else:
        raise ValueError(f"vllm_enable_prefix_caching={knob!r} is not true, false or {PREFIX_CACHING_AUTO!r}")
    return {"enabled": enabled, "mamba_cache_mode": spec.get("mamba_cache_mode") if enabled else None,
            "source": source}


def spark_attention_backend(settings: Mapping, catalogue: Mapping) -> str | None:
    """The --attention-backend of the selected method (None: leave the option out, vLLM chooses).

    Most specific first: ``vllm_attention_backends[method]``, then ``vllm_attention_backend`` (every
    method), then the catalogue's ``serve_flags.attention_backend``.
    """
    method = _get(settings, "spec_method")
    entry = _entry(catalogue, method)
    if entry is None:
        raise ValueError(f"spec_method={method!r} is not a known method; set spec_method to one of: "
                         f"{_valid_methods(catalogue)}")
    per_method = _get(settings, "vllm_attention_backends") or {}
    if isinstance(per_method, Mapping) and per_method.get(method):
        return per_method[method]
    if _get(settings, "vllm_attention_backend"):
        return _get(settings, "vllm_attention_backend")
    return (entry.get("serve_flags") or {}).get("attention_backend")


def spark_settings(variables: Mapping, overrides: Mapping | None = None) -> dict:
    """THE settings of the argv filter, picked from a host's variables: the one builder that
    validation (playbooks/validate.yml), the serve role, the cluster record and the bench record use,
    so that the unit, the records and what was validated are the same.

    Names the mapping does not define are left out (they take SETTING_DEFAULTS). A name set to null
    is kept as None: "null = vLLM's default", the filter renders no option for it (never the toolkit's
    default). ``overrides`` (e.g. the model path inside the container, a pinned drafter) win.
    """
    picked = {}
    if isinstance(variables, Mapping):
        for name in SETTING_DEFAULTS:
            if name in variables:
                picked[name] = variables[name]
    picked.update(overrides or {})
    return picked


def spark_method_variant(method: str, catalogue: Mapping, variants: Mapping) -> dict:
    """The vLLM build (spark_vllm_variants entry, plus its key as ``name``) a method needs."""
    entry = _entry(catalogue, method)
    if entry is None:
        raise ValueError(f"spec_method={method!r} is not a known method; set spec_method to one of: "
                         f"{_valid_methods(catalogue)}")
    name = entry.get("vllm_variant")
    if not isinstance(variants, Mapping) or name not in variants:
        raise CatalogueError(f"method {method!r} names vllm_variant {name!r}, which is not in "
                             f"spark_vllm_variants")
    return {"name": name, **dict(variants[name])}


def spark_server_env(method: str, catalogue: Mapping, lm_head_int8=False,
                     extra: Mapping | None = None) -> dict[str, str]:
    """The environment every vLLM process of ``method`` needs: the catalogue's ``server_env``,
    ``SPARKLLM_LM_HEAD_INT8=1`` with the INT8 head (patch 0002 reads it where the model loads), and
    ``extra`` (the owner's serve_container_env, for the Ray units; the server gets it as docker options).

    One source for the server container (serve's env template) and the Ray head and worker units
    (ray_cluster): with the Ray backend the model runs in Ray's processes, and vLLM copies to them only
    the variables of its own prefixes (vllm/ray/ray_env.py, DEFAULT_ENV_VAR_PREFIXES).
    """
    entry = _entry(catalogue, method)
    if entry is None:
        raise ValueError(f"spec_method={method!r} is not a known method; set spec_method to one of: "
                         f"{_valid_methods(catalogue)}")
    env = {str(k): str(v) for k, v in (entry.get("server_env") or {}).items()}
    if lm_head_int8 is True or (isinstance(lm_head_int8, str)
                                and lm_head_int8.lower() in ("true", "1", "yes")):
        env["SPARKLLM_LM_HEAD_INT8"] = "1"
    env.update({str(k): str(v) for k, v in (extra or {}).items()})
    for name, value in env.items():
        if not _ENV_NAME_RE.fullmatch(name) or not _ENV_VALUE_RE.fullmatch(value):
            raise CatalogueError(f"method {method!r}: server environment {name}={value!r} (server_env or "
                                 f"serve_container_env) must be an upper-case name and a plain value "
                                 f"(letters, digits, _ . , : / = + -)")
    return dict(sorted(env.items()))


class FilterModule:
    """Ansible filters: spark_method_settings_errors, spark_speculative_config, spark_serve_argv,
    spark_method_variant, spark_settings, spark_server_env, spark_prefix_caching."""

    def filters(self):
        return {
            "spark_method_settings_errors": spark_method_settings_errors,
            "spark_speculative_config": spark_speculative_config,
            "spark_serve_argv": spark_serve_argv,
            "spark_method_variant": spark_method_variant,
            "spark_settings": spark_settings,
            "spark_server_env": spark_server_env,
            "spark_prefix_caching": spark_prefix_caching,
        }
