#!/usr/bin/env bash
# Generation engine on the GPU, in one device call per part: the decode kernels' GPU tests and benches, the
# engine at the issue's shapes beside transformers' static cache, and GRPO. JSON lines under $OUT.
#   bash bench/generate_session.sh a   # kernel GPU tests; Qwen2-1.5B engine rows beside transformers; 8B engine rows
#   bash bench/generate_session.sh b   # transformers at 8B; GRPO at 1.5B; 8B NF4 engine row
#   bash bench/generate_session.sh c   # the NF4 decode kernel: GPU tests, alone vs dequantize + GEMM and vs bf16,
#                                      # a config sweep, the 8B NF4 engine row with and without it
#   bash bench/generate_session.sh d   # where the decode step's time goes: the 1.5B 16-row step profiled (kernel
#                                      # times per step) with its HLO; decode_linear alone and its config sweep
#   bash bench/generate_session.sh e   # decode_linear's configs swept layer after layer (decode_linear_chain.py),
#                                      # then the 1.5B 16-row engine with the rule's configs and with the best
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
elif [ "$part" = d ]; then
  $PY bench/make_checkpoint.py qwen2-1.5b $CK/qwen2-1.5b 2>>$ERR | tail -1
  engine qwen2-1.5b ${GEN_TIMEOUT:-170} "$best" --rows 16 --weights shared --new 64 --count-kernels \
    --dump-hlo $OUT/decode_qwen2-1.5b_16.hlo.txt --profile /tmp/trace15
  $PY bench/trace_summary.py /tmp/trace15 --steps 64 --top 60 > $OUT/trace_qwen2-1.5b_16.json 2>>$ERR
  engine qwen2-1.5b 90 "$best" --rows 16 --weights merged --new 64 --count-kernels \
    --dump-hlo $OUT/decode_qwen2-1.5b_16_merged.hlo.txt --profile /tmp/trace15m
  $PY bench/trace_summary.py /tmp/trace15m --steps 64 --top 60 > $OUT/trace_qwen2-1.5b_16_merged.json 2>>$ERR
  log "decode_linear_bench"
  timeout 150 $PY bench/decode_linear_bench.py --m 1,16,128 2>>$ERR | tee -a "$OUT/decode_linear.jsonl" | cut -c1-200
  log "decode_linear_bench --sweep --m 16"
  timeout ${SWEEP_TIMEOUT:-150} $PY bench/decode_linear_bench.py --sweep --m 16 --models qwen2-1.5b --budget-s 130 2>>$ERR \
    | tee -a "$OUT/decode_linear_sweep.jsonl" | grep -c .
elif [ "$part" = e ]; then
  $PY bench/make_checkpoint.py qwen2-1.5b $CK/qwen2-1.5b 2>>$ERR | tail -1
  log "decode_linear_chain qwen2-1.5b m=16"
  timeout 240 $PY bench/decode_linear_chain.py --models qwen2-1.5b --m 16 --budget-s ${CHAIN_BUDGET:-180} \
    --write-best $OUT/decode_tuned_qwen2-1.5b.json 2>>$ERR | tee -a "$OUT/decode_linear_chain.jsonl" | grep -c .
  log "decode_linear_chain llama-3-8b m=16 gate_up,down"
  timeout 160 $PY bench/decode_linear_chain.py --models llama-3-8b --proj gate_up,down --m 16 \
    --budget-s ${CHAIN_BUDGET_8B:-100} --write-best $OUT/decode_tuned_llama-3-8b.json 2>>$ERR \
    | tee -a "$OUT/decode_linear_chain.jsonl" | grep -c .
  engine qwen2-1.5b 110 "$best" --rows 16 --weights shared
  engine qwen2-1.5b 110 "$best" --rows 16 --weights shared --decode-configs $OUT/decode_tuned_qwen2-1.5b.json
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
