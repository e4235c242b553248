#!/bin/bash
# One device call of the GPU host (run with carry [".whl"]): install the carried wheels (../shared/tools/gpu-wheels.sh;
# for `suite`, also pytest-xdist and execnet from /opt/pypi/files), then run the named parts in order while time is
# left, each part's log under $OUT. A session's device budget rarely allows two calls after failed starts: `suite`
# runs the whole GPU suite on four pytest workers (file by file; SUITE_WORKERS=2 as before) so that it fits one call.
# usage: bash bench/gpu_batch.sh DEADLINE_S part...
#   parts: suite | suite-a | suite-b | t-<name> (tests/gpu/test_<name>.py alone) | cmp-<shape> (bench/compare.py --axolotl, beside transformers + Liger; the MoE
#          shape beside transformers' grouped_mm at micro-batch 1) | plancheck | pc-<row label word> |
#          row-<shape>:<variant>[+<variant>] (bench/compare.py 1-GPU config, beside transformers + Liger) | prof-<shape>
#          (a profile of steps 7-8 of the shape's Axolotl YAML or 1-GPU config, bench/trace_summary.py's digest) | lora-<shape>
#          (LoRA r16 on the shape's 1-GPU config, transformers engine + Liger, beside PEFT + Liger) |
#          mempeer-<shape> (transformers + Liger's memory peak, by allocating line) | dpoattn | dpo-<mode>
#          (bench/dpo_bench.py lora|qlora|full beside TRL + Liger) | dpoc-<mode>[@objective] / dpoe-<mode>[@objective] (ours alone, compiled / eager layers) |
#          sftc-lora (LoRA SFT on the 8B shape, eager then compiled layers) | attn (bench/attn_bench.py; FlashAttention-4 if installed) |
#          dpoprof[-auto|-false] (a LoRA DPO step's profile, the shared-prompt stream and/or the padded rows) |
#          lce-1b (the same at the 1B shape: our chunks of 256 to 4,096 tokens beside Liger's) | lce-olmo3 (output layer + CE at Olmo's unaligned vocabulary and at it padded to 128) |
#          h2d (bench/h2d_sync.py: does a pageable host->device copy wait for the GPU's queue) |
#          vision (bench/vision_plan_check.py: plan against image-text runs at gemma-3-4b-it's vision tower) |
#          vprof-<row> (a profile and memory peak of that vision row: QLoRA or full)
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl 2>&1 | tail -2
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
end=$(( $(date +%s) + $1 )); shift
left() { echo $(( end - $(date +%s) )); }
for part in "$@"; do
  t=$(left); [ "$t" -lt 40 ] && { echo "SKIP $part (no time)"; continue; }
  echo "=== $part (${t}s left) $(date -u +%H:%M:%S)"
  case $part in
    suite) # four workers (SUITE_WORKERS): on two, 472 s at 2026-12-06 18:55, most of a call; the host has 16 cores and
      # the tests' models are tiny, and the longest file (test_shared_gpu.py, ~240 s) bounds it. Four is not yet run.
      timeout $t python3 -m pytest -m gpu tests/gpu -n ${SUITE_WORKERS:-4} --dist loadfile -q -p no:cacheprovider --durations=12 > $OUT/suite.log 2>&1; echo rc=$?; tail -30 $OUT/suite.log;;
    t-*) f=tests/gpu/test_${part#t-}.py  # one GPU test file, at most 300 s
      timeout $(( t < 300 ? t : 300 )) python3 -m pytest -m gpu $f -q -p no:cacheprovider --durations=5 > $OUT/$part.log 2>&1; echo rc=$?; tail -25 $OUT/$part.log;;
    suite-a|suite-b) half=(tests/gpu/test_shared_gpu.py tests/gpu/test_dpo.py tests/gpu/test_fusions.py tests/gpu/test_train.py)
      # the suite in two calls (472 s on two workers at 2026-12-06 18:55): the shared-GPU file and three others, then the rest
      if [ $part = suite-a ]; then sel=("${half[@]}"); else sel=(tests/gpu); for f in "${half[@]}"; do sel+=(--ignore "$f"); done; fi
      timeout $t python3 -m pytest -m gpu "${sel[@]}" -n 2 --dist loadfile -q -p no:cacheprovider --durations=10 > $OUT/$part.log 2>&1; echo rc=$?; tail -25 $OUT/$part.log;;
    cmp-*) s=${part#cmp-}; peer="=hf-liger"; mb=2; [ $s = qwen3-moe-8l ] && { peer="=hf"; mb=1; }
      timeout $t python3 bench/compare.py --gpus 1 --axolotl --shape $s --micro-batch $mb --steps 10 --only "=nd-adapter Axolotl YAML ($s)" "$peer" --log-dir $OUT/cmp-$s > $OUT/cmp-$s.log 2>&1; echo rc=$?; tail -12 $OUT/cmp-$s.log;;
    plancheck) timeout $t python3 bench/plan_check.py --out $OUT/pc --timeout 150 > $OUT/pc.log 2>&1; echo rc=$?; tail -20 $OUT/pc.log;;
    pc-*) w=${part#pc-}; timeout $t python3 bench/plan_check.py --out $OUT/pc-$w --timeout 150 --only "$w" > $OUT/pc-$w.log 2>&1
      echo rc=$?; tail -6 $OUT/pc-$w.log;;
    row-*) s=${part#row-}; s=${s%%:*}; only=()  # row-<shape>:<variant>[+<variant>...] of compare.py's ONE_GPU_VARIANTS
      IFS='+' read -ra vs <<< "${part#*:}"; for v in "${vs[@]}"; do only+=("=nd-adapter 1 GPU ($s, $v)"); done
      timeout $t python3 bench/compare.py --gpus 1 --shape $s --micro-batch 2 --steps 10 --only "${only[@]}" "=hf-liger" --log-dir $OUT/row-$s > $OUT/row-$s.log 2>&1; echo rc=$?; tail -8 $OUT/row-$s.log
      for f in $OUT/row-$s/*.log; do grep -q "tok/s" "$f" || { echo "--- $f"; grep -v Warning "$f" | tail -4; }; done;;
    mempeer-*) s=${part#mempeer-}; y=$(python3 -c "import sys; sys.path.insert(0, '.'); from bench.compare import ONE_GPU; print(ONE_GPU['$s'])")
      ND_MEMORY_SNAPSHOT=/tmp/peer-$s.pickle timeout $t torchrun --nproc-per-node=1 bench/peers.py hf-liger --model-config configs/models/$y/config.json --seq 4096 --micro-batch 2 --steps 4 > $OUT/mempeer-$s.log 2>&1; echo rc=$?
      python3 bench/memory_peak.py /tmp/peer-$s.pickle > $OUT/mempeer-$s.txt 2>&1; head -30 $OUT/mempeer-$s.txt;;
    lora-*) s=${part#lora-}; y=$(python3 -c "import sys; sys.path.insert(0, '.'); from bench.compare import ONE_GPU; print(ONE_GPU['$s'])")
      timeout $t python3 bench/lora_bench.py --config bench/configs/$y-1gpu.yaml --model configs/models/$y/config.json --only "nd-adapter LoRA (transformers engine, Liger)" "peer LoRA" --set lora.r=16 lora.alpha=32 lora.target_linear=true batch.micro_batch_size=1 --log-dir $OUT/lora-$s > $OUT/lora-$s.log 2>&1; echo rc=$?; tail -6 $OUT/lora-$s.log;;
    prof-*) s=${part#prof-}; y=$(python3 -c "import sys; sys.path.insert(0, '.'); from bench.compare import ONE_GPU; print(ONE_GPU['$s'])")
      rm -rf /tmp/axolotl-out/$y  # a cmp- part's checkpoints there would (rightly) refuse a fresh run
      c=bench/configs/axolotl/$y.yaml; [ -f $c ] || c=bench/configs/$y-1gpu.yaml  # no Axolotl YAML: the 1-GPU config
      timeout $t deepspeed --num_gpus=1 launch/train.py --config $c --set data.synthetic=true --set 'logging.profile_steps=[7,8]' --set logging.profile_dir=/tmp/prof-$s > $OUT/prof-$s.log 2>&1; echo rc=$?
      cp /tmp/prof-$s/ops-rank0.txt $OUT/prof-$s-ops.txt; python3 bench/memory_peak.py /tmp/prof-$s/memory-rank0.pickle > $OUT/prof-$s-memory.txt 2>&1; head -30 $OUT/prof-$s-memory.txt; python3 bench/trace_summary.py /tmp/prof-$s/trace-rank0.json.gz --top 25 --host nd.forward > $OUT/prof-$s.txt 2>&1; head -40 $OUT/prof-$s.txt;;
    lce-1b) timeout $t python3 bench/linear_ce_bench.py --hidden 1b=2048 > $OUT/$part.log 2>&1; echo rc=$?; tail -9 $OUT/$part.log;;
    lce-olmo3) timeout $t python3 bench/linear_ce_bench.py --vocab 100278,100352 --hidden olmo3=4096 > $OUT/$part.log 2>&1
      echo rc=$?; tail -12 $OUT/$part.log;;
    vision) timeout $t python3 bench/vision_plan_check.py --out /tmp/vpc > $OUT/vision.log 2>&1; echo rc=$?
      cp /tmp/vpc/*.log $OUT/ 2>/dev/null; grep -v Warning $OUT/vision.log | tail -8;;
    vprof-*) r=${part#vprof-}  # vprof-QLoRA | vprof-full: a profile of steps 5-6 of that vision_plan_check row
      [ -f /tmp/vpc/$r.yaml ] || python3 bench/vision_plan_check.py --out /tmp/vpc --dry-run > $OUT/vprof-build.log 2>&1
      rm -rf /tmp/vpc/$r/run; timeout $t deepspeed --num_gpus=1 launch/train.py --config /tmp/vpc/$r.yaml --set 'logging.profile_steps=[5,6]' \
        --set logging.profile_dir=/tmp/vprof-$r > $OUT/$part.log 2>&1; echo rc=$?; grep -v Warning $OUT/$part.log | grep "tok/s" | tail -3
      python3 bench/memory_peak.py /tmp/vprof-$r/memory-rank0.pickle > $OUT/$part-memory.txt 2>&1; head -25 $OUT/$part-memory.txt
      python3 bench/trace_summary.py /tmp/vprof-$r/trace-rank0.json.gz --top 25 --host nd.forward > $OUT/$part.txt 2>&1; head -45 $OUT/$part.txt;;
    attn) timeout $t python3 bench/attn_bench.py > $OUT/attn.log 2>&1; echo rc=$?; grep -v Warning $OUT/attn.log | tail -20;;
    h2d) timeout $t python3 bench/h2d_sync.py > $OUT/h2d.log 2>&1; echo rc=$?; cat $OUT/h2d.log;;
    dpoattn) timeout $t python3 bench/dpo_attention_bench.py > $OUT/dpoattn.log 2>&1; echo rc=$?; tail -12 $OUT/dpoattn.log;;
    dpo-*) m=${part#dpo-}  # dpo-lora | dpo-qlora | dpo-full: bench/dpo_bench.py beside TRL + Liger
      timeout $t python3 bench/dpo_bench.py --mode $m --rows ours,trl-liger --out $OUT/dpo-$m > $OUT/dpo-$m.log 2>&1
      echo rc=$?; tail -8 $OUT/dpo-$m.log;;
    sftc-lora) c=bench/configs/llama-3.1-8b-lora-1gpu.yaml  # LoRA SFT (8B shape), eager then compiled layers, ours alone
      for v in false true; do timeout $(( $(left) / 2 )) deepspeed --num_gpus=1 launch/train.py --config $c --set model.compile=$v \
        > $OUT/sftc-lora-$v.log 2>&1; echo "compile=$v rc=$?"; grep -v Warning $OUT/sftc-lora-$v.log | grep -E "tok/s|compile" | tail -4; done;;
    dpoe-*|dpoc-*) m=${part#dpo?-}; o=(); [[ $m == *@* ]] && { o=(--ours-set objective=${m#*@}); m=${m%@*}; }
      # nd-adapter's row alone, eager (dpoe-) or compiled (dpoc-) layers; MODE@OBJECTIVE: another pair objective
      c=true; [[ $part == dpoe-* ]] && c=false
      timeout $t python3 bench/dpo_bench.py --mode $m --rows ours --ours-set model.compile=$c "${o[@]}" --out $OUT/${part/@/-} \
        > $OUT/${part/@/-}.log 2>&1; echo rc=$?; tail -3 $OUT/${part/@/-}.log;;
    dpoprof*) sps=${part#dpoprof}; sps=${sps#-}; for sp in ${sps:-auto false}; do  # a LoRA DPO step's profile:
        # the shared-prompt stream (auto) and the padded rows (false), with where the forward's host time goes
        timeout $(( $(left) / 2 )) python3 bench/dpo_bench.py --mode lora --rows ours --out $OUT/dpoprof-$sp \
          --ours-set dpo.share_prompt=$sp --ours-set 'logging.profile_steps=[6,7]' \
          --ours-set logging.profile_dir=/tmp/dpoprof-$sp > $OUT/dpoprof-$sp.log 2>&1; echo "$sp rc=$?"
        python3 bench/trace_summary.py /tmp/dpoprof-$sp/trace-rank0.json.gz --top 30 --host nd.forward \
          > $OUT/dpoprof-$sp.txt 2>&1; head -12 $OUT/dpoprof-$sp.txt; done;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
