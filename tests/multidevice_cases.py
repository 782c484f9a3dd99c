"""Multi-device cases run in a subprocess with forced CPU devices (tests/test_distributed.py launches them).

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m tests.multidevice_cases CASE SEED [ARGS_JSON]
    XLA_FLAGS=... python -m tests.multidevice_cases batch SEED '{"NAME": ["CASE", {ARGS}], ...}'

The device count must be fixed before jax initializes, so cases run in a process started for them and print one
JSON line (prefixed RESULT) that the test reads; `batch` runs several cases of one device count in one process
(one start, one set of eager compiles) and prints one RESULT line per case: {"name", "result"} or {"name",
"error"} (its traceback), so a case that raises fails only its own test. The truth each case compares with is
the same computation on one device (no mesh), in the same process.
"""
from __future__ import annotations

import functools
import json
import re
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from unsloth_jax import distributed, lora
from unsloth_jax.config import ModelConfig
from unsloth_jax.families import text_config
from unsloth_jax.models.decoder import CausalLM
from unsloth_jax.quant import quantize_projections
from unsloth_jax.train import make_optimizer, make_schedule, make_train_step

SMALL = dict(model_type="llama", vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32)


def built_once(make):
    """`make(*args)`, a model, built once per process for each `args`; every call returns a new model (nnx.merge)
    holding copies of that one's arrays, so a step that donates its inputs leaves the kept state intact. The
    cases build the same initial model for the truth and for each mesh: a copy costs far less than the random
    init (and quantization) again."""
    kept = {}

    @functools.wraps(make)
    def fresh(*args):
        key = json.dumps(args, sort_keys=True)
        if key not in kept:
            kept[key] = nnx.split(make(*args))
        graphdef, state = kept[key]
        return nnx.merge(graphdef, jax.tree.map(lambda x: jnp.copy(x) if isinstance(x, jax.Array) else x, state))

    return fresh


@built_once
def tiny_lora_model(seed: int, qlora: bool, cfg: dict = SMALL):
    """A random-init decoder with LoRA on every projection (B nonzero, so the adapter matters at step 0)."""
    model = CausalLM(ModelConfig(**cfg), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    if qlora:
        quantize_projections(model)
    lora.add_lora(model, lora.LoraSettings(r=4, lora_alpha=8, target_modules=lora.ALL_TARGETS),
                  jax.random.PRNGKey(seed + 1))
    for i, lin in enumerate(model.projections().values()):
        b = lin.lora_b.get_value()
        lin.lora_b.set_value(0.05 * jax.random.normal(jax.random.PRNGKey(seed + 2 + i), b.shape, b.dtype))
    return model


def random_batch(rng, accum: int, rows: int, seq: int, vocab: int) -> dict:
    ids = rng.integers(0, vocab, (accum, rows, seq)).astype(np.int32)
    mask = np.ones_like(ids)
    lengths = rng.integers(seq // 2, seq + 1, (accum, rows))
    mask[np.arange(seq)[None, None, :] >= lengths[..., None]] = 0  # right padding of random lengths
    return {"input_ids": ids, "labels": np.where(mask == 1, ids, -100).astype(np.int32), "attention_mask": mask}


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def run_steps(model, mesh, batches, optim: str, keys=("loss", "grad_norm"), remat: str = "full"):
    """({metric: values per step} for `keys`, final trainable leaves) of len(batches) train steps of `model`."""
    graphdef, trainable, frozen = lora.split(model)
    opt = make_optimizer(optim, make_schedule("constant", 0.5 if optim == "sgd" else 1e-2, 10, 0))
    opt_state = opt.init(trainable)
    step = make_train_step(graphdef, opt, remat=remat, mesh=mesh)
    if mesh is not None:
        trainable, frozen, opt_state = distributed.shard_state(mesh, (trainable, frozen, opt_state))
    history = {k: [] for k in keys}
    for batch in batches:
        trainable, opt_state, m = step(trainable, frozen, opt_state, batch)
        for k in keys:
            history[k].append(float(m[k]))
    return history, [np.asarray(x) for x in jax.tree.leaves(trainable)]


def train_steps(seed: int, qlora: bool, mesh, batches, optim: str, remat: str = "full"):
    """Losses, grad norms and final trainable leaves of len(batches) steps from the same initial state."""
    history, leaves = run_steps(tiny_lora_model(seed, qlora), mesh, batches, optim, remat=remat)
    return history["loss"], history["grad_norm"], leaves


def _equal_steps_batches(seed: int) -> list[dict]:
    rng = np.random.default_rng(seed)
    return [random_batch(rng, 2, 8, 16, SMALL["vocab_size"]) for _ in range(2)]


@functools.cache
def _single_device_steps(seed: int, kind: str, optim: str):
    """case_equal_steps' truth: the steps on one device ("full" remat); computed once per process for the
    cases that share it (the qlora "full" and "offload" cases of one batch)."""
    return train_steps(seed, kind == "qlora", None, _equal_steps_batches(seed), optim)


def case_equal_steps(seed: int, kind: str = "lora", optim: str = "sgd", remat: str = "full"):
    """The sharded step's losses and updated LoRA leaves against one device (per-layer "full" remat), for
    data-only, fsdp-only, mixed meshes, each step under `remat` ("offload": the prefetched custom-VJP layer scan,
    whose host copies are no-ops on the CPU)."""
    batches = _equal_steps_batches(seed)
    ref_losses, ref_norms, ref_leaves = _single_device_steps(seed, kind, optim)
    out = {"reference": ref_losses}
    initial = jax.tree.leaves(lora.split(tiny_lora_model(seed, kind == "qlora"))[1])
    for data, fsdp in ((8, 1), (1, 8), (2, 4)):
        losses, norms, leaves = train_steps(seed, kind == "qlora", distributed.make_mesh(data, fsdp), batches, optim,
                                            remat=remat)
        out[f"data={data},fsdp={fsdp}"] = {
            "losses": losses,
            "loss_relerr": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "grad_norm_relerr": max(abs(a - b) / abs(b) for a, b in zip(norms, ref_norms)),
            "param_relerr": max(_rel(a, b) for a, b in zip(leaves, ref_leaves)),
            "param_change": min(_rel(a, b) for a, b in zip(leaves, initial)),
        }
    return out


# Qwen3-MoE: layers MoE, dense, MoE (period 2 and a tail of 1), the load-balancing loss on
MOE = dict(model_type="qwen3_moe", vocab_size=320, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
           num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
           num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1], output_router_logits=True,
           router_aux_loss_coef=0.1)


@built_once
def tiny_moe_model(seed: int):
    """A random-init MoE model with LoRA on q/v and on the experts (B nonzero)."""
    model = CausalLM(text_config(MOE), dtype=jnp.float32, rngs=nnx.Rngs(seed))
    lora.add_lora(model, lora.LoraSettings(r=4, lora_alpha=8, target_modules=("q_proj", "v_proj"),
                                           target_parameters=("mlp.experts.gate_up_proj", "mlp.experts.down_proj")),
                  jax.random.PRNGKey(seed + 1))
    lins = list(model.projections().values()) + list(model.expert_projections().values())
    for i, lin in enumerate(x for x in lins if x.lora_b is not None):
        b = lin.lora_b.get_value()
        lin.lora_b.set_value(0.05 * jax.random.normal(jax.random.PRNGKey(seed + 2 + i), b.shape, b.dtype))
    return model


def moe_train_steps(seed: int, mesh, batches):
    """Losses, aux losses and final trainable leaves of the MoE model's steps."""
    history, leaves = run_steps(tiny_moe_model(seed), mesh, batches, "sgd", keys=("loss", "aux_loss"))
    return history["loss"], history["aux_loss"], leaves


def case_moe_equal_steps(seed: int):
    """The MoE step (grouped expert GEMMs, router statistics of both scans) on a mesh against one device."""
    rng = np.random.default_rng(seed)
    batches = [random_batch(rng, 2, 4, 16, MOE["vocab_size"]) for _ in range(2)]
    ref_losses, ref_aux, ref_leaves = moe_train_steps(seed, None, batches)
    out = {"reference": ref_losses, "reference_aux": ref_aux}
    for data, fsdp in ((4, 1), (2, 2)):
        losses, aux, leaves = moe_train_steps(seed, distributed.make_mesh(data, fsdp), batches)
        out[f"data={data},fsdp={fsdp}"] = {
            "loss_relerr": max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)),
            "aux_relerr": max(abs(a - b) / abs(b) for a, b in zip(aux, ref_aux)),
            "param_relerr": max(_rel(a, b) for a, b in zip(leaves, ref_leaves)),
        }
    return out


# ------------------------------------------------------------------------------------ DPO and GRPO
def _rl_batches(seed: int) -> tuple[dict, dict]:
    """A DPO batch [A=2, 2B=4, S=16] (chosen rows first; a prompt of 4 to 6 tokens, then the completion) and a
    GRPO batch [A=2, B=4, S=16] (prompt + completion, random advantages, stale old log-probabilities, reference
    log-probabilities: every term of the loss), with right padding of random lengths."""
    rng = np.random.default_rng(seed)
    base = random_batch(rng, 2, 4, 16, SMALL["vocab_size"])
    ids, mask = base["input_ids"], base["attention_mask"]
    prompt = rng.integers(4, 7, (2, 4))
    completion = (mask == 1) & (np.arange(16)[None, None, :] >= prompt[..., None])
    pairs = {"input_ids": ids, "attention_mask": mask, "completion_mask": completion.astype(np.int32)}
    grpo = dict(pairs, advantages=rng.normal(0, 1, (2, 4)).astype(np.float32),
                old_logps=rng.normal(-6, 0.3, (2, 4, 15)).astype(np.float32),
                ref_logps=rng.normal(-6, 0.3, (2, 4, 15)).astype(np.float32),
                num_items=np.float32(completion.sum()))
    return pairs, grpo


def _rl_step(kind: str, seed: int, mesh):
    """(metrics, updated trainable leaves) of one DPO or GRPO step (SGD: the update is the gradient times 10;
    "full" remat) on `mesh` or one device."""
    import optax

    from unsloth_jax.train.grpo import GRPOConfig, make_grpo_step
    from unsloth_jax.train.preference import DPOConfig, dpo_objective, make_preference_step

    graphdef, trainable, frozen = lora.split(tiny_lora_model(seed, False))
    optimizer = optax.sgd(10.0)  # large enough that every leaf moves far beyond the tolerance
    opt_state = optimizer.init(trainable)
    dpo_batch, grpo_batch = _rl_batches(seed)
    if kind == "dpo":
        step = make_preference_step(graphdef, optimizer, dpo_objective(DPOConfig(beta=0.1)), needs_reference=True,
                                    remat="full", mesh=mesh)
        trainable, _, metrics = step(trainable, frozen, opt_state, None, dpo_batch)
    else:
        cfg = GRPOConfig(num_generations=2, per_device_train_batch_size=4, gradient_accumulation_steps=2,
                         max_completion_length=12, beta=0.04)
        step = make_grpo_step(graphdef, optimizer, cfg, remat="full", mesh=mesh)
        trainable, _, metrics = step(trainable, frozen, opt_state, grpo_batch)
    return {k: float(v) for k, v in metrics.items()}, [np.asarray(x) for x in jax.tree.leaves(trainable)]


def case_rl_equal_steps(seed: int):
    """A DPO step on a data=2 mesh and a GRPO step on an fsdp=2 mesh (two micro-batches each; the DPO trainer case
    runs on fsdp=2) against one device: the largest relative error of their metrics and of the updated LoRA
    leaves, and how far the leaves moved."""
    out = {}
    initial = jax.tree.leaves(lora.split(tiny_lora_model(seed, False))[1])
    for kind, (data, fsdp) in (("dpo", (2, 1)), ("grpo", (1, 2))):
        ref_metrics, ref_leaves = _rl_step(kind, seed, None)
        metrics, leaves = _rl_step(kind, seed, distributed.make_mesh(data, fsdp))
        out[kind] = {"mesh": f"data={data},fsdp={fsdp}", "loss": ref_metrics["loss"],
                     "param_change": min(_rel(a, b) for a, b in zip(ref_leaves, initial)),
                     # DPO's rewards/* are beta x differences of ~-90 log-prob sums, near 0: float32 cancellation
                     # leaves up to 3.3e-7 absolute between the two placements (30 seeds), so errors relative to
                     # at least 1e-2
                     "metric_relerr": max(abs(metrics[k] - v) / max(abs(v), 1e-2) for k, v in ref_metrics.items()),
                     "param_relerr": max(_rel(a, b) for a, b in zip(leaves, ref_leaves))}
    return out


def _dpo_trainer_run(seed: int, output_dir: str, mesh: str | None, per_device: int) -> dict:
    """DPOTrainer (ORPO shares its code) for 3 steps of 2 accumulated micro-batches on the bundled tiny Llama:
    its logged losses and margins, and how many devices hold the trained LoRA leaves."""
    from tests.helpers import TINY_MODEL
    from unsloth_jax import FastLanguageModel
    from unsloth_jax.train.preference import DPOConfig, DPOTrainer

    model, tok = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, use_gradient_checkpointing=True,
                                             random_state=seed)
    pairs = [{"prompt": f"Question {i}: what is {i} plus {i}?", "chosen": f" It is {2 * i}.",
              "rejected": f" Maybe {2 * i + 3}, or something else."} for i in range(12)]
    args = DPOConfig(output_dir=output_dir, per_device_train_batch_size=per_device, gradient_accumulation_steps=2,
                     max_steps=3, logging_steps=1, learning_rate=5e-3, beta=0.1, seed=seed, save_steps=0, mesh=mesh)
    trainer = DPOTrainer(model=model, ref_model=None, args=args, train_dataset=pairs, processing_class=tok)
    trainer.train()
    hist = [e for e in trainer.state.log_history if "rewards/margins" in e]
    return {"losses": [e["loss"] for e in hist], "margins": [e["rewards/margins"] for e in hist],
            "devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(lora.split(model)[1])})}


def case_dpo_trainer(seed: int, output_dir: str):
    """DPOTrainer with mesh="data=1,fsdp=2" and 2 pairs per device against one device with 4 pairs: the same
    pairs per step (the order is seeded by the global batch), so the same logged losses and margins."""
    return {"mesh": _dpo_trainer_run(seed, f"{output_dir}/dpo-mesh", "data=1,fsdp=2", 2),
            "single": _dpo_trainer_run(seed, f"{output_dir}/dpo-single", None, 4)}


def _grpo_trainer_run(seed: int, output_dir: str, mesh: str | None, per_device: int) -> dict:
    """GRPOTrainer for 3 steps (beta and num_iterations=2: the old / reference log-probabilities are scored on the
    mesh too; step 3 generates again, with the weights the mesh trained) on the bundled tiny Llama with a length
    reward: logged losses, rewards and KL, every generation's completions, a sample of the trained LoRA values, and
    where the model's LoRA leaves are after training. With a mesh the model starts with its frozen weights sharded
    over it (as an earlier SFTTrainer on the mesh leaves them), so the trainer must gather them for its rollouts."""
    from tests.helpers import TINY_MODEL
    from unsloth_jax import FastLanguageModel
    from unsloth_jax.train.grpo import GRPOConfig, GRPOTrainer

    model, tok = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    model = FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, use_gradient_checkpointing=True,
                                             random_state=seed)
    if mesh is not None:  # as an earlier SFTTrainer on the mesh leaves it: frozen weights sharded over the devices
        from unsloth_jax import distributed

        m = distributed.resolve_mesh(mesh)
        frozen = lora.split(model)[2]
        nnx.update(model, distributed.put(frozen, distributed.state_shardings(m, frozen)))
    prompts = [{"prompt": f"Count to {i}:"} for i in range(8)]
    args = GRPOConfig(output_dir=output_dir, per_device_train_batch_size=per_device, num_generations=2,
                      max_completion_length=6, max_steps=3, logging_steps=1, learning_rate=1e-2, beta=0.1,
                      num_iterations=2, save_steps=0, seed=seed % 1000, mesh=mesh)
    seen = []

    def length(completions, **kwargs):
        seen.append(list(completions))
        return [float(len(c)) for c in completions]

    trainer = GRPOTrainer(model=model, reward_funcs=length, args=args, train_dataset=prompts, processing_class=tok)
    trainer.train()
    hist = [e for e in trainer.state.log_history if "reward" in e]
    _, trained, frozen = lora.split(model)
    values = np.concatenate([np.ravel(np.asarray(x)) for x in jax.tree.leaves(trained)])
    return {"losses": [e["loss"] for e in hist], "rewards": [e["reward"] for e in hist], "kl": [e["kl"] for e in hist],
            "completions": seen, "lora_sample": values[::97].tolist(), "lora_norm": float(np.linalg.norm(values)),
            "devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(trained)}),
            "with_frozen": {frozenset(x.sharding.device_set) for x in jax.tree.leaves(trained)}
            == {frozenset(x.sharding.device_set) for x in jax.tree.leaves(frozen)}}


def case_grpo_trainer(seed: int, output_dir: str):
    """GRPOTrainer with mesh="data=1,fsdp=2" and 2 completions per device against one device with 4: the same
    prompts and sampling seeds, so the same completions, and the same logged losses and KL."""
    return {"mesh": _grpo_trainer_run(seed, f"{output_dir}/grpo-mesh", "data=1,fsdp=2", 2),
            "single": _grpo_trainer_run(seed, f"{output_dir}/grpo-single", None, 4)}


def _vision_trainer_run(family: str, output_dir: str, mesh: str | None, per_device: int) -> dict:
    """SFTTrainer with UnslothVisionDataCollator for 2 steps of 2 accumulated micro-batches on a tiny random
    Gemma 3 or Qwen2.5-VL (LoRA on both towers, records with 1 or 2 images of several sizes): its logged losses
    and grad norms, and how many devices hold the trained LoRA leaves."""
    import os

    from tests import vl_models, vl_qwen_models as qm
    from tests.test_vision_qwen_sft import squares
    from unsloth_jax import FastVisionModel, SFTConfig, SFTTrainer, UnslothVisionDataCollator

    base = f"{output_dir}/{family}-base"
    if family == "gemma3":
        hf, processor = vl_models.hf_gemma3(), vl_models.processor()
        records = vl_models.shapes_dataset(4)
        records[1]["messages"][0]["content"].insert(0, {"type": "image"})  # 2 images in one row
        records[1]["images"] = records[1]["images"] * 2
    else:
        hf, processor = qm.hf_qwen_vl(processor_vocab=True), qm.processor()
        records = squares([[(16, 16), (16, 24)], [(24, 16)], [(16, 16)], [(24, 24)]])
    if not os.path.exists(base):
        hf.save_pretrained(base)
    model, _ = FastVisionModel.from_pretrained(base, dtype="float32", load_processor=False)
    model = FastVisionModel.get_peft_model(model, r=4, lora_alpha=8, finetune_vision_layers=True,
                                           use_gradient_checkpointing=True, random_state=3)
    args = SFTConfig(per_device_train_batch_size=per_device, gradient_accumulation_steps=2, max_steps=2,
                     learning_rate=1e-2, logging_steps=1, output_dir=f"{output_dir}/{family}-{mesh}", report_to="none",
                     remove_unused_columns=False, dataset_text_field="", save_steps=0,
                     dataset_kwargs={"skip_prepare_dataset": True}, max_length=64, mesh=mesh)
    trainer = SFTTrainer(model=model, tokenizer=processor, data_collator=UnslothVisionDataCollator(model, processor),
                         train_dataset=records, args=args)
    trainer.train()
    hist = [e for e in trainer.state.log_history if "grad_norm" in e]
    return {"losses": [e["loss"] for e in hist], "grad_norms": [e["grad_norm"] for e in hist],
            "devices": sorted({len(x.sharding.device_set) for x in jax.tree.leaves(lora.split(model)[1])})}


def case_vision_trainer(seed: int, output_dir: str):
    """SFTTrainer on vision-language batches on a mesh (Gemma 3 on data=2, Qwen2.5-VL on fsdp=2) with 1 row per
    device against one device with 2 rows: the same rows per step, so the same logged losses and grad norms."""
    return {family: {"mesh": _vision_trainer_run(family, output_dir, mesh, 1),
                     "single": _vision_trainer_run(family, output_dir, None, 2)}
            for family, mesh in (("gemma3", "data=2,fsdp=1"), ("qwen2_5_vl", "data=1,fsdp=2"))}


# ------------------------------------------------------------------------------------------- HLO
def _computations(hlo: str) -> dict[str, str]:
    """HLO module text -> {computation name: its text}."""
    comps = {}
    for block in re.split(r"\n(?=\S)", hlo):
        m = re.match(r"(?:ENTRY )?%?([\w.\-]+)", block)
        if m:
            comps[m.group(1)] = block
    return comps


def _loop_computations(comps: dict[str, str]) -> set[str]:
    """Names of the computations run inside some while loop's body (transitively)."""
    inside = set()
    todo = [b for text in comps.values() for b in re.findall(r"body=%?([\w.\-]+)", text)]
    while todo:
        name = todo.pop()
        if name in inside or name not in comps:
            continue
        inside.add(name)
        todo += re.findall(r"(?:body|condition|to_apply|calls|branch_computations)=\{?%?([\w.\-]+)", comps[name])
    return inside


def all_gathers(hlo: str) -> list[tuple[tuple[int, ...], bool]]:
    """(result shape, inside a while loop) of every all-gather of a compiled module."""
    comps = _computations(hlo)
    loops = _loop_computations(comps)
    found = []
    for name, text in comps.items():
        for m in re.finditer(r"= \(?(\w+)\[([\d,]*)\][^=]*? all-gather(?:-start)?\(", text):
            shape = tuple(int(d) for d in m.group(2).split(",") if d)
            found.append((shape, name in loops))
    return found


def _squeeze(shape):
    return tuple(d for d in shape if d != 1)


def case_fsdp_shards(seed: int):
    """fsdp=8: every large frozen leaf lives in 8 distinct shards; the compiled step gathers the stacked
    weights one layer at a time inside the layer loop and never gathers a whole stack."""
    out = {}
    for kind in ("lora", "qlora"):
        model = tiny_lora_model(seed, kind == "qlora")
        graphdef, trainable, frozen = lora.split(model)
        opt = make_optimizer("adamw_torch", make_schedule("constant", 1e-3, 10, 0))
        mesh = distributed.make_mesh(data=1, fsdp=8)
        trainable, frozen, opt_state = distributed.shard_state(mesh, (trainable, frozen, opt.init(trainable)))
        leaves = []
        for path, leaf in jax.tree_util.tree_leaves_with_path(frozen):
            spec = leaf.sharding.spec
            shards = leaf.addressable_shards
            leaves.append({
                "path": jax.tree_util.keystr(path), "shape": list(leaf.shape), "bytes": int(leaf.nbytes),
                "spec": str(spec), "devices": len(leaf.sharding.device_set),
                "distinct_shard_shapes": sorted({tuple(s.data.shape) for s in shards}),
                "shard_elems_total": int(sum(np.prod(s.data.shape) for s in shards)),
                "elems": int(np.prod(leaf.shape)),
                # the shards tile the array: concatenating their data in index order gives the array back
                "reassembled": bool(np.array_equal(_reassemble(leaf), np.asarray(leaf))),
                "stacked": "layers" in jax.tree_util.keystr(path),
            })
        batch = random_batch(np.random.default_rng(seed), 2, 8, 16, SMALL["vocab_size"])
        step = make_train_step(graphdef, opt, remat="full", mesh=mesh, donate=False)
        hlo = step.lower(trainable, frozen, opt_state, batch).compile().as_text()
        gathers = all_gathers(hlo)
        dense_shapes = {shape for lin in model.projections().values()
                        for shape in ((lin.in_features, lin.out_features), (lin.out_features, lin.in_features))}
        stacked = [tuple(x["shape"]) for x in leaves if x["stacked"] and "fsdp" in x["spec"]]
        out[kind] = {
            "leaves": leaves,
            "whole_stack_gathers": [list(s) for s, _ in gathers if s in stacked],
            "layer_gathers_in_loop": sum(1 for s, inside in gathers if inside and _squeeze(s) in
                                         {_squeeze(t[1:]) for t in stacked}),
            "layer_gathers_outside_loop": sum(1 for s, inside in gathers if not inside and _squeeze(s) in
                                              {_squeeze(t[1:]) for t in stacked}),
            "sharded_stacked_leaves": len(stacked),
            # [rows, S, D] activations (8 rows) or their [rows * (S - 1), D] flattening for the loss (S = 16)
            "activation_gathers": [list(s) for s, _ in gathers if s and s[0] in (8, 8 * 15)],
            # a 4-bit base must be gathered as codes, never as dequantized [in, out] weights
            "dense_projection_gathers": [list(s) for s, _ in gathers if _squeeze(s) in dense_shapes],
        }
    return out


def _reassemble(leaf) -> np.ndarray:
    full = np.zeros(leaf.shape, leaf.dtype)
    for s in leaf.addressable_shards:
        full[s.index] = np.asarray(s.data)
    return full


# -------------------------------------------------------------------------------------- memory
MEMORY_CFG = dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=4, head_dim=32)


def case_memory(seed: int, single: bool = True):
    """Bytes per device of the compiled step (memory_analysis) on 8 devices with fsdp 1, 2, 4, 8 (data = 8 /
    fsdp, so one row per device), and on one device with all 8 rows when `single`."""
    rows = []
    for kind in ("lora", "qlora"):
        batch = random_batch(np.random.default_rng(seed), 1, 8, 64, MEMORY_CFG["vocab_size"])
        for fsdp in ((None,) if single else ()) + (1, 2, 4, 8):
            model = tiny_lora_model(seed, kind == "qlora", MEMORY_CFG)
            graphdef, trainable, frozen = lora.split(model)
            opt = make_optimizer("adamw_torch", make_schedule("constant", 1e-3, 10, 0))
            opt_state = opt.init(trainable)
            mesh = None if fsdp is None else distributed.make_mesh(data=8 // fsdp, fsdp=fsdp)
            step = make_train_step(graphdef, opt, remat="full", mesh=mesh)
            compiled = step.lower(trainable, frozen, opt_state, batch).compile()
            m = compiled.memory_analysis()
            rows.append({"kind": kind, "mesh": distributed.describe(mesh) if mesh else "1 device",
                         "fsdp": fsdp, "per_device": distributed.compiled_memory_per_device(compiled),
                         "arguments": int(m.argument_size_in_bytes), "temp": int(m.temp_size_in_bytes),
                         "frozen_bytes": int(sum(x.nbytes for x in jax.tree.leaves(frozen)))})
    return rows


# --------------------------------------------------------------------------------- pallas on a mesh
def case_pallas_on_mesh(seed: int):
    """The Pallas kernels (interpret mode) inside the sharded QLoRA step run per batch shard (shard_map) and
    give the single-device step's losses and LoRA leaves."""
    from unsloth_jax import ops

    forced = ("rms_norm", "glu", "cross_entropy", "nf4_matmul", "rope", "attention")
    for op in forced:
        ops.set_impl(op, "pallas")
    try:  # the choices of this case's steps only (a batch traces other cases' steps in this process too)
        with ops.recording_choices() as seen:
            rng = np.random.default_rng(seed)
            batches = [random_batch(rng, 1, 8, 16, SMALL["vocab_size"])]
            ref = train_steps(seed, True, None, batches, "sgd")
            mesh = distributed.make_mesh(data=2, fsdp=4)
            got = train_steps(seed, True, mesh, batches, "sgd")
            graphdef, trainable, frozen = lora.split(tiny_lora_model(seed, True))
            opt = make_optimizer("sgd", make_schedule("constant", 1e-2, 10, 0))
            step = make_train_step(graphdef, opt, remat="full", mesh=mesh, donate=False)
            text = step.lower(trainable, frozen, opt.init(trainable), batches[0]).as_text()
    finally:
        for op in forced:
            ops.set_impl(op, "auto")
    chosen = {op: "+".join(impls) for op, impls in sorted(seen.items())}
    return {"loss_relerr": max(abs(a - b) / abs(b) for a, b in zip(got[0], ref[0])),
            "param_relerr": max(_rel(a, b) for a, b in zip(got[2], ref[2])), "chosen": chosen,
            # shard_map lowers to a manual computation (Shardy) or full-to-shard custom calls (GSPMD)
            "manual_regions": text.count("sdy.manual_computation") + text.count("SPMDFullToShardShape")}


# ---------------------------------------------------------------------------------------- trainer
def case_trainer(seed: int, output_dir: str, mesh: str | None, per_device: int, max_steps: int, save_steps: int = 0,
                 resume: bool = False, shard_trainable: bool = False):
    """SFTTrainer on the bundled tiny Llama over random token examples; returns the loss history and where
    the trained LoRA leaves live. shard_trainable: split even small trainable leaves (and their optimizer
    state) over fsdp, so a checkpoint holds sharded arrays."""
    from tests.helpers import TINY_MODEL
    from unsloth_jax import FastLanguageModel, SFTTrainer, TrainingArguments

    if shard_trainable:  # restored below, for the cases run after this one in a batch
        saved, distributed.MIN_TRAINABLE_SHARD_BYTES = distributed.MIN_TRAINABLE_SHARD_BYTES, 0
        try:
            return case_trainer(seed, output_dir, mesh, per_device, max_steps, save_steps, resume)
        finally:
            distributed.MIN_TRAINABLE_SHARD_BYTES = saved
    rng = np.random.default_rng(seed)
    data = [{"input_ids": rng.integers(4, 2048, int(rng.integers(8, 40))).tolist()} for _ in range(48)]
    model, tokenizer = FastLanguageModel.from_pretrained(TINY_MODEL, dtype="float32", progress=False)
    model = FastLanguageModel.get_peft_model(model, r=8, lora_alpha=16, target_modules="all-linear",
                                             use_gradient_checkpointing=True, random_state=seed)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=per_device, max_steps=max_steps,
                             save_steps=save_steps, logging_steps=1, learning_rate=5e-3, optim="adamw_torch",
                             seed=seed, mesh=mesh)
    trainer = SFTTrainer(model=model, tokenizer=tokenizer, train_dataset=data, max_seq_length=64, args=args)
    trainer.train(resume_from_checkpoint=resume)
    placed = [{"spec": str(x.sharding.spec), "devices": len(x.sharding.device_set),
               "shard_shapes": sorted({tuple(s.data.shape) for s in x.addressable_shards})}
              for x in jax.tree.leaves(lora.split(model)[1])]
    return {"losses": trainer.state.loss_history, "trainable": placed, "devices": jax.device_count()}


CASES = {"equal_steps": case_equal_steps, "fsdp_shards": case_fsdp_shards, "memory": case_memory,
         "pallas_on_mesh": case_pallas_on_mesh, "trainer": case_trainer, "moe_equal_steps": case_moe_equal_steps,
         "rl_equal_steps": case_rl_equal_steps, "dpo_trainer": case_dpo_trainer,
         "vision_trainer": case_vision_trainer, "grpo_trainer": case_grpo_trainer}



def run_batch(seed: int, cases: dict[str, list]) -> None:
    """Each {name: [case, kwargs]} in order, in this process: one RESULT line per case, its result or its error."""
    for name, (case, kwargs) in cases.items():
        start = time.perf_counter(), time.process_time()
        try:
            line = {"name": name, "result": CASES[case](seed, **kwargs)}
        except Exception:  # noqa: BLE001 - reported to the case's own test
            line = {"name": name, "error": traceback.format_exc()}
        print(f"{name}: {time.perf_counter() - start[0]:.1f} s, {time.process_time() - start[1]:.1f} s CPU",
              file=sys.stderr, flush=True)
        print("RESULT " + json.dumps(line), flush=True)


if __name__ == "__main__":
    # Programs run one at a time: with async dispatch, XLA's CPU runtime can start the next program's partitions
    # (a reshard's all-gather) while the last step's all-reduce still waits for a partition that has no thread yet
    # on a 2-core machine; the two rendezvous then wait on each other until XLA aborts (seen once in CI, a resumed
    # 4-device trainer). GPUs run collectives in stream order and are not affected.
    jax.config.update("jax_cpu_enable_async_dispatch", False)
    name, seed = sys.argv[1], int(sys.argv[2])
    kwargs = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    if name == "batch":
        run_batch(seed, kwargs)
    else:
        print("RESULT " + json.dumps(CASES[name](seed, **kwargs)), flush=True)
