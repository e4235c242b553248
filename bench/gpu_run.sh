#!/usr/bin/env bash
# On the GPU host (no network): install the carried wheels (.whl, built by ../shared/tools/gpu-wheels.sh), then run
# the one training entry point under the deepspeed launcher for each config given, logging to $OUT.
#   bench/gpu_run.sh bench/configs/llama-3.2-1b-tp2.yaml bench/configs/llama-3.2-1b-dp2.yaml
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never NVLink multicast here
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpus.txt"
python3 -c "import torch, deepspeed, megatron.core as m; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__, 'megatron-core', m.__version__)" 2>&1 | tail -1 | tee -a "$OUT/gpus.txt"
ngpu=${NGPU:-2}
for cfg in "$@"; do
  name=$(basename "$cfg" .yaml)
  echo "== deepspeed --num_gpus $ngpu launch/train.py --config $cfg"
  timeout "${RUN_TIMEOUT:-300}" deepspeed --num_gpus "$ngpu" launch/train.py --config "$cfg" > "$OUT/$name.log" 2>&1
  echo "exit $?"
  grep -E "^step|error|Error" "$OUT/$name.log" | grep -v Warning | tail -14
done
