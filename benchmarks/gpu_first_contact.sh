#!/bin/bash
# First contact with a GPU node of YOUR OWN cluster, one that reaches PyPI: install, report, check,
# annotate, score; each step time-boxed, all of it within BUDGET seconds (default 470, under 8
# minutes). For a lent machine with no package registry (the device tool's), run
# gpu_lease_check.sh instead: it installs nothing from a registry.
#
# Results in one place, OUT (default runs/first_contact): summary.json (each step's status, rc,
# seconds, limit and its own JSON line), logs/STEP.log; the summary is also the ONE JSON line this
# prints. Status: ok, failed, timeout, no_time, blocked, not_run, dry_run.
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
# Exit 0 when every step run passed.
# the step functions run through `step` (timeboxed.sh), which shellcheck cannot follow
# shellcheck disable=SC2317
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
BUDGET=${BUDGET:-470}
OUT=${OUT:-runs/first_contact}
VENV=${VENV:-.venv-gpu}
TORCH_GPU=${TORCH_GPU:-torch==2.14.0}
STEPS=${STEPS:-install env gpu_check annotate score}
WORK=$OUT/work
export VENV TORCH_GPU WORK

if [[ -n ${PYTHON:-} ]]; then
    py=$PYTHON
    STEPS=${STEPS//install/}  # an environment of your own is not installed into
else
    py=$VENV/bin/python
fi
export py

# shellcheck source=benchmarks/timeboxed.sh
source benchmarks/timeboxed.sh
steps_begin "$OUT/logs" "$OUT/summary.json" "$BUDGET" gpu_first_contact

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

step install 210 install || steps_block "the install failed (logs/install.log)"
step env 40 "$py" -m mmprm.cli env
step gpu_check 150 make gpu-check PYTHON="$py" \
    GPU_CHECK_ARGS="--steps 10 --rows 64 --timeout 100 --probe-tokens 2048 --skip vllm_tp,flash_attn"
step annotate 45 annotate
step score 35 "$py" benchmarks/prm_vllm_scoring.py --quick --device cuda --dtype bfloat16
steps_end
