"""bench/train_bench.py with the offload steps' command-buffer choice forced, for A/B runs of one code version.

    python bench/train_bench_cmdbuf.py {default|limited} CHECKPOINT [train_bench flags]

default: every step compiles with XLA's default command buffers; limited: the host-offload modes ("offload",
"offload_attention") compile with unsloth_jax.models.offload.OFFLOAD_COMPILER_OPTIONS, the rest with the
defaults. It replaces unsloth_jax.train.step.step_compiler_options before running train_bench."""
import runpy
import sys
from pathlib import Path

import unsloth_jax.train.step as step
from unsloth_jax.models.offload import OFFLOAD_COMPILER_OPTIONS

choice = sys.argv.pop(1)
if choice not in ("default", "limited"):
    sys.exit(f"train_bench_cmdbuf.py: first argument must be default or limited, got {choice!r}")
step.step_compiler_options = (lambda remat: None) if choice == "default" else (
    lambda remat: OFFLOAD_COMPILER_OPTIONS if remat in ("offload", "offload_attention") else None)
sys.argv[0] = str(Path(__file__).with_name("train_bench.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
