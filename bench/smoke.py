"""The smoke stage (issue 47): every mission feature once at a real shape, each row in its own process.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/smoke.py --out /tmp/out/smoke.jsonl   # the GPU stage (~8 min)
    python bench/smoke.py --list                  # the rows
    python bench/smoke.py --dry-run [--tiny]      # their commands, nothing run
    python bench/smoke.py --only lora_qwen2_1.5b,dpo_qwen2_1.5b
    python bench/smoke.py --tiny                  # the same rows at tiny shapes, on the CPU (tests/test_smoke_stage.py)

Rows (ROW_SPECS): a LoRA and a QLoRA train step of Qwen2-1.5B at 4 x 2048, a Llama-3-8B QLoRA step at 2 x 2048, the
vision-language LoRA steps with images of Qwen2.5-VL-7B and Gemma-3-4B (bench/vision_bench.py), two GRPO steps
(bench/grpo_bench.py), fast_generate at 16 rows, the merged 16-bit and the q8_0 GGUF export (transformers loads the
merged folder, the gguf package reads the file), a 32k-token step of Qwen2-1.5B (batch 1), a DPO step (the
public DPOTrainer, 2 pairs of 1024 tokens), and issue 46's families: LoRA steps at 4 x 2048 of Qwen3.5-9B's text
decoder, SmolLM3-3B and GLM-4.5-Air cut to 3 layers, and a Qwen3-VL-8B LoRA step with images (bench/shapes.py
says where each size came from). Train rows: one warm-up step and 2 timed steps.

Random-init checkpoints (bench/make_checkpoint.py, vision_bench.py make; bf16) are "prep" items written once under
--ckpt-dir (default /tmp/ckpt, as bench/gpu_session.sh: a checkpoint already there is reused), each through a
temporary folder renamed when complete, so a killed write leaves nothing that looks whole. The rows that need one
wait for it; a row whose checkpoint failed is reported failed without running. The checkpoints together outgrow a
64 GiB disk, so each is written only when its size (Item.disk) fits the free disk; when it does not, checkpoints
no row left needs are removed first (a later stage then writes its own again).

Every item runs in its own subprocess with its own timeout (and the stage's --budget, 480 s by default on a GPU:
an item is started only while enough of it is left), so one failure, hang or OOM never stops the others. Up to
--jobs items run at once (5 on a GPU, 1 on the CPU), each started only while the device memory it is expected
to take (Item.gib, a rough peak) fits beside the running ones in the card's free memory (nvidia-smi); concurrent
rows share the GPU, so their tokens/s are indicative only (each line's "overlapped" names the rows that ran beside
it). One JSON line per row (and per prep item, "prep": true) in --out as each ends: name, ran, error (the last
line of the error when it failed), tokens_per_s, peak_gib (jax's peak_bytes_in_use of that process), seconds
(the subprocess's wall time), measures (what the row measures), command, and the row's own measurements. Each
process's stdout and stderr are kept in --log-dir (default: beside --out, smoke_logs/). The last stdout line is
"smoke: N of M rows ran".

The workers behind three rows (`_export`, `_dpo`, `_generate`) and the atomic checkpoint writer (`_make`) are
subcommands of this file.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import queue
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

TINY_LLAMA = os.path.join(ROOT, "unsloth_jax", "assets", "tiny-llama")
PY = sys.executable


# ------------------------------------------------------------------------------------------------------ table
@dataclasses.dataclass
class Item:
    """A row (or a prep item: a checkpoint) of the stage: its command, limits and how its output is read."""

    name: str
    measures: str
    argv: list[str]
    timeout: int
    gib: float = 8.0  # rough device memory peak (GiB), for scheduling concurrent items on the card
    needs: tuple[str, ...] = ()  # prep items that must have succeeded first
    prep: bool = False
    read: str = "last"  # how the row's JSON lines become its fields: a key of READERS
    skip_if: str | None = None  # a prep item: the file whose presence means the checkpoint is already there
    disk: float = 0.0  # a prep item: GiB it writes (the folder of skip_if), for scheduling against free disk

    def command(self) -> str:
        return shlex.join(self.argv)


def _bench(script: str, *args) -> list[str]:
    return [PY, os.path.join(ROOT, "bench", script), *map(str, args)]


def _self(*args) -> list[str]:
    return [PY, os.path.abspath(__file__), *map(str, args)]


# Checkpoints: text shapes of bench/shapes.py SHAPES and VL_SHAPES; name -> (tiny twin, device GiB while it is
# written (torch holds the bf16 model on the GPU), disk GiB of its bf16 files).
TEXT_CHECKPOINTS = {"qwen2-1.5b": ("qwen2-tiny", 4, 3), "llama3-8b": ("llama3-tiny", 17, 15),
                    "llama-0.5b-tok2k": (None, 2, 1), "qwen3.5-9b": ("qwen3.5-tiny", 18, 17),
                    "smollm3-3b": ("smollm3-tiny", 7, 6), "glm4.5-air-3l": ("glm4.5-tiny", 13, 12),
                    "gemma4-e2b": ("gemma4-tiny", 11, 10)}
VISION_CHECKPOINTS = {("qwen2_5_vl", "7b"): ("tiny", 18, 16), ("gemma3", "4b"): ("tiny", 10, 8),
                      ("qwen3_vl", "8b"): ("tiny", 18, 17)}
# issue 46's checkpoints, written after the others (their rows come last)
LATE_CHECKPOINTS = ("qwen3.5-9b", "smollm3-3b", "glm4.5-air-3l", ("qwen3_vl", "8b"))
DISK_MARGIN_GIB = 4.0  # kept free beside a checkpoint being written (logs, compilation caches)


def items(tiny: bool, ck: str) -> list[Item]:
    """The stage's items in start order: checkpoints first (the fast, most used one first; issue 46's last), then
    the rows, longest first (the scheduler starts the first item whose checkpoints are ready and whose memory and
    disk fit)."""
    steps = ["--steps", 3, "--warmup", 1]  # one warm-up step, 2 timed
    out: list[Item] = []
    # ------------------------------------------------------------------ checkpoints (bf16, written once, reused)
    text = {}

    def text_checkpoint(name: str) -> None:
        tiny_name, gib, disk = TEXT_CHECKPOINTS[name]
        shape = tiny_name if tiny else name
        if shape is None:  # the export row at tiny shape: the bundled tiny-llama (it has a tokenizer)
            text[name] = TINY_LLAMA
            return
        path = os.path.join(ck, shape)
        text[name] = path
        out.append(Item(f"checkpoint_{shape}", f"random-init bf16 checkpoint of {shape} (bench/make_checkpoint.py)",
                        _self("_make", "text", shape, path), timeout=240, gib=1 if tiny else gib, prep=True,
                        skip_if=os.path.join(path, "config.json"), disk=0.0 if tiny else disk))

    vision = {}

    def vision_checkpoint(key: tuple[str, str]) -> None:
        (family, shape), (tiny_shape, gib, disk) = key, VISION_CHECKPOINTS[key]
        s = tiny_shape if tiny else shape
        path = os.path.join(ck, f"{family}-{s}")
        vision[family] = (s, path)
        out.append(Item(f"checkpoint_{family}-{s}", f"random-init bf16 checkpoint of {family} {s} "
                        "(bench/vision_bench.py make)", _self("_make", "vision", f"{family}:{s}", path), timeout=300,
                        gib=1 if tiny else gib, prep=True, skip_if=os.path.join(path, "config.json"),
                        disk=0.0 if tiny else disk))

    for key in (*TEXT_CHECKPOINTS, *VISION_CHECKPOINTS):
        if key not in LATE_CHECKPOINTS:
            (text_checkpoint if key in TEXT_CHECKPOINTS else vision_checkpoint)(key)
    for key in LATE_CHECKPOINTS:
        (text_checkpoint if key in TEXT_CHECKPOINTS else vision_checkpoint)(key)
    q15, l8, exp = text["qwen2-1.5b"], text["llama3-8b"], text["llama-0.5b-tok2k"]
    need = {path: "checkpoint_" + os.path.basename(path) for path in text.values() if path != TINY_LLAMA}
    batch, seq = (2, 128) if tiny else (4, 2048)
    # ----------------------------------------------------------------------------------------------- rows
    for family, label in (("qwen2_5_vl", "vision_qwen2_5_vl_7b"), ("gemma3", "vision_gemma3_4b")):
        s, path = vision[family]
        vb, vs = (1, 128) if tiny else (2, 2048)
        out.append(Item(label, f"vision-language LoRA step with images ({family} {s}, {vb} x {vs}, 2 images a "
                        "row, both towers adapted; bench/vision_bench.py run --side ours): tokens/s",
                        _bench("vision_bench.py", "run", "--side", "ours", "--family", family, "--shape", s,
                               "--checkpoint", path, "--batch", vb, "--seq", vs, *steps),
                        timeout=300, gib=2 if tiny else {"qwen2_5_vl": 30, "gemma3": 18}[family],
                        needs=(f"checkpoint_{family}-{s}",), read="vision"))
    out.append(Item("qlora_llama3_8b", "QLoRA (NF4 base) train step, Llama-3-8B shape, 2 x 2048, remat unsloth: "
                    "tokens/s", _bench("train_bench.py", l8, "--batch", 2, "--seq", 128 if tiny else 2048,
                                       "--remat", "unsloth", "--load-in-4bit", *steps),
                    timeout=300, gib=2 if tiny else 14, needs=(need[l8],)))
    long_seq = 1024 if tiny else 32768
    out.append(Item("long_context_32k", f"LoRA train step of one {long_seq}-token row, Qwen2-1.5B shape, remat "
                    "unsloth (train_bench --batch 1): tokens/s", _bench("train_bench.py", q15, "--batch", 1, "--seq",
                                                                        long_seq, "--remat", "unsloth", *steps),
                    timeout=300, gib=2 if tiny else 20, needs=(need[q15],)))
    out.append(Item("lora_qwen2_1.5b", f"LoRA r=16 train step, Qwen2-1.5B shape, {batch} x {seq}, remat unsloth: "
                    "tokens/s", _bench("train_bench.py", q15, "--batch", batch, "--seq", seq, "--remat", "unsloth",
                                       *steps), timeout=240, gib=2 if tiny else 10, needs=(need[q15],)))
    out.append(Item("qlora_qwen2_1.5b", f"QLoRA (load_in_4bit) train step, Qwen2-1.5B shape, {batch} x {seq}: "
                    "tokens/s", _bench("train_bench.py", q15, "--batch", batch, "--seq", seq, "--remat", "unsloth",
                                       "--load-in-4bit", *steps), timeout=240, gib=2 if tiny else 8,
                    needs=(need[q15],)))
    gen_new = 16 if tiny else 64
    out.append(Item("grpo_qwen2_1.5b", f"GRPO steps (2 prompts x 4 generations x {gen_new} tokens, in-process "
                    "generation + update; bench/grpo_bench.py): train tokens/s, generated tokens/s",
                    _bench("grpo_bench.py", q15, "--prompts", 2, "--generations", 4, "--completion", gen_new,
                           "--prompt-len", 16 if tiny else 64, *steps, "--no-sft-step"),
                    timeout=300, gib=2 if tiny else 10, needs=(need[q15],), read="grpo"))
    out.append(Item("dpo_qwen2_1.5b", "DPO step (public DPOTrainer, sigmoid loss, 2 pairs of "
                    f"{64 if tiny else 1024} tokens, the reference pass included): tokens/s (2 rows a pair)",
                    _self("_dpo", q15, "--prompt-len", 16 if tiny else 256, "--completion-len", 48 if tiny else 768,
                          *steps), timeout=300, gib=2 if tiny else 12, needs=(need[q15],)))
    out.append(Item("fast_generate_16", f"model.fast_generate, 16 rows of 64-token prompts, {gen_new * 2} new tokens "
                    "each (sampled, ignore_eos), LoRA on: tokens/s", _self("_generate", q15, "--rows", 16,
                                                                           "--prompt-len", 16 if tiny else 64,
                                                                           "--new", gen_new * 2),
                    timeout=240, gib=2 if tiny else 8, needs=(need[q15],)))
    # issue 46's families: a LoRA r=16 step each at 4 x 2048 (train_bench: the seven attention / MLP projections,
    # remat unsloth), after the rows above so that those keep the stage's budget first
    q35, smol, glm = text["qwen3.5-9b"], text["smollm3-3b"], text["glm4.5-air-3l"]
    out.append(Item("lora_qwen3_5_9b", f"LoRA r=16 train step, Qwen3.5-9B text shape (24 gated DeltaNet + 8 gated "
                    f"attention layers), {batch} x {seq}, remat unsloth: tokens/s",
                    _bench("train_bench.py", q35, "--batch", batch, "--seq", seq, "--remat", "unsloth", *steps),
                    timeout=300, gib=2 if tiny else 36, needs=(need[q35],)))
    out.append(Item("lora_smollm3_3b", f"LoRA r=16 train step, SmolLM3-3B shape (every 4th layer NoPE), {batch} x "
                    f"{seq}, remat unsloth: tokens/s",
                    _bench("train_bench.py", smol, "--batch", batch, "--seq", seq, "--remat", "unsloth", *steps),
                    timeout=240, gib=2 if tiny else 14, needs=(need[smol],)))
    out.append(Item("lora_glm4_5_air_3l", f"LoRA r=16 train step (attention and the dense layer's MLP; routed and "
                    f"shared experts frozen), GLM-4.5-Air shape cut to 3 of 46 layers (1 dense + 2 MoE, 128 experts top 8; "
                    f"about 13 GB of bf16 weights: the cut aims the row at about 20 GB), {batch} x {seq}, remat unsloth: "
                    "tokens/s", _bench("train_bench.py", glm, "--batch", batch, "--seq", seq, "--remat", "unsloth",
                                       *steps), timeout=300, gib=2 if tiny else 22, needs=(need[glm],)))
    g4 = text["gemma4-e2b"]
    out.append(Item("lora_gemma4_e2b", f"LoRA r=16 train step, Gemma 4 E2B text shape (global_head_dim 512 on the full "
                    f"layers, 20 KV-shared layers with the double-wide MLP, per-layer inputs), {batch} x {seq}, remat "
                    "unsloth: tokens/s",
                    _bench("train_bench.py", g4, "--batch", batch, "--seq", seq, "--remat", "unsloth", *steps),
                    timeout=300, gib=2 if tiny else 30, needs=(need[g4],)))
    s, path = vision["qwen3_vl"]
    vb, vs = (1, 128) if tiny else (2, 2048)
    out.append(Item("vision_qwen3_vl_8b", f"vision-language LoRA step with images (qwen3_vl {s}, {vb} x {vs}, 2 "
                    "images a row, DeepStack, both towers adapted; bench/vision_bench.py run --side ours): tokens/s",
                    _bench("vision_bench.py", "run", "--side", "ours", "--family", "qwen3_vl", "--shape", s,
                           "--checkpoint", path, "--batch", vb, "--seq", vs, *steps),
                    timeout=300, gib=2 if tiny else 30, needs=(f"checkpoint_qwen3_vl-{s}",), read="vision"))
    exp_needs = () if tiny else ("checkpoint_llama-0.5b-tok2k",)
    out.append(Item("export_merged_gguf", "save_pretrained_merged (16-bit) + save_pretrained_gguf q8_0 after a LoRA "
                    "init with B != 0; transformers loads the merged folder and its logits match ours; gguf.GGUFReader "
                    "reads the file: seconds of each", _self("_export", exp, "--tokenizer-from", TINY_LLAMA),
                    timeout=300, gib=1 if tiny else 4, needs=exp_needs, read="export"))
    return out


# ----------------------------------------------------------------------------------------------- readers
def _read_last(lines: list[dict]) -> dict:
    return dict(lines[-1])


def _read_vision(lines: list[dict]) -> dict:
    line = dict(lines[-1])
    if "error" in line:
        raise RuntimeError(line["error"])
    if not line.get("losses_finite", False):
        raise RuntimeError(f"non-finite loss: {line.get('loss_first')} .. {line.get('loss_last')}")
    return line


def _read_grpo(lines: list[dict]) -> dict:
    by = {line.get("name"): line for line in lines}
    if "grpo_train" not in by:
        raise RuntimeError("no grpo_train line")
    out = dict(by["grpo_train"])
    out["tokens_per_s"] = out.get("train_tokens_per_s")
    gen = by.get("grpo_generate", {})
    out["generated_tokens_per_s"] = gen.get("generated_tokens_per_s")
    out["generation_s"] = gen.get("generation_s")
    return out


def _read_export(lines: list[dict]) -> dict:
    line = dict(lines[-1])
    if not line.get("checks_passed"):
        raise RuntimeError(f"export checks failed: {line.get('failed')}")
    return line


READERS = {"last": _read_last, "vision": _read_vision, "grpo": _read_grpo, "export": _read_export}
# long lists and per-op tables that make a row line hard to read; the logs keep them
DROP = ("impls", "step_ms_all", "in_use_gib_by_step", "peak_gib_by_step", "train_s_all", "generation_s_all", "chosen",
        "xla_flags", "optimizer_state_dtypes")


# ----------------------------------------------------------------------------------------------- running
def error_line(text: str) -> str:
    """The last line of an error in a process's output: the last "SomethingError: ..." / "...Exception: ..." line
    (a traceback's end), else the last non-empty line."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if re.match(r"^[\w.]*(Error|Exception|Exit|Interrupt)\b", ln):
            return ln[:500]
    return lines[-1][:500] if lines else ""


def run_item(item: Item, timeout: float, log_dir: str, env: dict) -> dict:
    """Run one item's command in its own process group with `timeout`; its record (module docstring)."""
    rec = {"name": item.name, "ran": False, "error": None, "tokens_per_s": None, "peak_gib": None, "seconds": None,
           "measures": item.measures, "command": item.command()}
    if item.prep:
        rec["prep"] = True
        if item.skip_if and os.path.exists(item.skip_if):
            rec.update(ran=True, seconds=0.0, cached=True)
            return rec
    out_path, err_path = (os.path.join(log_dir, f"{item.name}.{k}.txt") for k in ("out", "err"))
    t0 = time.time()
    with open(out_path, "w") as fo, open(err_path, "w") as fe:
        proc = subprocess.Popen(item.argv, stdout=fo, stderr=fe, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)  # the group this item's process leads (its children too)
            rc = proc.wait()
            timed_out = True
    rec["seconds"] = round(time.time() - t0, 1)
    stdout, stderr = (open(p, errors="replace").read() for p in (out_path, err_path))
    lines = []
    for ln in stdout.splitlines():
        if ln.startswith("{"):
            try:
                lines.append(json.loads(ln))
            except ValueError:
                pass
    if timed_out:
        rec["error"] = f"timed out after {timeout:.0f} s; last output: {error_line(stderr or stdout)}"
        return rec
    if rc != 0:
        rec["error"] = error_line(stderr) or f"exit status {rc}"
        if lines and "error" in lines[-1]:
            rec["error"] = str(lines[-1]["error"])[:500]
        rec["exit_status"] = rc
        return rec
    if item.prep:
        rec["ran"] = True
        return rec
    if not lines:
        rec["error"] = f"no JSON line on stdout; stderr: {error_line(stderr)}"
        return rec
    try:
        fields = READERS[item.read](lines)
    except Exception as e:  # noqa: BLE001 - a row's own check failed: reported, never raised
        rec["error"] = f"{type(e).__name__}: {e}"[:500]
        return rec
    for k in DROP:
        fields.pop(k, None)
    fields.pop("name", None)
    for k in ("tokens_per_s", "peak_gib"):
        if k in fields:
            rec[k] = fields.pop(k)
    rec["ran"] = True
    rec["result"] = fields
    return rec


def gpu_free_gib() -> float | None:
    """Free memory of GPU 0 (nvidia-smi), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        return float(out.stdout.split()[0]) / 1024 if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, ValueError, IndexError, subprocess.TimeoutExpired):
        return None


def run_stage(chosen: list[Item], *, jobs: int, budget: float, mem_gib: float, log_dir: str, out_file,
              env: dict, disk_free=None) -> list[dict]:
    """Run the items: up to `jobs` at once, in order as their checkpoints are ready and their memory fits, none
    started once less than 20 s of the `budget` is left. With `disk_free` (a function: GiB free where the
    checkpoints go), a checkpoint is started only when its Item.disk fits beside the ones being written, with
    DISK_MARGIN_GIB to spare; when it does not, written checkpoints that no pending or running row needs are
    removed, and failing that it waits for rows to end (it fails when nothing is left running). Records in
    finishing order (each written to out_file)."""
    t_start = time.time()
    deadline = t_start + budget
    pending = list(chosen)
    running: dict[str, Item] = {}
    status: dict[str, bool] = {}  # name -> ran
    spans: dict[str, tuple[float, float]] = {}
    records: list[dict] = []
    done: queue.Queue = queue.Queue()

    def emit(rec: dict) -> None:
        records.append(rec)
        status[rec["name"]] = rec["ran"]
        if out_file is not None:
            out_file.write(json.dumps(rec) + "\n")
            out_file.flush()
        what = (f"ran, {rec['tokens_per_s']} tokens/s, peak {rec['peak_gib']} GiB" if rec["ran"] and not rec.get("prep")
                else "cached" if rec.get("cached") else "ok" if rec["ran"] else f"FAILED: {rec['error']}")
        print(f"== {time.time() - t_start:6.1f}s {rec['name']}: {what} ({rec['seconds']} s)", flush=True)

    def disk_short(item: Item) -> float:
        """GiB missing on the disk to write `item` now (0 when it fits, needs nothing or is already there)."""
        if disk_free is None or not item.disk or (item.skip_if and os.path.exists(item.skip_if)):
            return 0.0
        writing = sum(i.disk for i in running.values() if i.prep)
        return max(0.0, item.disk + DISK_MARGIN_GIB + writing - disk_free())

    def remove_unneeded(short: float) -> None:
        """Remove written checkpoints no pending or running item needs, in start order, until `short` GiB are freed;
        none when all of them together (by Item.disk) would not free that much."""
        wanted = {n for i in (*pending, *running.values()) for n in i.needs}
        spare = [p for p in chosen if p.prep and p.skip_if and status.get(p.name) and p.name not in wanted
                 and os.path.isdir(os.path.dirname(p.skip_if))]
        if sum(p.disk for p in spare) < short:
            return
        for prep in spare:
            if short <= 0:
                return
            folder = os.path.dirname(prep.skip_if)
            before = disk_free()
            shutil.rmtree(folder, ignore_errors=True)
            short -= disk_free() - before
            print(f"== {time.time() - t_start:6.1f}s removed {folder} (no row left needs it) for the disk", flush=True)

    def worker(item: Item, timeout: float) -> None:
        t0 = time.time()
        try:
            rec = run_item(item, timeout, log_dir, env)
        except Exception as e:  # noqa: BLE001 - e.g. the command could not start
            rec = {"name": item.name, "ran": False, "error": f"{type(e).__name__}: {e}", "tokens_per_s": None,
                   "peak_gib": None, "seconds": round(time.time() - t0, 1), "measures": item.measures,
                   "command": item.command()}
        done.put((item, rec, t0, time.time()))

    while pending or running:
        used = sum(i.gib for i in running.values())
        blocked: list[Item] = []  # checkpoints waiting for disk this round
        for item in list(pending):
            failed = [n for n in item.needs if status.get(n) is False]
            if failed:
                pending.remove(item)
                emit({"name": item.name, "ran": False, "error": f"not run: {', '.join(failed)} failed",
                      "tokens_per_s": None, "peak_gib": None, "seconds": 0.0, "measures": item.measures,
                      "command": item.command()})
                continue
            if any(n not in status for n in item.needs if n in {i.name for i in chosen}):
                continue  # its checkpoint is not written yet
            left = deadline - time.time()
            if left < 20:
                pending.remove(item)
                emit({"name": item.name, "ran": False, "error": f"not started: the stage's {budget:.0f} s budget "
                      "was spent", "tokens_per_s": None, "peak_gib": None, "seconds": 0.0,
                      "measures": item.measures, "command": item.command()})
                continue
            if len(running) >= jobs or (running and used + item.gib > mem_gib):
                continue
            if disk_short(item) > 0:
                remove_unneeded(disk_short(item))
                if disk_short(item) > 0:
                    blocked.append(item)  # rows still to run may free their checkpoints when they end
                    continue
            pending.remove(item)
            running[item.name] = item
            used += item.gib
            threading.Thread(target=worker, args=(item, min(item.timeout, left)), daemon=True).start()
        if not running:  # nothing left to end and free the disk: the checkpoints still waiting fail
            for item in blocked:
                pending.remove(item)
                emit({"name": item.name, "ran": False, "error": f"not started: {disk_free():.1f} GiB free on the "
                      f"disk, it writes {item.disk:.0f} GiB (+{DISK_MARGIN_GIB:.0f} kept free)", "tokens_per_s": None,
                      "peak_gib": None, "seconds": 0.0, "measures": item.measures, "command": item.command(),
                      "prep": True})
            continue
        try:
            item, rec, t0, t1 = done.get(timeout=1.0)
        except queue.Empty:
            continue
        running.pop(item.name)
        spans[item.name] = (t0, t1)
        emit(rec)
    # which rows shared the device with each (their timings are then indicative only)
    for rec in records:
        span = spans.get(rec["name"])
        if span:
            rec["overlapped"] = sorted(n for n, (a, b) in spans.items()
                                       if n != rec["name"] and a < span[1] - 1 and b > span[0] + 1)
    return records


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in WORKERS:
        return WORKERS[argv[0]](argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (the CPU check)")
    ap.add_argument("--only", help="comma-separated row names (their checkpoints are added)")
    ap.add_argument("--list", action="store_true", help="print the rows and what each measures")
    ap.add_argument("--dry-run", action="store_true", help="print each item's command; run nothing")
    ap.add_argument("--out", help="the JSONL file (appended to); default: stdout only")
    ap.add_argument("--log-dir", help="each process's stdout/stderr (default: smoke_logs/ beside --out, else a "
                                      "temporary folder)")
    ap.add_argument("--ckpt-dir", help="checkpoints (default /tmp/ckpt; --tiny: a temporary folder)")
    ap.add_argument("--jobs", type=int, help="items at once (default 5 with a GPU, else 1)")
    ap.add_argument("--budget", type=float, help="seconds for the whole stage (default 480 with a GPU, else 3000)")
    ap.add_argument("--mem-gib", type=float, help="device memory the running items may take together (default: "
                                                  "0.9 x the GPU's free memory; unlimited without one)")
    a = ap.parse_args(argv)
    ck = a.ckpt_dir or (tempfile.mkdtemp(prefix="smoke-ckpt-") if a.tiny and not (a.list or a.dry_run)
                        else "/tmp/ckpt-tiny" if a.tiny else "/tmp/ckpt")
    table = items(a.tiny, ck)
    if a.only:
        wanted = set(a.only.split(","))
        unknown = wanted - {i.name for i in table}
        if unknown:
            ap.error(f"--only: unknown row(s) {', '.join(sorted(unknown))} (--list shows them)")
        needed = {n for i in table if i.name in wanted for n in i.needs}
        table = [i for i in table if i.name in wanted or i.name in needed]
    if a.list:
        for i in table:
            print(f"{i.name:28s} {'(prep) ' if i.prep else ''}{i.measures}")
        return 0
    if a.dry_run:
        for i in table:
            print(f"{i.name}: {i.command()}")
        return 0
    free = gpu_free_gib()
    jobs = a.jobs or (5 if free else 1)
    budget = a.budget or (480.0 if free else 3000.0)
    mem = a.mem_gib or (0.9 * free if free else float("inf"))
    log_dir = a.log_dir or (os.path.join(os.path.dirname(os.path.abspath(a.out)), "smoke_logs") if a.out
                            else tempfile.mkdtemp(prefix="smoke-logs-"))
    os.makedirs(log_dir, exist_ok=True)
    os.makedirs(ck, exist_ok=True)
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    print(f"smoke: {len(table)} items, jobs {jobs}, budget {budget:.0f} s, memory {mem:.1f} GiB, checkpoints {ck}, "
          f"logs {log_dir}", flush=True)
    out_file = open(a.out, "a") if a.out else None
    try:
        records = run_stage(table, jobs=jobs, budget=budget, mem_gib=mem, log_dir=log_dir, out_file=out_file,
                            env=env, disk_free=lambda: shutil.disk_usage(ck).free / 2**30)
    finally:
        if out_file is not None:
            out_file.close()
    if a.out:  # rewritten with each record's "overlapped" (known only at the end); earlier lines kept
        with open(a.out) as f:
            kept = f.readlines()[:-len(records)] if records else f.readlines()
        with open(a.out, "w") as f:
            f.writelines(kept)
            for rec in records:
                f.write(json.dumps(rec) + "\n")
    else:
        for rec in records:
            print(json.dumps(rec))
    rows = [r for r in records if not r.get("prep")]
    preps = [r for r in records if r.get("prep")]
    ran = sum(r["ran"] for r in rows)
    failed = [r["name"] for r in rows if not r["ran"]]
    print(f"smoke: {ran} of {len(rows)} rows ran (checkpoints {sum(r['ran'] for r in preps)} of {len(preps)} ready)"
          + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 0 if ran == len(rows) else 1


# ----------------------------------------------------------------------------------------------- workers
def peak_gib() -> float | None:
    import jax

    stats = jax.devices()[0].memory_stats()
    return round(stats.get("peak_bytes_in_use", 0) / 2**30, 3) if stats else None


def device_kind() -> str:
    import jax

    return jax.devices()[0].device_kind


def _make(argv: list[str]) -> int:
    """_make text SHAPE DIR | _make vision FAMILY:SHAPE DIR: the checkpoint written to DIR.partial, then renamed."""
    kind, shape, out = argv
    if os.path.isfile(os.path.join(out, "config.json")):
        return 0
    tmp = out.rstrip("/") + ".partial"
    shutil.rmtree(tmp, ignore_errors=True)
    if kind == "text":
        from bench import make_checkpoint

        make_checkpoint.main(shape, tmp)
    else:
        from bench import vision_bench

        family, s = shape.split(":")
        vision_bench.make_checkpoint(family, s, tmp)
    shutil.rmtree(out, ignore_errors=True)  # a folder without config.json: an old partial write
    os.rename(tmp, out)
    return 0


def _steps_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16")


def _dpo(argv: list[str]) -> int:
    """_dpo MODEL_DIR: DPOTrainer (sigmoid, beta 0.1, LoRA r=16 all projections, reference = the adapter-free
    model) on 2 random-token pairs of prompt-len + completion-len tokens, batch 2; each step timed (synchronised)."""
    ap = argparse.ArgumentParser(prog="smoke.py _dpo")
    ap.add_argument("model_dir")
    ap.add_argument("--pairs", type=int, default=2)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--completion-len", type=int, default=768)
    _steps_args(ap)
    a = ap.parse_args(argv)
    import jax
    import numpy as np

    from bench.grpo_bench import IdTokenizer
    from unsloth_jax import DPOConfig, DPOTrainer, FastLanguageModel

    length = a.prompt_len + a.completion_len
    t0 = time.time()
    model, _ = FastLanguageModel.from_pretrained(a.model_dir, dtype=a.dtype, load_tokenizer=False,
                                                 max_seq_length=length, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0,
                                             use_gradient_checkpointing="unsloth")
    load_s = time.time() - t0
    cfg = model.config
    eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, (list, tuple)) else (cfg.eos_token_id or 0)
    tok = IdTokenizer(cfg.vocab_size, int(eos))
    rng = np.random.default_rng(0)

    def text(n):
        return " ".join(map(str, rng.integers(4, cfg.vocab_size, n)))

    # a leading space on the completions: "prompt" + " completion" tokenizes as the two parts' ids
    pairs = [{"prompt": text(a.prompt_len), "chosen": " " + text(a.completion_len),
              "rejected": " " + text(a.completion_len)} for _ in range(a.pairs)]

    class TimedDPOTrainer(DPOTrainer):
        def run_step(self, state, batch):
            t = time.perf_counter()
            out = jax.block_until_ready(super().run_step(state, batch))
            step_s.append(time.perf_counter() - t)
            return out

    step_s: list[float] = []
    args = DPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=a.pairs, max_steps=a.steps,
                     beta=0.1, loss_type="sigmoid", max_length=length, logging_steps=1, save_steps=0,
                     learning_rate=1e-5, report_to="none")
    trainer = TimedDPOTrainer(model=model, ref_model=None, processing_class=tok, train_dataset=pairs, args=args)
    result = trainer.train()
    timed = step_s[a.warmup:]
    ms = float(np.median(timed)) * 1e3
    tokens = 2 * a.pairs * length
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    print(json.dumps({"name": "dpo_step", "model_dir": os.path.basename(a.model_dir.rstrip("/")), "pairs": a.pairs,
                      "pair_tokens": length, "step_ms": round(ms, 2), "tokens_per_s": round(tokens / (ms / 1e3), 1),
                      "peak_gib": peak_gib(), "load_s": round(load_s, 1), "first_step_s": round(step_s[0], 2),
                      "steps_timed": len(timed), "step_ms_all": [round(t * 1e3, 1) for t in step_s],
                      "losses": losses, "training_loss": result.training_loss,
                      "losses_finite": bool(np.all(np.isfinite(losses))) if losses else None,
                      "device": device_kind()}), flush=True)
    return 0


def _generate(argv: list[str]) -> int:
    """_generate MODEL_DIR: model.fast_generate on --rows token-id prompts (LoRA r=16 with B random, so the adapter
    is live), sampled at temperature 1, --new tokens each (ignore_eos); one call to compile, then 2 timed."""
    ap = argparse.ArgumentParser(prog="smoke.py _generate")
    ap.add_argument("model_dir")
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from unsloth_jax import FastLanguageModel
    from unsloth_jax.inference import SamplingParams

    model, _ = FastLanguageModel.from_pretrained(a.model_dir, dtype=a.dtype, load_tokenizer=False,
                                                 max_seq_length=a.prompt_len + a.new, progress=False)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0)
    key = jax.random.PRNGKey(1)
    for i, lin in enumerate(model.projections().values()):
        b = lin.lora_b
        b[...] = 0.01 * jax.random.normal(jax.random.fold_in(key, i), b[...].shape, jnp.float32)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, model.config.vocab_size, a.prompt_len).tolist() for _ in range(a.rows)]
    params = SamplingParams(temperature=1.0, top_p=1.0, max_tokens=a.new, ignore_eos=True, seed=0)
    t0 = time.perf_counter()
    model.fast_generate(prompts, params)
    first = time.perf_counter() - t0
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        outs = model.fast_generate(prompts, params)
        times.append(time.perf_counter() - t0)
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    if lengths != [a.new] * a.rows:
        raise RuntimeError(f"fast_generate returned {lengths} tokens per row, not {a.new}")
    wall = float(np.median(times))
    print(json.dumps({"name": "fast_generate", "model_dir": os.path.basename(a.model_dir.rstrip("/")),
                      "rows": a.rows, "prompt_len": a.prompt_len, "new_tokens": a.new,
                      "tokens_per_s": round(a.rows * a.new / wall, 1), "wall_s": round(wall, 3),
                      "first_call_s": round(first, 2), "peak_gib": peak_gib(), "device": device_kind()}), flush=True)
    return 0


def _export(argv: list[str]) -> int:
    """_export MODEL_DIR [--tokenizer-from DIR]: LoRA r=16 (B random), save_pretrained_merged (merged_16bit) and
    save_pretrained_gguf (q8_0) into a temporary folder; then transformers loads the merged folder (float32, CPU)
    and its logits on a few tokens are compared with ours (the merged model), and gguf.GGUFReader reads the file
    (architecture, tensor count, a q8_0 tensor). One JSON line; checks_passed false names what failed."""
    ap = argparse.ArgumentParser(prog="smoke.py _export")
    ap.add_argument("model_dir")
    ap.add_argument("--tokenizer-from", help="the tokenizer's folder when MODEL_DIR has none")
    ap.add_argument("--quantization", default="q8_0")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args(argv)
    import jax
    import jax.numpy as jnp
    import numpy as np

    from unsloth_jax import FastLanguageModel

    t0 = time.time()
    model, tokenizer = FastLanguageModel.from_pretrained(a.model_dir, dtype=a.dtype, progress=False)
    if tokenizer is None:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(a.tokenizer_from)
    model = FastLanguageModel.get_peft_model(model, r=16, lora_alpha=16, lora_dropout=0.0)
    key = jax.random.PRNGKey(1)
    for i, lin in enumerate(model.projections().values()):
        b = lin.lora_b
        b[...] = 0.02 * jax.random.normal(jax.random.fold_in(key, i), b[...].shape, jnp.float32)
    load_s = time.time() - t0
    work = tempfile.mkdtemp(prefix="smoke-export-")
    failed = []
    rec: dict = {"name": "export", "model_dir": os.path.basename(a.model_dir.rstrip("/")),
                 "quantization": a.quantization, "load_s": round(load_s, 1)}
    try:
        merged = os.path.join(work, "merged")
        t = time.time()
        model.save_pretrained_merged(merged, tokenizer, save_method="merged_16bit")
        rec["merged_s"] = round(time.time() - t, 1)
        rec["merged_gib"] = round(sum(os.path.getsize(os.path.join(merged, f)) for f in os.listdir(merged))
                                  / 2**30, 3)
        t = time.time()
        path = model.save_pretrained_gguf(os.path.join(work, "gguf"), tokenizer, quantization_method=a.quantization)
        rec["gguf_s"] = round(time.time() - t, 1)
        rec["gguf_gib"] = round(os.path.getsize(path) / 2**30, 3)
        rec["peak_gib"] = peak_gib()
        # transformers reads the merged folder; its logits against ours on 8 tokens
        t = time.time()
        import torch
        import transformers

        hf = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
        ids = np.random.default_rng(0).integers(4, model.config.vocab_size, (1, 8))
        with torch.no_grad():
            ref = hf(torch.as_tensor(ids)).logits.float().numpy()
        ours = np.asarray(model(jnp.asarray(ids, jnp.int32)), np.float32)
        rec["hf_load_s"] = round(time.time() - t, 1)
        rec["hf_params"] = int(sum(p.numel() for p in hf.parameters()))
        rel = float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-12))
        rec["merged_logits_rel_err"] = round(rel, 5)
        rec["merged_top1_agree"] = round(float(np.mean(ours.argmax(-1) == ref.argmax(-1))), 3)
        # ours runs in bf16 (unmerged LoRA), transformers in float32 on bf16-rounded merged weights: random-init
        # stacks differ by a few percent; a misplaced or unmerged tensor gives O(1)
        if not rel < 0.5:
            failed.append(f"merged logits differ from ours: relative error {rel:.3g}")
        # the gguf package reads the file
        import gguf

        t = time.time()
        reader = gguf.GGUFReader(path)
        arch = reader.fields["general.architecture"]
        rec["gguf_arch"] = (arch.contents() if hasattr(arch, "contents")
                            else bytes(arch.parts[arch.data[0]]).decode())
        rec["gguf_tensors"] = len(reader.tensors)
        rec["gguf_types"] = sorted({t_.tensor_type.name for t_ in reader.tensors})
        rec["gguf_read_s"] = round(time.time() - t, 1)
        expected = a.quantization.upper()
        if expected not in rec["gguf_types"]:
            failed.append(f"no {expected} tensor in the GGUF file ({rec['gguf_types']})")
        if rec["gguf_tensors"] < 2 + 9 * model.config.num_hidden_layers:
            failed.append(f"{rec['gguf_tensors']} tensors in the GGUF file")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rec.update(checks_passed=not failed, failed=failed, device=device_kind(), tokens_per_s=None)
    print(json.dumps(rec), flush=True)
    return 0


WORKERS = {"_make": _make, "_dpo": _dpo, "_generate": _generate, "_export": _export}


if __name__ == "__main__":
    sys.exit(main())
