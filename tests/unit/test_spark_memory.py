"""The memory budget (filter_plugins/spark_memory.py): what vLLM reserves, what is left, the guard's lines."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from spark_memory import (
    GPU_MEMORY_MAX,
    MemoryBudgetError,
    parse_meminfo,
    spark_memory_budget,
    spark_memory_guard_kib,
    spark_memory_utilization,
    utilization_error,
)

ROOT = Path(__file__).resolve().parents[2]
GIB = 1 << 30
SPARK_TOTAL_KIB = 125_519_668  # a 128 GB Spark: MemTotal ~119.7 GiB
# the shipped defaults (group_vars/all): the budget's knobs and the utilization
_BUDGET = yaml.safe_load((ROOT / "group_vars/all/memory.yml").read_text())
DEFAULT_UTIL = yaml.safe_load((ROOT / "group_vars/all/main.yml").read_text())["vllm_gpu_memory_utilization"]
KNOBS = {"guard_term_bytes": _BUDGET["spark_memory_guard_term_bytes"],
         "guard_kill_bytes": _BUDGET["spark_memory_guard_kill_bytes"],
         "margin_bytes": _BUDGET["spark_memory_margin_bytes"]}


def meminfo(total_kib: int, avail_kib: int) -> str:
    return (f"MemTotal:       {total_kib} kB\nMemFree:        {avail_kib // 2} kB\n"
            f"MemAvailable:   {avail_kib} kB\n")


def spark(in_use_gib: float, util: float, **kw):
    avail = SPARK_TOTAL_KIB - int(in_use_gib * (1 << 20))
    return spark_memory_budget(meminfo(SPARK_TOTAL_KIB, avail), util, **{**KNOBS, **kw})


def test_parse_meminfo_gives_bytes():
    assert parse_meminfo(meminfo(2048, 1024)) == {"MemTotal": 2048 * 1024, "MemFree": 512 * 1024,
                                                  "MemAvailable": 1024 * 1024}
    with pytest.raises(MemoryBudgetError, match="no MemAvailable"):
        parse_meminfo("MemTotal: 1 kB\n")


def test_the_shipped_headroom_is_the_fields():
    """Issue 45: at least 12 GiB beside vLLM's reservation. 3 GiB guard line + 14 GiB margin = 17 GiB, so
    MemAvailable at READY stays >= 14 GiB (Entrpi's validated lower bound) after vLLM's ~3 GiB beyond it."""
    assert KNOBS["guard_term_bytes"] == 3 * GIB and KNOBS["guard_kill_bytes"] == 3 * GIB // 2
    assert KNOBS["margin_bytes"] == 14 * GIB
    assert DEFAULT_UTIL == 0.80


def test_headless_spark_at_the_default_utilization_fits():
    b = spark(5, DEFAULT_UTIL)
    assert b["ok"], b["message"]
    # vLLM's request_memory: ceil(total x utilization)
    assert b["reserved_bytes"] == -(-SPARK_TOTAL_KIB * 1024 * 80 // 100)
    assert 95.7 * GIB < b["reserved_bytes"] < 95.8 * GIB
    assert b["left_bytes"] == SPARK_TOTAL_KIB * 1024 - 5 * GIB - b["reserved_bytes"]
    assert 18.9 * GIB < b["left_bytes"] < 19 * GIB
    assert b["required_bytes"] == 17 * GIB and b["guard_term_kib"] == 3 * (1 << 20)
    assert "refused" not in b["message"]
    # (119.7 - 5 - 17) / 119.7 = 0.816 -> 0.81; 0.80 still fits with up to 6.9 GiB in use
    assert b["max_utilization"] == 0.81
    assert spark(6.9, DEFAULT_UTIL)["ok"] and not spark(7, DEFAULT_UTIL)["ok"]


def test_the_old_default_is_refused_headless_now():
    # 0.85 left ~13 GiB headless: below the 17 GiB the field's figures ask for
    b = spark(5, 0.85)
    assert not b["ok"] and 12.9 * GIB < b["left_bytes"] < 13 * GIB
    assert "lower vllm_gpu_memory_utilization to 0.81 or less" in b["message"]
    assert "boot to multi-user.target" not in b["message"]


def test_the_desktop_at_the_default_utilization_is_refused_with_both_fixes():
    # graphical.target active: the desktop's 16 GiB count even if it holds less right after login
    b = spark(4, DEFAULT_UTIL, desktop_bytes=16 * GIB, desktop_active=True)
    assert not b["ok"]
    assert b["in_use_bytes"] == 16 * GIB and b["measured_in_use_bytes"] == 4 * GIB
    assert 7.9 * GIB < b["left_bytes"] < 8 * GIB
    # (119.7 - 16 - 17) / 119.7 = 0.724 -> 0.72
    assert b["max_utilization"] == 0.72
    assert "lower vllm_gpu_memory_utilization to 0.72 or less" in b["message"]
    assert "boot to multi-user.target" in b["message"]
    assert "the desktop's 16.0 GiB: graphical.target is active" in b["message"]
    # the printed value fits
    assert spark(4, b["max_utilization"], desktop_bytes=16 * GIB, desktop_active=True)["ok"]
    assert not spark(4, b["max_utilization"] + 0.01, desktop_bytes=16 * GIB, desktop_active=True)["ok"]


def test_a_measured_figure_above_the_desktop_share_wins():
    b = spark(20, 0.5, desktop_bytes=16 * GIB, desktop_active=True)
    assert b["in_use_bytes"] == 20 * GIB


def test_the_desktop_share_is_not_counted_headless():
    assert spark(4, DEFAULT_UTIL, desktop_bytes=16 * GIB, desktop_active=False)["ok"]


def test_in_use_override_when_a_server_already_runs():
    # the box now holds a running server (100 GiB in use): the recorded figure is used instead
    b = spark(100, DEFAULT_UTIL, in_use_bytes=5 * GIB)
    assert b["ok"] and b["in_use_bytes"] == 5 * GIB


def test_nothing_fits_names_the_other_way_out():
    b = spark(115, 0.1)
    assert not b["ok"] and b["max_utilization"] == 0.0
    assert "lower vllm_gpu_memory_utilization" not in b["message"]
    assert "stop what else holds memory" in b["message"]


def test_the_guard_lines_are_kib_and_checked():
    assert spark_memory_guard_kib(3 * GIB, 3 * GIB // 2, 119 * GIB) == [3 << 20, 3 << 19]
    with pytest.raises(MemoryBudgetError, match="SIGKILL line below the SIGTERM line"):
        spark_memory_guard_kib(GIB, 2 * GIB, 119 * GIB)
    with pytest.raises(MemoryBudgetError, match="not below MemTotal"):
        spark_memory_guard_kib(3 * GIB, GIB, 2 * GIB)
    with pytest.raises(MemoryBudgetError, match="not a number of bytes"):
        spark_memory_guard_kib("3G", GIB, 2 * GIB)


@pytest.mark.parametrize("bad", [0, 1.5, "x", None])
def test_bad_utilization_is_named(bad):
    with pytest.raises(MemoryBudgetError, match="vllm_gpu_memory_utilization="):
        spark(5, bad)


def test_the_molecule_ops_figures():
    # molecule/ops: a 2 GiB test host, a 384 MiB desktop, guard 128/64 MiB, margin 192 MiB
    mib = 1 << 20
    knobs = {"guard_term_bytes": 128 * mib, "guard_kill_bytes": 64 * mib, "margin_bytes": 192 * mib,
             "desktop_bytes": 384 * mib, "desktop_active": True}
    info = meminfo(2048 * 1024, (2048 - 480) * 1024)
    assert spark_memory_budget(info, 0.4, **knobs)["ok"]
    refused = spark_memory_budget(info, 0.7, **knobs)
    assert not refused["ok"] and refused["max_utilization"] == 0.6


def test_guard_lines_without_facts_skip_only_the_memtotal_check():
    """A validation-only run (no facts) renders the ops defaults: lines out, their order still checked."""
    assert spark_memory_guard_kib(3 << 30, 3 << 29, 0) == [3 << 20, 3 << 19]
    assert spark_memory_guard_kib(3 << 30, 3 << 29, None) == [3 << 20, 3 << 19]
    with pytest.raises(MemoryBudgetError):
        spark_memory_guard_kib(1 << 30, 2 << 30, None)
    with pytest.raises(MemoryBudgetError):
        spark_memory_guard_kib(8 << 30, 1 << 30, 4 << 30)


# --- The fraction vLLM is given: one computation, one bound (issue 48) --------------------------------------
CATALOGUE = yaml.safe_load((ROOT / "group_vars/all/methods.yml").read_text())["spark_method_catalogue"]


def test_the_bound_is_the_one_group_vars_documents():
    assert GPU_MEMORY_MAX == 0.95
    assert "float in (0, 0.95]" in (ROOT / "group_vars/all/main.yml").read_text()


@pytest.mark.parametrize(("method", "util", "want"), [
    ("mtp", 0.80, 0.80),        # no cap: the knob
    ("mtp", 0.95, 0.95),        # the bound itself
    ("dflash", 0.90, 0.85),     # methods.yml: dflash caps it at 0.85
    ("dflash", 0.70, 0.70),     # below the cap: the knob
    ("baseline", "0.8", 0.8),   # a string from -e is read as its number
])
def test_the_effective_fraction(method, util, want):
    assert spark_memory_utilization(util, CATALOGUE, method) == want


@pytest.mark.parametrize(("util", "message"), [
    (0.96, "vllm_gpu_memory_utilization=0.96 is out of range; set it to a fraction in (0, 0.95]"),
    (1, "vllm_gpu_memory_utilization=1 is out of range; set it to a fraction in (0, 0.95]"),
    (0, "vllm_gpu_memory_utilization=0 is out of range"),
    (-0.5, "vllm_gpu_memory_utilization=-0.5 is out of range"),
    ("lots", "vllm_gpu_memory_utilization='lots' is not a number; set it to a fraction in (0, 0.95]"),
    (None, "vllm_gpu_memory_utilization=None is not a number"),
    (True, "vllm_gpu_memory_utilization=True is not a number"),
    (float("nan"), "vllm_gpu_memory_utilization=nan is not a number"),
])
def test_a_bad_fraction_is_named_with_the_bound(util, message):
    with pytest.raises(MemoryBudgetError) as err:
        spark_memory_utilization(util, CATALOGUE, "mtp")
    assert message in str(err.value)
    if not isinstance(util, str):  # (the settings check names a string itself, with the -e JSON hint)
        assert message in utilization_error(util)


def test_the_budget_has_the_same_bound():
    """The budget checked (0, 1] before: 0.96 passed preflight's budget and failed the serve settings."""
    assert spark(5, 0.5, margin_bytes=GIB)["ok"]
    bound = r"=0\.96 is out of range; set it to a fraction in \(0, 0\.95\]"
    with pytest.raises(MemoryBudgetError, match=bound):
        spark(5, 0.96)


def test_the_serve_settings_and_argv_use_the_same_fraction():
    from spark_methods import (
        SETTING_DEFAULTS,
        main_yml_defaults,
        spark_method_settings_errors,
        spark_serve_argv,
    )

    def settings(**kw):
        return {**SETTING_DEFAULTS, **main_yml_defaults(),
                "vllm_model_path": "/model", **kw}

    errors = spark_method_settings_errors(settings(vllm_gpu_memory_utilization=0.96), CATALOGUE)
    assert any(utilization_error(0.96) == e for e in errors), errors
    argv = spark_serve_argv(settings(spec_method="dflash", vllm_gpu_memory_utilization=0.9), CATALOGUE)
    got = float(argv[argv.index("--gpu-memory-utilization") + 1])
    assert got == spark_memory_utilization(0.9, CATALOGUE, "dflash") == 0.85


@pytest.mark.parametrize(("catalogue", "method", "message"), [
    ({"m": {"serve_flags": {"gpu_memory_utilization_cap": 1.2}}}, "m",
     "method 'm': serve_flags.gpu_memory_utilization_cap=1.2 is not a fraction in (0, 0.95]"),
    ({"m": {"serve_flags": {}}}, "x",
     "spec_method='x' is not in spark_method_catalogue; set it to one of ['m']"),
])
def test_a_bad_cap_or_method_is_named(catalogue, method, message):
    with pytest.raises(MemoryBudgetError) as err:
        spark_memory_utilization(0.8, catalogue, method)
    assert message in str(err.value)
