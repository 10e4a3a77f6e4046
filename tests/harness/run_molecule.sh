#!/usr/bin/env bash
# Run molecule scenarios, JOBS at a time (they use distinct containers, ports and images, so they can
# share the machine's Docker engine). Each scenario logs to .cache/molecule/<name>.log; a failure
# prints that log's tail. Exit status: non-zero if any scenario failed.
set -uo pipefail
jobs="${MOLECULE_JOBS:-2}"
logdir="${MOLECULE_LOGDIR:-.cache/molecule}"
mkdir -p "$logdir"
: >"$logdir/summary"

# Copies molecule's output to the log and notes when each of its actions starts and ends ("[site > converge]
# Executing" / "Executed: ..."), with the epoch second, in $1: where a scenario's time goes (CI's budget).
note_actions() {
  local line
  while IFS= read -r line; do
    case "$line" in
      *"] Executing"*|*"] Executed:"*) printf '%(%s)T %s\n' -1 "$line" >>"$1" ;;
    esac
    printf '%s\n' "$line"
  done
}

# "create 31 s, prepare 62 s, converge 301 s, ..." from note_actions' file (actions in the order they ran)
action_times() {
  awk '/\] Executing/ { match($0, /> [a-z_]+\]/); a = substr($0, RSTART + 2, RLENGTH - 3); t = $1; next }
       /\] Executed:/ && a != "" { out = out sep a " " ($1 - t) " s"; sep = ", "; a = "" }
       END { print out }' "$1"
}

run_one() {
  local s="$1" log="$logdir/$1.log" start rc
  start=$(date +%s)
  echo "=== molecule test -s $s (log: $log)"
  : >"$logdir/$s.actions"
  NO_COLOR=1 ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 molecule test -s "$s" 2>&1 \
    | note_actions "$logdir/$s.actions" >"$log"
  rc=${PIPESTATUS[0]}
  echo "=== $s: actions: $(action_times "$logdir/$s.actions")"
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
export -f run_one note_actions action_times
export logdir

printf '%s\n' "$@" | xargs -P "$jobs" -I{} bash -c 'run_one "$@"' _ {}
rc=$?
echo "scenarios run: $#"
echo "molecule: $(grep -c "^PASS" "$logdir/summary") passed, $(grep -c "^FAIL" "$logdir/summary") failed"
exit "$rc"
