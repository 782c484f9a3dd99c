"""The text families' registry: every supported text model_type is read by exactly one TextFamily, defined in one
module of unsloth_jax/families/, and a new family needs nothing beyond its module and its TEXT_FAMILIES entry (a
throwaway family for a fake model_type, with Llama's tables, loads and exports a tiny checkpoint that
transformers' Llama agrees with)."""
from __future__ import annotations

import ast
import importlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from safetensors.numpy import load_file  # noqa: E402

from tests.family_checks import load_f32, right_padded, torch_logits  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import families  # noqa: E402
from unsloth_jax.errors import UnsupportedArchitectureError  # noqa: E402
from unsloth_jax.families import LLAMA, TEXT_FAMILIES, TextFamily, family_for, family_of, text_config  # noqa: E402

FAMILIES_DIR = Path(families.__file__).parent


def _top_level_bindings() -> dict[str, list[tuple[str, str]]]:
    """family variable name -> [(module, name)] of every top-level `NAME = ...` in families/*.py."""
    out: dict[str, list[tuple[str, str]]] = {}
    for f in sorted(FAMILIES_DIR.glob("*.py")):
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        out.setdefault(t.id, []).append((f.stem, t.id))
    return out


def test_every_text_model_type_has_one_family_defined_in_one_module():
    bindings = _top_level_bindings()
    claimed: dict[str, list[str]] = {}
    for family in TEXT_FAMILIES:
        assert isinstance(family, TextFamily)
        for t in family.model_types:
            claimed.setdefault(t, []).append(family.name)
        # the module that assigns it (imports elsewhere are not definitions)
        homes = [(mod, name) for name, places in bindings.items() for mod, _ in places
                 if mod != "__init__" and getattr(importlib.import_module(f"unsloth_jax.families.{mod}"), name,
                                                  None) is family]
        assert len(homes) == 1, (family.name, homes)
    assert {t: n for t, n in claimed.items() if len(n) > 1} == {}
    assert set(claimed) == set(families.TEXT_BY_TYPE) and families.TEXT_BY_TYPE == families.text_families()
    assert not set(claimed) & set(families.VISION_FAMILIES)
    for t, family in families.TEXT_BY_TYPE.items():
        assert family_for({"model_type": t}) is family
    with pytest.raises(UnsupportedArchitectureError, match=r"model_type 'bert' is not supported; supported model "
                                                           r"types: llama, mistral, .*glm4_moe$"):
        text_config({"model_type": "bert"})
    with pytest.raises(UnsupportedArchitectureError, match="is a vision-language model; load it with FastVisionModel"):
        text_config({"model_type": "qwen2_5_vl"})


def test_a_new_family_is_one_module_plus_one_entry(tmp_path, monkeypatch, rng, seed):
    """A throwaway family (Llama's parsing and tensor table under a fake model_type), registered the way one
    entry in TEXT_FAMILIES registers it, loads a tiny Llama checkpoint relabelled as its type with transformers'
    logits, and its merged export writes back the same tensors under its type."""
    toy = TextFamily("Toy", ("toy_llama",), config_fields=LLAMA.config_fields, layer_tensors=LLAMA.layer_tensors)
    monkeypatch.setattr(families, "TEXT_FAMILIES", TEXT_FAMILIES + (toy,))
    monkeypatch.setattr(families, "TEXT_BY_TYPE", families.text_families())

    src = tmp_path / "llama"
    hf = save_hf_model("llama", src, seed=seed)
    toy_dir = tmp_path / "toy"
    shutil.copytree(src, toy_dir)
    config = json.loads((toy_dir / "config.json").read_text())
    (toy_dir / "config.json").write_text(json.dumps(config | {"model_type": "toy_llama"}))

    model = load_f32(toy_dir)
    assert model.config.model_type == "toy_llama" and family_of(model) is toy
    ids, mask = right_padded(rng, [12, 7])
    real = mask.astype(bool)
    assert rel_err(np.asarray(model(ids, mask))[real], torch_logits(hf, ids, mask)[real]) < 1e-5

    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["model_type"] == "toy_llama"
    want = {k: v for f in sorted(src.glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    got = {k: v for f in sorted((tmp_path / "merged").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    assert got.keys() == want.keys()
    for name, value in want.items():
        np.testing.assert_array_equal(got[name], value, err_msg=name)
