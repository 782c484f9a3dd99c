"""`unsloth-jax`: fine-tune, chat with and export models from the command line.

    unsloth-jax train --preset tiny        # LoRA fine-tune the bundled tiny model on the bundled alpaca sample
    unsloth-jax train --preset tiny-vision # the bundled tiny Gemma 3 vision-language model on the bundled images
    unsloth-jax generate --model_name outputs/adapter --prompt "What day was Ada Jaxon born?"
    unsloth-jax generate --model_name outputs/adapter            # interactive
    unsloth-jax generate --model_name outputs/tiny-vision/adapter --image picture.png --prompt "Describe the shape."
    unsloth-jax export --model_name outputs/adapter --save_method merged_16bit --save_gguf --quantization q8_0
    unsloth-jax doctor [--json]
    unsloth-jax --version

`train` takes the flags of Unsloth's unsloth-cli.py (--model_name, --dataset, --r, --lora_alpha, ...) with its
defaults (learning rate 2e-4, LoRA r=16 alpha=16, batch 2 x 4 accumulation, 400 steps, report to TensorBoard),
which suit real models. --model_name and --dataset default to the bundled tiny Llama (unsloth_jax/assets/tiny-llama)
and unsloth_jax/assets/alpaca_sample.jsonl; `--preset tiny` sets the toy's own hyperparameters (PRESETS), which
teach it the sample's facts in a minute or two on a laptop CPU. The adapter is saved to outputs/adapter. Problems
a user can fix (a bad dataset line, a missing model directory, a bad flag value, an output path that cannot be
written, a reused --output_dir) print one message and exit with code 2, flag values and output paths before any
model or data is loaded.

A --model_name whose config.json is a Gemma 3 vision-language model (model_type "gemma3" with a vision_config)
trains as docs/VISION.md describes: FastVisionModel, UnslothVisionDataCollator and a .jsonl of chat records
whose `images` are file paths relative to it (unsloth_jax.data.vision_loader.load_vision_records); `generate`
answers with such a model or adapter, given pictures by --image (repeatable).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_MODEL = ASSETS / "tiny-llama"
DEFAULT_DATASET = ASSETS / "alpaca_sample.jsonl"
VISION_MODEL = ASSETS / "tiny-gemma3-vl"
VISION_DATASET = ASSETS / "shapes_sample" / "shapes_sample.jsonl"
TRAINING_INFO = "unsloth_jax_training.json"  # written next to a saved adapter: how it was trained
PROMPT_FORMATS = ("auto", "alpaca", "chat", "raw")
# Named sets of `train` defaults; explicit flags still win. The bundled tiny model (4 layers, hidden size 128)
# needs a learning rate and LoRA scale about 10x what suits a real model, and many passes over the 120 samples.
PRESETS = {
    "tiny": {"learning_rate": 2e-3, "lora_alpha": 64, "max_steps": 600, "per_device_train_batch_size": 4,
             "gradient_accumulation_steps": 1, "logging_steps": 10},
    # the bundled random Gemma 3 vision-language model on the bundled shapes: halves the loss in 30 steps
    "tiny-vision": {"model_name": str(VISION_MODEL), "dataset": str(VISION_DATASET), "dtype": "float32",
                    "learning_rate": 1e-2, "lora_alpha": 32, "max_steps": 30, "warmup_steps": 3,
                    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1, "logging_steps": 1,
                    "use_gradient_checkpointing": False, "max_seq_length": 128,
                    "output_dir": "outputs/tiny-vision"},  # beside, not over, a `--preset tiny` run's outputs/
}

log = logging.getLogger("unsloth_jax")


class UsageError(Exception):
    """A problem with the command line the user can fix (exit code 2)."""


def _as_flags(message: str) -> str:
    """A library message (TrainingArguments, dataset checks) with `train`'s flags for the Python argument names
    in it: `name=True` of a switch becomes `--name`, a name with an underscore `--name`, and a message that starts
    with an argument's name gets `--` (formatting_func, which has no flag, is dropped)."""
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["train"]
    flags = {a.dest: a for a in sub._actions if a.option_strings and a.dest != "help"}
    message = message.replace("formatting_func / dataset_text_field", "dataset_text_field")
    for dest, action in flags.items():
        if "_" not in dest:
            continue
        name = rf"(?<![-\w./'\"]){dest}(?![\w/])"
        if isinstance(action, (argparse._StoreTrueAction, argparse.BooleanOptionalAction)):
            message = re.sub(name + r"=True\b", f"--{dest}", message)
        message = re.sub(name, f"--{dest}", message)
    first = message.split(" ", 1)[0]
    return f"--{message}" if first in flags else message


# ------------------------------------------------------------------------------------------------- parsing
def _bool_or_str(value: str):
    low = value.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no", "none"):
        return False
    return value


def _resume_value(value: str):
    """--resume_from_checkpoint: true (the newest checkpoint in --output_dir), false/none, or a path."""
    low = value.strip().lower()
    if low in ("true", "1", "yes"):
        return True
    if low in ("false", "0", "no", "none", ""):
        return None
    return value


def _dtype(value: str):
    return None if value.strip().lower() in ("none", "auto", "") else value


def _add_train_args(p: argparse.ArgumentParser) -> None:
    from unsloth_jax.train.optim import OPTIMIZERS, SCHEDULERS

    m = p.add_argument_group("model")
    m.add_argument("--model_name", default=str(DEFAULT_MODEL),
                   help="local Hugging Face model directory or llama.cpp .gguf file; the default is the bundled "
                        "tiny Llama")
    m.add_argument("--dataset", default=str(DEFAULT_DATASET),
                   help="a .jsonl/.json file or a directory of .jsonl files (text, alpaca, sharegpt or chatml records); "
                        "the default is the bundled alpaca sample")
    m.add_argument("--max_seq_length", type=int, default=2048, help="longest training sequence in tokens")
    m.add_argument("--dtype", type=_dtype, default=None,
                   help="bfloat16, float16 or float32; None: bfloat16 where supported, else float32")
    m.add_argument("--load_in_4bit", action="store_true", help="QLoRA: keep the frozen base weights in NF4")
    m.add_argument("--dataset_text_field", default="text", help="field of plain-text records")
    m.add_argument("--skip_bad_lines", action="store_true",
                   help="skip malformed dataset lines (counted and reported) instead of stopping")

    lo = p.add_argument_group("LoRA")
    lo.add_argument("--r", type=int, default=16, help="LoRA rank")
    lo.add_argument("--lora_alpha", type=float, default=16, help="LoRA alpha (scale = alpha / r)")
    lo.add_argument("--lora_dropout", type=float, default=0.0, help="accepted for compatibility; 0 is used")
    lo.add_argument("--bias", default="none", choices=("none", "all", "lora_only"), help="which biases train")
    lo.add_argument("--use_gradient_checkpointing", type=_bool_or_str, default="unsloth",
                    help='"unsloth" (offload checkpointed activations to the host on GPUs), true (recompute each '
                         'layer), "offload_attention" (as "unsloth", also offloading the attention output and '
                         'softmax statistics: no attention forward in the backward pass; long sequences), '
                         '"save_attention" (as true, keeping q, k, v and the attention output), false; layer-stack '
                         'settings may follow after commas: "unsloth,layer_loop=unrolled" '
                         '(unsloth_jax.models.layer_stack)')
    lo.add_argument("--layers_per_checkpoint", type=int, default=1,
                    help="keep only every K-th layer input across the stack and recompute K layers at a time in "
                         "the backward pass (long sequences: L/K + K layer inputs kept instead of L); 1: per layer")
    lo.add_argument("--random_state", type=int, default=3407, help="seed of the LoRA initialisation")
    lo.add_argument("--use_rslora", action="store_true", help="rank-stabilised LoRA (scale = alpha / sqrt(r))")
    lo.add_argument("--train_on_responses_only", action=argparse.BooleanOptionalAction, default=None,
                    help="compute the loss on responses only; None: yes for alpaca and chat data")

    t = p.add_argument_group("training")
    t.add_argument("--preset", default=None, choices=tuple(PRESETS),
                   help="named defaults for the flags below and --lora_alpha; explicit flags still win. tiny: "
                        + " ".join(f"--{k} {v:g}" for k, v in PRESETS["tiny"].items())
                        + " (the bundled tiny model: learns the sample's facts in a minute or two on a CPU). "
                        "tiny-vision: the bundled tiny Gemma 3 vision-language model and image sample, "
                        "30 steps (well under a minute on a CPU)")
    t.add_argument("--per_device_train_batch_size", type=int, default=2, help="rows per micro-batch (per device)")
    t.add_argument("--gradient_accumulation_steps", type=int, default=4,
                   help="micro-batches per optimizer step")
    t.add_argument("--warmup_steps", type=int, default=5, help="steps of linear learning-rate warmup")
    t.add_argument("--max_steps", type=int, default=400, help="optimizer steps (-1: use --num_train_epochs)")
    t.add_argument("--num_train_epochs", type=float, default=1.0, help="used when --max_steps is -1")
    t.add_argument("--learning_rate", type=float, default=2e-4, help="peak learning rate")
    t.add_argument("--logging_steps", type=int, default=1, help="log the loss every N steps")
    t.add_argument("--optim", default="adamw_8bit", choices=OPTIMIZERS, help="optimizer")
    t.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay")
    t.add_argument("--lr_scheduler_type", default="linear", choices=SCHEDULERS, help="learning-rate schedule")
    t.add_argument("--seed", type=int, default=3407, help="seed of the data order")
    t.add_argument("--output_dir", default="outputs", help="metrics.jsonl, checkpoints and saved models go here")
    t.add_argument("--save_steps", type=int, default=0, help="write a resumable checkpoint every N steps (0: never)")
    t.add_argument("--save_total_limit", type=int, default=None,
                   help="keep only the N newest checkpoints in OUTPUT_DIR (older ones are deleted); None: keep all")
    t.add_argument("--overwrite_output_dir", action="store_true",
                   help="replace an earlier run's files in OUTPUT_DIR (metrics.jsonl, checkpoints, runs/, adapter/, "
                        "merged_16bit/, gguf/); without it a reused OUTPUT_DIR is refused")
    t.add_argument("--resume_from_checkpoint", type=_resume_value, default=None,
                   help="continue an interrupted run: a checkpoint-N directory, or true for the newest in OUTPUT_DIR "
                        "(checkpoints are saved every --save_steps steps)")
    t.add_argument("--packing", action="store_true", help="pack several short examples into each row")
    _add_mesh_args(p)

    r = p.add_argument_group("reporting")
    r.add_argument("--report_to", nargs="+", default=["tensorboard"],
                   help="where logs go besides stdout and OUTPUT_DIR/metrics.jsonl: tensorboard, all or none")
    r.add_argument("--logging_dir", default=None,
                   help="TensorBoard event directory; None: OUTPUT_DIR/runs/<datetime>_<hostname>")

    s = p.add_argument_group("saving")
    s.add_argument("--save_model", action=argparse.BooleanOptionalAction, default=True,
                   help="save the result (the adapter goes to OUTPUT_DIR/adapter)")
    s.add_argument("--save_path", default=None,
                   help="where --save_method writes; None: OUTPUT_DIR/adapter or OUTPUT_DIR/merged_16bit")
    s.add_argument("--save_method", default="lora", choices=("lora", "merged_16bit"),
                   help="lora: the PEFT adapter; merged_16bit: also the merged 16-bit model")
    _add_gguf_args(s)


def _mesh_arg(text: str) -> str:
    from unsloth_jax.distributed import parse_mesh

    try:
        parse_mesh(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _add_mesh_args(p: argparse.ArgumentParser) -> None:
    d = p.add_argument_group("several devices and hosts")
    d.add_argument("--mesh", type=_mesh_arg, default=None,
                   help="shard training over a device mesh, e.g. data=8 (data parallel), fsdp=8 (weights split "
                        "over the devices), data=2,fsdp=4; -1 means the rest of the devices. "
                        "--per_device_train_batch_size is per device")
    d.add_argument("--coordinator_address", default=None,
                   help="several hosts: host:port of process 0 (else JAX_COORDINATOR_ADDRESS, or SLURM/Open MPI)")
    d.add_argument("--num_processes", type=int, default=None, help="several hosts: number of processes "
                                                                   "(else JAX_NUM_PROCESSES)")
    d.add_argument("--process_id", type=int, default=None, help="several hosts: this process's index "
                                                                "(else JAX_PROCESS_ID)")


def _start_mesh(args):
    """jax.distributed for several hosts (flags or environment), then the --mesh over every device, or None."""
    from unsloth_jax import distributed

    try:
        distributed.initialize(args.coordinator_address, args.num_processes, args.process_id)
        return distributed.resolve_mesh(args.mesh, "--mesh") if args.mesh else None
    except (ValueError, TypeError) as e:
        raise UsageError(str(e)) from None


def _mesh_summary(mesh) -> str:
    from unsloth_jax import distributed

    return "" if mesh is None else f" | mesh {distributed.describe(mesh)}"


def _add_gguf_args(s) -> None:
    s.add_argument("--save_gguf", action="store_true", help="also write a llama.cpp GGUF file of the merged model")
    s.add_argument("--quantization", nargs="+", default=["q8_0"],
                   help="GGUF quantization method(s), e.g. f16, bf16, q8_0 (several allowed)")
    s.add_argument("--gguf_path", default=None, help="directory of the GGUF file(s); None: 'gguf' next to the adapter")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max_new_tokens", type=int, default=128, help="tokens to generate at most")
    p.add_argument("--temperature", type=float, default=0.0, help="0 decodes greedily; above 0 samples")
    p.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling: keep the smallest set of tokens "
                                                            "whose probability reaches top_p")
    p.add_argument("--seed", type=int, default=0, help="seed of the sampler")


def _version_line() -> str:
    """'unsloth-jax X (jax Y)': jax's version from its installed distribution's metadata."""
    from importlib import metadata

    import unsloth_jax

    try:
        jax_version = metadata.version("jax")
    except metadata.PackageNotFoundError:
        jax_version = "not installed"
    return f"unsloth-jax {unsloth_jax.__version__} (jax {jax_version})"


def build_parser(preset: str | None = None) -> argparse.ArgumentParser:
    """The `unsloth-jax` parser; with `preset`, the train subcommand's defaults are PRESETS[preset]'s."""
    parser = argparse.ArgumentParser(prog="unsloth-jax", description="Fast LoRA/QLoRA fine-tuning in JAX.",
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("-q", "--quiet", action="store_true", help="no per-step lines; only warnings from the library log")
    parser.add_argument("--version", action="version", version=_version_line(),
                        help="print the versions of unsloth-jax and jax, and exit")
    sub = parser.add_subparsers(dest="command", metavar="{train,generate,export,doctor}")
    sub.required = True
    fmt = argparse.ArgumentDefaultsHelpFormatter

    tr = sub.add_parser("train", help="LoRA/QLoRA fine-tune a model on a dataset", formatter_class=fmt)
    _add_train_args(tr)
    if preset is not None:
        tr.set_defaults(**PRESETS[preset])

    ge = sub.add_parser("generate", help="generate text from a model or adapter (interactive without --prompt)",
                        formatter_class=fmt)
    ge.add_argument("--model_name", default="outputs/adapter",
                    help="model directory, saved adapter directory or .gguf file")
    ge.add_argument("--prompt", default=None, help="the prompt (or instruction, for alpaca formatting); omitted: "
                                                   "interactive chat on stdin")
    ge.add_argument("--input", default="", help="alpaca 'input' field for --prompt")
    ge.add_argument("--chat", action="store_true", help="format prompts with the tokenizer's chat template")
    ge.add_argument("--format", default="auto", choices=PROMPT_FORMATS,
                    help="prompt formatting: auto (the format an adapter was trained on: alpaca, chat, or raw for "
                         "text data; otherwise the tokenizer's chat template when it has one, else alpaca), alpaca, "
                         "chat or raw")
    ge.add_argument("--max_seq_length", type=int, default=2048, help="longest prompt + answer in tokens")
    ge.add_argument("--dtype", type=_dtype, default=None,
                    help="bfloat16, float16 or float32; None: bfloat16 where supported, else float32")
    ge.add_argument("--load_in_4bit", action="store_true", help="keep the base weights in NF4")
    ge.add_argument("--image", action="append", default=None, metavar="PATH",
                    help="a picture for a vision-language model (Gemma 3, Qwen2.5-VL) or adapter, put before the "
                         "prompt in the chat message; repeat for several")
    _add_sampling_args(ge)

    ex = sub.add_parser("export", help="export a saved adapter as a merged 16-bit model and/or GGUF",
                        formatter_class=fmt)
    ex.add_argument("--model_name", default="outputs/adapter", help="saved adapter directory")
    ex.add_argument("--save_method", default=None, choices=("merged_16bit", "lora"),
                    help="merged_16bit: write the merged HF checkpoint; lora: re-save the adapter")
    ex.add_argument("--save_path", default=None, help="output directory; None: 'merged_16bit' (or 'adapter_copy') next to "
                                                      "the adapter")
    ex.add_argument("--dtype", type=_dtype, default=None, help="dtype to load; None: bfloat16 where supported, else float32")
    _add_gguf_args(ex)

    do = sub.add_parser("doctor", help="check the installation, devices and Pallas kernels", formatter_class=fmt)
    from unsloth_jax import doctor

    doctor.add_arguments(do)
    for p in (tr, ge, ex):  # -q also works after the subcommand
        p.add_argument("-q", "--quiet", action="store_true", default=argparse.SUPPRESS, help=argparse.SUPPRESS)
    return parser


# ----------------------------------------------------------------------------------------------- helpers
def _setup_logging(quiet: bool) -> None:
    logger = logging.getLogger("unsloth_jax")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.WARNING if quiet else logging.INFO)
    logger.propagate = False  # printed by this handler only, also once a library configures the root logger
    for name in ("unsloth_jax.data",):
        logging.getLogger(name).setLevel(logging.WARNING)


def _records_format(records, text_field: str = "text") -> str:
    """The dominant format of a dataset: alpaca, chat (sharegpt / chatml), prompt_completion (TRL's records,
    whose completion-only loss the tokenizer step already applies) or text (records with `text_field`)."""
    from unsloth_jax.data import detect_format

    kinds = set()
    for rec in records[:200]:
        try:
            kinds.add(detect_format(rec, text_field))
        except Exception:  # noqa: BLE001 - validation reports bad records with their line
            pass
    if kinds == {"alpaca"}:
        return "alpaca"
    if kinds and kinds <= {"sharegpt", "chatml"}:
        return "chat"
    if kinds == {"prompt_completion"}:
        return "prompt_completion"
    return "text" if kinds == {"text"} else "mixed"


def _memory_summary() -> str:
    import jax

    peaks = []
    for dev in jax.local_devices():
        try:
            stats = dev.memory_stats() or {}
        except Exception:  # noqa: BLE001
            stats = {}
        if "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"] / 2**30)
    if len(peaks) > 1:
        return (f"{max(peaks):.2f} GiB peak per device (max of {len(peaks)} local "
                f"{jax.local_devices()[0].device_kind}; min {min(peaks):.2f})")
    if peaks:
        return f"{peaks[0]:.2f} GiB peak on {jax.devices()[0].device_kind}"
    try:
        import resource

        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
        return f"{rss:.2f} GiB peak host RSS"
    except (ImportError, OSError):
        return "unknown"


def _save_training_info(path: Path, info: dict) -> None:
    tmp = path / (TRAINING_INFO + ".tmp")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, path / TRAINING_INFO)


def _read_training_info(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / TRAINING_INFO).read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _export_gguf(model, tokenizer, gguf_dir: Path, methods: list[str]) -> None:
    for q in methods:
        path = model.save_pretrained_gguf(str(gguf_dir), tokenizer, quantization_method=q)
        print(f"unsloth-jax: wrote GGUF ({q}) {path}")


# -------------------------------------------------------------------------------------------- validation
def _hub_id_note(name, dataset: bool = False) -> str:
    """For a missing path that reads as a Hugging Face Hub id ("owner/name"): that ids are not downloaded."""
    text = str(name)
    if re.fullmatch(r"[A-Za-z0-9][\w.-]*/[\w.-]+", text) and not text.endswith((".jsonl", ".json", ".gguf")):
        kind = " --repo-type dataset" if dataset else ""
        return (f"; if {text} is a Hugging Face Hub id: unsloth-jax downloads nothing (no network use), so "
                f"download it first (`huggingface-cli download {text}{kind} --local-dir DIR`) and pass the local "
                f"{'.jsonl/.json file' if dataset else 'folder'}")
    return ""


def _check_model_path(name, hint: str) -> None:
    """UsageError unless `name` is a directory or a llama.cpp .gguf file (what from_pretrained loads)."""
    path = Path(name)
    if not (path.is_dir() or (path.is_file() and path.suffix.lower() == ".gguf")):
        what = "not a model directory or .gguf file" if path.exists() else "model not found"
        raise UsageError(f"{what}: {name} ({hint}){'' if path.exists() else _hub_id_note(name)}")


SAVE_DIRS = ("adapter", "merged_16bit", "gguf")  # what `train` writes under OUTPUT_DIR by default


def _save_targets(args) -> dict[str, tuple[Path, str]]:
    """What `train` saves after training: {"adapter" | "merged_16bit" | "gguf": (directory, the flag naming it)}."""
    out = Path(args.output_dir)
    if not args.save_model:
        return {}
    saved_here = args.save_path and args.save_method == "lora"
    targets = {"adapter": (Path(args.save_path), "--save_path") if saved_here else (out / "adapter", "--output_dir")}
    if args.save_method == "merged_16bit":
        targets["merged_16bit"] = ((Path(args.save_path), "--save_path") if args.save_path else
                                   (out / "merged_16bit", "--output_dir"))
    if args.save_gguf:
        targets["gguf"] = (Path(args.gguf_path), "--gguf_path") if args.gguf_path else (out / "gguf", "--output_dir")
    return targets


def _check_writable(path: Path, flag: str) -> None:
    """UsageError unless `path` is a directory, or one that can be created, that this process may write into."""
    if path.exists() and not path.is_dir():
        raise UsageError(f"{flag}: {path} exists and is not a directory; pass another path")
    probe = path.absolute()
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise UsageError(f"{flag}: {path} cannot be created, {probe} is not a directory; pass another path")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: {path} cannot be written, {probe} is not writable; pass another path")


def _earlier_run_files(args) -> list[Path]:
    """An earlier run's files in --output_dir: the trainer's (metrics.jsonl, checkpoints, runs/) and the saves."""
    from unsloth_jax.train.checkpoints import previous_run_files

    out = Path(args.output_dir)
    return previous_run_files(out) + [out / d for d in SAVE_DIRS if (out / d).exists()]


def _check_output_paths(args) -> None:
    """Everything `train` will write, checked before any model or data is loaded: --output_dir and the save
    directories can be written; a reused --output_dir needs --overwrite_output_dir or --resume_from_checkpoint;
    the checkpoint to resume from exists."""
    from unsloth_jax.train.checkpoints import checkpoints_in

    out = Path(args.output_dir)
    _check_writable(out, "--output_dir")
    for path, flag in _save_targets(args).values():
        _check_writable(path, flag)
    resume = args.resume_from_checkpoint
    if resume is True and not checkpoints_in(out):
        raise UsageError(f"--resume_from_checkpoint true: --output_dir {out} holds no checkpoint (checkpoint-N "
                         "directories are saved every --save_steps steps); pass a checkpoint directory, or drop the "
                         "flag to start a new run")
    if isinstance(resume, str) and not (Path(resume) / "trainer_state.json").is_file():
        raise UsageError(f"--resume_from_checkpoint {resume}: not a checkpoint directory (a checkpoint-N directory "
                         "with trainer_state.json, saved every --save_steps steps); pass one, or true for the newest "
                         "in --output_dir")
    earlier = [] if resume else _earlier_run_files(args)
    if earlier and not args.overwrite_output_dir:
        names = ", ".join(p.name for p in earlier[:6]) + (", ..." if len(earlier) > 6 else "")
        raise UsageError(f"--output_dir {out} holds an earlier run's files ({names}); pass --overwrite_output_dir to "
                         "replace them, --resume_from_checkpoint true to continue that run, or another --output_dir")


def _positive_int(flag: str, value: int) -> None:
    if value < 1:
        raise UsageError(f"{flag} must be a positive integer, got {value}")


def _check_model_flags(args) -> None:
    """The train flags TrainingArguments does not see: LoRA, sequence length, checkpointing, GGUF methods."""
    _positive_int("--max_seq_length", args.max_seq_length)
    _positive_int("--r", args.r)
    if not args.lora_alpha > 0:  # also rejects nan
        raise UsageError(f"--lora_alpha must be > 0, got {args.lora_alpha:g}")
    if not 0 <= args.lora_dropout < 1:
        raise UsageError(f"--lora_dropout must be in [0, 1), got {args.lora_dropout:g}")
    if args.layers_per_checkpoint < 1:
        raise UsageError(f"--layers_per_checkpoint must be >= 1, got {args.layers_per_checkpoint}")
    if args.layers_per_checkpoint > 1 and args.use_gradient_checkpointing is False:
        raise UsageError("--layers_per_checkpoint needs gradient checkpointing (--use_gradient_checkpointing "
                         "unsloth or true)")
    from unsloth_jax.models.layer_stack import LayerStackPolicy

    try:  # the flag's one parse: get_peft_model gets the LayerStackPolicy
        args.use_gradient_checkpointing = LayerStackPolicy.parse(
            args.use_gradient_checkpointing, args.layers_per_checkpoint, argument="--use_gradient_checkpointing")
    except ValueError as e:
        raise UsageError(str(e).replace("layers_per_checkpoint", "--layers_per_checkpoint")) from None
    if args.save_model and args.save_gguf:
        _check_gguf_methods(args.quantization)


def _check_gguf_methods(methods: list[str]) -> None:
    from unsloth_jax.errors import ConfigError
    from unsloth_jax.hf.gguf_export import resolve_method

    for method in methods:
        try:
            resolve_method(method)
        except ConfigError as e:
            raise UsageError(f"--quantization: {e}") from None


def _training_arguments(args, mesh=None):
    """TrainingArguments from the train flags (and the --mesh, made by _start_mesh); a flag value it rejects is
    a UsageError naming the flag."""
    from unsloth_jax import TrainingArguments

    try:
        return TrainingArguments(
            output_dir=args.output_dir, per_device_train_batch_size=args.per_device_train_batch_size,
            gradient_accumulation_steps=args.gradient_accumulation_steps, warmup_steps=args.warmup_steps,
            max_steps=args.max_steps, num_train_epochs=args.num_train_epochs, learning_rate=args.learning_rate,
            logging_steps=args.logging_steps, optim=args.optim, weight_decay=args.weight_decay,
            lr_scheduler_type=args.lr_scheduler_type, seed=args.seed, save_steps=args.save_steps,
            save_total_limit=args.save_total_limit,
            report_to=args.report_to, logging_dir=args.logging_dir, mesh=mesh,
            overwrite_output_dir=args.overwrite_output_dir, resume_from_checkpoint=args.resume_from_checkpoint)
    except (TypeError, ValueError) as e:
        raise UsageError(_as_flags(str(e))) from None  # the messages name arguments that are flags here


def _check_generate_flags(args) -> None:
    _positive_int("--max_seq_length", args.max_seq_length)
    _positive_int("--max_new_tokens", args.max_new_tokens)
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0, got {args.temperature:g}")
    if not 0 < args.top_p <= 1:
        raise UsageError(f"--top_p must be in (0, 1], got {args.top_p:g}")


# ------------------------------------------------------------------------------------------------- train
def _loss_summary(log_history: list[dict]) -> str:
    """'loss A (step i) -> B (step j)' from the first and last logged losses, then the eval loss if any."""
    logged = [(e["step"], e["loss"]) for e in log_history if "loss" in e]
    text = "loss n/a"
    if logged:
        (s0, l0), (s1, l1) = logged[0], logged[-1]
        text = f"loss {l0:.3f} (step {s0}) -> {l1:.3f} (step {s1})"
    evals = [e["eval_loss"] for e in log_history if "eval_loss" in e]
    if evals:
        text += f", eval loss {evals[-1]:.3f}"
    return text


def cmd_train(args) -> int:
    t_start = time.perf_counter()
    _check_model_flags(args)
    mesh = _start_mesh(args)  # jax.distributed first: before any jax computation
    targs = _training_arguments(args, mesh)  # checks the training flags before any model or data is loaded
    _check_output_paths(args)  # then where it will write
    if _is_vision_model(args.model_name):
        return _train_vision(args, targs, mesh, t_start)

    from unsloth_jax import FastLanguageModel, SFTTrainer
    from unsloth_jax.data import RESPONSE_PARTS, load_records, train_on_responses_only, validate_records
    from unsloth_jax.distributed import is_main_process

    main = is_main_process()
    if not main:  # the other processes of a multi-host run keep quiet: process 0 logs
        logging.getLogger("unsloth_jax").setLevel(logging.WARNING)
    _check_model_path(args.model_name, "pass --model_name with a local Hugging Face model directory or a .gguf "
                                        "file, or omit it to use the bundled tiny model")
    if not Path(args.dataset).exists():
        raise UsageError(f"dataset not found: {args.dataset} (pass --dataset with a .jsonl/.json file or a directory "
                         f"of .jsonl files){_hub_id_note(args.dataset, dataset=True)}")
    records = load_records(args.dataset, skip_bad_lines=args.skip_bad_lines)
    records = validate_records(records, "auto", skip_bad_lines=args.skip_bad_lines,
                               text_field=args.dataset_text_field)
    if not records:
        raise UsageError(f"dataset {args.dataset} holds no usable records")
    if records.skipped:
        print(f"unsloth-jax: skipped {records.skipped} malformed line(s) of {args.dataset}")
    fmt = _records_format(records, args.dataset_text_field)

    model, tokenizer = FastLanguageModel.from_pretrained(args.model_name, max_seq_length=args.max_seq_length,
                                                         dtype=args.dtype, load_in_4bit=args.load_in_4bit,
                                                         progress=main)
    if tokenizer is None:
        raise UsageError(f"{args.model_name} has no usable tokenizer (tokenizer.json / tokenizer_config.json)")
    model = FastLanguageModel.get_peft_model(
        model, r=args.r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, bias=args.bias,
        use_gradient_checkpointing=args.use_gradient_checkpointing, random_state=args.random_state,
        use_rslora=args.use_rslora, layers_per_checkpoint=args.layers_per_checkpoint)
    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=records,
                         dataset_text_field=args.dataset_text_field, max_seq_length=args.max_seq_length,
                         packing=args.packing, args=targs)
    trainer.resume_hint = lambda newest: _resume_hint(args, newest)
    responses_only = args.train_on_responses_only
    if responses_only is None:
        responses_only = fmt in ("alpaca", "chat", "prompt_completion")
    if responses_only:
        if fmt == "alpaca":
            instruction_part, response_part = RESPONSE_PARTS["alpaca"]
        elif fmt == "chat":
            instruction_part, response_part = _chat_response_parts(tokenizer)
        elif fmt == "prompt_completion":
            instruction_part = response_part = None  # the completion-only mask is already in the labels
        else:
            raise UsageError("--train_on_responses_only needs alpaca, chat (sharegpt/chatml) or prompt/completion "
                             "records")
        if response_part is not None:
            train_on_responses_only(trainer, instruction_part, response_part)
    if main:
        print(f"unsloth-jax train: {Path(args.model_name).name} ({model.config.model_type}, "
              f"{model.config.num_hidden_layers} layers) on {len(records)} {fmt} records from {args.dataset}; "
              f"{model.dtype.name}{' + NF4' if args.load_in_4bit else ''}, LoRA r={args.r} alpha={args.lora_alpha:g}"
              f"{', responses only' if responses_only else ''}")
    out = Path(args.output_dir)
    if args.overwrite_output_dir and not args.resume_from_checkpoint and main:  # the trainer removes its own files
        from unsloth_jax.train.checkpoints import remove_paths

        remove_paths([out / d for d in SAVE_DIRS if (out / d).exists()])
    trainer_stats = trainer.train()
    losses = trainer.state.loss_history or [float("nan")]

    saved = []
    rc = 0
    if not main:  # process 0 writes the exports and the summary
        return 0
    targets = _save_targets(args)
    if targets:
        adapter_dir = _save_adapter(model, tokenizer, targets["adapter"][0], out)
        _save_training_info(adapter_dir, {"dataset": str(args.dataset), "dataset_format": fmt,
                                          "base_model": str(Path(args.model_name).resolve()),
                                          "responses_only": bool(responses_only), "steps": trainer_stats.global_step,
                                          "final_loss": losses[-1]})
        saved.append(f"adapter -> {adapter_dir}")
        rc = 0 if adapter_dir == targets["adapter"][0] else 1
        from unsloth_jax.errors import UnslothJaxError

        try:
            if "merged_16bit" in targets:
                merged_dir = targets["merged_16bit"][0]
                model.save_pretrained_merged(str(merged_dir), tokenizer, save_method="merged_16bit")
                saved.append(f"merged_16bit -> {merged_dir}")
            if "gguf" in targets:
                _export_gguf(model, tokenizer, targets["gguf"][0], args.quantization)
                saved.append(f"gguf -> {targets['gguf'][0]}")
        except (OSError, UnslothJaxError) as e:
            print(f"unsloth-jax train: error: export failed ({e}); the trained adapter is saved in {adapter_dir} "
                  "(`unsloth-jax export --model_name` it to try again)", file=sys.stderr)
            rc = 1
    seconds = time.perf_counter() - t_start
    print(f"unsloth-jax: {trainer_stats.global_step} steps in {seconds:.0f}s, "
          f"{_loss_summary(trainer.state.log_history)} | "
          f"dtype {model.dtype.name}{_mesh_summary(mesh)} | kernels: {trainer.kernel_choices} | "
          f"memory: {_memory_summary()} | "
          f"metrics -> {out / 'metrics.jsonl'}" + (" | " + ", ".join(saved) if saved else ""))
    return rc


def _resume_hint(args, newest: Path | None) -> str:
    """After Ctrl-C: the newest checkpoint and the command line that continues from it (this one, with
    --resume_from_checkpoint true instead of any --resume_from_checkpoint / --overwrite_output_dir)."""
    if newest is None:
        return ("no checkpoint was saved, so a new run starts over (--save_steps N writes one every N steps)")
    kept, skip = [], False
    for arg in args.argv:
        if skip:
            skip = False
        elif arg == "--resume_from_checkpoint":
            skip = True
        elif not (arg.startswith("--resume_from_checkpoint=") or arg == "--overwrite_output_dir"):
            kept.append(arg)
    import shlex

    return (f"the newest checkpoint is {newest}; continue with: "
            f"unsloth-jax {shlex.join(kept + ['--resume_from_checkpoint', 'true'])}")


def _is_vision_model(model_name) -> bool:
    """Whether `model_name` is a directory whose config.json is a vision-language model FastVisionModel loads:
    Gemma 3 (model_type "gemma3" with a vision_config; its text-only checkpoints are "gemma3_text") or
    Qwen2.5-VL ("qwen2_5_vl"), Qwen3-VL ("qwen3_vl") or Qwen3.5 ("qwen3_5"): a config.json a vision-language
    Family reads), or an adapter directory whose base model is one."""
    from unsloth_jax.config import read_config_json
    from unsloth_jax.errors import UnslothJaxError
    from unsloth_jax.families import vision_family_for
    from unsloth_jax.hf import peft_io

    try:
        if Path(model_name).is_dir() and peft_io.is_adapter_dir(model_name):
            model_name = peft_io.base_model_path(model_name)
        cfg, _ = read_config_json(model_name)
    except (UnslothJaxError, OSError):
        return False
    if not isinstance(cfg, dict):
        return False
    return vision_family_for(cfg) is not None


def _train_vision(args, targs, mesh, t_start: float) -> int:
    """`train` for a vision-language model (families.VISION_FAMILIES): FastVisionModel +
    UnslothVisionDataCollator on a .jsonl of chat records with image file paths (docs/VISION.md); --load_in_4bit:
    QLoRA (NF4 language model); --mesh: the devices of this process. Prints and saves as the text path does."""
    for flag, unsupported in (("--packing", args.packing), ("--save_gguf", args.save_model and args.save_gguf),
                              ("--skip_bad_lines", args.skip_bad_lines)):
        if unsupported:
            raise UsageError(f"{flag} is not supported for vision-language models yet (docs/VISION.md)")
    from unsloth_jax import FastVisionModel, SFTTrainer, UnslothVisionDataCollator
    from unsloth_jax.data.vision_loader import load_vision_records

    if not Path(args.dataset).exists():
        raise UsageError(f"dataset not found: {args.dataset} (pass --dataset with a .jsonl file of chat records "
                         "with images, as unsloth_jax/assets/shapes_sample/shapes_sample.jsonl)"
                         f"{_hub_id_note(args.dataset, dataset=True)}")
    records = load_vision_records(args.dataset)
    model, processor = FastVisionModel.from_pretrained(args.model_name, max_seq_length=args.max_seq_length,
                                                       dtype=args.dtype, load_in_4bit=args.load_in_4bit)
    if processor is None:
        raise UsageError(f"{args.model_name}: no usable processor (preprocessor_config.json / processor_config.json "
                         "missing, or transformers could not build it: Qwen2.5-VL's needs torchvision); the vision "
                         "data collator needs it")
    model = FastVisionModel.get_peft_model(
        model, r=args.r, lora_alpha=args.lora_alpha, lora_dropout=args.lora_dropout, bias=args.bias,
        use_gradient_checkpointing=args.use_gradient_checkpointing, random_state=args.random_state,
        use_rslora=args.use_rslora, layers_per_checkpoint=args.layers_per_checkpoint)
    responses_only = args.train_on_responses_only is not False  # default: yes, as for chat data
    parts = _chat_response_parts(processor) if responses_only else (None, None)
    collator = UnslothVisionDataCollator(model, processor, train_on_responses_only=responses_only,
                                         instruction_part=parts[0], response_part=parts[1])
    trainer = SFTTrainer(model=model, tokenizer=processor, data_collator=collator, train_dataset=records,
                         max_seq_length=args.max_seq_length, args=targs)
    trainer.resume_hint = lambda newest: _resume_hint(args, newest)
    c, v = model.config, model.vl_config.vision
    quant = " + NF4 4-bit language model (QLoRA)" if args.load_in_4bit else ""
    print(f"unsloth-jax train: {Path(args.model_name).name} ({model.vl_config.model_type} vision-language, "
          f"{c.num_hidden_layers} + {v.num_hidden_layers} layers) on {len(records)} vision records from "
          f"{args.dataset}; {model.dtype.name}{quant}, LoRA r={args.r} alpha={args.lora_alpha:g}"
          f"{', responses only' if responses_only else ''}")
    out = Path(args.output_dir)
    if args.overwrite_output_dir and not args.resume_from_checkpoint:  # the trainer removes its own files
        from unsloth_jax.train.checkpoints import remove_paths

        remove_paths([out / d for d in SAVE_DIRS if (out / d).exists()])
    trainer_stats = trainer.train()
    losses = trainer.state.loss_history or [float("nan")]
    saved, rc = [], 0
    targets = _save_targets(args)
    if targets:
        adapter_dir = _save_adapter(model, processor, targets["adapter"][0], out)
        _save_training_info(adapter_dir, {"dataset": str(args.dataset), "dataset_format": "vision",
                                          "base_model": str(Path(args.model_name).resolve()),
                                          "responses_only": responses_only, "steps": trainer_stats.global_step,
                                          "final_loss": losses[-1]})
        saved.append(f"adapter -> {adapter_dir}")
        rc = 0 if adapter_dir == targets["adapter"][0] else 1
        if "merged_16bit" in targets:
            model.save_pretrained_merged(str(targets["merged_16bit"][0]), processor, save_method="merged_16bit")
            saved.append(f"merged_16bit -> {targets['merged_16bit'][0]}")
    seconds = time.perf_counter() - t_start
    print(f"unsloth-jax: {trainer_stats.global_step} steps in {seconds:.0f}s, "
          f"{_loss_summary(trainer.state.log_history)} | dtype {model.dtype.name}{_mesh_summary(mesh)} | "
          f"kernels: {trainer.kernel_choices} | memory: {_memory_summary()} | metrics -> {out / 'metrics.jsonl'}"
          + (" | " + ", ".join(saved) if saved else ""))
    return rc


def _save_adapter(model, tokenizer, adapter_dir: Path, out: Path) -> Path:
    """Save the trained adapter to `adapter_dir`; if that fails (OSError), to the first of OUTPUT_DIR, the current
    directory and the temporary directory that works, saying where, so a finished training is never lost.
    Returns the directory it was saved in."""
    try:
        model.save_pretrained(str(adapter_dir), tokenizer=tokenizer)
        return adapter_dir
    except OSError as e:
        failure = e
    name = f"adapter-rescued-{time.strftime('%Y%m%d-%H%M%S')}"
    for parent in (out, Path.cwd(), Path(tempfile.gettempdir())):
        try:
            model.save_pretrained(str(parent / name), tokenizer=tokenizer)
        except OSError:
            continue
        print(f"unsloth-jax train: error: could not save the adapter to {adapter_dir} ({failure}); saved it to "
              f"{parent / name} instead", file=sys.stderr)
        return parent / name
    raise failure


def _chat_response_parts(tokenizer) -> tuple[str, str]:
    """(instruction_part, response_part) of the tokenizer's chat template, found by rendering a probe
    conversation and looking for each known template's markers."""
    from unsloth_jax.data import RESPONSE_PARTS

    if not getattr(tokenizer, "chat_template", None):
        raise UsageError("chat data needs a tokenizer with a chat template (see unsloth_jax.data.get_chat_template)")
    probe = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
                                          tokenize=False)
    for name in ("chatml", "llama-3.1", "gemma"):
        instruction_part, response_part = RESPONSE_PARTS[name]
        if instruction_part in probe and response_part in probe:
            return instruction_part, response_part
    raise UsageError("cannot find the user/assistant markers of this chat template; pass "
                     "--no-train_on_responses_only")


# ---------------------------------------------------------------------------------------------- generate
class _TextPrinter:
    """Streams decoded text to stdout token by token (decodes the whole answer each time, prints the new tail,
    holding back an incomplete UTF-8 sequence)."""

    def __init__(self, tokenizer, stream=None):
        self.tokenizer = tokenizer
        self.stream = stream or sys.stdout
        self.ids: list[int] = []
        self.printed = 0

    def __call__(self, new_tokens) -> None:
        self.ids.append(int(new_tokens[0]))
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):
            return
        self.stream.write(text[self.printed:])
        self.stream.flush()
        self.printed = len(text)

    def text(self) -> str:
        return self.tokenizer.decode(self.ids, skip_special_tokens=True)


def _stop_ids(model, tokenizer, chat: bool) -> list[int]:
    from unsloth_jax.data import STOP_TOKENS
    from unsloth_jax.generation import default_eos_ids

    ids = list(default_eos_ids(model))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.append(int(tokenizer.eos_token_id))
    if chat:
        vocab = tokenizer.get_vocab()
        ids += [vocab[t] for t in set(STOP_TOKENS.values()) if t in vocab]
    return sorted(set(ids))


def _resolve_format(args, model_dir: Path, tokenizer=None) -> str:
    """The prompt format: --chat / --format when given; else the one the adapter was trained on (its
    TRAINING_INFO); else the tokenizer's chat template when it has one, alpaca when it has none."""
    if args.chat:
        return "chat"
    if args.format != "auto":
        return args.format
    info = _read_training_info(model_dir)
    trained = info.get("dataset_format")
    if trained == "chat":
        return "chat"
    if trained in ("text", "prompt_completion"):
        return "raw"
    if trained == "alpaca":
        return "alpaca"
    return "chat" if getattr(tokenizer, "chat_template", None) else "alpaca"


def cmd_generate(args) -> int:
    from unsloth_jax import FastLanguageModel
    from unsloth_jax.data import alpaca_prompt
    from unsloth_jax.data.tokenize import encode_texts
    from unsloth_jax.generation import generate

    _check_generate_flags(args)
    model_dir = Path(args.model_name)
    _check_model_path(model_dir, "train one with `unsloth-jax train`, or pass --model_name with a model or adapter "
                                 "directory or a .gguf file")
    if _is_vision_model(model_dir):
        return _generate_vision(args, model_dir)
    if args.image:
        raise UsageError(f"--image needs a vision-language model (Gemma 3 with a vision_config, Qwen2.5-VL) or an "
                         f"adapter of one; {model_dir} is a text-only model")
    model, tokenizer = FastLanguageModel.from_pretrained(str(model_dir), max_seq_length=args.max_seq_length,
                                                         dtype=args.dtype, load_in_4bit=args.load_in_4bit,
                                                         progress=False)
    if tokenizer is None:
        raise UsageError(f"{model_dir} has no usable tokenizer")
    FastLanguageModel.for_inference(model)
    fmt = _resolve_format(args, model_dir, tokenizer)
    if fmt == "chat" and not getattr(tokenizer, "chat_template", None):
        raise UsageError(f"{model_dir}: the tokenizer has no chat template; use --format alpaca or raw")
    stop = _stop_ids(model, tokenizer, fmt == "chat")
    sample = args.temperature > 0

    def answer(text: str, history: list[dict]) -> str:
        if fmt == "alpaca":
            prompt = alpaca_prompt(text, args.input if args.prompt is not None else "")
        elif fmt == "chat":
            history.append({"role": "user", "content": text})
            prompt = tokenizer.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        else:
            prompt = text
        ids = encode_texts([prompt], tokenizer)[0]
        if len(ids) + args.max_new_tokens > args.max_seq_length:
            ids = ids[-max(1, args.max_seq_length - args.max_new_tokens):]
        printer = _TextPrinter(tokenizer)
        generate(model, [ids], max_new_tokens=args.max_new_tokens, temperature=args.temperature if sample else 1.0,
                 top_p=args.top_p, do_sample=sample, eos_token_id=stop, seed=args.seed, streamer=printer)
        sys.stdout.write("\n")
        sys.stdout.flush()
        reply = printer.text()
        if fmt == "chat":
            history.append({"role": "assistant", "content": reply})
        return reply

    if args.prompt is not None:
        answer(args.prompt, [])
        return 0
    print(f"unsloth-jax: chatting with {model_dir} ({fmt} prompts). Empty line or Ctrl-D quits; /reset clears the "
          "conversation.", file=sys.stderr)
    return _chat_loop(answer)


def _chat_loop(answer) -> int:
    """Read prompts from stdin until an empty line, /exit, /quit or Ctrl-D; /reset clears the conversation.
    answer(line, history) answers one turn and appends it to history."""
    history: list[dict] = []
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            break
        if not line.strip() or line.strip() in ("/exit", "/quit"):
            break
        if line.strip() == "/reset":
            history = []
            continue
        answer(line, history)
    return 0


def _open_images(paths: list[str]) -> list:
    """The --image files as RGB PIL images; a missing or undecodable file is a UsageError naming it."""
    from PIL import Image, UnidentifiedImageError

    images = []
    for path in paths:
        if not Path(path).is_file():
            raise UsageError(f"--image {path}: file not found")
        try:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        except (UnidentifiedImageError, OSError) as e:
            raise UsageError(f"--image {path}: cannot be decoded as a picture ({e})") from None
    return images


def _generate_vision(args, model_dir: Path) -> int:
    """`generate` for a vision-language model or adapter (FastVisionModel): each prompt is a chat user turn of the
    --image pictures (first turn only) and the text, rendered by the processor's chat template with the
    generation prompt; the answer is decoded after model.generate."""
    from unsloth_jax import FastVisionModel

    if args.format not in ("auto", "chat") or args.input:
        raise UsageError("a vision-language model takes chat prompts only: drop --format / --input")
    images = _open_images(args.image or [])
    model, processor = FastVisionModel.from_pretrained(str(model_dir), max_seq_length=args.max_seq_length,
                                                       dtype=args.dtype, load_in_4bit=args.load_in_4bit,
                                                       progress=False)
    if processor is None or not getattr(processor, "chat_template", None):
        raise UsageError(f"{model_dir}: no usable processor with a chat template (preprocessor_config.json / "
                         "processor_config.json and chat_template); generating with images needs it")
    FastVisionModel.for_inference(model)
    stop = _stop_ids(model, processor.tokenizer, True)
    sample = args.temperature > 0

    def answer(text: str, history: list[dict]) -> str:
        parts = [{"type": "image"} for _ in images] if not history else []
        history.append({"role": "user", "content": parts + [{"type": "text", "text": text}]})
        prompt = processor.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
        inputs = processor(text=[prompt], images=[images] if images else None, return_tensors="np")
        prompt_len = inputs["input_ids"].shape[1]
        if prompt_len + args.max_new_tokens > args.max_seq_length:
            raise UsageError(f"the prompt is {prompt_len} tokens; with --max_new_tokens {args.max_new_tokens} it "
                             f"passes --max_seq_length {args.max_seq_length}")
        out = model.generate(**inputs, max_new_tokens=args.max_new_tokens,
                             temperature=args.temperature if sample else 1.0, top_p=args.top_p, do_sample=sample,
                             eos_token_id=stop, seed=args.seed)
        reply = processor.tokenizer.decode(out[0, prompt_len:], skip_special_tokens=True)
        print(reply, flush=True)
        history.append({"role": "assistant", "content": [{"type": "text", "text": reply}]})
        return reply

    if args.prompt is not None:
        answer(args.prompt, [])
        return 0
    print(f"unsloth-jax: chatting with {model_dir} (vision-language, {len(images)} image(s) in the first turn). "
          "Empty line or Ctrl-D quits; /reset clears the conversation.", file=sys.stderr)
    return _chat_loop(answer)


# ------------------------------------------------------------------------------------------------ export
def cmd_export(args) -> int:
    from unsloth_jax import FastLanguageModel
    from unsloth_jax.hf import peft_io

    adapter = Path(args.model_name)
    if not adapter.is_dir():
        raise UsageError(f"adapter directory not found: {adapter} (train one with `unsloth-jax train`)"
                         f"{_hub_id_note(adapter) if not adapter.exists() else ''}")
    if not peft_io.is_adapter_dir(adapter):
        raise UsageError(f"{adapter} is not a PEFT adapter directory (no adapter_config.json)")
    if args.save_method is None and not args.save_gguf:
        raise UsageError("nothing to export: pass --save_method merged_16bit and/or --save_gguf")
    model, tokenizer = FastLanguageModel.from_pretrained(str(adapter), dtype=args.dtype, progress=False)
    parent = adapter.resolve().parent
    if args.save_method == "merged_16bit":
        out = Path(args.save_path) if args.save_path else parent / "merged_16bit"
        model.save_pretrained_merged(str(out), tokenizer, save_method="merged_16bit")
        print(f"unsloth-jax: wrote merged 16-bit model {out}")
    elif args.save_method == "lora":
        out = Path(args.save_path) if args.save_path else parent / "adapter_copy"
        model.save_pretrained(str(out))
        if tokenizer is not None:
            tokenizer.save_pretrained(str(out))
        print(f"unsloth-jax: wrote adapter {out}")
    if args.save_gguf:
        _export_gguf(model, tokenizer, Path(args.gguf_path) if args.gguf_path else parent / "gguf", args.quantization)
    return 0


# -------------------------------------------------------------------------------------------------- main
def _refuse_unknown(parser: argparse.ArgumentParser, command: str, unknown: list[str]) -> None:
    """argparse's "unrecognized arguments" error (exit 2) from the subcommand's parser, with the closest flag of
    that subcommand for each mistyped one ("did you mean --learning_rate?")."""
    import difflib

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    flags = [o for a in sub._actions for o in a.option_strings if o.startswith("--")]
    parts = []
    for arg in unknown:
        close = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1, cutoff=0.6) if arg.startswith("-") else []
        parts.append(f"{arg} (did you mean {close[0]}?)" if close else arg)
    sub.error("unrecognized arguments: " + " ".join(parts))


def main(argv: list[str] | None = None) -> int:
    """Run the CLI; returns the exit code (0 ok, 1 failure, 2 a problem with the input the user can fix)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown(parser, args.command, unknown)
    if getattr(args, "preset", None):  # parse again with the preset's defaults under the explicit flags
        args = build_parser(args.preset).parse_args(argv)
    args.argv = argv  # the command line as given (the resume command after Ctrl-C)
    if args.command == "doctor":
        from unsloth_jax import doctor

        return doctor.run(args)
    _setup_logging(args.quiet)
    from unsloth_jax.errors import DatasetFormatError, TrainingError, UnslothJaxError

    commands = {"train": cmd_train, "generate": cmd_generate, "export": cmd_export}
    try:
        return commands[args.command](args)
    except UsageError as e:
        print(f"unsloth-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except DatasetFormatError as e:
        print(f"unsloth-jax {args.command}: dataset error: {_as_flags(str(e))}", file=sys.stderr)
        return 2
    except TrainingError as e:
        print(f"unsloth-jax {args.command}: training stopped: {e}", file=sys.stderr)
        return 1
    except (UnslothJaxError, FileNotFoundError) as e:
        print(f"unsloth-jax {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nunsloth-jax {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
