"""What the text-family parity tests (test_smollm3, test_qwen3_5, test_gemma4, test_glm4_moe, test_moe) share:
loading a checkpoint here and in transformers in float32, transformers' logits, right-padded batches, and the
two-step LoRA check. Imports torch: only for tests that compare against transformers."""
from __future__ import annotations

import numpy as np
import torch
import transformers
from flax import nnx

from unsloth_jax import FastLanguageModel, lora


def load_f32(path, **kw):
    """Our model of the checkpoint at `path`, float32, no tokenizer."""
    model, _ = FastLanguageModel.from_pretrained(path, dtype="float32", load_tokenizer=False, progress=False, **kw)
    return model


def hf_f32(path, **kw):
    """transformers' AutoModelForCausalLM of `path`, float32, eager attention."""
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager", **kw)


def torch_logits(m, ids, mask=None) -> np.ndarray:
    """Float32 logits [B, S, V] of a transformers model on ids [B, S] (and an attention mask)."""
    with torch.no_grad():
        kw = {} if mask is None else {"attention_mask": torch.tensor(np.asarray(mask), dtype=torch.long)}
        return m(torch.tensor(np.asarray(ids), dtype=torch.long), **kw).logits.float().numpy()


def right_padded(rng, lengths, vocab=256) -> tuple[np.ndarray, np.ndarray]:
    """(ids, mask) int64 [len(lengths), max(lengths)]: random tokens in [3, vocab), row i real for lengths[i]."""
    ids = np.zeros((len(lengths), max(lengths)), np.int64)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, :n] = rng.integers(3, vocab, size=n)
        mask[i, :n] = 1
    return ids, mask


def lora_steps_lower_the_loss(model, rng, vocab=256, lr=1e-3):
    """Two AdamW steps (remat "full") of a LoRA model on one random 2 x 16 micro-batch with a padded row tail
    (tokens in [3, vocab)): only LoRA factors train and the second loss is below the first. -> (graphdef, trained
    LoRA state, frozen state). Adam's first step moves every lora_b entry by lr whatever its gradient, so too large
    an lr can overshoot on a random model (Gemma 4: see its test)."""
    from unsloth_jax.train import make_optimizer, make_schedule, make_train_step

    g, t, f = lora.split(model)
    assert {p[-1] for p, _ in nnx.to_flat_state(t)} == {"lora_a", "lora_b"}
    ids = rng.integers(3, vocab, size=(1, 2, 16)).astype(np.int32)
    mask = np.ones_like(ids)
    mask[:, -1, -4:] = 0
    batch = {"input_ids": ids, "labels": np.where(mask == 1, ids, -100).astype(np.int32), "attention_mask": mask}
    opt = make_optimizer("adamw_torch", make_schedule("constant", lr, 10, 0))
    state = opt.init(t)
    step = make_train_step(g, opt, remat="full", donate=False)
    t1, state, m1 = step(t, f, state, batch)
    _, _, m2 = step(t1, f, state, batch)
    assert float(m2["loss"]) < float(m1["loss"]), (float(m1["loss"]), float(m2["loss"]))
    return g, t1, f


def trained_with_random_b(model, rng, lr=1e-3):
    """lora_steps_lower_the_loss on `model`, then every lora_b drawn at random (0.05 N(0, 1)) so that an adapter's
    every factor matters in what follows. -> (the trained model, ids [2, 18] right-padded, mask, real (bool mask),
    our float32 logits on them)."""
    g, t1, f = lora_steps_lower_the_loss(model, rng, lr=lr)
    model = nnx.merge(g, t1, f)
    for lin in model.projection_stacks().values():
        lin.lora_b[...] = np.asarray(0.05 * rng.standard_normal(lin.lora_b[...].shape), np.float32)
    ids, mask = right_padded(rng, [18, 11])
    return model, ids, mask, mask.astype(bool), np.asarray(model(ids, mask))


def assert_greedy_matches_transformers(hf, model, rng, lengths, *, new: int, eos: int) -> None:
    """A left-padded batch of random prompts of `lengths` tokens: our engine's greedy tokens (generation.generate,
    `new` tokens, eos id `eos`, pad 0) equal transformers' generate on the same batch."""
    from unsloth_jax.generation import generate

    width = max(lengths)
    ids = np.zeros((len(lengths), width), np.int64)
    mask = np.zeros_like(ids)
    for i, n in enumerate(lengths):
        ids[i, width - n:] = rng.integers(3, 256, size=n)
        mask[i, width - n:] = 1
    with torch.no_grad():
        ref = hf.generate(torch.tensor(ids), attention_mask=torch.tensor(mask), max_new_tokens=new, do_sample=False,
                          eos_token_id=[eos], pad_token_id=0).numpy()
    ours = generate(model, ids, mask, max_new_tokens=new, eos_token_id=[eos], pad_token_id=0)
    np.testing.assert_array_equal(ours, ref)


def assert_policies_equal_plain_stack(cfg, seed: int, modes=("offload", "full_every_2")) -> None:
    """A random CausalLM of `cfg` on 2 x 12 random ids: the loss (mean squared logits) and its gradients under each
    layer-stack policy of `modes` equal those of the plain stack ("none"): loss to 1e-6, each gradient leaf to 1e-4
    (float32 rounding of another summation order on small gradients)."""
    import jax
    import jax.numpy as jnp

    from tests.helpers import rel_err
    from unsloth_jax.models.decoder import CausalLM, make_batch
    from unsloth_jax.models.layer_stack import LayerStackPolicy

    graphdef, state = nnx.split(CausalLM(cfg, rngs=nnx.Rngs(seed % (1 << 30))))
    ids = jnp.asarray(np.random.default_rng(seed).integers(3, 256, size=(2, 12)), jnp.int32)

    def loss(state, policy):
        m = nnx.merge(graphdef, state)
        return jnp.mean(m.logits_from_hidden(m.hidden_states(ids, make_batch(ids), remat_mode=policy)) ** 2)

    want = jax.value_and_grad(loss)(state, LayerStackPolicy.parse("none"))
    for mode in modes:
        got = jax.value_and_grad(loss)(state, LayerStackPolicy.parse(mode))
        assert rel_err(got[0], want[0]) < 1e-6, mode
        for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1])):
            assert rel_err(g, w) < 1e-4, mode


def assert_lora_gradients_match_peft(model, path, tmp_path, rng, bound: float = 5e-3) -> int:
    """`model` (ours, with LoRA on the checkpoint at `path`) with every lora_b random: its PEFT adapter loaded by
    PEFT on transformers' model gives the same trainable count, and on a right-padded batch the same loss (1e-5)
    and LoRA gradients: per projection and factor over its layers, relative error below `bound` (each layer's
    pairs found by its submodule's rows, config.stack_holders, under the HF module name). -> the number of
    gradient tensors compared (every one PEFT has)."""
    import jax
    import jax.numpy as jnp

    from tests.helpers import rel_err
    from unsloth_jax.config import HF_MODULE, stack_holders

    for lin in model.projection_stacks().values():
        lin.lora_b[...] = np.asarray(0.05 * rng.standard_normal(lin.lora_b[...].shape), np.float32)
    model.save_pretrained(tmp_path / "adapter")
    import peft

    pm = peft.PeftModel.from_pretrained(hf_f32(path), str(tmp_path / "adapter"), is_trainable=True)
    assert model.get_nb_trainable_parameters() == pm.get_nb_trainable_parameters()
    ids, mask = right_padded(rng, [14, 10])
    labels = np.where(mask == 1, ids, -100)
    out = pm(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    out.loss.backward()
    want = {n: p.grad.numpy() for n, p in pm.named_parameters() if p.grad is not None}
    g, t, f = lora.split(model)

    def loss(t):
        logp = jax.nn.log_softmax(nnx.merge(g, t, f)(ids, mask)[:, :-1], -1)
        lab = jnp.asarray(labels[:, 1:])
        nll = -jnp.take_along_axis(logp, jnp.maximum(lab, 0)[..., None], -1)[..., 0]
        return jnp.sum(nll * (lab >= 0)) / jnp.sum(lab >= 0)

    value, grads = jax.value_and_grad(loss)(t)
    assert abs(float(value) - float(out.loss)) < 1e-5 * abs(float(out.loss))
    checked, ours_by, theirs_by = 0, {}, {}
    for p, v in nnx.to_flat_state(grads):
        sub, proj, kind = p[-3:]
        for r, i in enumerate(stack_holders(model.config, sub)):
            key = (f"base_model.model.model.layers.{i}.{HF_MODULE.get(sub, sub)}.{proj}.lora_{kind[-1].upper()}"
                   ".default.weight")
            if key in want:
                ours_by.setdefault((proj, kind), []).append(np.asarray(v[...])[r].ravel())
                theirs_by.setdefault((proj, kind), []).append(want[key].T.ravel())
                checked += 1
    for what in ours_by:
        assert rel_err(np.concatenate(ours_by[what]), np.concatenate(theirs_by[what])) < bound, what
    assert checked == len(want), (checked, len(want))
    return checked
