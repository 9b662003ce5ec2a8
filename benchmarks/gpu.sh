#!/usr/bin/env bash
# One GPU session's checks and timings, each phase time-boxed (seconds from the environment; 0
# skips a phase), results under OUT (default ./gpu_results). Run from the repository root on a
# machine with CUDA, where torch, triton and (for the hf phases) transformers and peft are installed:
#
#     OUT=/tmp/gpu bash benchmarks/gpu.sh                    # one 600 s command
#     OUT=/tmp/gpu T_TEST=0 T_NOISE=0 T_STEP=0 T_HF=0 T_HF2=200 T_LLAMA=300 bash benchmarks/gpu.sh   # a second
#
# Phases: the CUDA tests (pytest -m gpu: tests/test_cuda.py and the noise kernel's), the keyed
# noise against torch.randn, the DP step of the CNNs eager and compiled (CUDA graphs) against the
# non-private step, GPT-2 small eager and compiled (the #17 target point), GPT-2 small with
# two_pass (T_HF2=), and a 1B-class Llama (T_LLAMA=). The default limits (150 + 45 + 150 + 200 s)
# fit one 600 s command of a lent machine with room for its start; the last two phases are off
# unless given seconds.
set -u
OUT=${OUT:-gpu_results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
T0=$(date +%s)
phase() { echo "== $1: rc $2, $(( $(date +%s) - T0 )) s so far"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, optree; print('torch', torch.__version__, 'optree', optree.__version__)"
if [ "${T_TEST:-150}" != 0 ]; then
  timeout "${T_TEST:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu -k "not without_triton" --durations=10 tests > "$OUT/tests.txt" 2>&1
  phase tests $?; grep -E "passed|failed|^FAILED" "$OUT/tests.txt" | tail -12
fi
if [ "${T_NOISE:-45}" != 0 ]; then
  timeout "${T_NOISE:-45}" python3 benchmarks/noise.py --device cuda --sizes 1000000,10000000,100000000 --repeats 10 --tree gpt2 --out "$OUT/noise.json" > "$OUT/noise.txt" 2>&1
  phase noise $?; tail -8 "$OUT/noise.txt"
fi
if [ "${T_STEP:-150}" != 0 ]; then
  timeout "${T_STEP:-150}" python3 benchmarks/train_step.py --models mnist,cifar10,embedding --batch-sizes 128,512 \
    --methods torch,torch_compiled,vmapdp_auto,vmapdp_auto_compiled,opacus_hooks --repeats 10 --max-seconds 3 --out "$OUT/train_step.json" > "$OUT/train_step.txt" 2>&1
  phase train_step $?; grep -v USDT "$OUT/train_step.txt" | tail -9
fi
if [ "${T_HF:-200}" != 0 ]; then
  timeout "${T_HF:-200}" python3 benchmarks/hf.py --size gpt2-small --models gpt2 --variants full,lora \
    --methods torch,torch_compiled,vmapdp_eager,vmapdp_compiled --vmapdp-method ghost --repeats 5 --warmup 2 --max-seconds 6 --out "$OUT/hf.json" > "$OUT/hf.txt" 2>&1
  phase hf $?; grep -v USDT "$OUT/hf.txt" | tail -6
fi
if [ "${T_HF2:-0}" != 0 ]; then  # two_pass (its default chunk: 4 samples of GPT-2 small), which met #17's CPU targets
  timeout "${T_HF2:-0}" python3 benchmarks/hf.py --size gpt2-small --models gpt2 --variants full,lora \
    --methods torch,vmapdp_eager --vmapdp-method two_pass --repeats 5 --warmup 2 --max-seconds 6 --memory --out "$OUT/hf_two_pass.json" > "$OUT/hf_two_pass.txt" 2>&1
  phase hf_two_pass $?; grep -v USDT "$OUT/hf_two_pass.txt" | tail -6
fi
if [ "${T_LLAMA:-0}" != 0 ]; then
  timeout "${T_LLAMA}" python3 benchmarks/hf.py --size llama-1b --models llama --variants full,lora --methods torch,vmapdp_eager \
    --vmapdp-method ghost --repeats 3 --warmup 1 --max-seconds 8 --memory --out "$OUT/hf_llama.json" > "$OUT/hf_llama.txt" 2>&1
  phase llama $?; grep -v USDT "$OUT/hf_llama.txt" | tail -6
fi
