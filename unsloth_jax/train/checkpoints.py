"""A training run's files in output_dir: orbax checkpoints (`checkpoint-<step>/`), metrics.jsonl and runs/.

A checkpoint directory holds `state/` (orbax: the trainer's device state, {"trainable", "opt_state"}),
`trainer_state.json` (step, seed, epoch, the loss and log histories, and under "trainer" what the trainer itself
needs to continue: GRPO's generation counter and prompt stream position) and any files the trainer adds (GRPO:
the generation batch a step reuses). It is written under `.tmp-checkpoint-<step>` and renamed when complete, so
a crash never leaves a checkpoint that looks complete; only directories with trainer_state.json count.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
from pathlib import Path

import jax

from unsloth_jax import distributed
from unsloth_jax.errors import TrainingError

log = logging.getLogger("unsloth_jax")

STATE_FILE = "trainer_state.json"


def checkpoints_in(output_dir) -> list[tuple[int, Path]]:
    """(step, path) of the complete checkpoint-N directories in output_dir, oldest first."""
    out = Path(output_dir)
    found = []
    if out.is_dir():
        for p in out.iterdir():
            m = re.fullmatch(r"checkpoint-(\d+)", p.name)
            if m and (p / STATE_FILE).is_file():
                found.append((int(m.group(1)), p))
    return sorted(found)


def previous_run_files(output_dir) -> list[Path]:
    """What an earlier train() left in output_dir: metrics.jsonl, checkpoint-N directories (complete or not) and
    runs/ (TensorBoard's default logging_dir)."""
    out = Path(output_dir)
    if not out.is_dir():
        return []
    return sorted(p for p in out.iterdir()
                  if p.name in ("metrics.jsonl", "runs") or re.fullmatch(r"(\.tmp-)?checkpoint-\d+", p.name))


def remove_paths(paths) -> None:
    """Delete files and directory trees."""
    for p in paths:
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p)
        else:
            p.unlink()


def resume_path(resume_from_checkpoint, output_dir) -> Path | None:
    """The checkpoint directory a train() call resumes from: a path given (checked), the newest in output_dir for
    True (None, with a warning, when it holds none), None for False/None."""
    if not resume_from_checkpoint:
        return None
    if isinstance(resume_from_checkpoint, (str, os.PathLike)):
        path = Path(resume_from_checkpoint)
        if not (path / STATE_FILE).is_file():
            raise TrainingError(f"resume_from_checkpoint={str(resume_from_checkpoint)!r} is not a checkpoint "
                                f"directory (a checkpoint-N directory with {STATE_FILE}, saved every save_steps "
                                "steps); pass one, or True for the newest in output_dir")
        return path
    found = checkpoints_in(output_dir)
    if not found:
        log.warning("unsloth_jax: resume_from_checkpoint=True but %s holds no checkpoint; starting fresh", output_dir)
        return None
    return found[-1][1]


def save_checkpoint(output_dir, step: int, state: dict, record: dict, write_extra=None,
                    save_total_limit: int | None = None) -> Path | None:
    """Write checkpoint-<step> (see the module docstring): `state` (a pytree of arrays) with orbax, `record` as
    trainer_state.json, then `write_extra(directory)` (the trainer's own files), all under a temporary name
    renamed when complete. An existing checkpoint-<step> is never overwritten (None is returned). With
    save_total_limit, only that many newest checkpoints are kept. Every process saves its shards."""
    import orbax.checkpoint as ocp

    path = Path(output_dir).resolve() / f"checkpoint-{step}"
    if path.exists():
        return None
    tmp = path.with_name(f".tmp-{path.name}")
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp / "state", state)
    ckptr.wait_until_finished()
    if not distributed.is_main_process():
        distributed.sync(f"checkpoint-{step}")
        return path
    if write_extra is not None:
        write_extra(tmp)
    (tmp / STATE_FILE).write_text(json.dumps(record))
    os.replace(tmp, path)
    distributed.sync(f"checkpoint-{step}")
    if save_total_limit:
        for _, old in checkpoints_in(output_dir)[:-save_total_limit]:
            shutil.rmtree(old, ignore_errors=True)
    return path


def restore_checkpoint(path: Path, like: dict, optim_name: str) -> tuple[dict, dict]:
    """(state, trainer_state.json's record) of a checkpoint; the state is placed like `like` (same tree, shapes,
    dtypes; each array on its sharding, so a checkpoint saved on N devices restores on today's M). A saved
    state of another structure is a TrainingError naming the checkpoint and `optim_name`."""
    import orbax.checkpoint as ocp

    target = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), like)
    try:
        restored = ocp.StandardCheckpointer().restore(path.resolve() / "state", target)
    except ValueError as e:  # orbax: the saved tree's structure, shapes or dtypes differ from the target's
        raise TrainingError(
            f"{path}: the saved training state does not match this run's (optim {optim_name!r}, the "
            f"model's trainable weights): {str(e)[:300]}. It was saved with other settings, or by an "
            "unsloth_jax older than the fused AdamW state (AdamWState, 2026-12-01) or, for Qwen3.5, than its "
            "per-kind layer stacks (each token mixer stacked over its own layers only, 2026-12-06); such a "
            "checkpoint cannot be resumed; "
            "resume with the run's own settings, or start fresh") from e
    return restored, json.loads((path / STATE_FILE).read_text())


def keep_metrics_until(output_dir, step: int) -> None:
    """Drop the metrics.jsonl lines of steps after `step` (logged by the run a resume continues, after its
    checkpoint), so the file holds each step once. Rewritten through a temporary file."""
    path = Path(output_dir) / "metrics.jsonl"
    if not path.is_file() or not distributed.is_main_process():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except (json.JSONDecodeError, AttributeError):  # a line cut short by the crash
            pass
    if len(kept) != len(lines):
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


def prepare_output_dir(output_dir, *, resuming: bool, overwrite: bool, own_earlier: bool = False) -> None:
    """Create output_dir before any slow work. A fresh run refuses one holding an earlier run's files unless
    `overwrite` (overwrite_output_dir=True) or `own_earlier` (the files are this trainer object's, from its own
    earlier train() call); then they are removed, so only this run's files remain."""
    out = Path(output_dir)
    if out.exists() and not out.is_dir():
        raise TrainingError(f"output_dir {out} exists and is not a directory; pass another output_dir")
    earlier = [] if resuming else previous_run_files(out)
    if earlier and not (overwrite or own_earlier):
        names = ", ".join(p.name for p in earlier[:5]) + (", ..." if len(earlier) > 5 else "")
        raise TrainingError(f"output_dir {out} holds an earlier run's files ({names}); pass "
                            "overwrite_output_dir=True to replace them, resume_from_checkpoint=True to continue "
                            "that run, or another output_dir")
    if earlier and distributed.is_main_process():
        remove_paths(earlier)
        log.info("unsloth_jax: %s: removed %s from %s",
                 "overwrite_output_dir=True" if overwrite else "training again", ", ".join(p.name for p in earlier),
                 out)
    distributed.sync("prepare-output-dir")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise TrainingError(f"output_dir {out} cannot be created ({e}); pass another output_dir") from e
