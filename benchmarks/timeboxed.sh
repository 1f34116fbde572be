# Time-boxed steps for the GPU scripts (gpu_lease_check.sh, gpu_first_contact.sh): sourced, not run.
#
#   source benchmarks/timeboxed.sh
#   steps_begin LOG_DIR SUMMARY_JSON BUDGET_S SCRIPT_NAME   # a step's log: LOG_DIR/NAME.log
#   step NAME LIMIT_S CMD [ARGS...] || steps_block "why the later steps cannot run"
#   step_not_run NAME "why"                         # a check left out on purpose, said by name
#   steps_end                                       # SUMMARY_JSON written; ONE JSON line on stdout
#
# CMD is a program or a function of the sourcing script. `timeout` runs programs only (a function's
# name would run /usr/bin/install or exit 127), so a function runs as `bash -c`, with every function
# of the script exported; the variables a function reads must be exported by the script.
#
# A step's status: ok, failed, timeout, no_time (the budget had under 5 s left for it), blocked (an
# earlier step it needs failed), not_run (not in STEPS, or left out by name), dry_run (DRY_RUN=1).
# ok, not_run and dry_run count as passing. The summary holds each step's status, rc, seconds, limit,
# log, and the last JSON object its log printed (its own result), and is rewritten after every step,
# so a run killed from outside still leaves the steps it finished.

# STEPS (the names to run, set by the script, overridable by the user) and DRY_RUN come from the caller
DRY_RUN=${DRY_RUN:-0}

steps_begin() {
    STEPS_LOGS=$1
    STEPS_SUMMARY=$2
    STEPS_BUDGET=$3
    STEPS_SCRIPT=$4
    STEPS_START=$(date +%s)
    STEPS_BLOCKED=""
    mkdir -p "$STEPS_LOGS" "$(dirname "$STEPS_SUMMARY")"
    : > "$STEPS_LOGS/steps.tsv"
    steps_summary > /dev/null
}

# seconds of the budget still left
steps_left() {
    echo $((STEPS_BUDGET - ($(date +%s) - STEPS_START)))
}

steps_selected() {
    [[ " $STEPS " == *" $1 "* ]]
}

# steps_record NAME STATUS RC SECONDS LIMIT WHY
steps_record() {
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$@" >> "$STEPS_LOGS/steps.tsv"
    echo "[$STEPS_SCRIPT] $1: $2 (rc $3, ${4}s of ${5}s)${6:+: $6}" >&2
    steps_summary > /dev/null
}

steps_block() {
    [[ -n $STEPS_BLOCKED ]] || STEPS_BLOCKED=$1
}

step_not_run() {
    steps_record "$1" not_run null 0 0 "$2"
}

# step NAME LIMIT CMD...: run CMD under `timeout` within what is left of the budget; 0 when it passed.
step() {
    local name=$1 limit=$2
    shift 2
    local left log="$STEPS_LOGS/$name.log"
    left=$(steps_left)
    ((limit > left)) && limit=$((left > 0 ? left : 0))
    if ! steps_selected "$name"; then
        steps_record "$name" not_run null 0 "$limit" "not in STEPS"
        return 0
    elif ((DRY_RUN)); then
        steps_record "$name" dry_run null 0 "$limit" "$*"
        return 0
    elif [[ -n $STEPS_BLOCKED ]]; then
        steps_record "$name" blocked null 0 "$limit" "$STEPS_BLOCKED"
        return 1
    elif ((limit < 5)); then
        steps_record "$name" no_time null 0 "$limit" "the ${STEPS_BUDGET}s budget is spent"
        return 1
    fi
    local cmd=("$@")
    if declare -F "$1" > /dev/null; then
        local fn
        for fn in $(declare -F | awk '{print $3}'); do export -f "${fn?}"; done
        cmd=(bash -c '"$@"' "$1" "$@")
    elif ! type -P "$1" > /dev/null; then
        steps_record "$name" failed 127 0 "$limit" "no such program or function: $1"
        return 1
    fi
    local t0 rc status seconds why=""
    t0=$(date +%s.%N)
    timeout --kill-after=10 "$limit" "${cmd[@]}" > "$log" 2>&1
    rc=$?
    seconds=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    case $rc in
        0) status=ok ;;
        124 | 137)
            status=timeout
            why="stopped at its ${limit}s limit"
            ;;
        *)
            status=failed
            why=$(grep -v '^[[:space:]]*$' "$log" | tail -n 1 | cut -c 1-300 | tr '\t' ' ')
            ;;
    esac
    steps_record "$name" "$status" "$rc" "$seconds" "$limit" "$why"
    [[ $status == ok ]]
}

# the summary from steps.tsv and the logs; prints it as one line; 1 when a step did not pass
steps_summary() {
    python3 - "$STEPS_LOGS" "$STEPS_SUMMARY" "$STEPS_SCRIPT" "$STEPS_BUDGET" "$(($(date +%s) - STEPS_START))" << 'PY'
import json, sys
from pathlib import Path

logs, summary_file, script = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3]
budget, seconds = int(sys.argv[4]), int(sys.argv[5])
PASSING = {"ok", "not_run", "dry_run"}


def own_result(log):
    """The last JSON object the step printed, if any."""
    if not log.exists():
        return None
    for line in reversed(log.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                continue
    return None


steps = []
for line in (logs / "steps.tsv").read_text().splitlines():
    name, status, rc, secs, limit, why = (line.split("\t") + [""] * 6)[:6]
    log = logs / f"{name}.log"
    entry = {"name": name, "status": status, "rc": None if rc == "null" else int(rc), "seconds": float(secs)}
    entry["limit_s"] = int(limit)
    if why:
        entry["why"] = why
    if log.exists():
        entry["log"] = f"logs/{name}.log"
        entry["result"] = own_result(log)
    steps.append(entry)
failed = [s["name"] for s in steps if s["status"] not in PASSING]
summary = {"script": script, "ok": not failed, "failed": failed, "seconds": seconds, "budget_s": budget, "steps": steps}
summary_file.write_text(json.dumps(summary, indent=1) + "\n")
print(json.dumps(summary))
sys.exit(1 if failed else 0)
PY
}

# the summary written; its one line on stdout; 0 when every step passed
steps_end() {
    steps_summary
}
