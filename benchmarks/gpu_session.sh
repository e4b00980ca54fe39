#!/bin/bash
# The GPU measurements of docs/performance.md, in priority order, under one deadline.
#
#     bash benchmarks/gpu_session.sh PART [SECONDS]
#
# PART 1: the 0.5B step as it is by default (profiled), then with the decode options (the fused
#         decode attention first: its on-device check prints FAILED if the kernel is off),
#         cuDNN's attention, and the fewest-kernel decode under XLA's command buffers; about
#         5-6 minutes.
# PART 2: the layers written out alone, the 0.5B step against TRL with remat on both sides, the
#         log-prob block sizes, XLA's dynamic-slice fusion, the 1.5B step against TRL, the LoRA
#         presets and the LoRA sweep, then again the vmapped sweep at 50 steps (up to 7 minutes;
#         measured on an H200 on 2026-11-28, experiments/gpu_2026-11-28.md) and its group's
#         phases.
#
# Each command gets at most its own limit and never runs past SECONDS (default 540) from the
# start; one with under 25 s left is skipped. Logs go to $OUT/<name>.log (OUT defaults to
# /tmp/gpu_session); each log's tail is printed as it ends. TOKENIZER and GSM8K name the Qwen2.5
# tokenizer and the GSM8K directory (default: ../shared's, as benchmarks/trl_step.py). The
# prepared checkpoints stay in /tmp/gs between the commands and between the two parts. DRY=1
# prints the commands without running them.
set -u
cd "$(dirname "$0")/.."
PART=${1:?"usage: bash benchmarks/gpu_session.sh PART [SECONDS] (PART 1 or 2)"}
END=$(( $(date +%s) + ${2:-540} ))
OUT=${OUT:-/tmp/gpu_session}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
DATA=()
[ -n "${TOKENIZER:-}" ] && DATA+=(--tokenizer "$TOKENIZER")
[ -n "${GSM8K:-}" ] && DATA+=(--gsm8k "$GSM8K")

left() { echo $(( END - $(date +%s) )); }
run() {  # run NAME MAX_S CMD...
  local name=$1 max=$2; shift 2
  local l; l=$(left)
  if [ "$l" -lt 25 ]; then echo "== $name: skipped ($l s left)"; return; fi
  local t=$(( l < max ? l : max ))
  echo "== $name (limit $t s, $(date +%T)): $*"
  if [ -n "${DRY:-}" ]; then return; fi  # DRY=1: print the plan only
  timeout -k 5 "$t" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name rc=$? $(date +%T)"
  tail -c 4000 "$OUT/$name.log"
}
# gpu_step.py on the 0.5B shape, grpo_jax alone, sharing the prepared inputs; budget_s is its own
# limit for the measured steps (a little under the command's).
step05() { local name=$1 max=$2; shift 2
  run "$name" "$max" python3 benchmarks/gpu_step.py --sizes 0.5b --sides grpo_jax --dir /tmp/gs \
    --budget_s $(( max - 15 )) "${DATA[@]}" "$@"; }

if [ -z "${DRY:-}" ]; then
  nvidia-smi -L
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"
fi
case "$PART" in
  1)
    # layer scan, XLA attention: 678 kernels; where the device time goes (jax.profiler)
    step05 default 130 --profile
    step05 pallas 95 --decode_attention pallas                # fused attention: 534 kernels
    step05 unroll_pallas 95 --unroll_decode --decode_attention pallas --no_kernels   # 268
    # cuDNN's fused attention in the prefill and the train step (their attention writes ~200 GB
    # a step at 0.5B with XLA's, by the compiled program's output shapes)
    step05 cudnn 80 --attention cudnn --no_kernels
    # XLA's command buffers (CUDA graphs) over the decode loop's body, on the fewest kernels.
    # The names are XLA's (DebugOptions.CommandBufferCmdType) and move between versions.
    run command_buffers 90 env \
      XLA_FLAGS=--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL \
      python3 benchmarks/gpu_step.py --sizes 0.5b --sides grpo_jax --dir /tmp/gs --budget_s 75 \
      --unroll_decode --decode_attention pallas --no_kernels "${DATA[@]}"
    ;;
  2)
    # without part 1 before it, this first 0.5B command also prepares the inputs (~30 s)
    step05 unroll 150 --unroll_decode --no_kernels            # 364 kernels
    run trl05 170 python3 benchmarks/gpu_step.py --sizes 0.5b --remat 0.5b --sides grpo_jax,trl \
      --dir /tmp/gs --budget_s 155 --no_kernels "${DATA[@]}"
    step05 logprob4 60 --logprob_block_mib 4 --no_kernels
    step05 logprob256 60 --logprob_block_mib 256 --no_kernels
    # the layer scan's weight slices read in place by the GEMMs (a compile without the device
    # kept them as copies: experiments/decode_attention_2026-11-27.md); compare with `default`
    run ds_fusion 90 env XLA_FLAGS=--xla_gpu_enable_dynamic_slice_fusion=true \
      python3 benchmarks/gpu_step.py --sizes 0.5b --sides grpo_jax --dir /tmp/gs --budget_s 75 \
      "${DATA[@]}"
    run trl15 200 python3 benchmarks/gpu_step.py --sizes 1.5b --remat 1.5b --sides grpo_jax,trl \
      --dir /tmp/gs --budget_s 185 --no_kernels "${DATA[@]}"
    run preset_3b_lora 150 python3 benchmarks/preset_steps.py --preset 3b_lora --steps 2 "${DATA[@]}"
    run preset_7b_lora 200 python3 benchmarks/preset_steps.py --preset 7b_lora --steps 2 "${DATA[@]}"
    run sweep_lora 200 python3 benchmarks/sweep.py --lora --workdir=/tmp/sweep_lora
    # 8 tiny runs one after another, then vmapped; it prints nothing until both end
    run sweep50 420 python3 benchmarks/sweep.py --steps=50 --workdir=/tmp/sweep50
    # the group's phases, from sweep50's warm start (same plan, same workdir)
    run group_phases 120 python3 benchmarks/group_phases.py --steps=50 --workdir=/tmp/sweep50
    # the same without XLA's autotuning: how much of the group's compiles is autotuning (on an
    # H200, 2026-11-28: about 7 s of the train program's 21.4 s); a diagnosis, not a setting
    run group_phases_autotune0 110 env XLA_FLAGS=--xla_gpu_autotune_level=0 \
      python3 benchmarks/group_phases.py --steps=50 --workdir=/tmp/sweep50
    ;;
  *) echo "PART is 1 or 2"; exit 2 ;;
esac
echo "== part $PART done, $(left) s left"
