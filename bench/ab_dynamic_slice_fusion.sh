# A/B: XLA's dynamic-slice fusion (GEMMs read the scanned layer's weight slice in place) on the train step
# Result (2026-12-01, H200, jax 0.11.2): no gain on the Llama-3-8B FP8 step (275.5 vs 273.3 ms, the weight-slice
# memcpys stay), and the Qwen2-1.5B step with the flag hung after step 1 (killed at the call limit): not adopted.
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
python3 bench/make_checkpoint.py llama3-8b /tmp/ck/llama3-8b 2>&1 | tail -1
python3 bench/make_checkpoint.py qwen2-1.5b /tmp/ck/qwen2-1.5b 2>&1 | tail -1
run() { # name flags model batch remat extra
  echo "== $(date +%T) $1"
  XLA_FLAGS="$2" timeout 200 python3 bench/train_bench.py /tmp/ck/$3 --batch $4 --seq 2048 --remat $5 $6 2>>$OUT/err.txt \
    | tail -1 | sed "s/^{/{\"variant\": \"$1\", /" | tee -a $OUT/ab_dsf.jsonl | cut -c1-330
}
D="--xla_gpu_enable_dynamic_slice_fusion=true"
run fp8_base "" llama3-8b 2 save_attention --load-in-fp8
run fp8_dsf "$D" llama3-8b 2 save_attention "--load-in-fp8 --profile /tmp/pd --steps 13"
run q15_base "" qwen2-1.5b 4 true
run q15_dsf "$D" qwen2-1.5b 4 true
tail -5 $OUT/err.txt
