"""Every knob the bench stage reads, checked in the validation play before the first stage runs.

Pure Python (PyYAML and the standard library; Ansible itself only for the argument-spec types); Ansible
only needs the ``FilterModule`` at the bottom.

The bench stage runs last, hours after the validation play; a knob it alone reads was refused only
then (``bench_repeats: 0``, ``bench_concurrency: "1,,2"``, an unwritable results directory; issue 46).
``spark_bench_errors(hostvars[inventory_hostname], playbook_dir)`` checks, before any stage:

- the type and choices of every ``bench_*`` option the role's ``meta/argument_specs.yml`` declares, with
  Ansible's own argument-spec validator (the check the role makes when it starts, so a knob added to the
  spec is checked here too), for the values the user set;
- the ranges and list syntax ``scripts/bench.py run`` needs, on the values in effect (the user's, else
  the role's defaults): repeats >= 1, comma lists without empty items, a concurrency level no higher than
  ``vllm_max_num_seqs`` (vLLM runs at most that many sequences per step, vllm/config/scheduler.py:62-63
  of 0.19.1: more streams would measure its queue, not a concurrency level), rates > 0, a temperature
  >= 0 (vLLM refuses a negative one, vllm/sampling_params.py:452-455 of 0.19.1), goodput targets;
- the controller's side: ``bench_results_dir`` is (or can be created as) a writable directory, and the
  prompt and depth-text files exist.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path

import yaml

PROJECT = Path(__file__).resolve().parents[1]
ROLE = PROJECT / "roles" / "bench"
# the role default of bench_results_dir (roles/bench/defaults/main.yml), which the validation play
# cannot template (the role is not loaded there): SPARK_RESULTS_DIR, else results/ beside playbooks/.
# tests/unit/test_bench_knobs.py fails when the default changes and this does not
RESULTS_DIR_DEFAULT = ("{{ lookup('ansible.builtin.env', 'SPARK_RESULTS_DIR') | default(playbook_dir ~ "
                       "'/../results', true) }}")
GOODPUT_RE = re.compile(r"(ttft|tpot|e2e)=\d+(\.\d+)?(ms|s)?", re.IGNORECASE)


def _spec() -> dict:
    data = yaml.safe_load((ROLE / "meta" / "argument_specs.yml").read_text(encoding="utf-8"))
    return {k: v for k, v in data["argument_specs"]["main"]["options"].items() if k.startswith("bench_")}


def _defaults() -> dict:
    return yaml.safe_load((ROLE / "defaults" / "main.yml").read_text(encoding="utf-8")) or {}


def _templated(value) -> bool:
    return isinstance(value, str) and "{{" in value


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _spec_check(user: dict, spec: dict) -> tuple[list[str], dict]:
    """Ansible's own type/choices check of the user's values (what the role does when it starts): the
    errors, and the values as the role will see them (-e bench_repeats=0 arrives as the string "0")."""
    from ansible.module_utils.common.arg_spec import ArgumentSpecValidator

    options = {name: {k: v for k, v in spec[name].items() if k in ("type", "choices", "elements")}
               for name in user}
    result = ArgumentSpecValidator(options).validate(dict(user))
    return ([f"{msg}; the bench role's meta/argument_specs.yml says what each takes"
             for msg in result.error_messages], dict(result.validated_parameters))


def _list(errors: list[str], name: str, text, kind, lo: float, strict_lo: bool, example: str) -> list:
    """A comma-separated list of distinct numbers; [] for ""; an error naming the knob for anything else."""
    if text is None or str(text).strip() == "":
        return []
    items = [x.strip() for x in str(text).split(",")]
    bound = f"> {lo:g}" if strict_lo else f">= {lo:g}"
    fix = f"set {name} to distinct comma-separated {kind.__name__}s {bound}, e.g. {name}={example!r}"
    if any(x == "" for x in items):
        errors.append(f"{name}={text!r} has an empty item (two commas, or one at an end); {fix}")
        return []
    try:
        values = [kind(x) for x in items]
    except ValueError:
        errors.append(f"{name}={text!r} is not a list of {kind.__name__}s; {fix}")
        return []
    bad = [v for v in values if not math.isfinite(v) or v < lo or (strict_lo and v == lo)]
    if bad:
        errors.append(f"{name}={text!r}: {bad[0]!r} is out of range; {fix}")
        return []
    if len(set(values)) != len(values):
        errors.append(f"{name}={text!r} lists a value twice; {fix}")
        return []
    return values


def _int_at_least(errors: list[str], name: str, value, lo: int, example: int, why: str = "") -> None:
    if _is_int(value) and value < lo:
        errors.append(f"{name}={value!r} is out of range{why}; set {name} to an integer >= {lo}, "
                      f"e.g. {example}")


def _number_at_least(errors: list[str], name: str, value, lo: float, example, why: str = "") -> None:
    if isinstance(value, int | float) and not isinstance(value, bool) and not (
            math.isfinite(value) and value >= lo):
        errors.append(f"{name}={value!r} is out of range{why}; set {name} to a finite number >= {lo:g}, "
                      f"e.g. {example}")


def _writable_dir(path: str) -> str:
    """'' when ``path`` is a writable directory or can be created as one, else why not."""
    p = Path(os.path.expanduser(path))
    if p.exists():
        if not p.is_dir():
            return "exists and is not a directory"
        return "" if os.access(p, os.W_OK | os.X_OK) else "is not writable by this user"
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"cannot be created: {parent} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"cannot be created: {parent} is not writable by this user"
    return ""


def spark_bench_errors(variables: Mapping, playbook_dir: str | None = None) -> list[str]:
    """Every problem with the bench stage's knobs (module doc), as messages naming knob, value and fix."""
    if not isinstance(variables, Mapping):
        return [f"host variables must be a mapping, got {type(variables).__name__}"]
    spec, defaults = _spec(), _defaults()
    user = {name: variables[name] for name in spec if name in variables}
    user = {k: val for k, val in user.items() if not _templated(val)}
    errors, user = _spec_check(user, spec)
    if errors:
        return errors  # the types are wrong: ranges of values of the wrong type say nothing more
    v = {**{k: d for k, d in defaults.items() if not _templated(d)}, **user}

    _int_at_least(errors, "bench_repeats", v.get("bench_repeats"), 1, 3, " (0 passes measure nothing)")
    _int_at_least(errors, "bench_warmup", v.get("bench_warmup"), 0, 2)
    _int_at_least(errors, "bench_max_tokens", v.get("bench_max_tokens"), 1, 256)
    _int_at_least(errors, "bench_repetition", v.get("bench_repetition"), 0, 0)
    _int_at_least(errors, "bench_rate_requests", v.get("bench_rate_requests"), 0, 0)
    _int_at_least(errors, "bench_timeout_s", v.get("bench_timeout_s"), 1, 7200)
    _number_at_least(errors, "bench_rate_duration_s", v.get("bench_rate_duration_s"), 0, 0)
    _number_at_least(errors, "bench_temperature", v.get("bench_temperature"), 0, 0.0,
                     " (vLLM refuses a negative temperature)")

    levels = _list(errors, "bench_concurrency", v.get("bench_concurrency"), int, 1, False, "1,2,4")
    rates = _list(errors, "bench_request_rate", v.get("bench_request_rate"), float, 0, True, "0.5,1,2")
    _list(errors, "bench_depth", v.get("bench_depth"), int, 0, False, "0,8192")
    if not errors and not levels and not rates:
        errors.append("bench_concurrency and bench_request_rate are both empty: nothing to measure; set "
                      "bench_concurrency (e.g. \"1,2,4\") and/or bench_request_rate (e.g. \"0.5,1,2\")")
    seqs = variables.get("vllm_max_num_seqs") if "vllm_max_num_seqs" in variables else None
    if _is_int(seqs) and levels and max(levels) > seqs:
        errors.append(f"bench_concurrency={v.get('bench_concurrency')!r}: level {max(levels)} is above "
                      f"vllm_max_num_seqs={seqs}, so vLLM would queue the extra streams and the run would "
                      f"measure its queue; lower bench_concurrency to <= {seqs} or raise vllm_max_num_seqs")

    profile = v.get("bench_profile") or "decode"
    if not errors and profile != "decode":
        fix = "set bench_profile to decode to measure them, or leave them at their defaults"
        depths = [d for d in str(v.get("bench_depth") or "0").split(",") if d.strip() not in ("", "0")]
        if rates:
            errors.append(f"bench_request_rate={v.get('bench_request_rate')!r} with bench_profile={profile}: "
                          f"request rates are measured by the decode profile only; {fix}")
        if depths:
            errors.append(f"bench_depth={v.get('bench_depth')!r} with bench_profile={profile}: input depths "
                          f"are measured by the decode profile only; {fix}")
        if profile == "agent" and levels and levels != [1]:
            errors.append(f"bench_concurrency={v.get('bench_concurrency')!r} with bench_profile=agent: the "
                          "agent profile runs one conversation at a time; set bench_concurrency to \"1\"")

    goodput = v.get("bench_goodput") or ""
    bad = [x for x in str(goodput).split(",") if goodput and not GOODPUT_RE.fullmatch(x.strip())]
    if bad:
        errors.append(f"bench_goodput={goodput!r}: {bad[0]!r} is not NAME=TIME; write targets such as "
                      "ttft=2000ms,tpot=100ms (ttft, tpot, e2e; ms or s)")

    for name in ("bench_prompts_file", "bench_depth_text_file"):
        path = v.get(name)
        if isinstance(path, str) and path and not _templated(path) and not os.path.isfile(path):
            errors.append(f"{name}={path!r}: no such file on the controller; give an existing file or "
                          f"\"\" for the default")

    results = user.get("bench_results_dir")
    if results is None and defaults.get("bench_results_dir") == RESULTS_DIR_DEFAULT and playbook_dir:
        results = os.environ.get("SPARK_RESULTS_DIR") or os.path.join(playbook_dir, "..", "results")
    if isinstance(results, str) and results and not _templated(results):
        why = _writable_dir(results)
        if why:
            errors.append(f"bench_results_dir={results!r} {why} on the controller, and every run is "
                          "collected there after it is measured; set bench_results_dir (or "
                          "SPARK_RESULTS_DIR) to a directory you can write")
    return errors


class FilterModule:
    """Ansible filters: spark_bench_errors."""

    def filters(self):
        return {"spark_bench_errors": spark_bench_errors}
