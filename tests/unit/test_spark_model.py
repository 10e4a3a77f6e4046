"""Unit tests for filter_plugins/spark_model.py: the model and serve stages' state decisions."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from pathlib import Path

import pytest
import yaml
from spark_model import (
    FilterModule,
    spark_fact_merge,
    spark_fetch_record,
    spark_fetch_todo,
    spark_hybrid_current,
    spark_manifest_matches,
    spark_method_image,
    spark_model_revision,
    spark_revision_lock,
)

ROOT = Path(__file__).resolve().parents[2]
SHA_A = "a" * 40
SHA_B = "b" * 40


def manifest(*files: tuple[str, int]) -> str:
    return json.dumps({"files": [{"name": n, "size": s, "sha256": None} for n, s in files]}, indent=2)


def slurp(text: str) -> dict:
    return {"content": base64.b64encode(text.encode()).decode(), "encoding": "base64"}


def find(directory: str, *files: tuple[str, int]) -> dict:
    return {"files": [{"path": f"{directory}/{n}", "size": s} for n, s in files]}


def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


FILES = (("model.safetensors", 100), ("config.json", 7))
TEXT = manifest(*FILES)


# ------------------------------------------------------------------ manifests


def test_manifest_matches_only_the_recorded_manifest_with_every_file_sized():
    assert spark_manifest_matches(slurp(TEXT), find("/m", *FILES), "/m", sha(TEXT))
    assert spark_manifest_matches(slurp(TEXT), find("/m", *FILES), "/m/", sha(TEXT))  # trailing slash
    assert not spark_manifest_matches(slurp(TEXT), find("/m", *FILES), "/m", sha(TEXT + " "))
    resized = find("/m", ("model.safetensors", 99), FILES[1])
    assert not spark_manifest_matches(slurp(TEXT), resized, "/m", sha(TEXT))
    assert not spark_manifest_matches(slurp(TEXT), find("/m", FILES[0]), "/m", sha(TEXT))  # one missing
    unread = {"failed": True, "msg": "no such file"}
    assert not spark_manifest_matches(unread, find("/m", *FILES), "/m", sha(TEXT))
    assert not spark_manifest_matches(slurp(TEXT), find("/m", *FILES), "/m", "")
    assert not spark_manifest_matches(slurp("not json"), find("/m"), "/m", sha("not json"))


def test_extra_files_do_not_break_the_match():
    listing = find("/m", *FILES, ("sparkllm-manifest.json", 50))
    assert spark_manifest_matches(slurp(TEXT), listing, "/m", sha(TEXT))


def item(key: str, directory: str, source: str, refresh: object = False) -> dict:
    return {"key": key, "dir": directory, "source": source, "refresh": refresh}


def fetched_fact(source: str = "hub:r@main") -> dict:
    return {
        "int4_verified": True,
        "int4": {"dir": "/c/int4", "source": source, "manifest_sha256": sha(TEXT)},
        "fp8_verified": False,
        "fp8": {},
    }


def test_fetch_todo_keeps_what_is_in_place_and_names_the_rest():
    items = [item("int4", "/c/int4", "hub:r@main"), item("fp8", "/c/fp8", "hub:f@main")]
    manifests = [slurp(TEXT), {"failed": True}]
    listings = [find("/c/int4", *FILES), {"files": []}]
    todo = spark_fetch_todo(items, fetched_fact(), manifests, listings)
    assert [t["key"] for t in todo] == ["fp8"]
    # another source, another directory, a resized file: fetched again
    other = spark_fetch_todo(items, fetched_fact("hub:r@v2"), manifests, listings)
    assert [t["key"] for t in other] == ["int4", "fp8"]
    moved = [item("int4", "/d/int4", "hub:r@main"), items[1]]
    assert len(spark_fetch_todo(moved, fetched_fact(), manifests, [find("/d/int4", *FILES), {}])) == 2
    resized = [find("/c/int4", ("model.safetensors", 1), FILES[1]), {}]
    assert len(spark_fetch_todo(items, fetched_fact(), manifests, resized)) == 2


@pytest.mark.parametrize("refresh", [True, "True", "true"])
def test_fetch_todo_refetches_an_item_asked_to_refresh(refresh):
    items = [item("int4", "/c/int4", "hub:r@main", refresh)]
    assert spark_fetch_todo(items, fetched_fact(), [slurp(TEXT)], [find("/c/int4", *FILES)]) == items
    items[0]["refresh"] = "False"  # Ansible may template a boolean into a string
    assert spark_fetch_todo(items, fetched_fact(), [slurp(TEXT)], [find("/c/int4", *FILES)]) == []


def test_fetch_todo_refuses_lists_that_are_not_parallel():
    with pytest.raises(ValueError, match="parallel"):
        spark_fetch_todo([item("int4", "/c", "s")], {}, [], [])


def hybrid_fact(**over: object) -> dict:
    rec = {"dir": "/m", "inputs": {"int4": "i", "fp8": "f"}, "manifest_sha256": sha(TEXT)}
    return {"hybrid_verified": True, "hybrid": {**rec, **over}}


INPUTS = {"verified": True, "id": {"int4": "i", "fp8": "f"}}


def test_hybrid_current_needs_same_inputs_directory_and_manifest():
    args = ("/m", slurp(TEXT), find("/m", *FILES))
    assert spark_hybrid_current(hybrid_fact(), INPUTS, *args)
    assert spark_hybrid_current(hybrid_fact(), {**INPUTS, "verified": "True"}, *args)
    assert not spark_hybrid_current(hybrid_fact(), INPUTS, *args, force=True)
    assert not spark_hybrid_current(hybrid_fact(), INPUTS, *args, force="True")
    assert not spark_hybrid_current(hybrid_fact(inputs={"int4": "other", "fp8": "f"}), INPUTS, *args)
    assert not spark_hybrid_current(hybrid_fact(dir="/n"), INPUTS, *args)
    assert not spark_hybrid_current({**hybrid_fact(), "hybrid_verified": False}, INPUTS, *args)
    assert not spark_hybrid_current(hybrid_fact(), {**INPUTS, "verified": "False"}, *args)
    assert not spark_hybrid_current(hybrid_fact(), INPUTS, "/m", slurp(TEXT), find("/m", FILES[0]))


# ------------------------------------------------------------------ revisions


def test_a_branch_is_read_at_the_recorded_commit_until_an_update():
    fact = {"revisions": {"int4": {"repo": "Intel/x", "requested": "main", "commit": SHA_A}}}
    assert spark_revision_lock({}, "int4", "Intel/x", "main") == "main"  # first fetch: the tool resolves it
    assert spark_revision_lock(fact, "int4", "Intel/x", "main") == SHA_A
    assert spark_revision_lock(fact, "int4", "Intel/x", "main", True) == "main"
    assert spark_revision_lock(fact, "int4", "Intel/x", "main", "true") == "main"
    assert spark_revision_lock(fact, "int4", "Intel/y", "main") == "main"  # another repo: not locked
    assert spark_revision_lock(fact, "int4", "Intel/x", "v2") == "v2"  # another branch asked for
    assert spark_revision_lock(fact, "fp8", "Intel/x", "main") == "main"
    assert spark_revision_lock(fact, "int4", "Intel/x", SHA_B) == SHA_B  # a commit is read as given
    bad = {"revisions": {"int4": {"repo": "Intel/x", "requested": "main", "commit": "abc"}}}
    assert spark_revision_lock(bad, "int4", "Intel/x", "main") == "main"
    with pytest.raises(ValueError, match="revision of the int4 checkpoint is empty"):
        spark_revision_lock(fact, "int4", "Intel/x", "")


def test_model_revision_names_each_checkpoint_commit():
    fact = {"revisions": {"int4": {"repo": "Intel/x", "requested": "main", "commit": SHA_A},
                          "fp8": {"repo": "Qwen/f", "requested": "main", "commit": SHA_B}}}
    assert spark_model_revision(fact) == f"fp8=Qwen/f@{SHA_B} int4=Intel/x@{SHA_A}"
    assert spark_model_revision({}) is None
    assert spark_model_revision({"revisions": {"int4": {"repo": "Intel/x", "commit": ""}}}) is None


def test_fetch_record_locks_the_commit_the_tool_read():
    hub = {"key": "int4", "dir": "/c/int4", "source": "hub:Intel/x@main", "repo": "Intel/x",
           "revision": "main"}
    out = spark_fetch_record(hub, TEXT, json.dumps({"changed": True, "commit": SHA_A}))
    assert out["int4_verified"] is True
    assert out["int4"] == {"dir": "/c/int4", "source": "hub:Intel/x@main", "revision": "main",
                           "commit": SHA_A, "manifest_sha256": sha(TEXT), "files": 2, "bytes": 107}
    assert out["revisions"] == {"int4": {"repo": "Intel/x", "requested": "main", "commit": SHA_A}}
    # the lock it writes is the one the next run reads
    assert spark_revision_lock(spark_fact_merge({}, out), "int4", "Intel/x", "main") == SHA_A
    # a mirror, or a tool that named no commit: recorded, but nothing to lock
    mirror = {"key": "fp8", "dir": "/c/fp8", "source": "mirror:/m/fp8#abc"}
    assert "revisions" not in spark_fetch_record(mirror, TEXT, '{"changed": true}')
    assert "revisions" not in spark_fetch_record(hub, TEXT, "not json")
    assert "revisions" not in spark_fetch_record(hub, TEXT, json.dumps({"commit": "abc123"}))


def test_fact_merge_replaces_keys_and_keeps_other_locks():
    fact = {"int4_verified": True, "int4": {"dir": "/a"}, "hybrid_verified": True,
            "revisions": {"int4": {"commit": SHA_A}, "fp8": {"commit": SHA_B}}}
    out = spark_fact_merge(fact, {"int4_verified": False, "int4": {}})
    assert out["int4_verified"] is False and out["int4"] == {} and out["hybrid_verified"] is True
    assert out["revisions"] == fact["revisions"]  # forgetting a record keeps its commit lock
    out = spark_fact_merge(out, {"revisions": {"int4": {"commit": SHA_B}}})
    assert out["revisions"] == {"int4": {"commit": SHA_B}, "fp8": {"commit": SHA_B}}
    assert fact["int4_verified"] is True  # the input is not modified
    assert spark_fact_merge(None, {"a": 1}) == {"a": 1}
    with pytest.raises(ValueError, match="must be a mapping"):
        spark_fact_merge({}, ["a"])


# ------------------------------------------------------------------ images


def catalogue() -> dict:
    return yaml.safe_load((ROOT / "group_vars" / "all" / "methods.yml").read_text())["spark_method_catalogue"]


def test_method_image_prefers_override_then_published_then_local_fact():
    cat = catalogue()
    method = next(iter(cat))
    variant = cat[method]["vllm_variant"]
    assert spark_method_image(method, cat, "mine:1", {variant: "pub:1"}, {variant: "loc:1"}) == "mine:1"
    assert spark_method_image(method, cat, "", {variant: "pub:1"}, {variant: "loc:1"}) == "pub:1"
    assert spark_method_image(method, cat, "", {}, {variant: "loc:1"}) == "loc:1"
    assert spark_method_image(method, cat, "", {"other": "x"}, None) == ""
    with pytest.raises(ValueError, match="not in the method catalogue"):
        spark_method_image("nope", cat)


def test_roles_resolve_the_image_and_write_the_model_fact_in_one_place():
    """The image lookup and the spark_model.fact writer exist once; roles call them."""
    texts = {p: p.read_text() for p in (ROOT / "roles").rglob("*.yml")}
    lookups = [p for p, t in texts.items() if "spark_build.images" in t and "spark_method_image" not in t
               and "preflight" not in p.parts]
    assert lookups == []
    assert {p.parts[-3] for p, t in texts.items() if "spark_method_image" in t} == {"serve", "ray_cluster"}
    writers = [p.relative_to(ROOT).as_posix() for p, t in texts.items()
               if re.search(r"dest: .*spark_model\.fact", t)]
    assert writers == ["roles/spark_tools/tasks/model_fact.yml"]


def test_filter_module_exports_every_filter():
    names = set(FilterModule().filters())
    assert names == {"spark_manifest_matches", "spark_fetch_todo", "spark_hybrid_current",
                     "spark_revision_lock", "spark_model_revision", "spark_fact_merge", "spark_method_image",
                     "spark_fetch_record"}
