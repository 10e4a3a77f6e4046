"""The build's checks before anything is built (filter_plugins/spark_build.py, called by
roles/vllm_build/vars/main.yml and asserted in tasks/validate.yml): the requested methods against the variants
they need, the pins of what is built, the hybrid patch in each built variant's series. Each problem is a
message; a valid configuration gives none; a wrong type is a message, not a crash.

The messages the molecule scenario asserts (molecule/vllm_build/tests/test_vllm_build.py) are checked here
with the same words, so a reword that would break that 800 s scenario fails in a second."""

from __future__ import annotations

import ast
import copy
from pathlib import Path

import pytest
import yaml
from spark_build import (
    FilterModule,
    spark_build_hybrid_errors,
    spark_build_pin_errors,
    spark_build_requirement_errors,
)

from tests.unit.test_templates import defaults, env

ROOT = Path(__file__).resolve().parents[2]
ROLE = ROOT / "roles" / "vllm_build"
METHODS = yaml.safe_load((ROOT / "group_vars" / "all" / "methods.yml").read_text())
VARIANTS = METHODS["spark_vllm_variants"]
CATALOGUE = METHODS["spark_method_catalogue"]
DEFAULTS = defaults("vllm_build")
ALL_METHODS = {m: entry["vllm_variant"] for m, entry in CATALOGUE.items()}
SHA = "a" * 40
UNSET = object()


def requirement_errors(method_variants=None, variants=None, overrides=None, requirements=None, images=None,
                       allowed=None) -> list[str]:
    return spark_build_requirement_errors(
        ALL_METHODS if method_variants is None else method_variants,
        VARIANTS if variants is None else variants, overrides or {},
        DEFAULTS["vllm_build_method_requirements"] if requirements is None else requirements,
        images or {}, [] if allowed is None else allowed)


def pin_errors(build=None, variants=None, overrides=None, images=None, from_source=False,
               base_image=UNSET) -> list[str]:
    return spark_build_pin_errors(
        sorted(VARIANTS) if build is None else build, VARIANTS if variants is None else variants,
        overrides or {}, images or {}, from_source,
        DEFAULTS["vllm_build_base_image"] if base_image is UNSET else base_image,
        DEFAULTS["vllm_build_pr_diff_args"])


def hybrid_errors(root, build=None, method_variants=None, overrides=None, images=None, serves=True,
                  regex=None, variants=None) -> list[str]:
    return spark_build_hybrid_errors(
        sorted(VARIANTS) if build is None else build,
        ALL_METHODS if method_variants is None else method_variants,
        VARIANTS if variants is None else variants, overrides or {}, images or {}, serves, str(root),
        DEFAULTS["vllm_build_hybrid_patch_regex"] if regex is None else regex)


def _flat(errors: list[str]) -> str:
    assert all(isinstance(e, str) and "\n" not in e for e in errors), errors
    return " | ".join(errors)


# ------------------------------------------------------------------ the real catalogue passes


def test_the_catalogue_and_the_role_defaults_pass_every_check():
    assert requirement_errors() == []
    assert pin_errors() == []
    assert hybrid_errors(ROOT / "patches") == []  # every real series carries 0001-inc-hybrid-fp8.patch


# ------------------------------------------------------------------ requirements


def test_a_method_naming_an_undefined_variant():
    (error,) = requirement_errors({"mtp": "v9_nope"})
    assert error == "method mtp names vLLM variant v9_nope, which spark_vllm_variants does not define"


def test_dflash_on_a_019_only_configuration_is_refused_with_the_reason():
    """molecule: test_dflash_is_refused_on_a_019_only_configuration[only-0.19-allowed]."""
    (error,) = requirement_errors({"mtp": "v0_19_1", "dflash": "v0_26_dflash"}, allowed=["v0_19_1"])
    assert error.startswith("spec_method/vllm_build_methods asks for dflash, which needs the vLLM build "
                            "v0_26_dflash (vLLM 0.26.0) (DFlash arrived in vLLM 0.20.0")
    assert "0.26.0 is the first release" in error
    assert error.endswith("but this configuration only allows v0_19_1 (vllm_build_variants_allowed)")


def test_a_variant_not_allowed_names_its_prs_by_number():
    (error,) = requirement_errors({"mtp": "v0_19_1"}, allowed=["v0_26_dflash"])
    assert "needs the vLLM build v0_19_1 (vLLM 0.19.1 + PR #38325)" in error
    assert "'sha'" not in error  # the PR numbers, not the entries


def test_dflash_on_a_019_variant_is_refused_with_the_reason():
    """molecule: test_dflash_is_refused_on_a_019_only_configuration[dflash-variant-is-0.19]."""
    over = {"v0_26_dflash": {"ref": "v0.19.1", "version": "0.19.1", "extra_prs": []}}
    (error,) = requirement_errors({"dflash": "v0_26_dflash"}, overrides=over)
    assert error.startswith("method dflash needs vLLM >= 0.26.0 (DFlash arrived in vLLM 0.20.0")
    assert "0.26.0 is the first release" in error
    assert error.endswith("but its variant v0_26_dflash is vLLM 0.19.1 (ref v0.19.1)")


@pytest.mark.parametrize(("version", "refused"), [("0.26.0rc1", True), ("0.25.9", True), ("0.26.0", False),
                                                  ("0.26.1", False), ("1.0", False)])
def test_min_version_compares_release_numbers(version, refused):
    errors = requirement_errors({"dflash": "v0_26_dflash"}, overrides={"v0_26_dflash": {"version": version}})
    assert bool(errors) is refused, errors


def test_a_missing_pr_is_refused_unless_the_image_is_pulled():
    req = {"mtp": {"prs": [38325, 40000], "why": "the reason"}}
    (error,) = requirement_errors({"mtp": "v0_19_1"}, requirements=req)
    assert error == "method mtp needs vLLM PR #40000 (the reason), but variant v0_19_1 merges only [38325]"
    assert requirement_errors({"mtp": "v0_19_1"}, requirements=req, images={"v0_19_1": "x/y:1.0"}) == []
    req = {"mtp": {"prs": [38325]}}
    assert requirement_errors({"mtp": "v0_19_1"}, requirements=req) == []


def test_a_met_min_version_still_checks_the_prs():
    req = {"dflash": {"min_version": "0.26.0", "prs": [1]}}
    (error,) = requirement_errors({"dflash": "v0_26_dflash"}, requirements=req)
    assert error == "method dflash needs vLLM PR #1, but variant v0_26_dflash merges only []"


def test_malformed_extra_prs_are_left_to_the_pin_check():
    """An unpinned entry (molecule's test_unpinned_pr_is_refused) counts as no PR merged here."""
    over = {"v0_19_1": {"extra_prs": [40898]}}
    (error,) = requirement_errors({"mtp": "v0_19_1"}, requirements={"mtp": {"prs": [40898]}}, overrides=over)
    assert error.endswith("but variant v0_19_1 merges only []")
    assert requirement_errors({"mtp": "v0_19_1"}, overrides=over) == []


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"variants": ["v0_19_1"]}, "spark_vllm_variants must be a mapping (by variant or method), not list"),
    ({"method_variants": "mtp"}, "method_variants must be a mapping (by variant or method), not str"),
    ({"requirements": ["dflash"]},
     "vllm_build_method_requirements must be a mapping (by variant or method), not list"),
    ({"allowed": "v0_19_1"}, "vllm_build_variants_allowed must be a list of variant names, not str"),
    ({"overrides": {"v0_26_dflash": "v0.26.0"}},
     "vllm_build_variant_overrides.v0_26_dflash must be a mapping of the variant's settings, not str"),
    ({"requirements": {"dflash": "0.26.0"}},
     "vllm_build_method_requirements.dflash must be a mapping (min_version, prs, why), not str"),
    ({"requirements": {"dflash": {"prs": 38325}}},
     "vllm_build_method_requirements.dflash.prs must be a list of PR numbers, not int"),
    ({"requirements": {"dflash": {"min_version": "new"}}},
     "vllm_build_method_requirements.dflash.min_version 'new' is not a version number"),
    ({"overrides": {"v0_26_dflash": {"version": None}}},
     "has version None, not a version number (set spark_vllm_variants.v0_26_dflash.version)"),
])
def test_wrong_types_in_the_requirements_are_reported(kwargs, needle):
    errors = requirement_errors(**{"method_variants": {"dflash": "v0_26_dflash"}, **kwargs})
    assert needle in _flat(errors), errors


# ------------------------------------------------------------------ pins


def _with(variant: str, **change) -> dict:
    variants = copy.deepcopy(VARIANTS)
    variants[variant].update(change)
    return variants


@pytest.mark.parametrize(("ref", "ok"), [("v0.19.1", True), ("v0.26.0rc1", True), (SHA, True),
                                         ("main", False), ("refs/pull/1/head", False), ("v0.19", False),
                                         (None, False), (SHA + "\n", False)])
def test_the_ref_must_be_a_release_tag_or_a_commit(ref, ok):
    errors = pin_errors(["v0_19_1"], _with("v0_19_1", ref=ref))
    assert (errors == []) is ok, errors
    if not ok:
        assert errors == [f"v0_19_1: ref {ref} is neither a release tag (vX.Y.Z) nor a 40-hex commit; "
                          "a branch moves under the build"]


def test_an_unpinned_pr_is_refused():
    """molecule: test_unpinned_pr_is_refused asserts "must be {pr: N, sha: <40-hex commit>}"."""
    (error,) = pin_errors(["v0_19_1"], overrides={"v0_19_1": {"extra_prs": [40898]}})
    assert error == ("v0_19_1: extra_prs entry 40898 must be {pr: N, sha: <40-hex commit>} "
                     "(a refs/pull/N/head ref moves)")


@pytest.mark.parametrize("entry", [{"pr": 1, "sha": "refs/pull/1/head"}, {"pr": "1", "sha": SHA},
                                   {"pr": True, "sha": SHA}, {"sha": SHA}, {"pr": 1}, "38325", None])
def test_a_pr_entry_needs_a_number_and_a_commit(entry):
    (error,) = pin_errors(["v0_19_1"], overrides={"v0_19_1": {"extra_prs": [entry]}})
    assert f"extra_prs entry {entry} must be {{pr: N, sha: <40-hex commit>}}" in error


def test_extra_prs_that_are_not_a_list_are_reported():
    (error,) = pin_errors(["v0_19_1"], overrides={"v0_19_1": {"extra_prs": "38325"}})
    assert error == "v0_19_1: extra_prs 38325 must be a list of {pr: N, sha: <40-hex commit>} entries"


def test_a_bad_diff_hash_names_the_command_that_makes_it():
    (error,) = pin_errors(["v0_19_1"], overrides={"v0_19_1": {"extra_prs": [{"pr": 7, "sha": SHA,
                                                                             "diff_sha256": "abc"}]}})
    args = " ".join(DEFAULTS["vllm_build_pr_diff_args"])
    assert error == (f"v0_19_1: extra_prs entry of PR #7 has diff_sha256 abc, not a sha256 (64 hex): "
                     f"take it from `git diff {args} <sha>^1 <sha> | sha256sum`")


@pytest.mark.parametrize(("rewrite", "ok"), [([["a", "b"]], True), ([], True), ("a", False), ([["a"]], False),
                                              ([["a", ""]], False), ([["a", 3]], False), ([("a", "b")], True),
                                              ({"a": "b"}, False), ([["a", "b", "c"]], False)])
def test_rewrite_is_a_list_of_non_empty_string_pairs(rewrite, ok):
    entry = {"pr": 7, "sha": SHA, "diff_sha256": "0" * 64, "rewrite": rewrite}
    errors = pin_errors(["v0_19_1"], overrides={"v0_19_1": {"extra_prs": [entry]}})
    assert (errors == []) is ok, errors
    if not ok:
        assert errors == [f"v0_19_1: extra_prs entry of PR #7 has rewrite {rewrite}; it must be a list of "
                          "[from, to] pairs of non-empty strings"]


def test_a_rewrite_without_a_pinned_diff_is_refused():
    entry = {"pr": 7, "sha": SHA, "rewrite": [["a", "b"]]}
    (error,) = pin_errors(["v0_19_1"], overrides={"v0_19_1": {"extra_prs": [entry]}})
    assert error == ("v0_19_1: extra_prs entry of PR #7 has rewrite but no diff_sha256: a merged PR is not "
                     "rewritten; pin its diff to rewrite it")


@pytest.mark.parametrize(("from_source", "refused"), [(False, True), ("no", True), (True, False),
                                                      ("yes", False), ("True", False)])
def test_a_wheel_install_refuses_extra_prs(from_source, refused):
    errors = pin_errors(["v0_19_1"], overrides={"v0_19_1": {"install": "wheel"}}, from_source=from_source)
    assert bool(errors) is refused, errors
    if refused:
        assert errors == ["v0_19_1 installs the prebuilt vLLM 0.19.1 wheel (install: wheel), which its "
                          "extra_prs (PR #38325) cannot change: they patch the source before the compile. "
                          "Compile it (install: source, or vllm_build_from_source: true) or build it "
                          "without them (vllm_build_variant_overrides: {v0_19_1: {extra_prs: []}})"]


@pytest.mark.parametrize("toolchain", [None, {}, {"triton": "3.6.0"}, "torch==2.10.0"])
def test_a_variant_needs_a_torch_pin(toolchain):
    change = {} if toolchain is None else {"toolchain": toolchain}
    variants = _with("v0_26_dflash", **change)
    if toolchain is None:
        del variants["v0_26_dflash"]["toolchain"]
    assert pin_errors(["v0_26_dflash"], variants) == [
        "v0_26_dflash: no toolchain with a torch pin (spark_vllm_variants.v0_26_dflash.toolchain)"]


def test_pulled_and_undefined_variants_are_not_pin_checked():
    variants = _with("v0_19_1", ref="main")
    assert pin_errors(["v0_19_1"], variants, images={"v0_19_1": "nvcr.io/nvidia/vllm:26.01-py3"}) == []
    assert pin_errors(["v9_nope"]) == []  # the requirement check reports it


@pytest.mark.parametrize(("image", "ok"), [
    ("nvcr.io/nvidia/cuda:13.0.1-devel-ubuntu24.04", True),
    ("nvcr.io/nvidia/cuda@sha256:" + "0" * 64, True),
    ("spark-vllm-build-test/base:12.0-bookworm", True),  # the molecule scenario's base image
    ("nvcr.io/nvidia/cuda:latest", False),
    ("nvcr.io/nvidia/cuda", False),
    ("registry:5000/cuda", False),
    (None, False),
])
def test_the_base_image_needs_a_digest_or_a_version_tag(image, ok):
    errors = pin_errors([], base_image=image)
    assert (errors == []) is ok, errors
    if not ok:
        assert errors == [f"vllm_build_base_image {image} has neither a digest (@sha256:...) "
                          "nor a version tag"]


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"variants": []}, "spark_vllm_variants must be a mapping (by variant or method), not list"),
    ({"overrides": ["v0_19_1"]},
     "vllm_build_variant_overrides must be a mapping (by variant or method), not list"),
    ({"images": "x"}, "vllm_build_images must be a mapping (by variant or method), not str"),
    ({"build": "v0_19_1"}, "the variants to build must be a list of names, not str"),
    ({"overrides": {"v0_19_1": ["x"]}},
     "vllm_build_variant_overrides.v0_19_1 must be a mapping of the variant's settings, not list"),
    ({"variants": {"v0_19_1": "v0.19.1"}},
     "spark_vllm_variants.v0_19_1 must be a mapping of the variant's settings, not str"),
])
def test_wrong_types_in_the_pins_are_reported(kwargs, needle):
    assert needle in _flat(pin_errors(**{"build": ["v0_19_1"], **kwargs}))


# ------------------------------------------------------------------ the hybrid patch


def _series(root: Path, version: str, text: str) -> Path:
    d = root / f"vllm-{version}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "series").write_text(text)
    return d


def test_a_variant_without_a_series_is_refused(tmp_path):
    """molecule: test_variant_without_the_hybrid_patch_is_refused (dflash pointed at a made-up 0.99.0)."""
    over = {"v0_26_dflash": {"ref": "v0.99.0", "version": "0.99.0"}}
    (error,) = hybrid_errors(ROOT / "patches", ["v0_26_dflash"], {"mtp": "v0_19_1", "dflash": "v0_26_dflash"},
                             overrides=over)
    assert error.startswith("v0_26_dflash (vLLM 0.99.0, for dflash) has no hybrid INT4+FP8 loading patch: "
                            f"there is no {ROOT / 'patches'}/vllm-0.99.0/series. ")
    assert error.endswith("Served the hybrid checkpoint, vLLM 0.99.0 would load its FP8 shared experts "
                          "as INT4 (wrong weights, no error)")


def test_a_series_without_the_patch_names_the_regex(tmp_path):
    _series(tmp_path, "0.19.1", "# 0001-inc-hybrid-fp8.patch (commented out)\n0002-int8-lm-head.patch\n\n")
    _series(tmp_path, "0.26.0", "0001-inc-hybrid-fp8.patch  # the fix\n")
    (error,) = hybrid_errors(tmp_path)
    users = ", ".join(m for m, v in ALL_METHODS.items() if v == "v0_19_1")
    assert error.startswith(f"v0_19_1 (vLLM 0.19.1, for {users}) has no hybrid INT4+FP8 loading patch: "
                            f"{tmp_path}/vllm-0.19.1/series lists none matching inc-hybrid-fp8. ")


def test_a_patch_dir_override_is_read_and_pulled_variants_are_skipped(tmp_path):
    mine = _series(tmp_path / "mine", "x", "route-fp8-layers.patch\n")
    over = {v: {"patch_dir": str(mine)} for v in VARIANTS}
    assert hybrid_errors(tmp_path, overrides=over, regex="route-fp8-layers") == []
    assert len(hybrid_errors(tmp_path, overrides=over)) == len(VARIANTS)  # the default regex: no match
    assert hybrid_errors(tmp_path, images={v: "x/y:1.0" for v in VARIANTS}) == []


@pytest.mark.parametrize("serves", [False, "false", "no", 0])
def test_nothing_is_checked_when_the_hybrid_checkpoint_is_not_served(tmp_path, serves):
    assert hybrid_errors(tmp_path, serves=serves) == []
    assert hybrid_errors(tmp_path, serves="yes")  # and "yes" is true, as Ansible's bool has it


@pytest.mark.parametrize(("kwargs", "needle"), [
    ({"regex": "(unclosed"}, "vllm_build_hybrid_patch_regex '(unclosed' is not a regular expression"),
    ({"method_variants": ["dflash"]}, "method_variants must be a mapping (by variant or method), not list"),
    ({"build": 5}, "the variants to build must be a list of names, not int"),
    ({"overrides": {"v0_19_1": 3}}, "vllm_build_variant_overrides.v0_19_1 must be a mapping"),
])
def test_wrong_types_in_the_hybrid_check_are_reported(tmp_path, kwargs, needle):
    assert needle in _flat(hybrid_errors(ROOT / "patches", **kwargs))


# ------------------------------------------------------------------ the role's thin calls


def _render(name: str, **extra) -> list[str]:
    raw = yaml.safe_load((ROLE / "vars" / "main.yml").read_text())[name]
    e = env()
    e.filters.update(FilterModule().filters())
    c = {**DEFAULTS, "spark_vllm_variants": VARIANTS, "_vllm_build_variants": sorted(VARIANTS),
         "_vllm_build_method_variants": ALL_METHODS, "vllm_build_patches_root": str(ROOT / "patches"),
         **extra}
    return ast.literal_eval(e.from_string(raw).render(**c).strip())


def test_the_role_passes_its_knobs_to_the_filters():
    for name in ("_vllm_build_requirement_errors", "_vllm_build_pin_errors", "_vllm_build_hybrid_errors"):
        assert _render(name) == [], name
    assert _render("_vllm_build_requirement_errors", vllm_build_variants_allowed=["v0_19_1"])
    assert _render("_vllm_build_pin_errors", vllm_build_base_image="cuda:latest")
    assert _render("_vllm_build_hybrid_errors", vllm_build_hybrid_patch_regex="nothing-matches")
