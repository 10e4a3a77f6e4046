#!/usr/bin/env python3
"""The Makefile's runner: build a target's argv from make's variables, without a shell.

usage: make_run.py TARGET     (TARGET: deploy, check, tune, gpu-e2e, gpu-model, gpu-first-start, gpu-dflash,
                               gpu-dflash-graph, gpu-shared-experts, gpu-proxy, gpu-head-records)

The Makefile exports its user variables (SPEC_METHOD, INVENTORY, ARGS) and calls this script; the
values reach the program as argv items and never pass through a shell, so `;`, `$(...)`, quotes or
`#` in a value cannot start another command or drop an option:

- SPEC_METHOD: one method name (letters, digits, `_`, `-`); anything else is refused.
- INVENTORY: an inventory path (or Ansible's comma-separated host list); a value starting with `-`
  (an option, not a path), or holding a control character, is refused. For deploy and check the
  inventory must also exist, be readable by Ansible's own loader (`ansible-inventory --list`) and hold
  at least one host in the group `spark` (directly or in a child group): otherwise every play would
  skip with "no hosts matched" and exit 0 having done nothing.
- ARGS: split like a shell's words (shlex: quotes group, nothing is executed), appended as items.
  ARGS may not set `ansible_check_mode` (`make check` is the dry run, `make deploy` the real one).

`tune` runs scripts/tune.py with the inventory (checked as for deploy) and ARGS (e.g. ARGS="--quick").
`check` always runs with --check --diff: no value of ARGS can remove them. The program is echoed, then exec'd
(its exit status is make's). Exit codes: that program's, or 2 when a variable is refused (one line naming
the variable and the fix).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

from sparkllm.cli import UsageError, WorkFailed, run_main

METHOD_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
# target: (script, output directory, the target's own arguments before ARGS)
GPU_TARGETS = {
    "gpu-e2e": ("tests/gpu/e2e.py", "results/gpu-e2e", ()),
    "gpu-model": ("tests/gpu/model_entry.py", "results/gpu-model", ()),
    "gpu-first-start": ("tests/gpu/first_start.py", "results/gpu-first-start", ()),
    "gpu-dflash": ("tests/gpu/dflash_bench.py", "results/gpu-dflash", ()),
    # the CUDA-graph DFlash start needs a call of its own on a cold host (~400 s of Triton compile)
    "gpu-dflash-graph": ("tests/gpu/dflash_bench.py", "results/gpu-dflash-graph",
                         ("--cases", "base,dflash-graph", "--no-bench")),
    "gpu-shared-experts": ("tests/gpu/shared_experts.py", "results/gpu-shared-experts", ()),
    "gpu-proxy": ("tests/gpu/proxy_real.py", "results/gpu-proxy", ()),
    "gpu-head-records": ("tests/gpu/head_records.py", "results/gpu-head-records", ()),
}
TARGETS = ("deploy", "check", "tune", *GPU_TARGETS)


class Refused(UsageError):
    """A make variable holds a value that cannot be passed on; the message names it and the fix."""


def user_args(env: dict[str, str]) -> list[str]:
    text = env.get("ARGS", "")
    try:
        args = shlex.split(text)
    except ValueError as exc:
        raise Refused(f"ARGS={text!r}: {exc}; balance the quotes (ARGS is split like shell words)") from None
    for a in args:
        if "ansible_check_mode" in a:
            raise Refused(
                f"ARGS item {a!r} sets ansible_check_mode; use `make check` for a dry run and "
                "`make deploy` for a real one"
            )
    return args


EXAMPLES = "inventory/examples/ (remote-spark.yml: one Spark over ssh; two-sparks.yml: two)"


def _group_hosts(listing: dict, group: str, seen: set[str] | None = None) -> set[str]:
    """Hosts of ``group`` in `ansible-inventory --list` output, its child groups' included."""
    seen = set() if seen is None else seen
    if group in seen or not isinstance(listing.get(group), dict):
        return set()
    seen.add(group)
    hosts = set(listing[group].get("hosts", []))
    for child in listing[group].get("children", []):
        hosts |= _group_hosts(listing, child, seen)
    return hosts


def check_inventory(inventory: str, bin_dir: str) -> None:
    """Refuse an inventory that names no Spark: missing, unreadable to Ansible, or no host in `spark`."""
    fix = f"put your Spark(s) under the group `spark` (`spark:` -> `hosts:`), as in {EXAMPLES}"
    if "," not in inventory and not os.path.exists(inventory):
        raise Refused(f"INVENTORY={inventory}: no such file (from {os.getcwd()}); give an inventory file and "
                      f"{fix}")
    tool = os.path.join(bin_dir, "ansible-inventory")
    env = {**os.environ, "ANSIBLE_INVENTORY_UNPARSED_FAILED": "true"}
    try:
        r = subprocess.run([tool, "-i", inventory, "--list"], capture_output=True, text=True, env=env,
                           check=False)
    except OSError as exc:
        raise WorkFailed(f"cannot run {tool} ({exc.strerror}); run `make setup` first") from None
    try:
        listing = json.loads(r.stdout) if r.returncode == 0 else None
    except ValueError:
        listing = None
    if not isinstance(listing, dict):
        lines = [x.strip() for x in r.stderr.splitlines() if x.strip()]
        why = next((x for x in lines if "parsing failed" in x.lower()),
                   lines[-1] if lines else f"ansible-inventory exited {r.returncode}")
        why = re.sub(r"^\[\w+\]:\s*", "", why)[:200]
        raise Refused(f"INVENTORY={inventory}: Ansible cannot read it as an inventory ({why}); write it as "
                      f"YAML and {fix}")
    if not _group_hosts(listing, "spark"):
        groups = sorted(g for g in listing if g not in ("_meta", "all", "ungrouped"))
        has = f"its groups: {', '.join(groups)}" if groups else "it has no group"
        if listing.get("ungrouped", {}).get("hosts"):
            has += f"; hosts in no group: {', '.join(listing['ungrouped']['hosts'][:5])}"
        raise Refused(f"INVENTORY={inventory}: has no host in the group `spark` ({has}), so every play would "
                      f"skip; {fix}")


def checked_inventory(env: dict[str, str]) -> tuple[str, str]:
    """(INVENTORY, the venv's bin directory) once INVENTORY is a path Ansible reads with a Spark host in
    it; Refused otherwise."""
    inventory = env.get("INVENTORY", "")
    if not inventory or inventory.startswith("-") or CONTROL_RE.search(inventory):
        raise Refused(
            f"INVENTORY={inventory!r}: not an inventory path; give a file, e.g. INVENTORY=inventory/hosts.yml"
        )
    bin_dir = env.get("BIN", ".venv/bin")
    check_inventory(inventory, bin_dir)
    return inventory, bin_dir


def playbook_argv(target: str, env: dict[str, str]) -> list[str]:
    method = env.get("SPEC_METHOD", "")
    if not METHOD_RE.fullmatch(method):
        raise Refused(
            f"SPEC_METHOD={method!r}: not a method name (letters, digits, _ and - only); "
            "give one of the methods of group_vars/all/methods.yml, e.g. SPEC_METHOD=mtp"
        )
    inventory, bin_dir = checked_inventory(env)
    argv = [
        os.path.join(bin_dir, "ansible-playbook"),
        "-i",
        inventory,
        "site.yml",
        "-e",
        f"spec_method={method}",
    ]
    if target == "check":
        argv += ["--check", "--diff"]
    return argv + user_args(env)


def tune_argv(env: dict[str, str]) -> list[str]:
    """scripts/tune.py (method x K x LM head on the inventory's Spark) with the inventory and ARGS."""
    inventory, bin_dir = checked_inventory(env)
    return [os.path.join(bin_dir, "python"), "scripts/tune.py", "--inventory", inventory, *user_args(env)]


def build_argv(target: str, env: dict[str, str]) -> list[str]:
    if target in ("deploy", "check"):
        return playbook_argv(target, env)
    if target == "tune":
        return tune_argv(env)
    if target in GPU_TARGETS:
        script, out, own = GPU_TARGETS[target]
        return [sys.executable, script, "--out", out, *own, *user_args(env)]
    raise Refused(f"target {target!r}: unknown; give one of {', '.join(TARGETS)}")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    return run_main("make_run", lambda: run(args))


def run(args: list[str]) -> int:
    if len(args) != 1:
        raise UsageError(f"usage: make_run.py TARGET ({', '.join(TARGETS)})")
    cmd = build_argv(args[0], dict(os.environ))
    print(shlex.join(cmd), flush=True)  # what make would have echoed
    try:
        os.execv(cmd[0], cmd)
    except OSError as exc:
        raise WorkFailed(f"cannot run {cmd[0]} ({exc.strerror}); run `make setup` first") from None
    return 1  # not reached: execv replaces this process


if __name__ == "__main__":
    sys.exit(main())
