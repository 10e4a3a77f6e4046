"""Callback (test bed): how many tasks each host executed, appended as one JSON line per playbook run.

A task counts for a host when a module ran on that host: its result was ok, changed, failed or
unreachable (not skipped), it was not delegated to the controller, and its action is not one the
controller answers alone (set_fact, debug, assert, fail, meta, include/import, add_host, group_by).
The site scenario reads the line of the no-op rerun for its RERUN FIGURE (issue 14: T <= 25). Each line
also holds every play's name and its start and end (epoch seconds), for the PROVISION FIGURE.
Enable with ANSIBLE_CALLBACKS_ENABLED=sparkllm_task_count and SPARKLLM_TASK_COUNT_FILE=<path>.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict

from ansible import context
from ansible.plugins.callback import CallbackBase

DOCUMENTATION = r"""
name: sparkllm_task_count
type: aggregate
short_description: count the tasks each host executed (test bed)
description: >-
  Appends {"playbook", "check", "hosts": {host: {"executed": N, "names": [...]}},
  "plays": [{"name", "start", "end"}]} to SPARKLLM_TASK_COUNT_FILE.
requirements: [enabled in ANSIBLE_CALLBACKS_ENABLED]
"""

CONTROLLER_ONLY = {
    "set_fact", "debug", "assert", "fail", "meta", "validate_argument_spec", "include_tasks", "import_tasks",
    "include_role",
    "import_role", "include_vars", "add_host", "group_by", "set_stats", "pause",
}


def _short(action: str) -> str:
    return action.rsplit(".", 1)[-1]


class CallbackModule(CallbackBase):
    CALLBACK_VERSION = 2.0
    CALLBACK_TYPE = "aggregate"
    CALLBACK_NAME = "sparkllm_task_count"
    CALLBACK_NEEDS_ENABLED = True

    def __init__(self) -> None:
        super().__init__()
        self._names: dict[str, list[str]] = defaultdict(list)
        self._playbook = ""
        self._plays: list[dict[str, object]] = []

    def v2_playbook_on_start(self, playbook) -> None:
        self._playbook = os.path.basename(playbook._file_name)

    def _end_play(self) -> None:
        if self._plays and self._plays[-1]["end"] is None:
            self._plays[-1]["end"] = time.time()

    def v2_playbook_on_play_start(self, play) -> None:
        self._end_play()
        self._plays.append({"name": play.get_name(), "start": time.time(), "end": None})

    def _count(self, result) -> None:
        task = result._task
        if _short(task.action) in CONTROLLER_ONLY:
            return
        delegate = task.delegate_to
        if delegate and str(delegate) in ("localhost", "127.0.0.1"):
            return
        self._names[result._host.get_name()].append(task.get_name())

    def v2_runner_on_ok(self, result) -> None:
        self._count(result)

    def v2_runner_on_failed(self, result, ignore_errors=False) -> None:
        self._count(result)

    def v2_runner_on_unreachable(self, result) -> None:
        self._count(result)

    def v2_playbook_on_stats(self, stats) -> None:
        path = os.environ.get("SPARKLLM_TASK_COUNT_FILE")
        if not path:
            return
        self._end_play()
        hosts = {h: {"executed": len(n), "names": n} for h, n in sorted(self._names.items())}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"playbook": self._playbook, "check": bool(context.CLIARGS.get("check")),
                                "hosts": hosts, "plays": self._plays}) + "\n")
