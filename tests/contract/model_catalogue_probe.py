"""Ask the real vLLM about a model catalogue entry (no GPU, no checkpoint): the serve namespace our argv
parses to, including the KV-cache dtype, and what the release's model registry and speculative config
say about the entry's architecture and its MTP head.

Importable (tests/contract/test_model_catalogue_contract.py uses it in-process with .venv-vllm's vLLM
0.19.1) and runnable (``python model_catalogue_probe.py < requests.json`` in a subprocess with another
release's pure-Python tree first on PYTHONPATH, as vllm_probe.py is). Requests: a JSON list of
``{"argv": [...]}`` or ``{"architecture": name, "model_type": type, "text_config": {...}}``; the answer
is a JSON list on the last stdout line, prefixed with ``MODEL_PROBE_RESULT``.
"""

from __future__ import annotations

import json
import sys
from typing import Any

try:  # in-process (the contract tests) or as a script with tests/contract on PYTHONPATH
    from tests.contract import vllm_probe
except ImportError:  # pragma: no cover - the subprocess path
    import vllm_probe


def serve(argv: list[str]) -> dict[str, Any]:
    """vllm_probe.parse_serve, plus the KV-cache dtype the parser set and whether vLLM's CacheConfig
    accepts it (the engine builds one from it)."""
    result = vllm_probe.parse_serve(argv)
    if not result["ok"]:
        return result
    from pydantic import ValidationError
    from vllm.config import CacheConfig

    parser, _ = vllm_probe.build_serve_parser()
    dtype = parser.parse_args(["serve", *argv]).kv_cache_dtype
    result["args"]["kv_cache_dtype"] = dtype
    try:
        CacheConfig(cache_dtype=dtype)
    except ValidationError as exc:
        result["args"]["kv_cache_dtype_error"] = "; ".join(e["msg"] for e in exc.errors())
    else:
        result["args"]["kv_cache_dtype_error"] = None
    return result


def architecture(name: str, model_type: str, text_config: dict[str, Any]) -> dict[str, Any]:
    """Whether this release registers ``name``, and where its MTP path leads: the checkpoint's config
    built with the config class vLLM ships for ``model_type`` (vllm/transformers_utils/config.py), run
    through ``SpeculativeConfig.hf_config_override`` (what the MTP drafter's ModelConfig applies), and
    whether the drafter class it names is registered too."""
    vllm_probe.force_cpu_platform()
    from vllm.config.speculative import SpeculativeConfig
    from vllm.model_executor.models.registry import ModelRegistry
    from vllm.transformers_utils.config import _CONFIG_REGISTRY

    supported = set(ModelRegistry.get_supported_archs())
    answer: dict[str, Any] = {"registered": name in supported}
    info = ModelRegistry._try_inspect_model_cls(name) if name in supported else None
    answer["is_hybrid"] = None if info is None else bool(info.is_hybrid)
    if model_type not in _CONFIG_REGISTRY:
        answer["config_class"] = None
        return answer
    config = _CONFIG_REGISTRY[model_type](architectures=[name], text_config=dict(text_config))
    answer["config_class"] = type(config).__name__
    answer["config_model_type"] = config.model_type
    override = SpeculativeConfig.hf_config_override(config)
    drafter = list(override.architectures or [])
    answer["mtp_model_type"] = override.model_type
    answer["mtp_architectures"] = drafter
    answer["mtp_registered"] = bool(drafter) and drafter[0] != name and drafter[0] in supported
    return answer


def main() -> int:
    requests = json.load(sys.stdin)
    vllm_probe.force_cpu_platform()
    answers: list[dict[str, Any]] = [{"vllm_version": vllm_probe.vllm_version()}]
    for req in requests:
        if "argv" in req:
            answers.append(serve(req["argv"]))
        else:
            answers.append(architecture(req["architecture"], req["model_type"], req.get("text_config") or {}))
    print("MODEL_PROBE_RESULT " + json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
