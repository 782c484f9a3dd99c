"""Bad checkpoints give clear errors naming the file/key; sharded checkpoints load."""
from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel, errors  # noqa: E402
from unsloth_jax.hf import safetensors_io  # noqa: E402


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_hf_model("llama", path)
    return path


def _copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def _load(path):
    return FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)


def test_missing_directory(tmp_path):
    with pytest.raises(errors.CheckpointNotFoundError, match="not found"):
        _load(tmp_path / "nope")


def test_missing_config(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    (d / "config.json").unlink()
    with pytest.raises(errors.CheckpointNotFoundError, match="config.json"):
        _load(d)


def test_unknown_model_type_lists_supported(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "falcon"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(errors.UnsupportedArchitectureError, match="falcon.*llama, mistral, qwen2, qwen3, gemma, gemma2"):
        _load(d)


def _rewrite(d, fn):
    path = d / "model.safetensors"
    with safetensors_io.SafetensorsFile(path) as f:
        tensors = {k: np.array(f.get(k)) for k in f.keys()}
    safetensors_io.save_file(fn(tensors), path)


def test_missing_tensor_is_named(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    _rewrite(d, lambda t: {k: v for k, v in t.items() if k != "model.layers.1.mlp.up_proj.weight"})
    with pytest.raises(errors.MissingTensorError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        _load(d)


def test_extra_tensor_is_named(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    _rewrite(d, lambda t: t | {"model.layers.0.mlp.extra.weight": np.ones((2, 2), np.float32)})
    with pytest.raises(errors.UnexpectedTensorError, match=r"model\.layers\.0\.mlp\.extra\.weight"):
        _load(d)


def test_shape_mismatch_names_key_and_shapes(llama_dir, tmp_path):
    d = _copy(llama_dir, tmp_path)
    _rewrite(d, lambda t: t | {"model.layers.0.self_attn.q_proj.weight": np.ones((64, 63), np.float32)})
    with pytest.raises(errors.ShapeMismatchError, match=r"q_proj\.weight.*\[64, 63\].*\[64, 64\]"):
        _load(d)


@pytest.mark.parametrize("damage", ["truncate", "header_len", "bad_json"])
def test_corrupt_safetensors(llama_dir, tmp_path, damage):
    d = _copy(llama_dir, tmp_path)
    path = d / "model.safetensors"
    raw = path.read_bytes()
    if damage == "truncate":
        raw = raw[: len(raw) // 2]
    elif damage == "header_len":
        raw = struct.pack("<Q", 10**12) + raw[8:]
    else:
        n = struct.unpack("<Q", raw[:8])[0]
        raw = raw[:8] + b"{" * n + raw[8 + n:]
    path.write_bytes(raw)
    with pytest.raises(errors.CorruptCheckpointError, match="model.safetensors"):
        _load(d)


def test_sharded_checkpoint_and_bf16(tmp_path, rng):
    hf = save_hf_model("qwen2", tmp_path / "one", seed=3)
    hf.save_pretrained(str(tmp_path / "sharded"), max_shard_size="60KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    ids = rng.integers(0, 256, size=(2, 16))
    a = np.asarray(_load(tmp_path / "one")[0](ids))
    b = np.asarray(_load(tmp_path / "sharded")[0](ids))
    np.testing.assert_array_equal(a, b)
    with torch.no_grad():
        ref = hf(torch.tensor(ids)).logits.numpy()
    m16, _ = FastLanguageModel.from_pretrained(tmp_path / "one", dtype="bfloat16", load_tokenizer=False, progress=False)
    assert m16.model.layers.self_attn.q_proj.kernel[...].dtype == np.dtype("bfloat16")
    assert rel_err(np.asarray(m16(ids)), ref) < 3e-2


def test_safetensors_roundtrip_matches_reference_library(tmp_path, rng):
    import ml_dtypes
    from safetensors.numpy import load_file

    tensors = {"a": rng.standard_normal((3, 5)).astype(np.float32), "b": np.arange(7, dtype=np.int64),
               "c": rng.standard_normal((4,)).astype(np.float16)}
    safetensors_io.save_file(tensors, tmp_path / "x.safetensors", metadata={"format": "pt"})
    loaded = load_file(str(tmp_path / "x.safetensors"))
    for k, v in tensors.items():
        np.testing.assert_array_equal(loaded[k], v)
    bf = rng.standard_normal((2, 3)).astype(ml_dtypes.bfloat16)
    safetensors_io.save_file({"w": bf}, tmp_path / "y.safetensors")
    with safetensors_io.SafetensorsFile(tmp_path / "y.safetensors") as f:
        np.testing.assert_array_equal(np.array(f.get("w")), bf)


def test_a_row_outside_its_stack_is_refused_not_clamped():
    """A tensor spec whose row lies outside its stack (a table bug) raises naming the tensor, instead of jax's
    dynamic update clamping it onto the last row of another layer."""
    import jax.numpy as jnp

    from unsloth_jax.families.tensors import TensorSpec
    from unsloth_jax.hf.loading import _into_stack

    params = {}
    first = TensorSpec("model.layers.0.mlp.up_proj.weight", ("up",), 0, "kernel", (3, 2), slot=0)
    params["up"] = _into_stack(params, first, jnp.ones((2, 3)), 2, "ckpt/model.safetensors: " + first.hf_name)
    bad = TensorSpec("model.layers.5.mlp.up_proj.weight", ("up",), 5, "kernel", (3, 2), slot=5)
    with pytest.raises(errors.ShapeMismatchError, match=r"layers\.5\.mlp\.up_proj.*row 5 of a 2-row stack"):
        _into_stack(params, bad, jnp.ones((2, 3)), 2, "ckpt/model.safetensors: " + bad.hf_name)
