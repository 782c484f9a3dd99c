"""bench/train_bench.py with the offload steps' command buffers forced, for A/B runs of one code version.

    python bench/train_bench_cmdbuf.py {default|limited|KIND,KIND,...} [--offload-chunk-mib N] [--prefetch-weights] \
        [--scan-offload-attention] CHECKPOINT [train_bench flags]

default: every step compiles with XLA's default command buffers; limited: the host-offload modes ("offload",
"offload_attention") compile with unsloth_jax.models.offload.OFFLOAD_COMPILER_OPTIONS, the rest with the
defaults; a comma-separated list of XLA command-buffer kinds (e.g. FUSION,CUBLAS,CUBLASLT,CUDNN): the offload
modes compile with exactly those. --offload-chunk-mib N sets unsloth_jax.models.offload.OFFLOAD_CHUNK_BYTES (the
largest piece of a layer input the "offload" scan copies at once) to N MiB; --prefetch-weights sets
PREFETCH_LAYER_WEIGHTS (the scan slices each layer's weights one iteration ahead); --scan-offload-attention
sets SCAN_OFFLOAD_ATTENTION ("offload_attention" through the scan, attention's residuals kept). It replaces
unsloth_jax.train.step.step_compiler_options, then runs train_bench."""
import re
import runpy
import sys
from pathlib import Path

import unsloth_jax.models.offload as offload
import unsloth_jax.train.step as step
from unsloth_jax.models.decoder import HOST_OFFLOAD_MODES

choice = sys.argv.pop(1) if len(sys.argv) > 1 else ""
if choice == "default":
    options = None
elif choice == "limited":
    options = offload.OFFLOAD_COMPILER_OPTIONS
elif re.fullmatch(r"[A-Z_]+(,[A-Z_]+)*", choice):
    options = {"xla_gpu_enable_command_buffer": choice}
else:
    sys.exit(f"train_bench_cmdbuf.py: first argument must be default, limited or a comma-separated list of "
             f"command-buffer kinds such as FUSION,CUBLAS; got {choice!r}")
while len(sys.argv) > 1 and sys.argv[1] in ("--offload-chunk-mib", "--prefetch-weights", "--scan-offload-attention"):
    if sys.argv[1] in ("--prefetch-weights", "--scan-offload-attention"):
        setattr(offload, {"--prefetch-weights": "PREFETCH_LAYER_WEIGHTS",
                          "--scan-offload-attention": "SCAN_OFFLOAD_ATTENTION"}[sys.argv[1]], True)
        del sys.argv[1]
    else:
        offload.OFFLOAD_CHUNK_BYTES = int(float(sys.argv[2]) * 2 ** 20)
        del sys.argv[1:3]
step.step_compiler_options = lambda remat: options if remat in HOST_OFFLOAD_MODES else None
sys.argv[0] = str(Path(__file__).with_name("train_bench.py"))
runpy.run_path(sys.argv[0], run_name="__main__")
