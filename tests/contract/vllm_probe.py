"""Ask the real vLLM package about serve arguments and speculative configs (no GPU, no model).

Importable (the contract tests use it in-process with .venv-vllm's vLLM 0.19.1) and runnable
(``python vllm_probe.py < requests.json``, used in a subprocess for a second vLLM version put
first on PYTHONPATH). Requests: a JSON list of ``{"argv": [...]}``, ``{"speculative": {...}}`` or
``{"tool_call": {"parser": name, "text": model output, "tools": [OpenAI tool, ...]}}`` or
``{"hybrid_prefix": architecture}`` (how this vLLM caches a hybrid's prefix, ``hybrid_prefix_caching``);
the answer is a JSON list on the last stdout line, prefixed with ``VLLM_PROBE_RESULT``.

The platform is forced to vLLM's CPU platform before vLLM is first used.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import sys
from typing import Annotated, Any

# Parsed serve options reported back (attribute names of vLLM's argparse namespace).
REPORTED = (
    "model_tag", "served_model_name", "host", "port", "max_model_len", "gpu_memory_utilization",
    "reasoning_parser", "speculative_config", "attention_backend", "max_num_batched_tokens",
    "enable_prefix_caching", "disable_log_stats", "tensor_parallel_size",
    "distributed_executor_backend", "nnodes", "node_rank", "master_addr", "master_port", "headless",
    "api_key", "enforce_eager", "max_num_seqs", "enable_auto_tool_choice", "tool_call_parser",
    "load_format", "mamba_cache_mode",
)


def force_cpu_platform() -> None:
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    if not isinstance(platforms._current_platform, CpuPlatform):
        platforms._current_platform = CpuPlatform()


def vllm_version() -> str:
    import vllm

    return vllm.__version__


@functools.cache
def build_serve_parser():
    """The `vllm serve` parser exactly as vLLM's CLI main builds it (top parser + subcommand)."""
    force_cpu_platform()
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(description="vLLM CLI")
    subparsers = parser.add_subparsers(required=False, dest="subparser")
    serve = ServeSubcommand()
    serve.subparser_init(subparsers)
    return parser, serve


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)


def parse_serve(argv: list[str]) -> dict[str, Any]:
    """Parse ``vllm serve <argv>``; return {"ok": True, "args": {...}} or {"ok": False, ...}.

    Runs vLLM's own post-parse validation and converts the namespace to AsyncEngineArgs, as
    ``vllm serve`` does before it builds the engine.
    """
    parser, serve = build_serve_parser()
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = parser.parse_args(["serve", *argv])
    except SystemExit as exc:
        return {"ok": False, "exit_code": exc.code, "stderr": err.getvalue()[-2000:]}
    serve.validate(args)
    if args.model_tag is not None:
        args.model = args.model_tag
    from vllm.engine.arg_utils import AsyncEngineArgs

    engine_args = AsyncEngineArgs.from_cli_args(args)
    reported = {name: _jsonable(getattr(args, name, "<absent>")) for name in REPORTED}
    reported["engine_model"] = engine_args.model
    reported["engine_speculative_config"] = _jsonable(engine_args.speculative_config)
    reported.update(_check_attention(engine_args.attention_backend))
    reported.update(_check_tools_and_loader(args, engine_args))
    reported.update(_check_parallel(engine_args))
    reported.update(_check_cache(engine_args))
    return {"ok": True, "args": reported}


def _check_cache(engine_args) -> dict[str, Any]:
    """Build vLLM's CacheConfig from the parsed prefix-caching options (a mamba cache mode this release
    does not know is refused there, as the engine would)."""
    from pydantic import ValidationError
    from vllm.config import CacheConfig

    try:
        config = CacheConfig(enable_prefix_caching=bool(engine_args.enable_prefix_caching),
                             mamba_cache_mode=engine_args.mamba_cache_mode)
    except ValidationError as exc:
        return {"cache_config": "error: " + "; ".join(e["msg"] for e in exc.errors())}
    return {"cache_config": "ok", "cache_mamba_cache_mode": config.mamba_cache_mode}


def hybrid_prefix_caching(architecture: str) -> dict[str, Any]:
    """What this vLLM says about prefix caching for a model class, without a model: whether its registry
    marks it hybrid and able to cache Mamba state in "all" mode (else vLLM falls back to "align"), and
    whether a generative hybrid gets prefix caching by default (ModelConfig.is_prefix_caching_supported,
    asked with just the attributes it reads)."""
    force_cpu_platform()
    from types import SimpleNamespace

    from vllm.config import ModelConfig
    from vllm.model_executor.models.registry import ModelRegistry

    info = ModelRegistry._try_inspect_model_cls(architecture)
    if info is None:
        return {"ok": False, "error": f"{architecture} is not registered"}
    default_on = ModelConfig.is_prefix_caching_supported.fget(
        SimpleNamespace(attn_type="hybrid", pooler_config=None))
    return {"ok": True, "is_hybrid": info.is_hybrid,
            "supports_mamba_prefix_caching": info.supports_mamba_prefix_caching,
            "hybrid_default_prefix_caching": bool(default_on)}


def _check_attention(backend) -> dict[str, Any]:
    """The parser keeps --attention-backend as a string; vLLM's AttentionConfig resolves it."""
    if backend is None:
        return {"attention_backend_resolved": None}
    from pydantic import ValidationError
    from vllm.config.attention import AttentionConfig

    try:
        resolved = AttentionConfig(backend=backend).backend
    except ValidationError as exc:
        return {"attention_backend_error": "; ".join(e["msg"] for e in exc.errors())}
    return {"attention_backend_resolved": getattr(resolved, "name", str(resolved))}


def tool_parsers() -> list[str]:
    """The tool-call parser names this vLLM registers (what --tool-call-parser may name)."""
    from vllm.tool_parsers import ToolParserManager

    return sorted(ToolParserManager.list_registered())


def load_formats() -> list[str]:
    """The --load-format values this vLLM has a model loader for."""
    from vllm.model_executor.model_loader import _LOAD_FORMAT_TO_MODEL_LOADER

    return sorted(_LOAD_FORMAT_TO_MODEL_LOADER)


def _check_tools_and_loader(args, engine_args) -> dict[str, Any]:
    """What the API server checks before it builds the engine: the tool-call parser is registered
    (api_server.validate_api_server_args), and the load format has a loader (LoadConfig)."""
    from vllm.config import LoadConfig

    out: dict[str, Any] = {
        "tool_call_parser_registered": (args.tool_call_parser in tool_parsers()
                                        if args.tool_call_parser else None),
    }
    load_format = LoadConfig(load_format=engine_args.load_format).load_format
    out["load_format_resolved"] = load_format
    out["load_format_registered"] = load_format in load_formats()
    return out


class _VocabTokenizer:
    """Just enough tokenizer for a tool parser: the vocabulary of its marker tokens."""

    def __init__(self, tokens: list[str]):
        self._vocab = {t: 150000 + i for i, t in enumerate(tokens)}

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab)


def extract_tool_calls(request: dict[str, Any]) -> dict[str, Any]:
    """Run the named tool-call parser of this vLLM on a model output (non-streaming)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    tokenizer = _VocabTokenizer(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    try:
        chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}],
                                     tools=request["tools"], tool_choice="auto")
        # the request's tools go to the parser too: 0.20 reads their schema from there
        parser = ToolParserManager.get_tool_parser(request["parser"])(tokenizer, chat.tools)
        info = parser.extract_tool_calls(request["text"], chat)
    except Exception as exc:  # noqa: BLE001 - reported to the test, which decides
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True, "tools_called": info.tools_called,
            "calls": [{"name": c.function.name, "arguments": json.loads(c.function.arguments)}
                      for c in info.tool_calls]}


def _check_parallel(engine_args) -> dict[str, Any]:
    """Build vLLM's ParallelConfig from the parsed parallel options (what the engine would use).

    The ray backend needs Ray importable, which the contract environment does not install:
    that specific failure is reported as "needs_ray" (everything before it was accepted).
    """
    from typing import get_args

    from pydantic import ValidationError
    from vllm.config import ParallelConfig
    from vllm.config.parallel import DistributedExecutorBackend

    backend = engine_args.distributed_executor_backend
    out: dict[str, Any] = {
        "executor_backend_known": backend is None or backend in get_args(DistributedExecutorBackend),
    }
    kwargs = {
        "tensor_parallel_size": engine_args.tensor_parallel_size,
        "distributed_executor_backend": backend,
        "nnodes": engine_args.nnodes,
        "node_rank": engine_args.node_rank,
        "master_addr": engine_args.master_addr,
        "master_port": engine_args.master_port,
    }
    try:
        config = ParallelConfig(**kwargs)
    except ValidationError as exc:
        msgs = "; ".join(e["msg"] for e in exc.errors())
        out["parallel_config"] = "needs_ray" if "Failed to import Ray" in msgs else f"error: {msgs}"
    else:
        out["parallel_config"] = "ok"
        out["parallel_world_size"] = config.world_size
    return out


def speculative_methods() -> list[str]:
    """Every value vLLM's SpeculativeConfig.method accepts (the Literal type, flattened)."""
    force_cpu_platform()
    from typing import get_args

    from vllm.config.speculative import SpeculativeMethod

    def flatten(tp) -> list[str]:
        out: list[str] = []
        for arg in get_args(tp):
            out += flatten(arg) if get_args(arg) else [arg]
        return out

    return sorted(set(flatten(SpeculativeMethod)))


def check_speculative(config: dict[str, Any]) -> dict[str, Any]:
    """Validate a speculative config with vLLM's SpeculativeConfig as far as possible without a model.

    1. every key is a SpeculativeConfig field and its value passes that field's pydantic type
       (method Literal, integer constraints, ...);
    2. the config is constructed: fully for model-free methods (ngram). Methods that need the
       target model's config (mtp, eagle3, dflash) stop at that point; the stage reached is
       reported so the caller can tell "rejected" from "needs a model".
    """
    force_cpu_platform()
    from pydantic import TypeAdapter, ValidationError
    from vllm.config import SpeculativeConfig

    fields = SpeculativeConfig.__pydantic_fields__
    # The class's own "before" field validators run first, as in construction (0.26.0 parses
    # attention_backend names such as "TRITON_ATTN" into AttentionBackendEnum members this way).
    before = {}
    for dec in SpeculativeConfig.__pydantic_decorators__.field_validators.values():
        if dec.info.mode == "before":
            for name in dec.info.fields:
                before.setdefault(name, []).append(dec.func)
    report: dict[str, Any] = {"field_errors": {}, "constructed": False, "stage_error": None,
                              "parsed": {}}
    for key, value in config.items():
        if key not in fields:
            report["field_errors"][key] = "not a SpeculativeConfig field"
            continue
        info = fields[key]
        tp = Annotated[(info.annotation, *info.metadata)] if info.metadata else info.annotation
        try:
            for func in before.get(key, ()):
                value = func(value)
            parsed = TypeAdapter(tp).validate_python(value)
        except ValidationError as exc:
            report["field_errors"][key] = "; ".join(e["msg"] for e in exc.errors())
        except (KeyError, ValueError) as exc:
            report["field_errors"][key] = f"{type(exc).__name__}: {exc}"
        else:
            report["parsed"][key] = getattr(parsed, "name", None) or _jsonable(parsed)
    backend = report["parsed"].get("attention_backend")
    if backend:
        # what the DFlash loader needs of the drafter's backend (use_non_causal in its selector)
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        try:
            backend_cls = AttentionBackendEnum[backend].get_class()
            report["attention_backend_non_causal"] = bool(backend_cls.supports_non_causal())
        except Exception as exc:  # noqa: BLE001 - a backend whose module cannot load here
            report["attention_backend_non_causal"] = f"{type(exc).__name__}: {exc}"
    try:
        built = SpeculativeConfig(**config)
    except ValidationError as exc:
        report["stage_error"] = f"ValidationError: {exc}"
    except (AttributeError, ValueError) as exc:
        report["stage_error"] = f"{type(exc).__name__}: {exc}"
    else:
        report["constructed"] = True
        report["built"] = {
            "method": built.method,
            "num_speculative_tokens": built.num_speculative_tokens,
            "prompt_lookup_min": built.prompt_lookup_min,
            "prompt_lookup_max": built.prompt_lookup_max,
            "model": built.model,
        }
    return report


def main() -> int:
    requests = json.load(sys.stdin)
    force_cpu_platform()
    answers: list[dict[str, Any]] = [{"vllm_version": vllm_version(), "methods": speculative_methods(),
                                      "tool_parsers": tool_parsers(), "load_formats": load_formats()}]
    for req in requests:
        if "argv" in req:
            answers.append(parse_serve(req["argv"]))
        elif "tool_call" in req:
            answers.append(extract_tool_calls(req["tool_call"]))
        elif "hybrid_prefix" in req:
            answers.append(hybrid_prefix_caching(req["hybrid_prefix"]))
        else:
            answers.append(check_speculative(req["speculative"]))
    print("VLLM_PROBE_RESULT " + json.dumps(answers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
