"""The one memory budget of a Spark: what vLLM will reserve of the unified memory and what is left.

vLLM 0.19.1 (``vllm/v1/worker/utils.py`` ``request_memory``) requests
``ceil(total x gpu_memory_utilization)`` at start and refuses to start when the free memory is below
it; on GB10 (compute capability 12.1, ``vllm/utils/mem_utils.py``) "free" is
``psutil.virtual_memory().available``, i.e. MemAvailable, and "total" is the unified memory
(MemTotal). Whatever vLLM does not reserve is all the box has left for the desktop, sshd, Ansible and
the page cache, and the memory guard (earlyoom) stops the server once MemAvailable falls below its
SIGTERM line. So the budget is:

    in use before vLLM = MemTotal - MemAvailable (at least the desktop's share when graphical.target
                         is active)
    reserved           = ceil(MemTotal x utilization)
    left               = MemTotal - in use - reserved
    required           = the guard's SIGTERM line + a margin (what vLLM holds beyond its reservation:
                         API server, tokenizer, CUDA context, compile workers; and the headroom the
                         field's reports ask to stay free once the server is READY: memory.yml says which)

and a deploy is refused when ``left < required``, naming the highest utilization that fits. The
guard's lines are the same figures in KiB, as earlyoom's ``-M SIZE,KILL_SIZE`` takes them.

The fraction vLLM is given is computed here too, once: ``spark_memory_utilization`` checks the knob
against the one bound ``GPU_MEMORY_MAX`` and lowers it to the method's ``gpu_memory_utilization_cap``
(group_vars/all/methods.yml); the serve argv (filter_plugins/spark_methods.py) and the preflight budget
(roles/preflight/tasks/budget.yml) both read it from here.
"""

from __future__ import annotations

import math

GIB = 1 << 30
# The highest vllm_gpu_memory_utilization accepted, the one bound of every check of it:
# group_vars/all/main.yml documents the knob as a "float in (0, 0.95]" (0.90 fails on some units).
GPU_MEMORY_MAX = 0.95
_CAP = "gpu_memory_utilization_cap"


class MemoryBudgetError(ValueError):
    """Inconsistent budget inputs (a guard line above MemTotal, the SIGKILL line above SIGTERM's)."""


def _gib(b: float) -> str:
    return f"{b / GIB:.1f} GiB"


def _int(name: str, value) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise MemoryBudgetError(f"{name}={value!r} is not a number of bytes; set it to an integer") from None
    if out < 0:
        raise MemoryBudgetError(f"{name}={value!r} is negative; set it to a number of bytes >= 0")
    return out


def utilization_error(value) -> str | None:
    """None when ``value`` is a fraction in (0, GPU_MEMORY_MAX], else the message naming it and the fix."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return (f"vllm_gpu_memory_utilization={value!r} is not a number; set it to a fraction "
                f"in (0, {GPU_MEMORY_MAX}], e.g. 0.8")
    if not 0 < value <= GPU_MEMORY_MAX:
        return (f"vllm_gpu_memory_utilization={value!r} is out of range; set it to a fraction "
                f"in (0, {GPU_MEMORY_MAX}], e.g. 0.8 (0.90 fails on some units)")
    return None


def _fraction(value) -> float:
    """The knob as a float (a string such as "0.8" from -e is read as its number), checked."""
    try:
        util = float(value) if isinstance(value, str) else value
    except ValueError:
        util = value
    error = utilization_error(util)
    if error:
        raise MemoryBudgetError(error)
    return float(util)


def spark_memory_utilization(utilization, catalogue, method) -> float:
    """The fraction vLLM is given (--gpu-memory-utilization): the knob, checked, lowered to the method's
    ``serve_flags.gpu_memory_utilization_cap`` where the catalogue sets one."""
    util = _fraction(utilization)
    if method not in (catalogue or {}):
        raise MemoryBudgetError(f"spec_method={method!r} is not in spark_method_catalogue; set it to one of "
                                f"{sorted(catalogue or {})}")
    cap = (catalogue[method].get("serve_flags") or {}).get(_CAP)
    if cap is None:
        return util
    if isinstance(cap, bool) or not isinstance(cap, int | float) or not 0 < cap <= GPU_MEMORY_MAX:
        raise MemoryBudgetError(f"method {method!r}: serve_flags.{_CAP}={cap!r} is not a fraction in "
                                f"(0, {GPU_MEMORY_MAX}]; fix it in group_vars/all/methods.yml")
    return min(util, float(cap))


def parse_meminfo(text: str) -> dict[str, int]:
    """/proc/meminfo as bytes per field (``MemTotal:  123 kB`` -> 125952)."""
    out = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[key.strip()] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    for need in ("MemTotal", "MemAvailable"):
        if need not in out:
            raise MemoryBudgetError(f"/proc/meminfo has no {need} line; the budget needs MemTotal and "
                                    "MemAvailable")
    return out


def spark_memory_guard_kib(guard_term_bytes, guard_kill_bytes, total_bytes) -> list[int]:
    """earlyoom's ``-M`` values (KiB): [SIGTERM line, SIGKILL line], checked against MemTotal.

    ``total_bytes`` 0 or None (facts not gathered, e.g. a validation-only run's argument check): the lines are
    given without the MemTotal check; the ops play gathers facts, so a real run always checks."""
    term = _int("spark_memory_guard_term_bytes", guard_term_bytes)
    kill = _int("spark_memory_guard_kill_bytes", guard_kill_bytes)
    total = _int("MemTotal", total_bytes) if total_bytes else None
    if not 0 < kill <= term:
        raise MemoryBudgetError(
            f"spark_memory_guard_kill_bytes={kill} must be above 0 and at most spark_memory_guard_term_bytes="
            f"{term}; set the SIGKILL line below the SIGTERM line (e.g. half of it)")
    if total is not None and term >= total:
        raise MemoryBudgetError(
            f"spark_memory_guard_term_bytes={term} ({_gib(term)}) is not below MemTotal ({_gib(total)}); "
            "set it to a small part of the box's memory")
    return [term // 1024, kill // 1024]


def spark_memory_budget(meminfo, utilization, guard_term_bytes, guard_kill_bytes, margin_bytes,
                        desktop_bytes=0, desktop_active=False, in_use_bytes=None) -> dict:
    """The budget (see the module's docstring). ``meminfo``: /proc/meminfo's text or a parsed dict.
    ``in_use_bytes``: use this figure for "in use before vLLM" instead of MemTotal - MemAvailable
    (a server already runs, so the measured figure counts it)."""
    info = parse_meminfo(meminfo) if isinstance(meminfo, str) else {k: int(v) for k, v in meminfo.items()}
    total, avail = info["MemTotal"], info["MemAvailable"]
    util = _fraction(utilization)
    term_kib, kill_kib = spark_memory_guard_kib(guard_term_bytes, guard_kill_bytes, total)
    margin = _int("spark_memory_margin_bytes", margin_bytes)
    desktop = _int("spark_memory_desktop_bytes", desktop_bytes)
    measured = total - avail if in_use_bytes is None else _int("in use", in_use_bytes)
    in_use = max(measured, desktop) if desktop_active else measured
    reserved = math.ceil(total * util)  # vLLM's request_memory
    left = total - in_use - reserved
    required = term_kib * 1024 + margin
    fit = math.floor((total - in_use - required) / total * 100) / 100
    ok = left >= required
    why = f"{_gib(in_use)} in use before vLLM starts"
    if desktop_active and desktop > measured:
        why += f" (the desktop's {_gib(desktop)}: graphical.target is active)"
    elif desktop_active:
        why += " (graphical.target is active)"
    summary = (f"vllm_gpu_memory_utilization={util:g} reserves {_gib(reserved)} of {_gib(total)} (MemTotal); "
               f"with {why}, {_gib(left)} is left for everything else; the guard stops the server below "
               f"{_gib(term_kib * 1024)} available (SIGKILL below {_gib(kill_kib * 1024)}), "
               f"plus a {_gib(margin)} margin: {_gib(required)} required")
    fixes = []
    if fit > 0:
        fixes.append(f"lower vllm_gpu_memory_utilization to {fit:.2f} or less")
    if desktop_active:
        fixes.append("boot to multi-user.target "
                     "(sudo systemctl set-default multi-user.target && sudo reboot)")
    if not fixes:
        fixes.append("stop what else holds memory on the box")
    message = summary if ok else f"{summary}; refused: {' or '.join(fixes)}"
    return {
        "total_bytes": total, "available_bytes": avail, "in_use_bytes": in_use,
        "measured_in_use_bytes": measured,
        "utilization": util, "reserved_bytes": reserved, "left_bytes": left, "required_bytes": required,
        "guard_term_kib": term_kib, "guard_kill_kib": kill_kib, "margin_bytes": margin,
        "desktop_active": bool(desktop_active), "max_utilization": min(max(fit, 0.0), GPU_MEMORY_MAX),
        "ok": ok,
        "message": message,
    }


class FilterModule:
    def filters(self):
        return {"spark_memory_budget": spark_memory_budget, "spark_memory_guard_kib": spark_memory_guard_kib,
                "spark_memory_utilization": spark_memory_utilization}
