#!/usr/bin/env bash
# On the GPU host (no network): install the carried wheels (.whl, built by ../shared/tools/gpu-wheels.sh), then run
# the one training entry point under the deepspeed launcher for each config given, logging to $OUT. KEY=VALUE
# arguments after a config are `--set` overrides for that run (and name its log); env:NAME=VALUE sets an environment
# variable for that run only.
#   bench/gpu_run.sh bench/configs/llama-3.2-1b-tp2.yaml bench/configs/llama-3.2-1b-dp2.yaml model.fused_kernels=false
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast here
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
LOGS=${LOGS:-/tmp/nd-logs}; mkdir -p "$LOGS"  # $OUT brings back 8 files at most: logs travel as one archive
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, deepspeed, megatron.core as m; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'megatron-core', m.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpus.txt"
ngpu=${NGPU:-2}
RUNS=0
run_one() {  # config, then its KEY=VALUE overrides
  local cfg=$1; shift
  local name sets=() envs=()
  name=$(basename "$cfg" .yaml)
  for kv in "$@"; do
    if [[ $kv == env:* ]]; then envs+=("${kv#env:}"); else sets+=(--set "$kv"); fi
    name+="_$(echo "${kv##*.}" | tr -c 'A-Za-z0-9_.=-' '_' | tr '=' '-')"
  done
  RUNS=$((RUNS + 1))
  name=$(printf '%02d' "$RUNS")_${name:0:120}  # file names have a length limit; the index keeps them unique
  echo "== ${envs[*]} deepspeed --num_gpus $ngpu launch/train.py --config $cfg ${sets[*]}"
  env "${envs[@]}" timeout "${RUN_TIMEOUT:-300}" deepspeed --num_gpus "$ngpu" launch/train.py --config "$cfg" "${sets[@]}" \
    > "$LOGS/$name.log" 2>&1
  echo "exit $?"
  grep -E "^step|error|Error" "$LOGS/$name.log" | grep -v Warning | tail -"${SHOW:-8}"
  tar czf "$OUT/logs.tgz" -C "$LOGS" .
}
args=()
for a in "$@" END; do
  if [[ $a == END || $a == *.yaml ]]; then
    (( ${#args[@]} )) && run_one "${args[@]}"
    args=("$a")
  else
    args+=("$a")
  fi
done
