"""Action spark_serve_wait: the phase-aware readiness wait of the serve role, with a progress line per phase.

Runs scripts/serve_wait.py (deployed by spark_tools) on the Spark in short steps, carrying the wait's
state from one step to the next, and prints one line per phase as the server enters it (Ansible
shows nothing of a module while it runs, so the loop lives here, on the controller). Fails with the
phase, how long it had been silent, its budget and the phase's last lines when the start stalls,
exits or runs past the overall timeout; returns the phases and their durations when it is ready.
"""

from __future__ import annotations

import json

from ansible.errors import AnsibleActionFail
from ansible.plugins.action import ActionBase
from ansible.utils.display import Display

display = Display()

_ARGS = ("tool", "python", "unit", "since", "health", "budgets", "timeout", "step", "lines")


class ActionModule(ActionBase):
    TRANSFERS_FILES = False
    _VALID_ARGS = frozenset(_ARGS)

    def run(self, tmp=None, task_vars=None):
        result = super().run(tmp, task_vars)
        a = self._task.args
        missing = [k for k in ("tool", "unit", "since", "health") if not a.get(k)]
        if missing:
            raise AnsibleActionFail(f"spark_serve_wait needs {', '.join(missing)}")
        if self._task.check_mode:
            result.update(skipped=True, msg="check mode: the server was not started, nothing to wait for")
            return result
        host = task_vars.get("inventory_hostname", "?")
        argv = [a.get("python", "python3"), a["tool"], "--unit", a["unit"], "--since", str(a["since"]),
                "--health", a["health"], "--budgets", json.dumps(a.get("budgets") or {}),
                "--timeout", str(a.get("timeout", 7200)), "--step", str(a.get("step", 20)),
                "--lines", str(a.get("lines", 20))]
        state = None
        while True:
            res = self._execute_module(module_name="ansible.legacy.command",
                                       module_args={"argv": argv, "stdin": json.dumps(state)},
                                       task_vars=task_vars)
            if res.get("rc") != 0:
                raise AnsibleActionFail(f"serve_wait.py failed (rc {res.get('rc')}): "
                                        f"{(res.get('stderr') or res.get('msg') or '').strip()}")
            out = json.loads(res["stdout"])
            for ev in out["events"]:
                display.display(f"{host}: {a['unit']}: {ev['text']}")
            if out["status"] != "waiting":
                break
            state = out["state"]
        out.pop("state", None)
        result.update(changed=False, status=out["status"], phases=out["phases"], phase=out["phase"],
                      last_lines=out["last_lines"], elapsed=out["elapsed"])
        if out["status"] == "ready":
            result["msg"] = f"{a['unit']} ready after {out['elapsed']:.0f} s: " + ", ".join(
                f"{p['phase']} {p['seconds']:.0f} s" for p in out["phases"])
            return result
        st, u = out["status"], out["unit"]
        where = f"in phase {out['phase_title']} ({out['phase']})"
        why = {"stalled": (f"stalled in phase {out['phase_title']} ({out['phase']}): its log was silent for "
                           f"{out['silent_seconds']:.0f} s, over the phase's budget of {out['budget']} s "
                           f"(serve_phase_budgets.{out['phase']})"),
               "exited": (f"exited {where} after {out['elapsed']:.0f} s: the server stopped or systemd "
                          f"restarted it (unit {u.get('ActiveState')}/{u.get('SubState')}, exit status "
                          f"{u.get('ExecMainStatus')})"),
               "timeout": (f"still {where} after {out['elapsed']:.0f} s, over serve_ready_timeout, though "
                           "its log still advanced")}[st]
        tail = out["last_lines"][-int(a.get("lines", 20)):]
        result.update(failed=True, msg=f"the server {why}. Last lines of the phase: " + " | ".join(tail))
        return result
