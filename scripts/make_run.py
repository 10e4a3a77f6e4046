#!/usr/bin/env python3
"""The Makefile's runner: build a target's argv from make's variables, without a shell.

usage: make_run.py TARGET     (TARGET: deploy, check, gpu-e2e, gpu-first-start, gpu-dflash,
                               gpu-dflash-graph, gpu-shared-experts, gpu-proxy)

The Makefile exports its user variables (SPEC_METHOD, INVENTORY, ARGS) and calls this script; the
values reach the program as argv items and never pass through a shell, so `;`, `$(...)`, quotes or
`#` in a value cannot start another command or drop an option:

- SPEC_METHOD: one method name (letters, digits, `_`, `-`); anything else is refused.
- INVENTORY: an inventory path (or Ansible's comma-separated host list); a value starting with `-`
  (an option, not a path), or holding a control character, is refused.
- ARGS: split like a shell's words (shlex: quotes group, nothing is executed), appended as items.
  ARGS may not set `ansible_check_mode` (`make check` is the dry run, `make deploy` the real one).

`check` always runs with --check --diff: no value of ARGS can remove them. The program is echoed, then exec'd
(its exit status is make's). Exit codes: that program's, or 2 when a variable is refused (one line naming
the variable and the fix).
"""

from __future__ import annotations

import os
import re
import shlex
import sys

from sparkllm.cli import UsageError, WorkFailed, run_main

METHOD_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
CONTROL_RE = re.compile(r"[\x00-\x1f\x7f]")
# target: (script, output directory, the target's own arguments before ARGS)
GPU_TARGETS = {
    "gpu-e2e": ("tests/gpu/e2e.py", "results/gpu-e2e", ()),
    "gpu-first-start": ("tests/gpu/first_start.py", "results/gpu-first-start", ()),
    "gpu-dflash": ("tests/gpu/dflash_bench.py", "results/gpu-dflash", ()),
    # the CUDA-graph DFlash start needs a call of its own on a cold host (~400 s of Triton compile)
    "gpu-dflash-graph": ("tests/gpu/dflash_bench.py", "results/gpu-dflash-graph",
                         ("--cases", "base,dflash-graph", "--no-bench")),
    "gpu-shared-experts": ("tests/gpu/shared_experts.py", "results/gpu-shared-experts", ()),
    "gpu-proxy": ("tests/gpu/proxy_real.py", "results/gpu-proxy", ()),
}
TARGETS = ("deploy", "check", *GPU_TARGETS)


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


def playbook_argv(target: str, env: dict[str, str]) -> list[str]:
    method = env.get("SPEC_METHOD", "")
    if not METHOD_RE.fullmatch(method):
        raise Refused(
            f"SPEC_METHOD={method!r}: not a method name (letters, digits, _ and - only); "
            "give one of the methods of group_vars/all/methods.yml, e.g. SPEC_METHOD=mtp"
        )
    inventory = env.get("INVENTORY", "")
    if not inventory or inventory.startswith("-") or CONTROL_RE.search(inventory):
        raise Refused(
            f"INVENTORY={inventory!r}: not an inventory path; give a file, e.g. INVENTORY=inventory/hosts.yml"
        )
    bin_dir = env.get("BIN", ".venv/bin")
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


def build_argv(target: str, env: dict[str, str]) -> list[str]:
    if target in ("deploy", "check"):
        return playbook_argv(target, env)
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
