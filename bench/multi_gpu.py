"""Issue 22: LoRA and QLoRA training on 1, 2, 4 and 8 GPUs, data parallel and FSDP, against the 1-GPU run.

    python bench/make_checkpoint.py llama3-8b /tmp/ckpt/llama3-8b
    python bench/multi_gpu.py /tmp/ckpt/llama3-8b --methods lora,qlora --gpus 1,2,4,8 --strategies data,fsdp
    # the CPU check (tiny shapes, forced host devices):
    python bench/multi_gpu.py unsloth_jax/assets/tiny-llama --cpu-devices 8 --gpus 1,2,8 --batch 1 --seq 64 --steps 4
    # split over several device calls (--max-gpus keeps the steps comparable), then the summary of all lines:
    python bench/multi_gpu.py /tmp/ckpt/llama3-8b --methods lora --gpus 1,2 --max-gpus 8 > a.jsonl
    python bench/multi_gpu.py /tmp/ckpt/llama3-8b --methods lora --gpus 4,8 --max-gpus 8 > b.jsonl
    python bench/multi_gpu.py --summarize a.jsonl b.jsonl

Every configuration trains the same optimizer steps through SFTTrainer: G = batch x M rows per step (M =
--max-gpus, default max(--gpus)), as n devices x `batch` rows x M/n accumulated micro-batches. So the per-device micro-batch (and its
activation memory) is the same in every configuration, the losses must agree with the 1-GPU run (token-weighted
accumulation makes the steps the same), and tokens/s per GPU compares directly: scaling efficiency = tokens/s
per GPU on n GPUs / tokens/s on 1 GPU. LoRA r=16, alpha=16, all seven projections, AdamW, bf16 (float32 on the
CPU), random token ids, per-layer remat; step time = median of the steps after --warmup, each synchronised.

Each configuration runs in its own process (fresh peak-memory counters, CUDA_VISIBLE_DEVICES = its n GPUs, or n
forced CPU devices) and prints one JSON line; then one summary line per configuration. NCCL's NVLink multicast
(NVLS) stays off: NCCL_NVLS_ENABLE=0 is set before jax starts, here and in every child.

Peak memory: the loader puts the whole model on GPU 0 before the trainer shards it, so GPU 0's high-water mark
includes the loaded model; `peak_gib_per_gpu` is therefore the largest peak of the other GPUs (n > 1), and
GPU 0's own peak and the peaks before training are reported beside it. On the CPU, where devices report no
memory, `step_program_gib_per_device` (the compiled step's memory_analysis) stands in.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ["NCCL_NVLS_ENABLE"] = "0"  # before jax starts (also inherited by the children)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def configurations(methods, gpus, strategies):
    """(method, strategy, n) for every run: n = 1 once per method (no mesh), then each strategy on n > 1."""
    for method in methods:
        if 1 in gpus:
            yield method, "single", 1
        for n in (g for g in gpus if g > 1):
            for strategy in strategies:
                yield method, strategy, n


def child_env(n: int, cpu_devices: int | None) -> dict:
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", XLA_PYTHON_CLIENT_PREALLOCATE="false",
               PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if cpu_devices:
        env["JAX_PLATFORMS"] = "cpu"
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={n}").strip()
    else:
        visible = env.get("CUDA_VISIBLE_DEVICES")
        ids = visible.split(",") if visible else [str(i) for i in range(n)]
        env["CUDA_VISIBLE_DEVICES"] = ",".join(ids[:n])
    return env


def run_one(cfg: dict) -> dict:
    """One configuration in this process (all its visible devices); returns its JSON line."""
    import jax
    import numpy as np

    from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments, distributed
    import unsloth_jax.train.trainer as trainer_module

    n, strategy = cfg["gpus"], cfg["strategy"]
    devices = jax.devices()
    if len(devices) != n:
        raise SystemExit(f"expected {n} devices, jax sees {len(devices)}")
    mesh = None
    if n > 1:
        mesh = distributed.make_mesh(data=n, fsdp=1) if strategy == "data" else distributed.make_mesh(data=1, fsdp=n)
    accum = cfg["max_gpus"] // n
    t0 = time.time()
    model, _ = FastLanguageModel.from_pretrained(cfg["model"], dtype=cfg["dtype"], load_in_4bit=cfg["method"] == "qlora",
                                                 load_tokenizer=False, max_seq_length=cfg["seq"], progress=False)
    load_s = time.time() - t0
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0,
                                             use_gradient_checkpointing=cfg["remat"])
    rows = cfg["batch"] * cfg["max_gpus"]  # per optimizer step, the same in every configuration
    rng = np.random.default_rng(0)
    data = [{"input_ids": rng.integers(0, model.config.vocab_size, cfg["seq"]).tolist()}
            for _ in range(rows * cfg["steps"])]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=cfg["batch"],
                             gradient_accumulation_steps=accum, max_steps=cfg["steps"], logging_steps=1,
                             save_steps=0, optim="adamw_torch", learning_rate=1e-4, mesh=mesh)
    trainer = SFTTrainer(model=model, train_dataset=data, args=args, max_seq_length=cfg["seq"])
    trainer._pad_id = lambda: 0
    before = [d.memory_stats() or {} for d in devices]
    step_times, first_args, made = [], [], []
    real_make = trainer_module.make_train_step

    def timed_make(*a, **kw):
        step = real_make(*a, **kw)
        made.append(step)

        def timed(*xs):
            if not first_args:  # shapes and shardings of the first call (its buffers are donated)
                first_args.append(jax.tree.map(lambda v: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding),
                                               xs))
            t = time.perf_counter()
            outs = step(*xs)
            jax.block_until_ready(outs)
            step_times.append(time.perf_counter() - t)
            return outs

        timed.lower = step.lower  # the trainer compiles the step for its memory plan before step 1
        return timed

    trainer_module.make_train_step = timed_make
    try:
        trainer.train()
    finally:
        trainer_module.make_train_step = real_make
    times = step_times[cfg["warmup"]:] or step_times
    step_s = float(np.median(times))
    tokens = rows * cfg["seq"]
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    gib = lambda b: None if b is None else round(b / 2**30, 3)  # noqa: E731
    line = {"name": "multi_gpu", "model": os.path.basename(cfg["model"].rstrip("/")), "method": cfg["method"],
            "strategy": strategy, "gpus": n, "mesh": distributed.describe(mesh) if mesh else "1 device",
            "per_device_batch": cfg["batch"], "accumulation": accum, "rows_per_step": rows, "seq": cfg["seq"],
            "step_ms": round(step_s * 1e3, 2), "tokens_per_s": round(tokens / step_s, 1),
            "tokens_per_s_per_gpu": round(tokens / step_s / n, 1),
            "peak_gib_per_gpu": gib(max(peaks[1:]) if n > 1 and None not in peaks else peaks[0]),
            "peak_gib_gpu0": gib(peaks[0]), "peak_gib_all": [gib(p) for p in peaks],
            "peak_gib_before_train": [gib(s.get("peak_bytes_in_use")) for s in before],
            "losses": [round(x, 6) for x in trainer.state.loss_history], "load_s": round(load_s, 1),
            "first_step_s": round(step_times[0], 2), "steps_timed": len(times),
            "remat": cfg["remat"], "dtype": cfg["dtype"], "jax": jax.__version__,
            "device": devices[0].device_kind, "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    if cfg["memory_analysis"] and made and first_args:
        compiled = made[0].lower(*first_args[0]).compile()
        line["step_program_gib_per_device"] = gib(distributed.compiled_memory_per_device(compiled))
    return line


def summarize(lines: list[dict]) -> list[dict]:
    """Per configuration: scaling efficiency and loss difference against the same method's 1-GPU line."""
    out = []
    for line in lines:
        base = next((b for b in lines if b["gpus"] == 1 and all(b[k] == line[k] for k in (
            "method", "model", "seq", "rows_per_step", "per_device_batch"))), None)
        row = {"name": "multi_gpu_summary", "method": line["method"], "strategy": line["strategy"],
               "gpus": line["gpus"], "tokens_per_s_per_gpu": line["tokens_per_s_per_gpu"],
               "peak_gib_per_gpu": line["peak_gib_per_gpu"],
               "step_program_gib_per_device": line.get("step_program_gib_per_device")}
        if base is not None:
            row["scaling_efficiency"] = round(line["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"], 3)
            pairs = list(zip(line["losses"], base["losses"]))
            row["max_loss_relerr_vs_1gpu"] = max(abs(a - b) / abs(b) for a, b in pairs) if pairs else None
            row["steps_compared"] = len(pairs)
        out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", nargs="?", help="a Hugging Face checkpoint directory")
    ap.add_argument("--methods", default="lora,qlora")
    ap.add_argument("--gpus", default="1,2,4,8", help="device counts to run (a configuration per count)")
    ap.add_argument("--strategies", default="data,fsdp", help="data (data=n) and/or fsdp (fsdp=n)")
    ap.add_argument("--max-gpus", type=int, default=None, help="rows per step = batch x this (default max(--gpus)); "
                                                               "each n in --gpus must divide it")
    ap.add_argument("--batch", type=int, default=1, help="rows per device per micro-batch")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--remat", default="true", choices=["true", "unsloth", "false"])
    ap.add_argument("--cpu-devices", type=int, default=None, help="run on the CPU with forced host devices")
    ap.add_argument("--memory-analysis", action="store_true", help="also compile the step once more for XLA's "
                                                                   "per-device buffer sizes (always on the CPU)")
    ap.add_argument("--timeout", type=int, default=900, help="seconds per configuration")
    ap.add_argument("--summarize", nargs="+", metavar="JSONL", help="only print the summary of saved lines")
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one configuration (JSON) in this process
    a = ap.parse_args()
    if a.one:
        print("RESULT " + json.dumps(run_one(json.loads(a.one))), flush=True)
        return
    if a.summarize:
        lines = [json.loads(x) for f in a.summarize for x in open(f) if x.startswith('{"name": "multi_gpu"')]
        for row in summarize(lines):
            print(json.dumps(row), flush=True)
        return
    if not a.model:
        ap.error("give a checkpoint directory (or --summarize FILES)")
    gpus = sorted({int(g) for g in a.gpus.split(",")})
    if a.cpu_devices and max(gpus) > a.cpu_devices:
        ap.error(f"--gpus {a.gpus} asks for more than --cpu-devices {a.cpu_devices}")
    max_gpus = a.max_gpus or max(gpus)
    if any(max_gpus % n for n in gpus):
        ap.error(f"every count in --gpus {a.gpus} must divide --max-gpus {max_gpus}")
    remat = {"true": True, "unsloth": "unsloth", "false": False}[a.remat]
    lines = []
    for method, strategy, n in configurations(a.methods.split(","), gpus, a.strategies.split(",")):
        cfg = {"model": a.model, "method": method, "strategy": strategy, "gpus": n, "max_gpus": max_gpus,
               "batch": a.batch, "seq": a.seq, "steps": a.steps, "warmup": a.warmup, "remat": remat,
               "dtype": "float32" if a.cpu_devices else "bfloat16",
               "memory_analysis": bool(a.memory_analysis or a.cpu_devices)}
        t0 = time.time()
        try:
            proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--one", json.dumps(cfg)],
                                  env=child_env(n, a.cpu_devices), capture_output=True, text=True, timeout=a.timeout)
        except subprocess.TimeoutExpired:
            print(json.dumps({"name": "multi_gpu_error", **cfg, "error": f"timeout after {a.timeout}s"}), flush=True)
            continue
        found = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        if proc.returncode or not found:
            print(json.dumps({"name": "multi_gpu_error", **cfg, "rc": proc.returncode,
                              "stderr": proc.stderr[-3000:]}), flush=True)
            continue
        line = json.loads(found[-1][len("RESULT "):])
        line["wall_s"] = round(time.time() - t0, 1)
        lines.append(line)
        print(json.dumps(line), flush=True)
    for row in summarize(lines):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
