#!/usr/bin/env bash
# Generation engine on the GPU, in one device call per part: the decode kernels' GPU tests and benches, the
# engine at the issue's shapes beside transformers' static cache, and GRPO. JSON lines under $OUT.
#   bash bench/generate_session.sh a   # kernel GPU tests; Qwen2-1.5B engine rows beside transformers; 8B engine rows
#   bash bench/generate_session.sh b   # transformers at 8B; GRPO at 1.5B; 8B NF4 engine row
#   bash bench/generate_session.sh c   # the NF4 decode kernel: GPU tests, alone vs dequantize + GEMM and vs bf16,
#                                      # a config sweep, the 8B NF4 engine row with and without it
# Env: GEN_IMPLS (the kernel choices tried besides the default, space-separated UNSLOTH_JAX_IMPL values),
# GEN_TIMEOUT, HF_TIMEOUT.
set -u
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache
PY=${PY:-python3}
CK=/tmp/ckpt
ERR=$OUT/err.txt
IMPLS=${GEN_IMPLS:-"paged_attention=pallas,decode_linear=pallas"}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/session.log"; }
engine() {  # engine MODEL TIMEOUT IMPL ARGS...
  local m=$1 t=$2 impl=$3; shift 3
  log "engine $m impl=${impl:-auto} $*"
  UNSLOTH_JAX_IMPL=$impl timeout $t $PY bench/generate_bench.py $CK/$m "$@" 2>>$ERR | grep '^{' \
    | tee -a "$OUT/engine.jsonl" | $PY -c "
import json, sys
for l in sys.stdin:
    d = json.loads(l)
    print(d['model_dir'], d['base'], d['weights'], d['rows'], d['impl'] or 'auto', 'ms/step', d['ms_per_step'],
          'tok/s', d['tokens_per_s'], 'decode tok/s', d['decode_tokens_per_s'], 'compile', d['compile_s'],
          'kernels', d['kernels_per_step'], 'peak', d['peak_gib'], 'bound', d['fraction_of_bound'])"
}
hf() {  # hf MODEL ROWS
  log "transformers static cache $1 rows $2"
  timeout ${HF_TIMEOUT:-200} $PY bench/hf_generate_bench.py $CK/$1 --rows $2 2>>$ERR | grep '^{' | tee -a "$OUT/hf.jsonl"
}
part=${1:-a}
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader | tee -a "$OUT/session.log"
best=${IMPLS%% *}
if [ "$part" = a ]; then
  $PY bench/make_checkpoint.py qwen2-1.5b $CK/qwen2-1.5b 2>>$ERR | tail -1
  tests=$(ls tests/kernels/test_decode_attention.py tests/kernels/test_decode_linear.py 2>/dev/null)
  log "pytest -m gpu $tests"
  timeout 120 $PY -m pytest -m gpu -q -p no:cacheprovider -n 4 $tests > "$OUT/pytest_gpu.txt" 2>&1
  tail -3 "$OUT/pytest_gpu.txt"
  engine qwen2-1.5b ${GEN_TIMEOUT:-170} "$best" --rows 1,16,128 --weights shared --count-kernels
  engine qwen2-1.5b 90 "$best" --rows 16,128 --weights merged
  engine qwen2-1.5b 90 "" --rows 16 --weights shared
  hf qwen2-1.5b 16,128
  $PY bench/make_checkpoint.py llama3-8b $CK/llama3-8b 2>>$ERR | tail -1
  engine llama3-8b 120 "$best" --rows 16,128 --weights shared
elif [ "$part" = c ]; then
  log "pytest -m gpu tests/kernels/test_nf4_decode.py"
  timeout 150 $PY -m pytest -m gpu -q -p no:cacheprovider -n 4 tests/kernels/test_nf4_decode.py > "$OUT/pytest_gpu_nf4_decode.txt" 2>&1
  tail -3 "$OUT/pytest_gpu_nf4_decode.txt"
  log "nf4_decode_bench"
  timeout 150 $PY bench/nf4_decode_bench.py --models llama-3-8b --m 1,16,128 2>>$ERR | tee -a "$OUT/nf4_decode.jsonl" \
    | cut -c1-220
  $PY bench/make_checkpoint.py llama3-8b $CK/llama3-8b 2>>$ERR | tail -1
  engine llama3-8b 100 "$best,nf4_decode=pallas" --rows 16 --weights shared --load-in-4bit
  engine llama3-8b 100 "$best,nf4_decode=xla" --rows 16 --weights shared --load-in-4bit
  log "nf4_decode_bench --sweep"
  timeout ${SWEEP_TIMEOUT:-130} $PY bench/nf4_decode_bench.py --sweep --models llama-3-8b --proj gate_up,down --m 16 \
    --budget-s ${SWEEP_BUDGET:-110} 2>>$ERR | tee -a "$OUT/nf4_decode_sweep.jsonl" | grep -c .
else
  $PY bench/make_checkpoint.py llama3-8b $CK/llama3-8b 2>>$ERR | tail -1
  hf llama3-8b 16
  $PY bench/make_checkpoint.py qwen2-1.5b $CK/qwen2-1.5b 2>>$ERR | tail -1
  log "grpo qwen2-1.5b impl=$best"
  UNSLOTH_JAX_IMPL=$best timeout 120 $PY bench/grpo_bench.py $CK/qwen2-1.5b --prompts 2 --generations 8 \
    --completion 256 --prompt-len 64 --steps 4 --warmup 1 2>>$ERR | grep '^{"name' | tee -a "$OUT/grpo.jsonl"
  engine llama3-8b 90 "$best" --rows 16 --weights shared --load-in-4bit
fi
grep -v -i "warn" $ERR | grep -E "Error|error" | tail -5
