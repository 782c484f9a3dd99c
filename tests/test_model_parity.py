"""Logits of every family equal transformers' (float32, relative error < 1e-5), with padding and windows."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from tests.helpers import rel_err  # noqa: E402
from tests.hf_models import FAMILIES, save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family)
        out[family] = (path, save_hf_model(family, path, seed=len(family)))
    return out


def _hf_logits(model, ids, mask, positions=None):
    with torch.no_grad():
        kw = {"attention_mask": torch.tensor(mask)}
        if positions is not None:
            kw["position_ids"] = torch.tensor(positions)
        return model(torch.tensor(ids), **kw).logits.float().numpy()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_logits_match_transformers_right_padding(family, checkpoints, rng):
    path, hf = checkpoints[family]
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
    b, s = 3, 24  # longer than the sliding windows (8) of mistral / gemma2
    ids = rng.integers(0, 256, size=(b, s)).astype(np.int64)
    lengths = np.array([s, s - 5, 11])
    mask = (np.arange(s)[None] < lengths[:, None]).astype(np.int64)
    ref = _hf_logits(hf, ids, mask)
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    err = rel_err(out[real], ref[real])
    assert err < 1e-5, f"{family}: relative error {err:.2e}"


@pytest.mark.parametrize("family", ["llama", "gemma2", "qwen3"])
def test_logits_match_transformers_left_padding(family, checkpoints, rng):
    path, hf = checkpoints[family]
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False)
    b, s = 2, 20
    ids = rng.integers(0, 256, size=(b, s)).astype(np.int64)
    mask = np.ones((b, s), np.int64)
    mask[1, :7] = 0  # left padding
    positions = np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ref = _hf_logits(hf, ids, mask, positions)
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    err = rel_err(out[real], ref[real])
    assert err < 1e-5, f"{family}: relative error {err:.2e}"
