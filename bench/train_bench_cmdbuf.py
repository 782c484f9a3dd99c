"""bench/train_bench.py with the offload steps' command buffers forced, for A/B runs of one code version.

    python bench/train_bench_cmdbuf.py {default|limited|KIND,KIND,...} CHECKPOINT [train_bench flags]

default: every step compiles with XLA's default command buffers; limited: the host-offload modes ("offload",
"offload_attention") compile with unsloth_jax.models.offload.OFFLOAD_COMPILER_OPTIONS, the rest with the
defaults; a comma-separated list of XLA command-buffer kinds (e.g. FUSION,CUBLAS,CUBLASLT,CUDNN): the offload
modes compile with exactly those. It replaces unsloth_jax.train.step.step_compiler_options, then runs
train_bench. The offload scan's own settings are layer-stack settings given with --remat
(unsloth_jax.models.layer_stack): --remat offload_attention,offload_attention=policy,
--remat unsloth,offload_weights=prefetch (or in_step), --remat unsloth,offload_copies=whole (or blocks)."""
import re
import runpy
import sys
from pathlib import Path

import unsloth_jax.train.step as step
from unsloth_jax.models.layer_stack import LayerStackPolicy
from unsloth_jax.models.offload import OFFLOAD_COMPILER_OPTIONS

choice = sys.argv.pop(1) if len(sys.argv) > 1 else ""
if choice == "default":
    options = None
elif choice == "limited":
    options = OFFLOAD_COMPILER_OPTIONS
elif re.fullmatch(r"[A-Z_]+(,[A-Z_]+)*", choice):
    options = {"xla_gpu_enable_command_buffer": choice}
else:
    sys.exit(f"train_bench_cmdbuf.py: first argument must be default, limited or a comma-separated list of "
             f"command-buffer kinds such as FUSION,CUBLAS; got {choice!r}")


def compiler_options(remat, policy=None):
    """`options` for the per-layer host-offload modes ("offload", "offload_attention"), else None."""
    stack = LayerStackPolicy.parse(remat)
    return options if stack.offload != "none" and stack.layers_per_checkpoint == 1 else None


step.step_compiler_options = compiler_options
sys.argv[0] = str(Path(__file__).with_name("train_bench.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
