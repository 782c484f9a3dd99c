#!/usr/bin/env bash
# One device call: GPU tests + benchmarks, JSON under $OUT. Usage: bash bench/gpu_session.sh [stage ...]
# Nothing is written into the tree: after the session a person files $OUT's JSON lines into benchmarks/data/AREA.jsonl
# with bench/add_results.py (benchmarks/data/index.json maps each $OUT file to its area; logs go to
# benchmarks/data/logs/) and updates BENCHMARKS.md.
# Stages: smoke tests kernels train15 (alias final) traingemma2 train8b parity attention ab fp8probe offloadprobe offloadab
# longctx rematmem gateddelta qwen35
# grpo fullft
# speed (issue 16's table: each row of SPEED_ROWS run with the default kernels and with every Pallas kernel off,
# one after the other; tokens/s, peak memory, MFU; the first row also profiled for its step-time breakdown) moe
# (bench/moe_bench.py: the Qwen3-30B-A3B-shaped MoE LoRA step) vision (issue 39: bench/vision_bench.py, the
# vision-language LoRA step with images on the Qwen2.5-VL-7B and Gemma-3-4B shapes: transformers + PEFT bf16 LoRA,
# ours bf16 LoRA, ours NF4 QLoRA; tokens/s and peak memory, vision.jsonl)
# smoke (issue 47: bench/smoke.py, every mission feature once at a real shape (about 8 minutes before issue 46's
# rows), each row its own process and timeout, up to 5 at once as the card's free memory allows: Qwen2-1.5B LoRA and
# QLoRA 4 x 2048, Llama-3-8B QLoRA, Qwen2.5-VL-7B and Gemma-3-4B LoRA with images, GRPO, fast_generate 16 rows,
# merged + q8_0 GGUF export, a 32k-token step, DPO, then issue 46's LoRA rows (Qwen3.5-9B, SmolLM3-3B, GLM-4.5-Air
# cut to 3 layers, Qwen3-VL-8B with images; checkpoints written as the disk allows, unneeded ones removed); one JSON
# line a row in smoke.jsonl (ran, error, tokens_per_s, peak_gib, seconds), each process's output in smoke_logs/,
# then "smoke: N of M rows ran"; run it first)
# gateddelta (issue 46: tests/kernels/test_gated_delta.py on the GPU, then bench/gated_delta_bench.py: forward + backward
# of the gated delta rule at Qwen3.5's shape, B=4 T=2048 Hk=16 Hv=32 Dk=Dv=128 bf16, for the Pallas kernel, the chunked
# XLA form and the token scan, each in its own process: ms and peak memory, gated_delta.jsonl; the test log in
# pytest_gated_delta.txt)
# qwen35 (issue 46's Show rows, one call: bench/gated_delta_bench.py (no tests): the kernel beside the chunked XLA form
# and the token scan, forward + backward at 4 x 2048, gated_delta.jsonl; then bench/qwen35_ab.py, the
# Qwen3.5-9B-shaped LoRA step (4 x 2048, bf16, r=16, gradient checkpointing) of ours and of transformers + PEFT, each
# side in its own process: tokens/s, peak memory and which gated-delta / conv1d path transformers ran, qwen35.jsonl)
# (default: tests kernels train15). `ab` times the train step of the code in .bench_old/ (an older commit,
# carried) against the working tree's, alternating, on the Qwen2-1.5B and Llama-3-8B shapes (AB_RUNS each).
# Env: GPU_TESTS (paths), GPU_MARKS (default "gpu or gpu_suite"), GPU_SHARD (K/N: the K-th of N parts of the test
# files, one call each: the whole suite did not fit one call on 2026-12-06), TEST_TIMEOUT (the stage, retries included),
# PER_TEST_TIMEOUT, PYTEST_WORKERS (pytest-xdist processes sharing the GPU; default: one per GIB_PER_TEST_WORKER (12)
# GiB of free memory, at most the CPU count, each capped at its share by XLA_PYTHON_CLIENT_MEM_FRACTION; compiling is
# the slow part of the GPU tests), KERNEL_BENCHES, KERNEL_TIMEOUT, ATTN_BENCH_FLAGS,
# ATTN_TIMEOUT, TRAIN15_VARIANTS, GEMMA2_VARIANTS, TRAIN_TIMEOUT, TRAIN8B_FLAGS, TRAIN8B_TIMEOUT, GRPO_FLAGS,
# GRPO_TIMEOUT, FULLFT_VARIANTS, FULLFT_FIT_SHAPES, FULLFT_FIT_OPTIMS, FIT_TIMEOUT, FULLFT_RUN_LARGEST (1: train the
# largest shape that fits), FULLFT_BIG_TIMEOUT, SPEED_ROWS, SPEED_IMPLS, SPEED_TIMEOUT, MOE_LAYERS, MOE_FULL, MOE_TIMEOUT,
# LONGCTX_SEQS, LONGCTX_REMAT (remat modes), LONGCTX_SIDES (old new), LONGCTX_XFLAGS (sets of extra XLA flags and NAME=VALUE environment settings, + joined; none = no extra), LONGCTX_FALLBACK (the remat retried when a run prints nothing; default true, empty: none), OFFLOADPROBE_FLAGS, LONGCTX_FLAGS (e.g. --layers-per-checkpoint+4), OFFLOADAB_RUNS, OFFLOADAB_TIMEOUT, REMATMEM_SEQS, REMATMEM_MODES, REMATMEM_TIMEOUT,
# VISION_SHAPES (family:shape ..., qwen3_vl:8b too),
# VISION_FLAGS (vision_bench run flags joined with +, e.g. --batch+4), VISION_TIMEOUT,
# SMOKE_FLAGS (bench/smoke.py flags joined with +, e.g. --only+dpo_qwen2_1.5b,export_merged_gguf or --budget+420+--jobs+3),
# SMOKE_TIMEOUT (the stage's hard limit, default 540 s; smoke.py's own budget is 480 s), GDN_TIMEOUT (the gated delta
# bench, default 300 s; its tests get TEST_TIMEOUT), GDN_FLAGS (gated_delta_bench flags, e.g. --sweep),
# QWEN35_MODEL (a bench/shapes.py name, default qwen3.5-9b), QWEN35_FLAGS (qwen35_ab flags joined with +, e.g.
# --sides+hf or --timeout+240: each side's limit, default 300 s), QWEN35_TIMEOUT (the A/B, both sides, default
# 480 s), CK (the checkpoints' folder, default /tmp/ckpt).
# A GPU time breakdown of a train step: add --profile+/tmp/p15 to a variant's flags (train_bench --profile).
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD
PY=${PY:-python3}
CK=${CK:-/tmp/ckpt}
stages=${*:-tests kernels train15}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/session.log"; }
# train_variants MODEL VARIANT...: one train_bench run (batch 4 x 2048) per "remat|impl overrides|extra flags"
# (flags joined with +) on the checkpoint of MODEL, one JSON line each in train.jsonl.
train_variants() {
  local model=$1; shift
  $PY bench/make_checkpoint.py $model $CK/$model 2>&1 | tail -1
  for v in "$@"; do
    local r=${v%%|*} rest=${v#*|}; local impl=${rest%%|*} flags=${rest#*|}; flags=${flags//+/ }
    log "train $model remat=$r impl=${impl:-auto} $flags"
    UNSLOTH_JAX_IMPL=$impl timeout ${TRAIN_TIMEOUT:-150} $PY bench/train_bench.py $CK/$model --batch 4 \
      --seq 2048 --remat $r $flags 2>>"$OUT/train_err.txt" | tail -1 \
      | sed "s/^{/{\"impl\": \"${impl:-auto}\", /" | tee -a "$OUT/train.jsonl"
  done
}
log "stages: $stages"
# The code needs flax >= 0.12 (nnx.data, Variable.get_value); a carried wheel (.whl/) is installed if the image's
# flax is older.
if ! $PY -c "import flax, sys; v = tuple(int(x) for x in flax.__version__.split('.')[:2]); sys.exit(v < (0, 12))" 2>/dev/null \
   && ls .whl/flax-*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/flax-*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
$PY -c "import flax, jax; print('flax', flax.__version__, 'jax', jax.__version__)" 2>&1 | tee -a "$OUT/session.log"
# Compiled programs and GEMM autotuning results are cached on disk for the later runs of this call (FP8 GEMMs
# autotune for about two minutes at 8B); the autotune-cache flag is used only if this XLA knows it.
export JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
if XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=/tmp/autotune" \
   $PY -c "import jax.numpy as jnp; jnp.ones(2).block_until_ready()" >/dev/null 2>&1; then
  export XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_per_fusion_autotune_cache_dir=/tmp/autotune"
fi
log "XLA_FLAGS=${XLA_FLAGS:-}"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee -a "$OUT/session.log"
$PY -c "import jax, torch; print('jax', jax.__version__, jax.devices(), 'torch', torch.__version__)" 2>&1 | tee -a "$OUT/session.log"
for st in $stages; do
  case $st in
    smoke)
      # bench/smoke.py: checkpoints under $CK (written once, reused by the later stages), rows as they end
      log "smoke ${SMOKE_FLAGS:-}"
      timeout ${SMOKE_TIMEOUT:-540} $PY bench/smoke.py --out "$OUT/smoke.jsonl" --log-dir "$OUT/smoke_logs" --ckpt-dir $CK \
        ${SMOKE_FLAGS:+${SMOKE_FLAGS//+/ }} 2>>"$OUT/smoke_err.txt" | tee -a "$OUT/session.log"
      [ "${PIPESTATUS[0]}" = 124 ] && echo "smoke: stopped after ${SMOKE_TIMEOUT:-540} s; the rows that ended are in smoke.jsonl" ;;
    tests)
      # bench/gpu_tests.py: -m "gpu or gpu_suite" (GPU_MARKS; gpu_suite: the engine, vision and long-context files),
      # one pytest-xdist worker per GIB_PER_TEST_WORKER (12) GiB of the card's free memory (PYTEST_WORKERS overrides),
      # each with XLA_PYTHON_CLIENT_MEM_FRACTION = its share; tests out of memory or time beside the others retried
      # alone in the time left; the summary line "gpu tests: P passed, F failed, ..."
      log "gpu tests ${GPU_MARKS:-gpu or gpu_suite} ${GPU_TESTS:-tests}"
      $PY bench/gpu_tests.py --marks "${GPU_MARKS:-gpu or gpu_suite}" ${PYTEST_WORKERS:+--workers $PYTEST_WORKERS} \
        ${GPU_SHARD:+--shard $GPU_SHARD} \
        --gib-per-worker ${GIB_PER_TEST_WORKER:-12} --timeout ${TEST_TIMEOUT:-480} \
        --per-test-timeout ${PER_TEST_TIMEOUT:-150} --out "$OUT/pytest_gpu.txt" ${GPU_TESTS:-tests} 2>&1 \
        | tee -a "$OUT/session.log" | tail -30 ;;
    kernels)
      # KERNEL_BENCHES: "name[:flag+flag][@seconds] ..." e.g. "nf4:--sweep=dequant@80 kernels_elementwise"
      for spec in ${KERNEL_BENCHES:-kernels_elementwise kernels_matmul nf4}; do
        t=${KERNEL_TIMEOUT:-170}; [[ $spec == *@* ]] && { t=${spec##*@}; spec=${spec%@*}; }
        b=${spec%%:*}; flags=""; [[ $spec == *:* ]] && flags=${spec#*:}; flags=${flags//+/ }
        [ -f bench/$b.py ] || continue
        log "bench $b $flags (limit ${t}s)"
        timeout $t $PY bench/$b.py $flags 2>>"$OUT/bench_err.txt" | tee -a "$OUT/bench_kernels.jsonl" | grep -c .
      done ;;
    gateddelta)
      log "gated delta: tests/kernels/test_gated_delta.py"
      timeout ${TEST_TIMEOUT:-480} $PY -m pytest -q -p no:cacheprovider tests/kernels/test_gated_delta.py \
        >"$OUT/pytest_gated_delta.txt" 2>&1
      tail -3 "$OUT/pytest_gated_delta.txt" | tee -a "$OUT/session.log"
      log "bench gated_delta"
      timeout ${GDN_TIMEOUT:-300} $PY bench/gated_delta_bench.py ${GDN_FLAGS:-} 2>>"$OUT/bench_err.txt" \
        | tee -a "$OUT/gated_delta.jsonl" ;;
    qwen35)
      m=${QWEN35_MODEL:-qwen3.5-9b}
      # the smoke stage's checkpoints may fill the disk: the others go when this one (17 GiB at 9B) would not fit
      mkdir -p $CK
      if [ ! -f $CK/$m/config.json ] && [ "$(df -BG --output=avail $CK | tail -1 | tr -dc 0-9)" -lt 22 ]; then
        for d in $CK/*/; do [ "${d%/}" != "$CK/$m" ] && rm -rf "$d"; done
      fi
      # the kernel bench first (short): a call cut at its 10 minutes still has it; each line is kept as it ends
      log "bench gated_delta ${GDN_FLAGS:-}"
      timeout ${GDN_TIMEOUT:-300} $PY bench/gated_delta_bench.py ${GDN_FLAGS:-} 2>>"$OUT/bench_err.txt" \
        | tee -a "$OUT/gated_delta.jsonl"
      $PY bench/make_checkpoint.py $m $CK/$m 2>&1 | tail -1
      log "qwen35 A/B $m ${QWEN35_FLAGS:-}"
      timeout ${QWEN35_TIMEOUT:-480} $PY bench/qwen35_ab.py $CK/$m ${QWEN35_FLAGS:+${QWEN35_FLAGS//+/ }} \
        2>>"$OUT/qwen35_err.txt" | tee -a "$OUT/qwen35.jsonl" | cut -c1-600 ;;
    attention)
      log "bench attention"
      timeout ${ATTN_TIMEOUT:-240} $PY bench/attention.py ${ATTN_BENCH_FLAGS:-} 2>>"$OUT/bench_err.txt" | tee -a "$OUT/bench_attention.jsonl" ;;
    train15|final)
      # TRAIN15_VARIANTS (FINAL_VARIANTS is the old name); the default is the per-kernel A/B of BENCHMARKS.md.
      train_variants qwen2-1.5b ${TRAIN15_VARIANTS:-${FINAL_VARIANTS:-"true||" "true|glu=pallas|" \
        "true|linear=pallas|" "true|rope=pallas|" "unsloth||" "true||--load-in-4bit" "true|nf4_matmul=xla|--load-in-4bit"}} ;;
    traingemma2)
      # Gemma-2-2B (attention softcap: the flash kernel's case); default: flash vs XLA attention.
      train_variants gemma2-2b ${GEMMA2_VARIANTS:-"true||" "true|attention=xla|"} ;;
    train8b)
      $PY bench/make_checkpoint.py llama3-8b $CK/llama3-8b 2>&1 | tail -2
      log "train llama3-8b"
      # TRAIN8B_FLAGS: extra train_bench flags joined with + (e.g. --load-in-4bit)
      timeout ${TRAIN8B_TIMEOUT:-240} $PY bench/train_bench.py $CK/llama3-8b --batch 2 --seq 2048 --remat ${TRAIN8B_REMAT:-unsloth} \
        ${TRAIN8B_FLAGS:+${TRAIN8B_FLAGS//+/ }} 2>>"$OUT/train_err.txt" | tail -1 | tee -a "$OUT/train.jsonl" ;;
    grpo)
      # GRPO on Qwen2-1.5B: 8 generations of 256 tokens per prompt, beside the SFT step (bench/grpo_bench.py)
      $PY bench/make_checkpoint.py qwen2-1.5b $CK/qwen2-1.5b 2>&1 | tail -1
      log "grpo qwen2-1.5b ${GRPO_FLAGS:-}"
      timeout ${GRPO_TIMEOUT:-420} $PY bench/grpo_bench.py $CK/qwen2-1.5b --prompts 2 --generations 8 \
        --completion 256 --prompt-len 64 --steps 6 --warmup 2 ${GRPO_FLAGS:+${GRPO_FLAGS//+/ }} \
        2>>"$OUT/grpo_err.txt" | grep '^{"name' | tee -a "$OUT/grpo.jsonl" ;;
    ab)
      # old (.bench_old) vs new (working tree), same checkpoint, same flags, alternating; AB_MODELS; AB_GENERATE=1
      # also times the engine (16 rows, both decode kernels forced on both sides) on each model after its train runs
      for m in ${AB_MODELS:-qwen2-1.5b llama3-8b}; do
        $PY bench/make_checkpoint.py $m $CK/$m 2>&1 | tail -1
        b=4; [ $m = llama3-8b ] && b=2
        for i in $(seq ${AB_RUNS:-1}); do
          for side in old new; do
            root=$PWD; [ $side = old ] && root=$PWD/.bench_old
            log "ab $m $side run $i"
            PYTHONPATH=$root timeout ${TRAIN_TIMEOUT:-150} $PY $root/bench/train_bench.py $CK/$m --batch $b --seq 2048 \
              --remat true 2>>"$OUT/train_err.txt" | tail -1 | sed "s/^{/{\"side\": \"$side\", /" | tee -a "$OUT/ab.jsonl"
          done
        done
        [ "${AB_GENERATE:-0}" = 1 ] || continue
        for side in old new; do
          root=$PWD; [ $side = old ] && root=$PWD/.bench_old
          log "ab generate $m $side"
          PYTHONPATH=$root UNSLOTH_JAX_IMPL=paged_attention=pallas,decode_linear=pallas timeout ${GEN_TIMEOUT:-90} \
            $PY $root/bench/generate_bench.py $CK/$m --rows 16 --weights shared 2>>"$OUT/train_err.txt" | grep '^{' \
            | tail -1 | sed "s/^{/{\"side\": \"$side\", /" | tee -a "$OUT/ab_generate.jsonl" | cut -c1-300
        done
      done ;;
    offloadprobe)
      # bench/offload_prefetch_probe.py (plain JAX): each variant in its own process (its own peak), with XLA's
      # default command buffers and with the limited kinds the "offload" step compiles with; OFFLOADPROBE_FLAGS
      # (joined with +): more probe flags, e.g. --tokens+32768+--dump+/tmp/hlo_dump
      for xf in "" "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,CUSTOM_CALL"; do
        for v in device offload_policy custom_vjp_fetch custom_vjp_prefetch; do
          log "offload probe $v extra XLA_FLAGS=${xf:-none}"
          XLA_FLAGS="${XLA_FLAGS:-} $xf" timeout 100 $PY bench/offload_prefetch_probe.py --variants $v \
            --profile /tmp/prof_offload ${OFFLOADPROBE_FLAGS:+${OFFLOADPROBE_FLAGS//+/ }} 2>>"$OUT/bench_err.txt" | sed "s/^{/{\"extra_xla_flags\": \"$xf\", /" \
            | tee -a "$OUT/offload_probe.jsonl" | cut -c1-200
        done
      done ;;
    offloadab)
      # Llama-3-8B rows through bench/train_bench_cmdbuf.py, one JSON line each in offload_ab.jsonl; OFFLOADAB_RUNS:
      # "command buffers|environment (e.g. UNSLOTH_JAX_IMPL=nf4_gemm=fp8)|train_bench flags", + joined (the
      # offload scan's settings go with --remat: --remat+unsloth,offload_weights=prefetch)
      $PY bench/make_checkpoint.py llama3-8b $CK/llama3-8b 2>&1 | tail -1
      for run in ${OFFLOADAB_RUNS:-"limited||--batch+1+--seq+32768+--remat+unsloth+--load-in-4bit+--steps+3+--warmup+1"}; do
        IFS='|' read -r cb ev fl <<< "$run"; fl=${fl//+/ }; ev=${ev//+/ }
        log "offloadab cmdbuf=$cb env=${ev:-none} $fl"
        env $ev timeout ${OFFLOADAB_TIMEOUT:-200} $PY bench/train_bench_cmdbuf.py $cb $CK/llama3-8b $fl \
          2>>"$OUT/train_err.txt" | tail -1 \
          | sed "s/^{/{\"cmdbuf\": \"$cb\", \"env\": \"$ev\", /" | tee -a "$OUT/offload_ab.jsonl" | cut -c1-600
      done ;;
    fp8probe)
      log "fp8 probe"
      timeout ${FP8_TIMEOUT:-150} $PY bench/fp8_probe.py 2>>"$OUT/bench_err.txt" | tee -a "$OUT/fp8_probe.jsonl" ;;
    rematmem)
      # XLA's memory analysis of the Llama-3-8B-shaped LoRA step (bf16, batch 1, compiled from shapes only) per
      # remat mode and length: per-layer vs two-level checkpointing (bench/remat_memory.py)
      timeout ${REMATMEM_TIMEOUT:-500} $PY bench/remat_memory.py --layers 32 --hidden 4096 --intermediate 14336 \
        --heads 32 --kv-heads 8 --vocab 128256 --batch 1 --dtype bfloat16 --seqs ${REMATMEM_SEQS:-32768 65536} \
        --modes ${REMATMEM_MODES:-offload offload_every_4 full full_every_4} 2>>"$OUT/bench_err.txt" \
        | tee -a "$OUT/remat_memory.jsonl" ;;
    longctx)
      # Llama-3-8B QLoRA batch 1 at LONGCTX_SEQS (one warm-up step, one timed), XLA's memory analysis included;
      # LONGCTX_REMAT: train_bench's --remat (default unsloth; e.g. offload_attention)
      $PY bench/make_checkpoint.py llama3-8b $CK/llama3-8b 2>&1 | tail -1
      # a length given as SEQ:1 runs one step only (its time is pure execution: the trainer compiles the step
      # before step 1); a run that prints nothing (out of host or device memory) is retried with on-device remat
      # LONGCTX_SIDES="old new": each length and remat also run on the code in .bench_old/ (carried), first
      for spec in ${LONGCTX_SEQS:-16384 32768}; do
        s=${spec%%:*}; steps="--steps 2 --warmup 1"; [[ $spec == *:1 ]] && steps="--steps 1 --warmup 0"
        for rr in ${LONGCTX_REMAT:-unsloth}; do
          for side in ${LONGCTX_SIDES:-new}; do
            root=$PWD; [ $side = old ] && root=$PWD/.bench_old
            for xs in ${LONGCTX_XFLAGS:-none}; do
              # a set: XLA flags (--...) and environment assignments (NAME=VALUE, e.g. JAX_ENABLE_PGLE=true)
              xf=""; ev=""
              if [ "$xs" != none ]; then for t in ${xs//+/ }; do [[ $t == --* ]] && xf+=" $t" || ev+=" $t"; done; fi
              for r in $rr ${LONGCTX_FALLBACK-true}; do
                log "longctx seq $s remat $r side $side ${LONGCTX_FLAGS:-} extra XLA_FLAGS=${xf:-none} env=${ev:-none}"
                line=$(env $ev XLA_FLAGS="${XLA_FLAGS:-} $xf" PYTHONPATH=$root timeout ${LONGCTX_TIMEOUT:-240} $PY \
                  $root/bench/train_bench.py $CK/llama3-8b --batch 1 --seq $s --remat $r --load-in-4bit $steps \
                  --memory-analysis ${LONGCTX_FLAGS:+${LONGCTX_FLAGS//+/ }} 2>>"$OUT/train_err.txt" | tail -1)
                echo "${line/#\{/\{\"side\": \"$side\", \"extra_xla_flags\": \"$xf\", \"extra_env\": \"$ev\", }" | tee -a "$OUT/longctx.jsonl"
                [[ $line == "{"* ]] && break
              done
            done
          done
        done
      done ;;
    fullft)
      # Qwen2-1.5B: LoRA beside full fine-tuning (AdamW, float32 moments; and 8-bit AdamW), one JSON line each.
      train_variants qwen2-1.5b ${FULLFT_VARIANTS:-"unsloth||" "unsloth||--full-finetuning" \
        "unsloth||--full-finetuning+--optim+adamw_8bit"}
      # XLA's buffer estimate of full fine-tuning for larger shapes (compiled abstractly, no weights allocated).
      for o in ${FULLFT_FIT_OPTIMS:-adamw_torch adamw_8bit}; do
        log "full_ft_fit $o"
        timeout ${FIT_TIMEOUT:-300} $PY bench/full_ft_fit.py --shapes ${FULLFT_FIT_SHAPES:-qwen2.5-7b,llama3-8b,qwen2.5-14b} \
          --optim $o 2>>"$OUT/fit_err.txt" | tee -a "$OUT/fullft_fit.jsonl"
      done
      # Then train the largest shape the estimate says fits, for real (peak memory and tokens/s).
      if [ "${FULLFT_RUN_LARGEST:-1}" = 1 ]; then
        pick=$($PY -c "import json,sys; rows=[json.loads(l) for l in open(sys.argv[1]) if l.strip()]; ok=[r for r in rows if r.get('fits')]; best=max(ok, key=lambda r: (r['params'], r['optim']=='adamw_torch'), default=None); print(f\"{best['shape']} {best['optim']}\" if best else '')" "$OUT/fullft_fit.jsonl")
        if [ -n "$pick" ]; then
          read -r shape optim <<< "$pick"
          $PY bench/make_checkpoint.py $shape $CK/$shape 2>&1 | tail -1
          log "train $shape full fine-tuning, $optim"
          timeout ${FULLFT_BIG_TIMEOUT:-420} $PY bench/train_bench.py $CK/$shape --batch 4 --seq 2048 --remat unsloth \
            --full-finetuning --optim $optim --memory-analysis 2>>"$OUT/train_err.txt" | tail -1 | tee -a "$OUT/train.jsonl"
        fi
      fi ;;
    speed)
      # SPEED_ROWS: "model|batch|remat|flags+joined" ...; all-XLA = every Pallas kernel off (cuDNN attention kept).
      # SPEED_IMPLS: the UNSLOTH_JAX_IMPL of each run of a row, space-separated; "auto" = the defaults, "allxla" =
      # all-XLA (default "auto allxla"; e.g. "auto glu_fp8=pallas" for a one-op A/B). IMPL@FLAG+FLAG adds XLA flags
      # to that run (e.g. "auto auto@--xla_gpu_enable_command_buffer=": the offload copies with command buffers off).
      allxla="rms_norm=xla,rope=xla,glu=xla,glu_fp8=xla,linear=xla,nf4_matmul=xla,cross_entropy=xla"
      first=1
      for row in ${SPEED_ROWS:-"llama3-8b|2|save_attention|--load-in-fp8" "llama3-8b|2|unsloth|--load-in-4bit" \
          "qwen2-1.5b|4|true|" "qwen2-1.5b|4|unsloth|--load-in-4bit" "gemma2-2b|4|true|"}; do
        IFS='|' read -r m b r fl <<< "$row"; fl=${fl//+/ }
        $PY bench/make_checkpoint.py $m $CK/$m 2>&1 | tail -1
        for spec in ${SPEED_IMPLS:-auto allxla}; do
          impl=${spec%%@*}; xf=""; [[ $spec == *@* ]] && { xf=${spec#*@}; xf=${xf//+/ }; }
          [ "$impl" = auto ] && impl=""; [ "$impl" = allxla ] && impl=$allxla
          prof=""; [ $first = 1 ] && [ -z "$impl" ] && [ -z "$xf" ] && prof="--profile /tmp/prof_speed --steps 13"
          log "speed $m batch $b remat $r $fl impl=${impl:-auto} extra XLA_FLAGS=${xf:-none}"
          XLA_FLAGS="${XLA_FLAGS:-} $xf" UNSLOTH_JAX_IMPL=$impl timeout ${SPEED_TIMEOUT:-200} $PY bench/train_bench.py \
            $CK/$m --batch $b --seq 2048 --remat $r $fl $prof 2>>"$OUT/train_err.txt" | tail -1 \
            | sed "s/^{/{\"impl\": \"${impl:-auto}\", \"extra_xla_flags\": \"$xf\", /" | tee -a "$OUT/speed.jsonl"
        done
        first=0
      done ;;
    moe)
      # Qwen3-30B-A3B-shaped MoE LoRA step: MOE_LAYERS layers, grouped vs per-expert loop + expert-GEMM MFU;
      # MOE_FULL=1 adds the 48-layer grouped step
      log "moe bench layers=${MOE_LAYERS:-4}"
      timeout ${MOE_TIMEOUT:-560} $PY bench/moe_bench.py --layers ${MOE_LAYERS:-4} --experts-impl both --steps 6 \
        2>>"$OUT/bench_err.txt" | tee -a "$OUT/moe.jsonl"
      if [ "${MOE_FULL:-0}" = 1 ]; then
        log "moe bench 48 layers, grouped"
        timeout ${MOE_TIMEOUT:-560} $PY bench/moe_bench.py --experts-impl grouped --steps 6 --skip-block \
          2>>"$OUT/bench_err.txt" | tee -a "$OUT/moe.jsonl"
      fi ;;
    vision)
      # each family:shape of VISION_SHAPES: transformers + PEFT bf16 LoRA, ours bf16 LoRA, ours NF4 QLoRA, one after the
      # other on the same random-init checkpoint and the same batch (default 2 rows x 2048 tokens, 2 images a row)
      for fs in ${VISION_SHAPES:-qwen2_5_vl:7b gemma3:4b}; do
        f=${fs%%:*} s=${fs#*:}
        $PY bench/vision_bench.py make --family $f --shape $s --checkpoint $CK/$f-$s 2>&1 | tail -1
        for run in "hf|" "ours|" "ours|--load-in-4bit"; do
          side=${run%%|*} fl=${run#*|}
          log "vision $f $s $side $fl ${VISION_FLAGS:-}"
          timeout ${VISION_TIMEOUT:-300} $PY bench/vision_bench.py run --side $side --family $f --shape $s \
            --checkpoint $CK/$f-$s $fl ${VISION_FLAGS:+${VISION_FLAGS//+/ }} 2>>"$OUT/vision_err.txt" | tail -1 \
            | tee -a "$OUT/vision.jsonl" | cut -c1-600
        done
      done ;;
    parity)
      for m in llama3-8b gemma2-2b; do
        $PY bench/make_checkpoint.py $m $CK/$m 2>&1 | tail -2
        log "parity $m"
        timeout 200 $PY bench/gpu_parity.py $CK/$m 2>>"$OUT/parity_err.txt" | tail -1 | tee -a "$OUT/parity.jsonl"
      done ;;
  esac
done
log "done"
tail -c 3000 "$OUT"/*err.txt 2>/dev/null | tail -40
