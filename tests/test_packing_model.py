"""A packed row (DataLoader packing: segment ids + restarted positions) gives each example the same loss as
running it alone: no attention or position leaks across packed examples."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("torch")

from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import FastLanguageModel  # noqa: E402
from unsloth_jax.data import DataLoader  # noqa: E402
from unsloth_jax.train.step import loss_and_count  # noqa: E402


def test_packed_loss_equals_unpacked(tmp_path, rng):
    save_hf_model("qwen2", tmp_path, seed=31)
    model, _ = FastLanguageModel.from_pretrained(tmp_path, dtype="float32", load_tokenizer=False, progress=False)
    lengths = [int(n) for n in rng.integers(5, 20, size=3)]
    examples = [{"input_ids": rng.integers(1, 256, size=n).tolist()} for n in lengths]
    loader = DataLoader(examples, batch_size=1, max_seq_length=64, pad_token_id=0, packing=True, shuffle=False)
    packed = {k: jnp.asarray(v) for k, v in loader.batch(0, 0).items()}
    assert int(packed["segment_ids"].max()) == 3  # all three examples share one row

    def loss(batch):
        value, n = loss_and_count(model, batch, remat="none")
        return float(value) * int(n), int(n)

    packed_sum, packed_n = loss(packed)
    alone_sum = alone_n = 0
    for ex in examples:
        ids = jnp.asarray([ex["input_ids"]], jnp.int32)
        s, n = loss({"input_ids": ids, "labels": ids, "attention_mask": jnp.ones_like(ids)})
        alone_sum += s
        alone_n += n
    assert packed_n == alone_n == sum(lengths) - 3
    np.testing.assert_allclose(packed_sum, alone_sum, rtol=1e-5)
