"""The bundled vision sample (issue 39): scripts/make_vision_sample.py rewrites the bundled images, .jsonl and tiny
Gemma 3 vision-language model; load_vision_records reads image paths relative to the .jsonl and names the line of
each problem; `unsloth-jax train --preset tiny-vision` halves the loss and writes an adapter that PEFT loads onto
transformers' Gemma3ForConditionalGeneration."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import re

import numpy as np
import pytest

from tests.helpers import ASSETS, ROOT
from unsloth_jax.errors import DatasetFormatError

SAMPLE = ASSETS / "shapes_sample"
MODEL = ASSETS / "tiny-gemma3-vl"


def _generator():
    spec = importlib.util.spec_from_file_location("make_vision_sample", ROOT / "scripts" / "make_vision_sample.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _files(root):
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()}


def test_generator_rewrites_the_bundled_sample(tmp_path):
    written = _generator().write_sample(tmp_path)
    ours, bundled = _files(tmp_path), _files(SAMPLE)
    assert set(ours) == set(bundled) and len(written) == 49
    for name, path in ours.items():
        assert path.read_bytes() == bundled[name].read_bytes(), name
    assert sum(p.stat().st_size for p in bundled.values()) < 200_000


def _keys_of(shape: dict, d: dict) -> dict:
    """d cut to the keys of `shape`, nested dicts too (a key missing from d stays missing, so the comparison fails)."""
    return {k: _keys_of(shape[k], d[k]) if isinstance(shape[k], dict) and isinstance(d.get(k), dict) else d[k]
            for k in shape if k in d}


@pytest.mark.torch
def test_generator_rewrites_the_bundled_model(tmp_path):
    """Every file equal; the JSON ones up to the transformers version they record: config.json as this
    transformers reads it, keys it does not write left out (the bundled files come from transformers 5.25, whose
    SigLIP config writes vision_use_head; 5.17 has no such key)."""
    pytest.importorskip("torch")
    from transformers import AutoConfig

    _generator().write_model(tmp_path / "m")
    ours, bundled = _files(tmp_path / "m"), _files(MODEL)
    assert set(ours) == set(bundled)
    for name, path in ours.items():
        if name == "config.json":
            mine, theirs = (AutoConfig.from_pretrained(p.parent).to_dict() for p in (path, bundled[name]))
            theirs = _keys_of(mine, theirs)
        elif name.endswith(".json"):
            mine, theirs = json.loads(path.read_text()), json.loads(bundled[name].read_text())
        if name.endswith(".json"):
            for d in (mine, theirs):
                d.pop("transformers_version", None), d.pop("_name_or_path", None)
            assert mine == theirs, name
        else:
            assert path.read_bytes() == bundled[name].read_bytes(), name
    assert sum(p.stat().st_size for p in bundled.values()) < 1_000_000


def test_loader_reads_relative_paths_and_names_the_line(tmp_path):
    from unsloth_jax.data.vision_loader import load_vision_records

    records = load_vision_records(SAMPLE / "shapes_sample.jsonl")
    assert len(records) == 48 and records[0]["images"][0].mode == "RGB" and records[0]["images"][0].size == (40, 40)
    pixels = np.asarray(records[0]["images"][0])
    assert (pixels == np.asarray(records[0]["images"][0].getpixel((20, 20)))).all(-1).sum() > 50

    good = (SAMPLE / "shapes_sample.jsonl").read_text().splitlines()[0].replace(
        "images/", str(SAMPLE / "images") + "/")  # an absolute path works too
    (tmp_path / "bad.png").write_bytes(b"not a png")
    two_images = good.replace('"images": [', '"images": ["x.png", ')
    cases = {"line 3: invalid JSON": '{"messages": [',
             r"line 3: image file .*missing\.png not found": good.replace("00.png", "missing.png"),
             r"line 3: image file .*bad\.png cannot be decoded": good.replace(str(SAMPLE / "images/00.png"),
                                                                           "bad.png"),
             r"line 3: 1 image placeholder.* but 2 image\(s\)": two_images,
             r"line 3: no 'messages'": '{"images": []}',
             r"line 3, field 'messages': turn 0 is not": '{"messages": ["hi"], "images": []}',
             r"line 3: 'images' must be a list of image file paths": good.replace(
                 f'["{SAMPLE / "images/00.png"}"]', "[1]")}
    for message, line in cases.items():
        path = tmp_path / "data.jsonl"
        path.write_text("\n".join([good, good, line]) + "\n")
        with pytest.raises(DatasetFormatError, match=message):
            load_vision_records(path)
    path.write_text("\n".join([good, good]) + "\n")
    assert len(load_vision_records(path)) == 2


@pytest.mark.torch
def test_cli_vision_preset_halves_the_loss_and_peft_loads_the_adapter(tmp_path):
    """`unsloth-jax train --preset tiny-vision` (10 of its 30 steps): the bundled model is recognised as a vision-
    language model, the mean of the last 5 logged losses is at most half the first, and PEFT loads the adapter."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    from transformers import Gemma3ForConditionalGeneration

    from unsloth_jax.cli import main

    out = tmp_path / "run"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["-q", "train", "--preset", "tiny-vision", "--max_steps", "10", "--report_to", "none",
                   "--output_dir", str(out)])
    text = buf.getvalue()
    assert rc == 0, text
    assert "tiny-gemma3-vl (gemma3 vision-language, 2 + 2 layers) on 48 vision records" in text, text
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 10 and np.mean(losses[-5:]) <= 0.5 * losses[0], losses
    assert "unsloth-jax: 10 steps in" in text and f"adapter -> {out / 'adapter'}" in text
    print(f"loss {losses[0]:.3f} -> mean of the last 5 {np.mean(losses[-5:]):.3f}")

    base = Gemma3ForConditionalGeneration.from_pretrained(MODEL, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 20, 30, 40, 50]])
    before = base(input_ids=ids).logits
    tuned = peft.PeftModel.from_pretrained(base, out / "adapter").eval()
    adapted = [n for n, _ in tuned.named_modules() if n.endswith("lora_A.default")]
    assert adapted and all("language_model" in n for n in adapted)
    with torch.no_grad():
        assert (tuned(input_ids=ids).logits - before).abs().max() > 0.1


@pytest.mark.torch
def test_cli_vision_4bit_trains_and_qwen_is_recognised(tmp_path):
    """--load_in_4bit on the bundled vision model: QLoRA (said in the summary line), finite losses, an adapter.
    A Qwen2.5-VL folder is taken to the vision path too, and one without a processor is refused by name."""
    pytest.importorskip("torch")
    from tests import vl_qwen_models as qm
    from unsloth_jax.cli import _is_vision_model, main

    out = tmp_path / "run"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["-q", "train", "--preset", "tiny-vision", "--max_steps", "2", "--load_in_4bit", "--report_to",
                   "none", "--output_dir", str(out)])
    text = buf.getvalue()
    assert rc == 0, text
    assert "(gemma3 vision-language, 2 + 2 layers)" in text and "NF4 4-bit language model (QLoRA)" in text, text
    losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()
              if '"loss"' in line]
    assert len(losses) == 2 and np.all(np.isfinite(losses)), losses
    assert (out / "adapter" / "adapter_model.safetensors").is_file()

    qwen = tmp_path / "qwen"
    qm.hf_qwen_vl().save_pretrained(qwen)  # no processor files
    assert _is_vision_model(qwen) and _is_vision_model(MODEL) and not _is_vision_model(ASSETS / "tiny-llama")
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = main(["-q", "train", "--model_name", str(qwen), "--dataset", str(SAMPLE / "shapes_sample.jsonl"),
                   "--max_steps", "1", "--report_to", "none", "--output_dir", str(tmp_path / "qrun")])
    assert rc != 0 and f"{qwen}: no usable processor" in err.getvalue(), err.getvalue()


def test_cli_generates_from_the_vision_adapter_it_trained(tmp_path):
    """`unsloth-jax generate --model_name OUT/adapter --image PICTURE --prompt ...` after 2 steps of the
    tiny-vision preset: loads the vision adapter with FastVisionModel and prints an answer. --image on a text-only
    model, and a missing picture, are errors naming --image."""
    from unsloth_jax.cli import main

    out = tmp_path / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert main(["-q", "train", "--preset", "tiny-vision", "--max_steps", "2", "--report_to", "none",
                     "--output_dir", str(out)]) == 0
    picture = SAMPLE / "images" / "00.png"
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["-q", "generate", "--model_name", str(out / "adapter"), "--image", str(picture), "--prompt",
                   "What colour is the shape?", "--max_new_tokens", "8"])
    assert rc == 0 and buf.getvalue().strip(), buf.getvalue()
    print("generated:", repr(buf.getvalue()))

    for argv, message in (
            (["--model_name", str(ASSETS / "tiny-llama"), "--image", str(picture)],
             "--image needs a vision-language model"),
            (["--model_name", str(out / "adapter"), "--image", str(tmp_path / "missing.png")],
             f"--image {tmp_path / 'missing.png'}: file not found")):
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            rc = main(["-q", "generate", *argv, "--prompt", "hi", "--max_new_tokens", "2"])
        assert rc == 2 and message in err.getvalue(), err.getvalue()


def test_notebook_runs_shortened(tmp_path, monkeypatch):
    """notebooks/vision_finetune.ipynb, stored with a full run's outputs, runs top to bottom from a copy with
    them cleared, with VISION_STEPS=10 (quick XLA codegen: it mostly compiles): it shows the pictures and the loss curve, the loss halves, the adapter is
    saved. Its training arguments are the CLI test's (10 steps of the tiny-vision preset), so after that test the
    kernel loads the train step from the run's compile cache (tests/conftest.py) instead of compiling it."""
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    pytest.importorskip("ipykernel")
    pytest.importorskip("matplotlib")
    from tests.helpers import quick_codegen_flags, subprocess_env

    path = ROOT / "notebooks" / "vision_finetune.ipynb"
    book = nbformat.read(path, as_version=4)
    assert any(c.outputs for c in book.cells if c.cell_type == "code")  # what a user opening it sees
    for cell in book.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    monkeypatch.setenv("PYTHONPATH", subprocess_env()["PYTHONPATH"])
    monkeypatch.setenv("TQDM_DISABLE", "1")
    monkeypatch.setenv("VISION_STEPS", "10")
    if quick_codegen_flags():
        monkeypatch.setenv("XLA_FLAGS", quick_codegen_flags())
    client = nbclient.NotebookClient(book, timeout=240, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as e:
        pytest.fail(f"{path.name} failed:\n{str(e)[-4000:]}")
    outputs = [o for c in book.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    assert sum("image/png" in o.get("data", {}) for o in outputs) == 2  # the pictures and the loss curve
    text = "".join(o.get("text", "") for o in outputs if o.get("name") == "stdout")
    first, last = map(float, re.search(r"training loss (\d+\.\d+) -> (\d+\.\d+)", text).groups())
    assert last < 0.5 * first, text[-2000:]
    assert re.search(r"generated: '.*'\nlabel: ", text), text[-2000:]  # a picture described by model.generate
    assert (tmp_path / "outputs" / "vision" / "adapter" / "adapter_config.json").is_file()
