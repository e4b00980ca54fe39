#!/bin/bash
# Prepares, on this machine, what benchmarks/gpu_decide.py needs on a GPU machine that has JAX
# with its CUDA plugin, PyTorch and transformers but no network: the other runtime wheels and,
# for --trl, TRL's and the Qwen2.5 tokenizer and GSM8K's train split. Into .gpu/ (ignored by
# git; the device tool carries it with carry=[".gpu"]), under 64 MiB:
#
#     bash benchmarks/gpu_prepare.sh            # then, on the GPU machine:
#     bash benchmarks/gpu_prepare.sh --run      # installs .gpu/whl to /tmp/site, runs the decide
#
# PY (default 3.12) is the GPU machine's Python version.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--run" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .gpu/whl/*.whl
  export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false \
    HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
  nvidia-smi -L || true
  exec python3 benchmarks/gpu_decide.py --dir "${OUT:-/tmp}/decide" --trl \
    --tokenizer .gpu/qwen2-tokenizer --gsm8k .gpu/gsm8k "${@:2}"
fi
rm -rf .gpu && mkdir -p .gpu/whl .gpu/gsm8k
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "${PY:-3.12}" \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d .gpu/whl \
  flax==0.12.8 optax==0.2.8 orbax-checkpoint==0.12.8 ml_collections==1.1.0 \
  tensorboardX==2.6.5 datasets==5.2.0 trl==1.16.0 dill==0.4.1 multiprocess==0.70.19
cp -r ../shared/qwen2-tokenizer .gpu/ && cp ../shared/gsm8k/train.jsonl .gpu/gsm8k/
du -sh .gpu
