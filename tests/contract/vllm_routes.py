"""Every HTTP route a vLLM release's API server can register, read from its source (no import).

``vllm serve`` builds its FastAPI app from the routers under ``vllm/entrypoints`` (which of them it
mounts depends on the model's tasks and flags such as ``VLLM_SERVER_DEV_MODE``), so this collects
the union over all of them: every ``@<router or app>.<verb>(path)`` decorator, every
``add_api_route`` / ``add_route`` / ``add_websocket_route`` / ``mount`` call and every starlette
``Route`` / ``Mount`` / ``WebSocketRoute`` with a literal path, plus FastAPI's own documentation
routes (``/docs``, ``/redoc``, ``/openapi.json``, ``/docs/oauth2-redirect``), which 0.19.1 and 0.26.0
serve through ``serve/instrumentator/offline_docs.py`` or FastAPI's defaults. The legacy demo server
``vllm/entrypoints/api_server.py`` (``python -m vllm.entrypoints.api_server``, not ``vllm serve``) is
left out. Standard library only, so the same code reads 0.19.1's installed package and 0.26.0's
overlay.
"""

from __future__ import annotations

import ast
from pathlib import Path

VERBS = {"get", "post", "put", "delete", "patch", "head", "options", "api_route", "websocket", "route"}
CALLS = {"add_api_route", "add_route", "add_websocket_route", "add_api_websocket_route", "mount"}
CLASSES = {"Route", "Mount", "WebSocketRoute", "APIRoute", "APIWebSocketRoute"}
FASTAPI_DOCS = ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect")
LEGACY = "entrypoints/api_server.py"


def _literal_path(call: ast.Call) -> str | None:
    arg = call.args[0] if call.args else next((k.value for k in call.keywords if k.arg == "path"), None)
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str) and arg.value.startswith("/"):
        return arg.value
    return None


def _callee(call: ast.Call) -> str:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else (f.id if isinstance(f, ast.Name) else "")


def routes_in(source: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for dec in node.decorator_list:
                if (isinstance(dec, ast.Call) and isinstance(dec.func, ast.Attribute)
                        and dec.func.attr in VERBS):
                    path = _literal_path(dec)
                    if path:
                        found.add(path)
        elif isinstance(node, ast.Call) and _callee(node) in CALLS | CLASSES:
            path = _literal_path(node)
            if path:
                found.add(path)
    return found


def release_routes(vllm_dir: Path) -> dict[str, set[str]]:
    """path -> the files (relative to vllm/) that register it."""
    out: dict[str, set[str]] = {p: {"fastapi"} for p in FASTAPI_DOCS}
    for py in sorted((vllm_dir / "entrypoints").rglob("*.py")):
        rel = py.relative_to(vllm_dir).as_posix()
        if rel == LEGACY or "/tests/" in rel:
            continue
        for path in routes_in(py.read_text(encoding="utf-8")):
            out.setdefault(path, set()).add(rel)
    return out


def build_app_routes() -> list[list]:
    """[path, sorted methods] of the FastAPI app a real ``vllm serve`` builds for a generate model
    (run with the contract environment's vLLM, platform forced to CPU; prints one JSON line)."""
    import vllm.platforms as platforms
    from vllm.platforms.cpu import CpuPlatform

    platforms._current_platform = CpuPlatform()
    from vllm.entrypoints.openai.api_server import build_app
    from vllm.entrypoints.openai.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "/model", "--api-key", "k"])

    def walk(routes, prefix=""):
        for r in routes:
            if hasattr(r, "path"):
                yield [prefix + r.path, sorted(getattr(r, "methods", None) or [])]
            else:  # FastAPI's _IncludedRouter (include_router): its own routes under a prefix
                sub = getattr(r, "original_router", None) or r.router
                yield from walk(sub.routes, prefix + (getattr(r, "prefix", "") or ""))

    return list(walk(build_app(args, ("generate",)).routes))


if __name__ == "__main__":
    import json

    print("VLLM_ROUTES " + json.dumps(build_app_routes()))
