#!/usr/bin/env bash
# `make test`: every suite CI runs, arranged for a 2-core machine.
#
# 1. alone, the unit tests whose assertions are timings of a stand-in server (UNIT_TIMED: load ratios,
#    queueing delays; a busy CPU would skew them). They wait more than they compute: about a minute.
# 2. the molecule scenarios (tests/harness/run_molecule.sh, MOLECULE_JOBS at a time) in the background:
#    they spend much of their time waiting on containers, builds slowed on purpose and rate-capped downloads;
# 3. meanwhile, at a lower CPU priority (nice), the rest of the unit tests, lint and the contract suite (its
#    environment first), which time nothing to a tight margin, so the scenarios' timed steps keep the CPU
#    they need. Those three took 8.5 min beside a site scenario (unit alone: 4.5 min), well inside the
#    scenarios' hour; running them first cost the whole run their time.
# Each step's output is shown whole; the molecule summary comes last. Exit status: 0 when every step passed,
# 1 when any failed (the failing steps are named).
set -uo pipefail
cd "$(dirname "$0")/../.."
scenarios=${SCENARIOS:?SCENARIOS (the molecule scenarios to run) is not set: run this through make test}
logdir="${MOLECULE_LOGDIR:-.cache/molecule}"
mkdir -p "$logdir"
start=$(date +%s)
failed=()

step() {
  local name="$1" t rc
  shift
  t=$(date +%s)
  echo "=== $name: $*"
  "$@"
  rc=$?
  echo "=== $name: $([ "$rc" -eq 0 ] && echo passed || echo "FAILED (rc $rc)") in $(( $(date +%s) - t )) s"
  [ "$rc" -eq 0 ] || failed+=("$name")
}

py="${BIN:-.venv/bin}/python"
# a new unit test that asserts a timing with a tight margin belongs in this list
UNIT_TIMED=(tests/unit/test_bench_load_outputs.py tests/unit/test_bench_rate.py)
ignore_timed=()
for f in "${UNIT_TIMED[@]}"; do ignore_timed+=(--ignore "$f"); done

step unit-timed "$py" -m pytest "${UNIT_TIMED[@]}" -q -m "not vllm_contract"

echo "=== molecule: ${scenarios} in the background (output at the end; logs in ${logdir}/)"
mol_start=$(date +%s)
# shellcheck disable=SC2086  # one scenario per word
bash tests/harness/run_molecule.sh ${scenarios} >"${logdir}/run.out" 2>&1 &
mol_pid=$!

step unit nice -n 10 "$py" -m pytest tests/unit -q -m "not vllm_contract" "${ignore_timed[@]}"
step lint nice -n 10 make --no-print-directory lint
step contract nice -n 10 make --no-print-directory contract

echo "=== waiting for the molecule scenarios ($(( $(date +%s) - mol_start )) s so far)"
wait "$mol_pid"
mol_rc=$?
cat "${logdir}/run.out"
echo "=== molecule: $([ "$mol_rc" -eq 0 ] && echo passed || echo "FAILED (rc $mol_rc)") in $(( $(date +%s) - mol_start )) s"
[ "$mol_rc" -eq 0 ] || failed+=(molecule)

echo "=== make test: $(( $(date +%s) - start )) s"
if [ ${#failed[@]} -gt 0 ]; then
  echo "=== make test FAILED: ${failed[*]}"
  exit 1
fi
echo "=== make test passed"
