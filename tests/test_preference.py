"""DPO / ORPO: the chunked per-token log-probabilities, the losses against TRL's formulas (transcribed in torch),
log-probabilities against transformers, the reference as the base without a copy, TRL's tokenization, adapters."""
from __future__ import annotations

import json
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
F = torch.nn.functional

from pallas_kernels import reference as ref  # noqa: E402
from tests.helpers import TINY_MODEL, rel_err  # noqa: E402
from tests.hf_models import save_hf_model  # noqa: E402
from unsloth_jax import DPOConfig, DPOTrainer, FastLanguageModel, ORPOConfig, ORPOTrainer  # noqa: E402
from unsloth_jax.errors import DatasetFormatError, TrainingError  # noqa: E402
from unsloth_jax.train import preference as P  # noqa: E402


# ------------------------------------------------------------------------------------------------ helpers
def _torch_completion_logps(hf_model, batch: dict) -> dict:
    """Per-row sums of log softmax(logits)[next token] over completion tokens and over every real token after
    the first, from a transformers model (the independent truth for our log-probabilities)."""
    ids = torch.tensor(batch["input_ids"], dtype=torch.long)
    att = torch.tensor(batch["attention_mask"], dtype=torch.long)
    with torch.no_grad():
        logits = hf_model(input_ids=ids, attention_mask=att).logits.float()
    lp = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    comp = torch.tensor(batch["completion_mask"][:, 1:], dtype=torch.float32)
    real = att[:, 1:].float()
    return {"logps": (lp * comp).sum(-1).numpy(), "lengths": comp.sum(-1).numpy(),
            "all_logps": (lp * real).sum(-1).numpy(), "all_lengths": real.sum(-1).numpy()}


def _hf(path):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                             attn_implementation="eager").eval()


def _tiny(r=8, seed=3407):
    model, tok = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    model = FastLanguageModel.get_peft_model(model, r=r, lora_alpha=2 * r, use_gradient_checkpointing=False,
                                             random_state=seed)
    return model, tok


def _pairs(n=4, offset=0):
    return [{"prompt": f"Question {i + offset}: what is {i} plus {i}?",
             "chosen": f" It is {2 * i}.", "rejected": f" Maybe {2 * i + 3}, or something else."} for i in range(n)]


# ------------------------------------------------------------------------------------- per-token log-probs
def test_token_logprobs_equals_full_log_softmax(rng):
    """The chunked per-token log-probabilities (ragged T, several chunks, softcap, temperature, ignored labels)
    and their gradients equal log_softmax over materialised logits."""
    t, d, v = 37, 16, 50
    h = jnp.asarray(rng.standard_normal((t, d)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((v, d)) * 0.3, jnp.float32)
    labels = rng.integers(0, v, t).astype(np.int32)
    labels[[3, 20]] = -100
    labels = jnp.asarray(labels)
    cot = jnp.asarray(rng.standard_normal(t), jnp.float32)

    def naive(h, w):
        z = h @ w.T
        z = 30.0 * jnp.tanh(z / 30.0) / 0.7
        lp = jnp.take_along_axis(jax.nn.log_softmax(z, -1), jnp.maximum(labels, 0)[:, None], -1)[:, 0]
        return jnp.where(labels != -100, lp, 0.0)

    def chunked(h, w):
        return ref.token_logprobs(h, w, labels, softcap=30.0, temperature=0.7, chunk_size=8)

    np.testing.assert_allclose(np.asarray(chunked(h, w)), np.asarray(naive(h, w)), rtol=1e-5, atol=1e-5)
    g_ours = jax.grad(lambda h, w: jnp.sum(chunked(h, w) * cot), argnums=(0, 1))(h, w)
    g_ref = jax.grad(lambda h, w: jnp.sum(naive(h, w) * cot), argnums=(0, 1))(h, w)
    for a, b in zip(g_ours, g_ref):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("softcap", [None, 30.0])
def test_token_mean_logits_equals_the_full_logits_mean(softcap, rng):
    """The vocabulary mean of each token's logits without [T, V] logits (linear without softcap, chunked with it)
    equals the mean of the full logits, over ragged chunks."""
    import jax.numpy as jnp
    from unsloth_jax import ops

    h = jnp.asarray(rng.normal(size=(37, 16)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(101, 16)) * 2, jnp.float32)
    z = h @ w.T
    if softcap is not None:
        z = softcap * jnp.tanh(z / softcap)
    got = ops.token_mean_logits(h, w, softcap=softcap, chunk=16)
    np.testing.assert_allclose(np.asarray(got), np.asarray(z.mean(-1)), rtol=1e-5, atol=1e-5)


def test_sequence_logps_match_transformers(tmp_path, rng):
    """Our per-sequence completion log-probabilities of right-padded prompt + completion rows equal the ones
    transformers computes for the same tiny Llama."""
    save_hf_model("llama", tmp_path, seed=int(rng.integers(1 << 30)))
    model, _ = FastLanguageModel.from_pretrained(tmp_path, dtype="float32", load_tokenizer=False, progress=False)
    pairs = [{"prompt_ids": rng.integers(4, 256, int(rng.integers(2, 9))).tolist(),
              "chosen_ids": rng.integers(4, 256, int(rng.integers(1, 12))).tolist(),
              "rejected_ids": rng.integers(4, 256, int(rng.integers(1, 12))).tolist()} for _ in range(3)]
    batch = P.pair_batch(pairs, pad_id=0, max_length=None)
    graphdef, state = nnx.split(model)
    ours = jax.jit(lambda s, b: P.sequence_stats(nnx.merge(graphdef, s), b))(state, batch)
    theirs = _torch_completion_logps(_hf(tmp_path), batch)
    for key in ("logps", "all_logps"):
        assert rel_err(ours[key], theirs[key]) < 1e-5, key
    np.testing.assert_array_equal(np.asarray(ours["lengths"]), theirs["lengths"])
    expect = [len(p["chosen_ids"]) for p in pairs] + [len(p["rejected_ids"]) for p in pairs]
    np.testing.assert_array_equal(theirs["lengths"], expect)


# ------------------------------------------------------------------------------------------------ losses
def _trl_dpo(pc, pr, rc, rr, beta, loss_type, ls, lc, lr):
    """TRL's DPO losses (trl/trainer/dpo_trainer.py; sigmoid with label smoothing as TRL <= 0.28), in torch."""
    pc, pr, rc, rr, lc, lr = (torch.tensor(np.asarray(x), dtype=torch.float64) for x in (pc, pr, rc, rr, lc, lr))
    chosen_lr, rejected_lr = pc - rc, pr - rr
    logits = chosen_lr - rejected_lr
    if loss_type == "sigmoid":
        out = -F.logsigmoid(beta * logits) * (1 - ls) - F.logsigmoid(-beta * logits) * ls
    elif loss_type == "hinge":
        out = torch.relu(1 - beta * logits)
    elif loss_type == "ipo":
        out = (chosen_lr / lc.clamp(min=1.0) - rejected_lr / lr.clamp(min=1.0) - 1 / (2 * beta)) ** 2
    else:  # robust
        out = (-(1 - ls) * F.logsigmoid(beta * logits) - (-ls * F.logsigmoid(-beta * logits))) / (1 - 2 * ls)
    return out.numpy()


@pytest.mark.parametrize("loss_type", P.DPO_LOSS_TYPES)
def test_dpo_loss_equals_trl_formula(loss_type, rng):
    b = 16
    pc, pr = -rng.uniform(5, 60, b), -rng.uniform(5, 60, b)
    rc, rr = pc + rng.normal(0, 3, b), pr + rng.normal(0, 3, b)
    lc, lr = rng.integers(1, 40, b).astype(np.float64), rng.integers(1, 40, b).astype(np.float64)
    for beta in (0.1, float(rng.uniform(0.01, 1.0))):
        for ls in (0.0, float(rng.uniform(0.01, 0.4))):
            ours = P.dpo_loss(*(jnp.asarray(x, jnp.float32) for x in (pc, pr, rc, rr)), beta=beta,
                              loss_type=loss_type, label_smoothing=ls, chosen_lengths=jnp.asarray(lc, jnp.float32),
                              rejected_lengths=jnp.asarray(lr, jnp.float32))
            theirs = _trl_dpo(pc, pr, rc, rr, beta, loss_type, ls, lc, lr)
            assert rel_err(ours, theirs) < 2e-5, (beta, ls)


def test_orpo_and_preference_metrics_equal_trl_formula(rng):
    b = 12
    ac, ar = -rng.uniform(0.01, 5, b), -rng.uniform(0.01, 5, b)  # per-token average log-probabilities (< 0)
    ac[0], ar[1] = -1e-4, -0.69  # both branches of log1mexp
    t_ac, t_ar = torch.tensor(ac), torch.tensor(ar)

    def log1mexp(x):  # TRL's, trl/experimental/orpo/orpo_trainer.py
        return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))

    log_odds = (t_ac - t_ar) - (log1mexp(t_ac) - log1mexp(t_ar))
    ours_odds, ours_ratio = P.orpo_odds_ratio(jnp.asarray(ac, jnp.float32), jnp.asarray(ar, jnp.float32))
    assert rel_err(ours_odds, log_odds.numpy()) < 1e-5
    assert rel_err(ours_ratio, F.logsigmoid(log_odds).numpy()) < 1e-5
    # the full ORPO objective on fixed sequence statistics: nll(chosen) - beta * mean(logsigmoid(log_odds))
    beta = float(rng.uniform(0.05, 1))
    lengths = rng.integers(1, 30, 2 * b).astype(np.float64)
    pol = {"logps": np.concatenate([ac, ar]) * lengths, "lengths": lengths,
           "all_logps": -rng.uniform(10, 90, 2 * b), "all_lengths": rng.integers(5, 50, 2 * b).astype(np.float64),
           "logit_sums": rng.normal(0, 3, 2 * b) * lengths}
    loss, metrics = P.orpo_objective(ORPOConfig(output_dir="unused", beta=beta))(
        {k: jnp.asarray(v, jnp.float32) for k, v in pol.items()}, None)
    nll = -pol["all_logps"][:b].sum() / pol["all_lengths"][:b].sum()
    assert abs(float(loss) - (nll - beta * F.logsigmoid(log_odds).mean().item())) < 1e-4
    assert abs(float(metrics["rewards/margins"]) - beta * np.mean(ac - ar)) < 1e-5
    assert abs(float(metrics["rewards/accuracies"]) - np.mean(ac > ar)) < 1e-6
    assert abs(float(metrics["log_odds_chosen"]) - log_odds.mean().item()) < 1e-4
    # TRL's logits/chosen: per-token mean logits averaged over every completion token of the chosen rows
    for name, rows in (("logits/chosen", slice(0, b)), ("logits/rejected", slice(b, None))):
        expect = pol["logit_sums"][rows].sum() / lengths[rows].sum()
        assert abs(float(metrics[name]) - expect) < 1e-5 * max(1.0, abs(expect))


def test_dpo_objective_combines_weighted_losses_and_logs_trl_keys(rng):
    b = 6
    pol = {"logps": jnp.asarray(-rng.uniform(5, 40, 2 * b), jnp.float32),
           "lengths": jnp.asarray(rng.integers(1, 20, 2 * b), jnp.float32),
           "logit_sums": jnp.asarray(rng.normal(0, 40, 2 * b), jnp.float32)}
    refs = {"logps": pol["logps"] + jnp.asarray(rng.normal(0, 2, 2 * b), jnp.float32)}
    cfg = DPOConfig(output_dir="unused", loss_type=["sigmoid", "ipo"], loss_weights=[0.8, 0.2], beta=0.3)
    loss, m = P.dpo_objective(cfg)(pol, refs)
    pc, pr, rc, rr = (np.asarray(x, np.float64) for x in (pol["logps"][:b], pol["logps"][b:], refs["logps"][:b],
                                                          refs["logps"][b:]))
    lc, lr = np.asarray(pol["lengths"][:b]), np.asarray(pol["lengths"][b:])
    expect = (0.8 * _trl_dpo(pc, pr, rc, rr, 0.3, "sigmoid", 0.0, lc, lr).mean()
              + 0.2 * _trl_dpo(pc, pr, rc, rr, 0.3, "ipo", 0.0, lc, lr).mean())
    assert abs(float(loss) - expect) < 1e-4 * max(1.0, abs(expect))
    chosen_r, rejected_r = 0.3 * (pc - rc), 0.3 * (pr - rr)
    np.testing.assert_allclose(float(m["rewards/chosen"]), chosen_r.mean(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(float(m["rewards/margins"]), (chosen_r - rejected_r).mean(), rtol=1e-5, atol=1e-5)
    assert abs(float(m["rewards/accuracies"]) - np.mean(chosen_r > rejected_r)) < 1e-6
    np.testing.assert_allclose(float(m["logps/rejected"]), pr.mean(), rtol=1e-6)


# -------------------------------------------------------------------------------------------- the trainer
@pytest.fixture(scope="module")
def dpo_run(tmp_path_factory):
    """A short DPO run on the bundled tiny model: 4 pairs in one batch, so every step sees the same pairs."""
    model, tok = _tiny()
    out = tmp_path_factory.mktemp("dpo")
    args = DPOConfig(output_dir=str(out), per_device_train_batch_size=4, max_steps=4, logging_steps=1,
                     learning_rate=2e-3, beta=0.1)
    trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=_pairs(4), processing_class=tok)
    result = trainer.train()
    return trainer, result, out


def test_dpo_first_loss_is_ln2_and_reference_is_the_base(dpo_run):
    """Step 1: policy == reference (LoRA B = 0), so the sigmoid loss is ln 2 and the logged log-probabilities
    are the base model's (transformers). Later steps: the policy moves, and the reference implied by the logged
    rewards (logps - rewards / beta) is still the base, i.e. the adapters were switched off for it."""
    trainer, result, _ = dpo_run
    hist = [e for e in trainer.state.log_history if "rewards/margins" in e]
    assert len(hist) == 4 and [e["step"] for e in hist] == [1, 2, 3, 4]
    assert abs(hist[0]["loss"] - math.log(2)) < 1e-6
    assert abs(hist[0]["rewards/chosen"]) < 1e-5 and abs(hist[0]["rewards/margins"]) < 1e-5
    batch = P.pair_batch(trainer.train_pairs, trainer.pad_id, trainer.args.max_length)
    base = _torch_completion_logps(_hf(TINY_MODEL), batch)
    b = len(trainer.train_pairs)
    base_chosen, base_rejected = base["logps"][:b].mean(), base["logps"][b:].mean()
    assert abs(hist[0]["logps/chosen"] - base_chosen) < 1e-3 * abs(base_chosen)
    assert abs(hist[0]["logps/rejected"] - base_rejected) < 1e-3 * abs(base_rejected)
    # TRL's logits/chosen and logits/rejected: the base's logits averaged over vocabulary and completion tokens
    with torch.no_grad():
        logits = _hf(TINY_MODEL)(input_ids=torch.tensor(batch["input_ids"], dtype=torch.long),
                                 attention_mask=torch.tensor(batch["attention_mask"])).logits.float()[:, :-1]
    comp = torch.tensor(batch["completion_mask"][:, 1:]).bool()
    for name, rows in (("logits/chosen", slice(0, b)), ("logits/rejected", slice(b, None))):
        want = float(logits[rows][comp[rows]].mean())
        assert abs(hist[0][name] - want) < 1e-4 * max(abs(want), 1.0), (name, hist[0][name], want)
    last = hist[-1]
    assert last["rewards/margins"] > 0.05 and last["loss"] < math.log(2) - 0.02  # it learned the preference
    assert abs(last["logps/chosen"] - base_chosen) > 0.1  # the policy is no longer the base ...
    implied_ref = last["logps/chosen"] - last["rewards/chosen"] / trainer.args.beta
    assert abs(implied_ref - base_chosen) < 2e-3 * abs(base_chosen)  # ... but the reference is
    assert result.global_step == 4 and "train_runtime" in result.metrics
    assert trainer.state.log_history[-1]["step"] == 4 and "train_loss" in trainer.state.log_history[-1]
    for key in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins", "logps/chosen",
                "logps/rejected", "logits/chosen", "logits/rejected", "loss", "grad_norm", "learning_rate", "epoch"):
        assert key in hist[0], key


def test_reference_shares_the_frozen_arrays(dpo_run):
    """ref_model=None keeps no second copy of the base: the split state gives no reference weights and no new
    kernel-sized buffer (the frozen state views the model's own buffers), and the compiled step takes exactly
    the policy's arguments (trainable, frozen, optimizer state, batch) and closes over no weight-sized constant,
    so the reference forward can only read the same frozen arrays."""
    trainer, _, _ = dpo_run
    kernel_shapes = {tuple(v.shape) for p, v in nnx.to_flat_state(nnx.state(trainer.model)) if p[-1] == "kernel"}

    def kernel_buffers():  # device buffers (several jax.Array objects may view one) of kernel-shaped arrays
        return {a.unsafe_buffer_pointer() for a in jax.live_arrays() if tuple(a.shape) in kernel_shapes}

    before = kernel_buffers()
    graphdef, trainable, frozen, ref_trainable = trainer.split_state(need_reference=True)
    assert ref_trainable is None
    assert kernel_buffers() == before  # the frozen state holds the model's own buffers
    model_kernels = {p: v for p, v in nnx.to_flat_state(nnx.state(trainer.model)) if p[-1] == "kernel"}
    for p, v in nnx.to_flat_state(frozen):
        if p[-1] == "kernel":
            assert v.get_value().unsafe_buffer_pointer() == model_kernels[p].get_value().unsafe_buffer_pointer()
    schedule, optimizer = trainer.make_optimizer(2)
    opt_state = optimizer.init(trainable)
    step = P.make_preference_step(graphdef, optimizer, trainer.objective(), needs_reference=True, remat="none")
    batch = P.stack_micro_batches([P.pair_batch(trainer.train_pairs, trainer.pad_id, None)], trainer.pad_id)
    jaxpr = jax.make_jaxpr(step)(trainable, frozen, opt_state, None, batch)
    n_args = len(jax.tree.leaves((trainable, frozen, opt_state, batch)))
    assert len(jaxpr.jaxpr.invars) == n_args
    smallest = min(int(np.prod(s)) for s in kernel_shapes)
    consts = list(jaxpr.consts)
    for eqn in jaxpr.jaxpr.eqns:  # the jitted step's own closed-over constants
        inner = eqn.params.get("jaxpr")
        consts += list(getattr(inner, "consts", ()))
    assert not [c for c in consts if np.size(c) >= smallest]


def test_dpo_step_under_the_offload_scan_equals_no_remat(dpo_run):
    """remat "offload" (the custom-VJP layer scan of unsloth_jax.models.offload; its host copies are no-ops on
    the CPU) gives the DPO step's loss and LoRA gradients (SGD with rate 1: the update is the gradient) of the
    step without remat, with the policy model under it and the reference (no gradient) beside it."""
    import optax

    trainer, _, _ = dpo_run
    graphdef, trainable, frozen, _ = trainer.split_state(need_reference=True)
    optimizer = optax.sgd(1.0)
    batch = P.stack_micro_batches([P.pair_batch(trainer.train_pairs, trainer.pad_id, None)], trainer.pad_id)
    out = {}
    for remat in ("none", "offload"):
        step = P.make_preference_step(graphdef, optimizer, trainer.objective(), needs_reference=True, remat=remat)
        fresh = jax.tree.map(jnp.copy, trainable)  # the step donates its trainable and optimizer state
        new, _, m = step(fresh, frozen, optimizer.init(fresh), None, batch)
        grads = [np.asarray(b) - np.asarray(a) for a, b in zip(jax.tree.leaves(new), jax.tree.leaves(trainable))]
        out[remat] = (float(m["loss"]), grads)
    # f32 sums in another order (the offload scan's backward pass recomputes and reorders): a few ulps per token
    assert abs(out["offload"][0] - out["none"][0]) <= 1e-5 * abs(out["none"][0])
    assert any(np.any(g != 0) for g in out["none"][1])
    for a, b in zip(out["offload"][1], out["none"][1]):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b) + 1e-12  # LoRA A's gradient is 0 while B is


def test_dpo_step_never_holds_full_logits(dpo_run):
    """With chunk=32, no value of the traced DPO step (forward, reference and backward) has a vocabulary axis
    and more than 32 rows: [rows, seq, vocab] logits are never materialised."""
    trainer, _, _ = dpo_run
    graphdef, trainable, frozen, _ = trainer.split_state(need_reference=True)
    _, optimizer = trainer.make_optimizer(2)
    step = P.make_preference_step(graphdef, optimizer, trainer.objective(), needs_reference=True, remat="none",
                                  chunk=32)
    batch = P.stack_micro_batches([P.pair_batch(trainer.train_pairs, trainer.pad_id, None)], trainer.pad_id)
    v, d = trainer.model.config.vocab_size, trainer.model.config.hidden_size
    assert batch["input_ids"][0].size > 4 * 32  # the full logits would be several chunks
    jaxpr = jax.make_jaxpr(step)(trainable, frozen, optimizer.init(trainable), None, batch)
    sizes = []

    def visit(jp):
        for eqn in jp.eqns:
            for var in eqn.outvars:
                shape = tuple(getattr(var.aval, "shape", ()))
                if v in shape and sorted(shape) != sorted((v, d)):
                    sizes.append(int(np.prod(shape)))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jaxpr.jaxpr)
    assert sizes and max(sizes) <= 32 * v, max(sizes)


def test_dpo_adapter_saves_and_loads_in_peft(dpo_run, tmp_path, rng):
    """The DPO-trained adapter is a PEFT adapter: transformers + PEFT reproduce our logits, and
    FastLanguageModel.from_pretrained loads it back."""
    import peft

    trainer, _, _ = dpo_run
    model = trainer.model
    ids = rng.integers(4, model.config.vocab_size, size=(2, 12))
    ours = np.asarray(model(ids))
    model.save_pretrained(tmp_path / "adapter")
    pm = peft.PeftModel.from_pretrained(_hf(TINY_MODEL), str(tmp_path / "adapter")).eval()
    with torch.no_grad():
        theirs = pm(torch.tensor(ids)).logits.float().numpy()
    assert rel_err(ours, theirs) < 1e-5
    back, _ = FastLanguageModel.from_pretrained(tmp_path / "adapter", dtype="float32", progress=False)
    assert rel_err(np.asarray(back(ids)), ours) < 1e-6


def test_orpo_trains_and_logs_trl_keys(tmp_path):
    model, tok = _tiny(r=4)
    args = ORPOConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                      max_steps=3, logging_steps=1, learning_rate=3e-3, beta=0.2)
    trainer = ORPOTrainer(model=model, args=args, train_dataset=_pairs(4), eval_dataset=_pairs(3, offset=10),
                          processing_class=tok)
    trainer.train()
    hist = [e for e in trainer.state.log_history if "nll_loss" in e]
    evals = trainer.state.log_history[-2]  # the eval entry, before the run summary (transformers' order)
    assert evals["step"] == 3 and np.isfinite(evals["eval_loss"]) and "eval_rewards/margins" in evals
    assert "train_runtime" in trainer.state.log_history[-1]
    assert len(hist) == 3
    for key in ("nll_loss", "log_odds_ratio", "log_odds_chosen", "rewards/chosen", "rewards/margins",
                "logps/chosen", "logps/rejected"):
        assert np.isfinite(hist[0][key]), key
    # loss = nll - beta * log_odds_ratio at every logged step (means over the same micro-batches)
    for e in hist:
        assert abs(e["loss"] - (e["nll_loss"] - 0.2 * e["log_odds_ratio"])) < 1e-5
    assert hist[-1]["nll_loss"] < hist[0]["nll_loss"]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[0])["step"] == 1


# ------------------------------------------------------------------------------------------ data and args
def test_tokenize_pairs_follows_trl(tmp_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(TINY_MODEL))
    std = {"prompt": "Name a colour.", "chosen": " Blue.", "rejected": " A colour."}
    ex = P.tokenize_pairs([std], tok, max_length=1024)[0]
    prompt_ids = tok(std["prompt"])["input_ids"]
    assert ex["prompt_ids"] == prompt_ids and prompt_ids[0] == tok.bos_token_id
    assert ex["chosen_ids"] == tok(std["prompt"] + std["chosen"] + tok.eos_token)["input_ids"][len(prompt_ids):]
    assert ex["chosen_ids"][-1] == tok.eos_token_id
    # implicit prompt: the common prefix of chosen and rejected
    implicit = P.tokenize_pairs([{"chosen": std["prompt"] + std["chosen"], "rejected": std["prompt"] +
                                  std["rejected"]}], tok, max_length=1024)[0]
    assert implicit == ex
    conv = {"prompt": [{"role": "user", "content": "Name a colour."}],
            "chosen": [{"role": "assistant", "content": "Blue."}],
            "rejected": [{"role": "assistant", "content": "A colour."}]}
    cex = P.tokenize_pairs([conv], tok, max_length=1024)[0]
    gen_prompt = tok.apply_chat_template(conv["prompt"], tokenize=True, add_generation_prompt=True,
                                         return_dict=True)["input_ids"]
    full = tok.apply_chat_template(conv["prompt"] + conv["chosen"], tokenize=True, return_dict=True)["input_ids"]
    assert cex["prompt_ids"] == list(gen_prompt) and cex["chosen_ids"] == list(full)[len(gen_prompt):]
    # max_length keeps the start; a prompt filling max_length drops the pair
    assert P.tokenize_pairs([std], tok, max_length=len(prompt_ids)) == []
    batch = P.pair_batch([ex], pad_id=3, max_length=len(prompt_ids) + 2)
    assert batch["attention_mask"].sum(axis=1).tolist() == [len(prompt_ids) + 2] * 2
    assert batch["completion_mask"].sum(axis=1).tolist() == [2, 2]
    with pytest.raises(DatasetFormatError, match=r"train_dataset\[1\].*'rejected'"):
        P.tokenize_pairs([std, {"prompt": "x", "chosen": "y"}], tok, max_length=64)


def test_configs_and_trainer_arguments_are_checked():
    assert DPOConfig(output_dir="o").learning_rate == 1e-6 and DPOConfig(output_dir="o").loss_type == ["sigmoid"]
    with pytest.raises(ValueError, match="loss_type"):
        DPOConfig(output_dir="o", loss_type="bogus")
    with pytest.raises(ValueError, match="beta"):
        DPOConfig(output_dir="o", beta=0.0)
    with pytest.raises(ValueError, match="label_smoothing"):
        DPOConfig(output_dir="o", label_smoothing=0.5)
    with pytest.raises(ValueError, match="loss_weights"):
        DPOConfig(output_dir="o", loss_type=["sigmoid", "hinge"], loss_weights=[1.0])
    with pytest.raises(ValueError, match="max_length"):
        ORPOConfig(output_dir="o", max_length=0)
    model, tok = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    with pytest.raises(TrainingError, match="get_peft_model"):
        DPOTrainer(model=model, train_dataset=_pairs(2), processing_class=tok)
    model = FastLanguageModel.get_peft_model(model, r=2, lora_alpha=2, use_gradient_checkpointing=False)
    # older TRL took DPO parameters as trainer arguments: they override args
    trainer = DPOTrainer(model=model, args=DPOConfig(output_dir="o"), beta=0.25, max_length=32,
                         train_dataset=_pairs(2), processing_class=tok)
    assert trainer.args.beta == 0.25 and trainer.args.max_length == 32
    with pytest.raises(TypeError, match="bogus"):
        DPOTrainer(model=model, bogus=1, train_dataset=_pairs(2), processing_class=tok)
    with pytest.raises(TrainingError, match="processing_class"):
        DPOTrainer(model=model, train_dataset=_pairs(2))
