#!/bin/bash
# First contact with a GPU machine: install, report, check, annotate, score; each step time-boxed,
# all of it within BUDGET seconds (default 470, under 8 minutes). Ends with ONE JSON line: each
# step's status (ok, failed, timeout, no_time, blocked, not_run, dry_run), exit code and seconds.
#
# Usage, from a fresh clone on a bare one-GPU machine with pip access:
#   bash benchmarks/gpu_first_contact.sh
#   PYTHON=/path/to/python bash benchmarks/gpu_first_contact.sh   # an environment of your own: no install
#   DRY_RUN=1 bash benchmarks/gpu_first_contact.sh                # the steps and their limits, nothing run
#   STEPS="env gpu_check" bash benchmarks/gpu_first_contact.sh    # only these steps (the rest: not_run)
#
# Steps (limit in seconds; a step also stops when the budget is spent):
#   install    (210) venv .venv-gpu, torch TORCH_GPU (torch==2.14.0), mmprm with the vllm and
#                    deepspeed extras, then `make install` (flash-attn is not built: it takes longer
#                    than the budget, so gpu-check skips it by name)
#   env        (40)  mmprm env: versions, each library imported and used once on the GPU
#   gpu_check  (150) make gpu-check, shortened (10 steps, 64 rows), --skip vllm_tp,flash_attn
#   annotate   (45)  a toy policy and 4 toy problems, mcts_annotate.py with policy.backend=vllm
#   score      (35)  benchmarks/prm_vllm_scoring.py --quick: the vLLM and HF scorers agree
# Logs: WORK/logs/STEP.log (WORK default runs/first_contact). Exit 0 when every step run passed.
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
BUDGET=${BUDGET:-470}
WORK=${WORK:-runs/first_contact}
VENV=${VENV:-.venv-gpu}
TORCH_GPU=${TORCH_GPU:-torch==2.14.0}
DRY_RUN=${DRY_RUN:-0}
STEPS=${STEPS:-install env gpu_check annotate score}
mkdir -p "$WORK/logs"

if [[ -n ${PYTHON:-} ]]; then
    py=$PYTHON
    STEPS=${STEPS//install/}  # an environment of your own is not installed into
else
    py=$VENV/bin/python
fi

start=$(date +%s)
steps_json=()
all_ok=1
install_failed=0

# step NAME LIMIT CMD...: run CMD under `timeout`, within what is left of the budget; record it.
step() {
    local name=$1 limit=$2
    shift 2
    local status rc=null seconds=0 left
    left=$((BUDGET - ($(date +%s) - start)))
    ((limit > left)) && limit=$left
    if [[ " $STEPS " != *" $name "* ]]; then
        status=not_run
    elif ((DRY_RUN)); then
        status=dry_run
    elif ((install_failed)); then
        status=blocked
    elif ((limit < 5)); then
        status=no_time
    else
        local t0
        t0=$(date +%s.%N)
        timeout --kill-after=10 "$limit" "$@" > "$WORK/logs/$name.log" 2>&1
        rc=$?
        seconds=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
        case $rc in
            0) status=ok ;;
            124 | 137) status=timeout ;;
            *) status=failed ;;
        esac
    fi
    case $status in ok | not_run | dry_run) ;; *) all_ok=0 ;; esac
    if [[ $name == install && $status != ok && $status != not_run && $status != dry_run ]]; then
        install_failed=1
    fi
    steps_json+=("{\"name\": \"$name\", \"status\": \"$status\", \"rc\": $rc, \"seconds\": $seconds, \"limit_s\": $limit}")
}

install() {
    python3 -m venv "$VENV" &&
        "$py" -m pip install -q "$TORCH_GPU" &&
        "$py" -m pip install -q -e ".[vllm,deepspeed,dev]" &&
        make install PYTHON="$py"
}

annotate() {
    "$py" -m mmprm.cli tiny-model --arch qwen2_vl --out "$WORK/base" --vllm &&
        "$py" -m mmprm.annotate.simulated --base "$WORK/base" --out "$WORK/policy" \
            --problems-dir "$WORK/problems" --n 4 &&
        "$py" recipes/mcts_annotate.py --config recipes/configs/tiny/mcts_annotate.yaml \
            policy.path="$WORK/policy" data.problems_file="$WORK/problems/problems.jsonl" \
            output_dir="$WORK/annotate" policy.backend=vllm policy.dtype=bfloat16 \
            policy.vllm.max_model_len=1024 policy.vllm.gpu_memory_utilization=0.3 \
            "policy.vllm.kwargs={enforce_eager: true}" search.max_searches=4 search.rollouts_per_estimate=4 \
            policy.sampling.max_new_tokens=64
}

step install 210 install
step env 40 "$py" -m mmprm.cli env
step gpu_check 150 make gpu-check PYTHON="$py" \
    GPU_CHECK_ARGS="--steps 10 --rows 64 --timeout 100 --probe-tokens 2048 --skip vllm_tp,flash_attn"
step annotate 45 annotate
step score 35 "$py" benchmarks/prm_vllm_scoring.py --quick --device cuda --dtype bfloat16

total=$(($(date +%s) - start))
joined=$(printf '%s, ' "${steps_json[@]}")
ok=$([[ $all_ok == 1 ]] && echo true || echo false)
echo "{\"script\": \"gpu_first_contact\", \"ok\": $ok, \"seconds\": $total, \"budget_s\": $BUDGET, \"steps\": [${joined%, }]}"
((all_ok)) || exit 1
