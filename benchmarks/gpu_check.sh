#!/usr/bin/env bash
# The checks run on a lent GPU machine (CI has no GPU): the CUDA tests, the example scripts under DeepSpeed
# ZeRO-2/3 on one GPU in bf16 and fp16 (with a ZeRO-3 checkpoint resumed), and the padded vs padding-free
# passes at 135M and 0.5B parameters (benchmarks/gpu_padding_free.py). Results and one log go to $OUT
# (default /tmp/gpu-check): gpu_check.log, deepspeed_gpu.json, gpu_padding_free_<gpu>.json.
#
#     OUT=/tmp/gpu-check bash benchmarks/gpu_check.sh
#
# Machines without network: missing packages may be carried as wheels in .whl/ (installed into
# /tmp/site), the offline kit as a copy of its cache folder in .gpukit/ (else it is built, ~1 minute).
# SECTIONS picks parts (default: tests deepspeed padding); GPU_CHECK_EXTRA adds flags to every launch
# (a dry run on a CPU machine: GPU_CHECK_EXTRA="--use_cpu true" SECTIONS=deepspeed); PADDING_ARGS adds
# arguments to gpu_padding_free.py (e.g. --runs ...); TESTS_TIMEOUT / PADDING_TIMEOUT (seconds, default
# 300 each) bound those sections.
set -u
SECTIONS=${SECTIONS:-tests deepspeed padding}
OUT=${OUT:-/tmp/gpu-check}
mkdir -p "$OUT"
LOG=$OUT/gpu_check.log
exec > >(tee -a "$LOG") 2>&1
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/*.whl 2>&1 | grep -v WARNING | tail -3
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
[ -d .gpukit ] && export RLHF_TRAINERS_KIT_DIR=$PWD/.gpukit
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, accelerate, datasets; print('torch', torch.__version__, 'transformers', transformers.__version__, 'accelerate', accelerate.__version__, 'datasets', datasets.__version__)"
python3 -c "import deepspeed; print('deepspeed', deepspeed.__version__)" 2>&1 | tail -1

section() { [[ " $SECTIONS " == *" $1 "* ]]; }

if section tests; then
echo "=== CUDA tests"
began=$SECONDS
timeout ${TESTS_TIMEOUT:-300} python3 -m pytest tests/test_cuda.py \
    "tests/test_reward_sources.py::test_reward_model_on_cuda_takes_cpu_ids_and_returns_cpu_float32" \
    -q -p no:cacheprovider -o addopts="-ra --durations=8" >"$OUT/cuda_tests.log" 2>&1
tail -25 "$OUT/cuda_tests.log"
echo "CUDA tests: $((SECONDS - began)) s"
fi

if section padding; then
echo "=== padding-free passes"
began=$SECONDS
timeout ${PADDING_TIMEOUT:-300} python3 benchmarks/gpu_padding_free.py --out "$OUT" ${PADDING_ARGS:-} 2>&1 \
    | grep -v Warning | tail -16
echo "padding-free: $((SECONDS - began)) s"
fi

if section deepspeed; then
echo "=== DeepSpeed on one GPU"
DS=/tmp/ds-check
rm -rf $DS && mkdir -p $DS
COMMON="--report_to none --logging_steps 1 --num_sample_generations 0 --disable_tqdm true --max_eval_samples 64 ${GPU_CHECK_EXTRA:-}"
launch() {  # name, config (zero2|zero3), script, extra flags...
    local name=$1 config=$2 script=$3
    shift 3
    local began=$SECONDS
    timeout 240 python3 -m accelerate.commands.launch --config_file examples/accelerate_configs/deepspeed_$config.yaml \
        --num_processes 1 "examples/$script" --output_dir "$DS/$name" --results_file "$DS/$name.json" \
        $COMMON "$@" >"$DS/$name.log" 2>&1
    echo "$name: exit $? in $((SECONDS - began)) s, $(grep -c "'objective/kl'" "$DS/$name.log") updates logged"
    grep -E "Error|error:|Traceback" "$DS/$name.log" | tail -4
}
DS_RUNS=${DS_RUNS:-ppo rloo grpo}
if [[ " $DS_RUNS " == *" ppo "* ]]; then
    launch ppo_zero3_bf16 zero3 ppo.py --bf16 true --max_steps 8 --save_strategy steps --save_steps 4
    launch ppo_zero3_bf16_resumed zero3 ppo.py --bf16 true --max_steps 8 --save_strategy no \
        --resume_from_checkpoint $DS/ppo_zero3_bf16/checkpoint-4
fi
[[ " $DS_RUNS " == *" rloo "* ]] && launch rloo_zero2_bf16 zero2 rloo.py --bf16 true --max_steps 20 --save_strategy no
[[ " $DS_RUNS " == *" grpo "* ]] && launch grpo_zero2_fp16 zero2 grpo.py --fp16 true --max_steps 32 --save_strategy no
python3 - "$DS" "$OUT/deepspeed_gpu.json" <<'EOF'
import json, sys
from pathlib import Path
ds, out = Path(sys.argv[1]), Path(sys.argv[2])
record = {}
for path in sorted(ds.glob("*.json")):
    record[path.stem] = json.loads(path.read_text())
for path in sorted(ds.glob("*.log")):
    record.setdefault(path.stem, {})["log_tail"] = path.read_text()[-3000:]
out.write_text(json.dumps(record, indent=1) + "\n")
for name, r in record.items():
    b, a = r.get("before", {}), r.get("after", {})
    key = "eval_objective/scores/true_reward"
    print(name, "steps", r.get("global_step"), "zero", r.get("zero_stage"), "true reward",
          b.get(key), "->", a.get(key), "train", {k: v for k, v in r.get("train", {}).items() if "runtime" in k})
EOF
fi
