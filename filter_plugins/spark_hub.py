"""Drafter revisions on the Hugging Face Hub: resolved to a commit once, then locked (controller side).

A speculative method whose drafter is a Hub repo id (DFlash's z-lab drafter; an EAGLE-3 repo) is
downloaded by vLLM inside the server container. Left at ``main``, every restart could load a
different drafter (the 122B DFlash drafter was retrained in June 2026). The serve role therefore
passes vLLM a commit SHA as the drafter's ``revision``:

- ``spark_drafter_lock``: the commit a deploy uses without asking the Hub: the knob itself when it is
  a commit SHA; else the commit recorded in ``spark_serve.fact`` for the same repo and requested
  revision, unless an update is asked for; else "" (resolve it now).
- ``spark_hub_commit``: resolve a branch or tag to its commit with ``huggingface_hub`` (the
  controller's venv has it), honouring ``HF_ENDPOINT``; errors name the repo, the revision and the fix,
  never the token.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

COMMIT_RE = re.compile(r"[0-9a-f]{40}")
DEFAULT_REVISION = "main"


def _truthy(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "1", "on")
    return bool(value)


def lock_key(repo: str, requested: str) -> str:
    return f"{repo}@{requested or DEFAULT_REVISION}"


def spark_drafter_lock(fact: Mapping[str, Any] | None, repo: str, requested: str = "",
                       update: Any = False) -> str:
    """The commit to serve ``repo`` at without asking the Hub, or "" when it must be resolved."""
    requested = requested or ""
    if COMMIT_RE.fullmatch(requested):
        return requested
    if _truthy(update):
        return ""
    locks = (fact or {}).get("drafter_revisions") or {}
    recorded = locks.get(lock_key(repo, requested), "") if isinstance(locks, Mapping) else ""
    return recorded if isinstance(recorded, str) and COMMIT_RE.fullmatch(recorded) else ""


def spark_hub_commit(repo: str, requested: str = "", token: str | None = None, endpoint: str = "",
                     knob: str = "the drafter revision") -> str:
    """The commit SHA ``repo`` at ``requested`` (a branch or tag; "" = main) points to now."""
    revision = requested or DEFAULT_REVISION
    if COMMIT_RE.fullmatch(revision):
        return revision
    where = endpoint or os.environ.get("HF_ENDPOINT") or "https://huggingface.co"
    fix = (f"check that the controller reaches {where} (HF_ENDPOINT), that the token (HF_TOKEN) may read "
           f"{repo}, or set {knob} to a commit SHA")
    try:
        from huggingface_hub import HfApi
    except ImportError as exc:  # the controller runs Ansible outside the project's venv
        raise ValueError(f"resolving {repo}@{revision} needs huggingface_hub on the controller "
                         f"(`make setup` installs it); or set {knob} to a commit SHA") from exc
    try:
        info = HfApi(endpoint=endpoint or None).model_info(repo, revision=revision, token=token or False,
                                                           timeout=30)
    except Exception as exc:  # noqa: BLE001 - every Hub failure gets the same fix
        raise ValueError(f"could not resolve the Hub revision {repo}@{revision} to a commit "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else 'no detail'}); "
                         f"{fix}") from None
    sha = getattr(info, "sha", None) or ""
    if not COMMIT_RE.fullmatch(sha):
        raise ValueError(f"the Hub answered for {repo}@{revision} without a commit SHA ({sha!r}); {fix}")
    return sha


class FilterModule:
    def filters(self):
        return {"spark_drafter_lock": spark_drafter_lock, "spark_hub_commit": spark_hub_commit}
