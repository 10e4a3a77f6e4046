"""The model stage's and the serve stage's state decisions, in one tested place.

Pure Python (standard library only); Ansible only needs the ``FilterModule`` at the bottom.

- ``spark_manifest_matches``: is a directory still what its recorded manifest says (the manifest's
  sha256 equals the recorded one, every listed file present with its size)?
- ``spark_fetch_todo``: which checkpoints ``model_fetch`` still has to fetch.
- ``spark_hybrid_current``: whether ``model_hybrid``'s merged model is current.
- ``spark_revision_lock`` / ``spark_fetch_record`` / ``spark_model_revision``: a branch is resolved to
  a commit once, at the first fetch, and recorded; reruns read the recorded commit until an update is
  asked for.
- ``spark_fact_merge``: the one merge rule of the ``spark_model`` local fact (both roles write it
  through ``roles/spark_tools/tasks/model_fact.yml``).
- ``spark_method_image``: the vLLM image of a method's build variant (override, the build role's
  published images, the build's local fact).
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

COMMIT_RE = re.compile(r"[0-9a-f]{40}")


def _truthy(value: Any) -> bool:
    """A boolean that Ansible may have templated into a string ("True", "false", "yes")."""
    if isinstance(value, str):
        return value.strip().lower() in ("true", "yes", "1", "on")
    return bool(value)


def _manifest_text(slurp: Mapping[str, Any] | None) -> str | None:
    """The decoded text of an ``ansible.builtin.slurp`` result, None when it read nothing."""
    if not isinstance(slurp, Mapping) or slurp.get("content") is None:
        return None
    raw = base64.b64decode(slurp["content"])
    return raw.decode("utf-8")


def _sizes(find: Mapping[str, Any] | None) -> dict[str, int]:
    """path -> size of an ``ansible.builtin.find`` result."""
    files = (find or {}).get("files") or []
    return {f["path"]: int(f["size"]) for f in files if "path" in f and "size" in f}


def spark_manifest_matches(
    slurp: Mapping[str, Any] | None,
    find: Mapping[str, Any] | None,
    directory: str,
    recorded_sha256: str,
) -> bool:
    """True when the manifest read by ``slurp`` hashes to ``recorded_sha256`` (the sha256 of its
    bytes, as the roles record it) and every file it lists is in ``find`` with the listed size."""
    text = _manifest_text(slurp)
    if text is None or not recorded_sha256:
        return False
    if hashlib.sha256(text.encode("utf-8")).hexdigest() != recorded_sha256:
        return False
    try:
        entries = json.loads(text).get("files", [])
    except (ValueError, AttributeError):
        return False
    sizes = _sizes(find)
    base = directory.rstrip("/")
    return all(sizes.get(f"{base}/{e['name']}", -1) == e["size"] for e in entries)


def spark_fetch_todo(
    items: Sequence[Mapping[str, Any]],
    fact: Mapping[str, Any],
    manifests: Sequence[Mapping[str, Any]],
    listings: Sequence[Mapping[str, Any]],
) -> list[Mapping[str, Any]]:
    """The items (key, dir, source, refresh, ...) that are not in place: not recorded as verified,
    recorded from another directory or source, manifest changed, a file missing or resized, or
    ``refresh`` set (an update of a branch was asked for). ``manifests`` and ``listings`` are the
    slurp and find results of the items, in the same order."""
    if not (len(items) == len(manifests) == len(listings)):
        raise ValueError(
            f"spark_fetch_todo: {len(items)} items, {len(manifests)} manifests and {len(listings)} "
            "listings; the three lists must be parallel"
        )
    todo = []
    for item, manifest, listing in zip(items, manifests, listings, strict=True):
        key = item["key"]
        rec = fact.get(key) or {}
        ok = (
            not _truthy(item.get("refresh", False))
            and _truthy(fact.get(f"{key}_verified", False))
            and rec.get("dir", "") == item["dir"]
            and rec.get("source", "") == item["source"]
            and spark_manifest_matches(manifest, listing, item["dir"], rec.get("manifest_sha256", ""))
        )
        if not ok:
            todo.append(item)
    return todo


def spark_hybrid_current(
    fact: Mapping[str, Any],
    inputs: Mapping[str, Any],
    out_dir: str,
    manifest: Mapping[str, Any] | None,
    listing: Mapping[str, Any] | None,
    force: bool = False,
) -> bool:
    """True when the merged model in ``out_dir`` is the one recorded (verified, same inputs, same
    directory, manifest unchanged, every file present with its size) and no re-merge is forced."""
    rec = fact.get("hybrid") or {}
    return (
        not _truthy(force)
        and _truthy(fact.get("hybrid_verified", False))
        and _truthy(inputs.get("verified", False))
        and rec.get("dir", "") == out_dir
        and (rec.get("inputs") or {}) == (inputs.get("id") or {})
        and spark_manifest_matches(manifest, listing, out_dir, rec.get("manifest_sha256", ""))
    )


def spark_revision_lock(
    fact: Mapping[str, Any], key: str, repo: str, requested: str, update: bool = False
) -> str:
    """The revision a fetch of checkpoint ``key`` reads: a commit SHA as given; else the commit
    recorded for the same repo and requested revision at an earlier fetch, unless ``update``;
    else the requested branch or tag (the fetch tool resolves it once and reports the commit)."""
    if not requested:
        raise ValueError(
            f"the revision of the {key} checkpoint is empty; set it to a branch, tag or commit SHA"
        )
    if COMMIT_RE.fullmatch(requested) or _truthy(update):
        return requested
    lock = (fact.get("revisions") or {}).get(key) or {}
    commit = lock.get("commit") or ""
    if lock.get("repo") == repo and lock.get("requested") == requested and COMMIT_RE.fullmatch(commit):
        return commit
    return requested


def spark_model_revision(fact: Mapping[str, Any]) -> str | None:
    """One line naming the commits the served model was built from (``int4=repo@sha fp8=repo@sha``),
    for the run meta's ``model_revision``; None when no Hub fetch is recorded (a mirror)."""
    revisions = fact.get("revisions") or {}
    parts = [
        f"{key}={rev['repo']}@{rev['commit']}"
        for key, rev in sorted(revisions.items())
        if isinstance(rev, Mapping) and rev.get("repo") and rev.get("commit")
    ]
    return " ".join(parts) or None


def spark_fetch_record(item: Mapping[str, Any], manifest_text: str, tool_stdout: str = "") -> dict[str, Any]:
    """The ``spark_model`` fact update after checkpoint ``item`` was fetched and its manifest written:
    ``<key>_verified``, the ``<key>`` record (dir, source, requested revision, commit read, manifest
    sha256, files, bytes) and, for a Hub fetch whose tool named a commit, the ``revisions`` lock."""
    key = item["key"]
    doc = json.loads(manifest_text)
    files = doc.get("files", [])
    try:
        tool = json.loads(tool_stdout) if tool_stdout and tool_stdout.strip() else {}
    except ValueError:
        tool = {}
    commit = (tool.get("commit") or "") if isinstance(tool, dict) else ""
    record = {
        "dir": item["dir"],
        "source": item["source"],
        "revision": item.get("revision", ""),
        "commit": commit,
        "manifest_sha256": hashlib.sha256(manifest_text.encode("utf-8")).hexdigest(),
        "files": len(files),
        "bytes": sum(int(f["size"]) for f in files),
    }
    out: dict[str, Any] = {f"{key}_verified": True, key: record}
    if item.get("repo") and COMMIT_RE.fullmatch(commit):
        lock = {"repo": item["repo"], "requested": item.get("revision", ""), "commit": commit}
        out["revisions"] = {key: lock}
    return out


def spark_fact_merge(fact: Mapping[str, Any] | None, update: Mapping[str, Any]) -> dict[str, Any]:
    """The fact with ``update``'s top-level keys replaced; ``revisions`` is merged per checkpoint
    (forgetting a checkpoint's record keeps the commit it was locked to)."""
    if not isinstance(update, Mapping):
        raise ValueError(f"the spark_model fact update must be a mapping, got {update!r}")
    out = dict(fact or {})
    for key, value in update.items():
        if key == "revisions" and isinstance(value, Mapping):
            out[key] = {**(out.get(key) or {}), **value}
        else:
            out[key] = value
    return out


def spark_method_image(
    method: str,
    catalogue: Mapping[str, Any],
    override: str = "",
    published: Mapping[str, str] | None = None,
    local_images: Mapping[str, str] | None = None,
) -> str:
    """The image of ``method``'s vLLM build variant: ``override``, else the build role's published
    ``spark_vllm_images``, else the build's local fact; "" when none is known (the callers stop
    with the fix)."""
    if method not in catalogue:
        known = ", ".join(sorted(catalogue))
        raise ValueError(f"spec_method={method!r} is not in the method catalogue ({known})")
    if override:
        return override
    variant = catalogue[method]["vllm_variant"]
    return (published or {}).get(variant) or (local_images or {}).get(variant) or ""


class FilterModule:
    """Ansible filters of the model and serve stages' state."""

    def filters(self):
        return {
            "spark_manifest_matches": spark_manifest_matches,
            "spark_fetch_todo": spark_fetch_todo,
            "spark_hybrid_current": spark_hybrid_current,
            "spark_revision_lock": spark_revision_lock,
            "spark_model_revision": spark_model_revision,
            "spark_fact_merge": spark_fact_merge,
            "spark_fetch_record": spark_fetch_record,
            "spark_method_image": spark_method_image,
        }
