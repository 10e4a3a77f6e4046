#!/usr/bin/env bash
# Run molecule scenarios, JOBS at a time (they use distinct containers, ports and images, so they can
# share the machine's Docker engine). Each scenario logs to .cache/molecule/<name>.log; a failure
# prints that log's tail. Exit status: non-zero if any scenario failed.
set -uo pipefail
jobs="${MOLECULE_JOBS:-2}"
logdir="${MOLECULE_LOGDIR:-.cache/molecule}"
mkdir -p "$logdir"
: >"$logdir/summary"

run_one() {
  local s="$1" log="$logdir/$1.log" start rc
  start=$(date +%s)
  echo "=== molecule test -s $s (log: $log)"
  NO_COLOR=1 ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 molecule test -s "$s" >"$log" 2>&1
  rc=$?
  if [ "$rc" -eq 0 ]; then
    echo "=== $s: passed in $(( $(date +%s) - start )) s ($(grep -Eo '[0-9]+ passed' "$log" | tail -n 1))"
    grep -E 'FIGURE' "$log" | sed "s/^/=== $s: /"
    echo "PASS $s" >>"$logdir/summary"
  else
    echo "=== $s: FAILED (rc $rc) after $(( $(date +%s) - start )) s; last lines of $log:"
    tail -n 200 "$log"
    echo "FAIL $s" >>"$logdir/summary"
  fi
  return "$rc"
}
export -f run_one
export logdir

printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c 'run_one "$@"' _ {}
rc=$?
echo "scenarios run: $#"
echo "molecule: $(grep -c "^PASS" "$logdir/summary") passed, $(grep -c "^FAIL" "$logdir/summary") failed"
exit "$rc"
