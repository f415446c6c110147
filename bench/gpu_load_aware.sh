#!/usr/bin/env bash
# Issue 30's two benches on a GPU host: bench/decider.py (2P2D, measured-cost against
# static; one engine per GPU on 4 GPUs, a GPU per pool on 2) and bench/priority.py (1P1D,
# a GPU each; a flood and an interactive
# key), CUDA shim engines serving Llama-3-8B's layer shape (bench/llama8b_shape.py,
# LAYERS of its 32, random bf16 weights built here). Figures go to $OUT (or ./gpu-out).
# The engines' step budget is vLLM's default for online serving (2,048 tokens a step).
#
#   bash bench/gpu_load_aware.sh [decider|priority|both]
#
# Wheels the host lacks are installed from .whl/ (or .whlslim/: the same with nixl's unused
# expert-parallel extensions cut, to fit a 64 MiB carry); without either the packages must
# already be installed (pip install -e '.[shim]').
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-both}
out=${OUT:-gpu-out}
mkdir -p "$out"
wheels=$(ls -d .whl .whlslim 2>/dev/null | head -1 || true)
if [ -n "$wheels" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site "$wheels"/*.whl
    export PYTHONPATH=/tmp/site:$PWD/src
fi
export PYTHONUNBUFFERED=1
n=$(nvidia-smi -L | wc -l)
devices=$(seq -s, -f 'cuda:%g' 0 $((n - 1)))
# 2P2D: engine i on GPU i*n/4 (4 GPUs: one each; 2: the P pool on one, the D pool on the other)
pd4=$(for i in 0 1 2 3; do printf 'cuda:%d\n' $((i * n / 4)); done | paste -sd,)
echo "gpus: $n ($devices); commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
nvidia-smi -L
model=/tmp/l8
[ -d $model ] || python3 bench/llama8b_shape.py $model --layers "${LAYERS:-8}" --device cuda
if [ "$what" != priority ]; then
    python3 bench/decider.py --device "$pd4" --up-arg=--model=$model \
        --burst "${BURST:-160}" --mixed "${MIXED:-96}" --keep-logs "$out/logs" \
        --step-budget 2048 ${DECIDER_ARGS:-} --json 2>&1 \
        | tee "$out/decider.txt"
fi
if [ "$what" != decider ]; then
    python3 bench/priority.py --up-arg=--device="$devices" --up-arg=--model=$model \
        --prompt-tokens "${PROMPT_TOKENS:-480}" --max-tokens 32 --flood-max-tokens 32 \
        --interactive "${INTERACTIVE:-30}" ${PRIORITY_ARGS:-} --json 2>&1 | tee "$out/priority.txt"
fi
