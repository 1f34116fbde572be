#!/bin/bash
# For a LENT GPU machine with NO package registry (the device tool's one H100 or H200): its image's
# python3 (3.12, torch 2.11 CUDA 13, transformers 5.17, accelerate, peft, triton) plus the wheels
# carried in `.whl` (made here first: `bash benchmarks/gpu_wheels.sh download`). Nothing is fetched.
# A machine with a registry (a cluster node of your own) runs gpu_first_contact.sh instead.
#
# Each step runs under `timeout` within one budget (BUDGET, default 450 s); the results go to OUT
# (the device tool's $OUT, default runs/lease_check): summary.json (each step's status, rc, seconds,
# limit and its own JSON line), gpu.txt (nvidia-smi, torch, pip freeze), logs.tgz (every step's log).
#
#   bash benchmarks/gpu_lease_check.sh                       # every step
#   DRY_RUN=1 bash benchmarks/gpu_lease_check.sh              # the steps and their limits, nothing run
#   STEPS="gpu install env probe" bash benchmarks/gpu_lease_check.sh   # only these (the rest: not_run)
#   ALLOW_CPU=1 STEPS="env probe" PYTHON=.venv/bin/python bash ...       # CPU, for this script's own tests
#
# Steps (limit in seconds; a step also stops when the budget is spent; once `gpu` or `install` fails,
# the later steps are `blocked`):
#   gpu          (30)  nvidia-smi, torch.cuda, one 8192^3 bf16 matmul (TFLOP/s)
#   install      (45)  the carried wheels, --no-index (deepspeed from its sdist, DS_BUILD_OPS=0), mmprm -e
#   env          (30)  mmprm env --json: each library imported and used once on the GPU
#   zero2        (60)  gpu_check --only zero2,memory_7b_layer: bf16 prm_train under ZeRO-2, 10 steps
#   zero3        (60)  gpu_check --only zero3,scorer: ZeRO-3 with checkpointing, then load_prm scores
#   probe        (75)  gpu_probe.py: Liger's loss against F.cross_entropy, the flex tree block mask
#                      against sdpa's dense mask (forward, backward), the MFU table against a measured
#                      matmul, the sdpa kernel of the 7B grouped-query shape
#   packed_flex  (60)  gpu_check --only zero3_packed_flex: tree packing through FlexAttention
#   scoring      (45)  gpu_check --only scoring_throughput: ours against the bare-forward floor
#   compile      (50)  gpu_probe.py --only compile: train.compile in bf16 against eager
#   annotate     (45)  mcts_annotate.py, HF backend (on the GPU: its device auto), bf16, a toy policy on 4 problems
# The limits add up to more than the budget: the steps come in order of what a lease must learn
# first, and a step the budget cannot reach is no_time (a failure, said so).
# Not run, by name: flash_attn, vllm, vllm_tp, vllm_scorer (why: in summary.json).
# Exit 0 when every step passed; 1 otherwise (a machine with no GPU: at once, after `gpu`).
# the step functions run through `step` (timeboxed.sh), which shellcheck cannot follow
# shellcheck disable=SC2317
set -uo pipefail

cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)
OUT=${OUT:-runs/lease_check}
BUDGET=${BUDGET:-450}
WHEELS=${WHEELS:-.whl}
STEPS=${STEPS:-gpu install env zero2 zero3 probe packed_flex scoring compile annotate}
export REPO OUT WHEELS
export py=${PYTHON:-python3}
export ALLOW_CPU=${ALLOW_CPU:-0}
# on CPU (the tests only): each check's own flag for running without a GPU
if ((ALLOW_CPU)); then
    export CHECK_CPU=--allow-cpu ENV_CPU=--cpu-ok DTYPE=float32
else
    export CHECK_CPU="" ENV_CPU="" DTYPE=bfloat16
fi
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# the recipes import mmprm from this tree even before (or without) its editable install
export PYTHONPATH=$REPO${PYTHONPATH:+:$PYTHONPATH}
mkdir -p "$OUT"
WORK=$(mktemp -d "${TMPDIR:-/tmp}/lease_check.XXXXXX")
export WORK

# the logs travel back as one logs.tgz: a lease returns at most 8 files from $OUT
# shellcheck source=benchmarks/timeboxed.sh
source benchmarks/timeboxed.sh
steps_begin "$WORK/logs" "$OUT/summary.json" "$BUDGET" gpu_lease_check

gpu() {
    {
        nvidia-smi 2>&1 || echo "nvidia-smi: not found or failed"
        "$py" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda)' 2>&1
        "$py" -m pip freeze 2>&1
    } > "$OUT/gpu.txt"
    if ! nvidia-smi -L; then
        echo "no GPU is visible: nvidia-smi is missing or lists no GPU; this script is for a lent GPU machine"
        return 1
    fi
    "$py" - << 'PY'
import json, sys, time
import torch

if not torch.cuda.is_available():
    sys.exit(f"no GPU is visible to torch {torch.__version__} (torch.cuda.is_available() is False)")
props = torch.cuda.get_device_properties(0)
a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
for _ in range(3):
    a @ b
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(10):
    a @ b
torch.cuda.synchronize()
tflops = 10 * 2 * 8192**3 / (time.perf_counter() - t0) / 1e12
print(json.dumps({"device": torch.cuda.get_device_name(0), "gpus": torch.cuda.device_count(),
                  "capability": list(torch.cuda.get_device_capability(0)), "memory_gib": round(props.total_memory / 2**30, 1),
                  "torch": torch.__version__, "cuda": torch.version.cuda, "bf16_matmul_tflops": round(tflops, 1), "ok": True}))
PY
}

install() {
    if [[ ! -d $WHEELS ]]; then
        echo "no wheels at $WHEELS: run 'bash benchmarks/gpu_wheels.sh download' on a machine with PyPI and carry .whl"
        return 1
    fi
    bash benchmarks/gpu_wheels.sh install "$WHEELS" "$py"
}

# gpu_check_group NAME[,NAME]: one group of make gpu-check, short (10 steps, 64 rows); its own JSON line
gpu_check_group() {
    "$py" benchmarks/gpu_check.py --only "$1" --steps 10 --rows 64 --timeout 55 --out "$WORK/gpu_check_${1//,/_}" \
        ${CHECK_CPU:+"$CHECK_CPU"}
}

annotate() {
    "$py" -m mmprm.cli tiny-model --arch qwen2_vl --out "$WORK/base" &&
        "$py" -m mmprm.annotate.simulated --base "$WORK/base" --out "$WORK/policy" \
            --problems-dir "$WORK/problems" --n 4 &&
        "$py" recipes/mcts_annotate.py --config recipes/configs/tiny/mcts_annotate.yaml \
            policy.path="$WORK/policy" data.problems_file="$WORK/problems/problems.jsonl" \
            output_dir="$WORK/annotate" policy.backend=hf policy.dtype="$DTYPE" \
            search.max_searches=4 search.rollouts_per_estimate=4 policy.sampling.max_new_tokens=64 &&
        "$py" -c "import json, sys; rows = open(sys.argv[1]).read().splitlines(); print(json.dumps({'prm_rows': len(rows), 'ok': len(rows) > 0}))" \
            "$WORK/annotate/prm_data.jsonl"
}

step gpu 30 gpu || steps_block "no usable GPU (logs/gpu.log)"
step install 45 install || steps_block "the carried wheels did not install (logs/install.log)"
step env 30 "$py" -m mmprm.cli env --json ${ENV_CPU:+"$ENV_CPU"}
step zero2 60 gpu_check_group zero2,memory_7b_layer
step zero3 60 gpu_check_group zero3,scorer
step probe 75 "$py" benchmarks/gpu_probe.py --only liger,flex_tree,mfu,sdpa_kernel ${CHECK_CPU:+"$CHECK_CPU"}
step packed_flex 60 gpu_check_group zero3_packed_flex
step scoring 45 gpu_check_group scoring_throughput
step compile 50 "$py" benchmarks/gpu_probe.py --only compile ${CHECK_CPU:+"$CHECK_CPU"}
step annotate 45 annotate
step_not_run flash_attn "flash-attn has no wheel on PyPI (sdist only, a compile longer than a lease); training used sdpa"
for name in vllm vllm_tp vllm_scorer; do
    step_not_run "$name" "vLLM's CUDA wheel (over 300 MB) cannot travel in the 64 MiB a lease carries"
done

steps_end
rc=$?
tar -czf "$OUT/logs.tgz" -C "$WORK" logs
rm -rf "$WORK"
exit "$rc"
