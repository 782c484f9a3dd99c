"""Mixture-of-experts families (Qwen3-MoE, Mixtral, gpt-oss) against transformers, PEFT and a dense reference.

Truths: transformers' logits and load_balancing_loss_func (torch), PEFT's loading of our adapters (and ours of
PEFT's), a dense one-hot einsum of the experts (every expert on every token, weighted by the router) for the
grouped-GEMM path and its gradients.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from tests.family_checks import load_f32, hf_f32, torch_logits  # noqa: E402
from tests.helpers import rel_err  # noqa: E402
from tests.hf_moe_models import MOE_FAMILIES, make_hf_moe_model, save_hf_moe_model  # noqa: E402
from unsloth_jax import FastLanguageModel, lora, ops  # noqa: E402
from unsloth_jax.families import read_text_config, text_config  # noqa: E402
from unsloth_jax.errors import ConfigError, UnsupportedArchitectureError  # noqa: E402
from unsloth_jax.hf.safetensors_io import SafetensorsFile  # noqa: E402
from unsloth_jax.models.moe import (EXPERT_PARAMETERS, Experts, expert_activation, expert_ffn,  # noqa: E402
                                    load_balancing_loss, route, router_stats)
from unsloth_jax.train import loss_and_count, make_train_step  # noqa: E402

FAMILIES = ("qwen3_moe", "mixtral", "gpt_oss")
EXPERTS = list(EXPERT_PARAMETERS)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(directory, torch model) per family and layout: "original" as save_pretrained writes by default,
    "fused" with save_original_format=False (Qwen3-MoE and Mixtral experts as 3-D tensors)."""
    out = {}
    for i, family in enumerate(MOE_FAMILIES):
        for layout in ("original", "fused"):
            path = tmp_path_factory.mktemp(f"{family}_{layout}")
            out[family, layout] = (path, save_hf_moe_model(family, path, seed=5 + i,
                                                           save_original_format=layout == "original"))
    return out






def _right_padded(rng, b=3, s=24):
    ids = rng.integers(0, 256, size=(b, s)).astype(np.int64)
    lengths = np.array([s, s - 5, 11])[:b]
    return ids, (np.arange(s)[None] < lengths[:, None]).astype(np.int64)




# ----------------------------------------------------------------------------------------------- config
def test_config_reads_each_family(checkpoints):
    for (family, layout), (path, hf) in checkpoints.items():
        if layout != "original":
            continue
        cfg = read_text_config(path)
        assert cfg.is_moe and cfg.num_experts == hf.config.num_local_experts
        blocks = [type(layer.mlp).__name__ for layer in hf.model.layers]
        assert cfg.layer_sparse == tuple(not n.endswith("MLP") or n == "GptOssMLP" for n in blocks), (family, blocks)
    qwen = read_text_config(checkpoints["qwen3_moe", "original"][0])
    assert qwen.layer_sparse == (False, True, False, True) and qwen.layer_period == 2 and qwen.norm_topk_prob
    oss = read_text_config(checkpoints["gpt_oss", "original"][0])
    assert oss.layer_windows == (8, None, 8, None) and oss.rope_type == "yarn" and oss.rope_attention_factor > 1


# ----------------------------------------------------------------------------------------------- parity
@pytest.mark.parametrize("layout", ["original", "fused"])
@pytest.mark.parametrize("family", list(MOE_FAMILIES))
def test_logits_match_transformers_right_padding(family, layout, checkpoints, rng):
    path, hf = checkpoints[family, layout]
    with SafetensorsFile(path / "model.safetensors") as f:
        fused = any(k.endswith("mlp.experts.gate_up_proj") for k in f.keys())
    assert fused == (layout == "fused" or family == "gpt_oss")  # the layout under test is the one on disk
    model = load_f32(path)
    ids, mask = _right_padded(rng)  # 24 tokens: longer than the windows (8) of Mixtral and gpt-oss
    out = np.asarray(model(ids, attention_mask=mask))
    real = mask.astype(bool)
    err = rel_err(out[real], torch_logits(hf, ids, mask)[real])
    assert err < 1e-5, f"{family} ({layout}): relative error {err:.2e}"


def test_gpt_oss_parity_exercises_clamp_sinks_and_yarn(checkpoints, rng):
    """The gpt-oss features the parity test covers change the logits: without the clamp (a high swiglu_limit),
    the sinks (zeroed) or YaRN's scaling the same weights give clearly different logits."""
    path, hf = checkpoints["gpt_oss", "original"]
    ids, mask = _right_padded(rng)
    ref = torch_logits(hf, ids, mask)
    for change in ("limit", "sinks", "yarn"):
        kw = {"swiglu_limit": 100.0} if change == "limit" else {}
        if change == "yarn":
            kw["rope_parameters"] = {"rope_type": "default", "rope_theta": 150000.0}
        other = make_hf_moe_model("gpt_oss", **kw)
        other.load_state_dict(hf.state_dict())
        if change == "sinks":
            with torch.no_grad():
                for layer in other.model.layers:
                    layer.self_attn.sinks.zero_()
        assert rel_err(torch_logits(other, ids, mask), ref) > 1e-3, change


def test_greedy_generation_matches_transformers(checkpoints, rng):
    """The cached decode path (sinks, sliding windows, experts on one token per row) against HF's generate. HF
    is given the all-ones mask: without one it masks every prompt token equal to pad_token_id."""
    for family in ("gpt_oss", "qwen3_moe"):
        path, hf = checkpoints[family, "original"]
        model = load_f32(path)
        ids = rng.integers(0, 256, size=(1, 12))
        ids[0, int(rng.integers(12))] = 0  # the pad id inside the prompt: attended, since the mask says so
        with torch.no_grad():
            want = hf.generate(torch.tensor(ids), attention_mask=torch.ones_like(torch.tensor(ids)),
                               max_new_tokens=6, do_sample=False, pad_token_id=0).numpy()
        got = np.asarray(model.generate(ids, max_new_tokens=6))
        np.testing.assert_array_equal(got[:, :want.shape[1]], want, err_msg=family)


def test_layer_pattern_with_a_tail_matches_transformers(tmp_path, rng):
    """A Qwen3-MoE whose MoE/dense pattern does not divide the depth (layers MoE, dense, MoE: period 2, a tail
    of 1 run as the second scan): logits equal transformers', and the router statistics come back in layer
    order, each MoE layer's equal to what transformers' router of that layer gives (its recorded logits)."""
    hf = save_hf_moe_model("qwen3_moe", tmp_path, seed=int(rng.integers(1 << 20)), num_hidden_layers=3,
                           mlp_only_layers=[1], decoder_sparse_step=1)
    model = load_f32(tmp_path)
    cfg = model.config
    assert cfg.layer_sparse == (True, False, True) and cfg.layer_period == 2  # 3 = 1 x 2 + a tail of 1
    ids, mask = _right_padded(rng)
    real = mask.astype(bool)
    err = rel_err(np.asarray(model(ids, attention_mask=mask))[real], torch_logits(hf, ids, mask)[real])
    assert err < 1e-5, err
    from unsloth_jax.models.decoder import make_batch

    batch = make_batch(jnp.asarray(ids, jnp.int32), jnp.asarray(mask, jnp.int32), right_padded=True)
    _, stats = model.hidden_states(jnp.asarray(ids, jnp.int32), batch, router_stats=True)
    with torch.no_grad():
        out = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), output_router_logits=True)
    assert len(out.router_logits) == 2 and stats.prob_sum.shape == (2, cfg.num_experts)
    w = mask.reshape(-1, 1).astype(np.float64)
    for layer, logits in enumerate(out.router_logits):  # HF records the MoE layers in order: 0, then 2
        want = (torch.softmax(logits.double(), -1).numpy() * w).sum(0)
        np.testing.assert_allclose(np.asarray(stats.prob_sum[layer]), want, rtol=1e-5, err_msg=f"MoE layer {layer}")
    assert np.asarray(stats.rows).tolist() == [mask.sum()] * 2


# ------------------------------------------------------------------------------------ grouped experts
def _dense_reference(x, weights, experts, block, cfg):
    """Every expert on every token (one-hot einsum), combined with the routing weights: [T, D]."""
    comb = jnp.zeros((x.shape[0], cfg.num_experts), jnp.float32).at[jnp.arange(x.shape[0])[:, None], experts].set(
        weights)

    def effective(g):
        w = g.kernel[...]
        if g.lora_a is not None:
            w = w + g.lora_scale * jnp.einsum("eir,ero->eio", g.lora_a[...], g.lora_b[...])
        return w

    h = jnp.einsum("td,edo->teo", x, effective(block.gate_up_proj))
    if block.gate_up_proj.bias is not None:
        h = h + block.gate_up_proj.bias[...][None]
    y = jnp.einsum("tef,efd->ted", expert_activation(h, cfg), effective(block.down_proj))
    if block.down_proj.bias is not None:
        y = y + block.down_proj.bias[...][None]
    return jnp.einsum("te,ted->td", comb, y)


def _check_grouped_against_dense(family: str, seed: int, dtype, tol: float, clamp: bool = True) -> None:
    """expert_ffn (sorted rows, grouped GEMMs, LoRA on both expert weights) against the dense reference
    (float32, on the same dtype-rounded inputs), forward and the gradients of x and every LoRA factor; some
    experts get no token. clamp=False lifts gpt-oss's SwiGLU clamp (limit = inf), so the function is smooth."""
    cfg = text_config(make_hf_moe_model(family).config.to_dict())
    if not clamp:
        cfg = dataclasses.replace(cfg, swiglu_limit=float("inf"))
    key = jax.random.PRNGKey(seed)
    block = Experts(cfg, dtype=dtype, rngs=nnx.Rngs(seed))
    ks = iter(jax.random.split(key, 12))
    for g in (block.gate_up_proj, block.down_proj):
        g.lora_a = nnx.LoRAParam(0.3 * jax.random.normal(next(ks), g.kernel[...].shape[:-1] + (3,)))
        g.lora_b = nnx.LoRAParam(0.3 * jax.random.normal(next(ks), (cfg.num_experts, 3, g.out_features)))
        g.lora_scale = 0.7
        g.kernel[...] = (0.3 * jax.random.normal(next(ks), g.kernel[...].shape)).astype(dtype)
        if g.bias is not None:
            g.bias[...] = (0.3 * jax.random.normal(next(ks), g.bias[...].shape)).astype(dtype)
    t = 37
    x = jax.random.normal(next(ks), (t, cfg.hidden_size)).astype(dtype)
    logits = 2.0 * jax.random.normal(next(ks), (t, cfg.num_experts))
    logits = logits.at[:, 0].add(-50.0)  # expert 0 is never chosen: an empty group
    weights, experts = route(logits, cfg)
    graphdef, lora_state, rest = nnx.split(block, nnx.LoRAParam, ...)
    rest32 = jax.tree.map(lambda a: a.astype(jnp.float32), rest)

    def ours(x, lora_state):
        return expert_ffn(x, weights, experts, nnx.merge(graphdef, lora_state, rest), cfg).astype(jnp.float32)

    def ref(x, lora_state):
        return _dense_reference(x.astype(jnp.float32), weights, experts, nnx.merge(graphdef, lora_state, rest32), cfg)

    out, want = jax.jit(ours)(x, lora_state), jax.jit(ref)(x, lora_state)
    assert rel_err(out, want) < tol
    cot = jax.random.normal(next(ks), out.shape)
    g_ours = jax.jit(jax.grad(lambda *a: jnp.sum(ours(*a) * cot), argnums=(0, 1)))(x, lora_state)
    g_ref = jax.jit(jax.grad(lambda *a: jnp.sum(ref(*a) * cot), argnums=(0, 1)))(x, lora_state)
    for a, b in zip(jax.tree.leaves(g_ours), jax.tree.leaves(g_ref)):
        assert rel_err(a, b) < tol
    if family == "gpt_oss" and clamp:  # the clamps are hit
        h = jnp.einsum("td,edo->teo", x.astype(jnp.float32), block.gate_up_proj.kernel[...].astype(jnp.float32))
        assert float(jnp.mean(jnp.abs(h) > cfg.swiglu_limit)) > 0.05


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_experts_match_dense_reference_with_gradients(family, seed):
    _check_grouped_against_dense(family, seed, jnp.float32, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(jnp.float32, 1e-3), (jnp.bfloat16, 2e-2)], ids=["fp32_tf32", "bf16"])
@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_experts_on_gpu(family, dtype, tol, seed):
    """The same check where the GPU runs the grouped GEMMs (TF32 / bf16 products). gpt-oss runs without its
    clamp here: the clamp's derivative jumps from 1 to 0 at the limit, so products rounded differently from the
    float32 reference put a few pre-activations on the other side and their gradients differ by whole terms
    (6% measured in TF32 on the H200); the clamp itself is checked exactly by the float32 test above."""
    _check_grouped_against_dense(family, seed, dtype, tol, clamp=family != "gpt_oss")


def test_grouped_experts_pallas_kernel_equals_ragged_dot(seed):
    """The experts with ops.grouped_matmul on the Pallas kernel (interpret mode here) equal the ragged_dot path:
    forward and the gradients of x and every LoRA factor (float32, so both paths round alike)."""
    from unsloth_jax import ops

    cfg = text_config(make_hf_moe_model("qwen3_moe").config.to_dict())
    block = Experts(cfg, dtype=jnp.float32, rngs=nnx.Rngs(seed))
    ks = iter(jax.random.split(jax.random.PRNGKey(seed), 8))
    for g in (block.gate_up_proj, block.down_proj):
        g.lora_a = nnx.LoRAParam(0.3 * jax.random.normal(next(ks), g.kernel[...].shape[:-1] + (3,)))
        g.lora_b = nnx.LoRAParam(0.3 * jax.random.normal(next(ks), (cfg.num_experts, 3, g.out_features)))
        g.lora_scale = 0.7
    x = jax.random.normal(next(ks), (29, cfg.hidden_size))
    logits = (2.0 * jax.random.normal(next(ks), (29, cfg.num_experts))).at[:, 1].add(-50.0)
    weights, experts = route(logits, cfg)
    graphdef, lora_state, rest = nnx.split(block, nnx.LoRAParam, ...)
    cot = jax.random.normal(next(ks), x.shape)

    def loss(x, lora_state):
        y = expert_ffn(x, weights, experts, nnx.merge(graphdef, lora_state, rest), cfg)
        return jnp.sum(y.astype(jnp.float32) * cot)

    results = {}
    for impl in ("xla", "pallas"):
        policy = ops.current_policy().with_impl("grouped_matmul", impl)
        with ops.policy_scope(policy):
            results[impl] = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, lora_state)
        assert ops.chosen_impls(policy)["grouped_matmul"] == impl
    (v_x, g_x), (v_p, g_p) = results["xla"], results["pallas"]
    # the loss is a sum of terms of both signs: their rounding over |sum| (a CI seed gave 1.5e-5); a wrong path is O(1)
    assert rel_err(v_p, v_x) < 1e-4
    for a, b in zip(jax.tree.leaves(g_p), jax.tree.leaves(g_x)):
        assert rel_err(a, b) < 1e-5


def test_grouped_weight_grad_and_ragged_matmul(rng):
    """The tiled weight gradient equals the per-group x_e^T g_e (empty groups, rows past the groups' total,
    N not a multiple of the tile), and ragged_matmul's gradients equal jax's own ragged_dot gradients."""
    from unsloth_jax.models.moe import grouped_weight_grad, ragged_matmul

    for _ in range(3):
        n, e, tile = int(rng.integers(1, 300)), int(rng.integers(2, 9)), int(rng.choice([4, 16, 128]))
        gs = rng.multinomial(n, np.ones(e) / e).astype(np.int32)
        gs[int(rng.integers(e))] = 0
        extra = int(rng.integers(0, 5))  # trailing rows that belong to no group
        x = rng.normal(size=(n + extra, 6)).astype(np.float32)
        g = rng.normal(size=(n + extra, 5)).astype(np.float32)
        ends = np.cumsum(gs)
        want = np.stack([x[t - c:t].T @ g[t - c:t] for t, c in zip(ends, gs)])
        got = np.asarray(grouped_weight_grad(jnp.asarray(x), jnp.asarray(g), jnp.asarray(gs), tile=tile))
        assert rel_err(got, want) < 1e-5, (n, e, tile, gs)
        w = rng.normal(size=(e, 6, 5)).astype(np.float32)
        cot = rng.normal(size=(n + extra, 5)).astype(np.float32)
        ours = jax.jit(jax.grad(lambda x, w: jnp.sum(ragged_matmul(x, w, jnp.asarray(gs)) * cot), (0, 1)))(x, w)
        theirs = jax.jit(jax.grad(lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, jnp.asarray(gs)) * cot),
                                  (0, 1)))(x, w)
        for a, b in zip(ours, theirs):
            assert rel_err(a, b) < 1e-5


def test_grouped_path_has_no_dense_expert_buffer():
    """The MoE block's forward and LoRA backward: no value of shape [T, E, ...] (no dense expert buffer, no
    per-expert loop), ragged_dots for the GEMMs, and none of them a ragged contraction (XLA's GPU compiler
    rewrites those to a dense dot over an [E, N, K] zero-padded copy): the LoRA weight gradients are tiled."""
    cfg = text_config(make_hf_moe_model("mixtral").config.to_dict())
    block = Experts(cfg, rngs=nnx.Rngs(0))
    for g in (block.gate_up_proj, block.down_proj):
        g.lora_a = nnx.LoRAParam(jnp.ones(g.kernel[...].shape[:-1] + (2,)))
        g.lora_b = nnx.LoRAParam(jnp.ones((cfg.num_experts, 2, g.out_features)))
        g.lora_scale = 1.0
    graphdef, lora_state, rest = nnx.split(block, nnx.LoRAParam, ...)
    t = 29
    x = jnp.ones((t, cfg.hidden_size))
    logits = jax.random.normal(jax.random.PRNGKey(1), (t, cfg.num_experts))

    def loss(x, lora_state):
        return jnp.sum(expert_ffn(x, *route(logits, cfg), nnx.merge(graphdef, lora_state, rest), cfg))

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(x, lora_state)
    eqns = _all_eqns(jaxpr.jaxpr)
    ragged = [eqn for eqn in eqns if eqn.primitive.name == "ragged_dot_general"]
    assert len(ragged) >= 6  # forward and dX of the base and LoRA GEMMs
    for eqn in ragged:
        dn = eqn.params["ragged_dot_dimension_numbers"]
        (contract, _), _ = dn.dot_dimension_numbers
        assert not set(dn.lhs_ragged_dimensions) & set(contract), "a ragged contraction (weight gradient)"
    shapes = [tuple(v.aval.shape) for eqn in eqns for v in eqn.outvars if hasattr(v.aval, "shape")]
    assert not any(len(s) > 2 and s[0] == t and s[1] == cfg.num_experts for s in shapes)


def _all_eqns(jaxpr):
    """Every equation of a jaxpr, including those of nested jaxprs (custom_vjp, pjit, scan bodies)."""
    out = []
    for eqn in jaxpr.eqns:
        out.append(eqn)
        for param in eqn.params.values():
            for sub in (param if isinstance(param, (list, tuple)) else [param]):
                inner = getattr(sub, "jaxpr", None)
                if inner is not None:
                    out += _all_eqns(getattr(inner, "jaxpr", inner))
    return out


# ---------------------------------------------------------------------------------------- aux loss
def test_aux_loss_equals_transformers_load_balancing_loss_func(rng):
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    for trial in range(6):
        e, k, b, s, layers = int(rng.integers(4, 12)), int(rng.integers(1, 4)), 3, int(rng.integers(5, 20)), 3
        logits = [rng.normal(size=(b * s, e)).astype(np.float32) for _ in range(layers)]
        mask = (rng.random((b, s)) > 0.3).astype(np.int64) if trial % 2 else None
        want = load_balancing_loss_func(tuple(torch.tensor(x) for x in logits), e, k,
                                        None if mask is None else torch.tensor(mask)).item()
        stats = []
        for x in logits:
            _, experts = jax.lax.top_k(jax.nn.softmax(jnp.asarray(x)), k)
            stats.append(router_stats(jnp.asarray(x), experts, None if mask is None else jnp.asarray(mask.reshape(-1))))
        stacked = jax.tree.map(lambda *a: jnp.stack(a), *stats)
        got = float(load_balancing_loss(stacked, e))
        assert abs(got - want) <= 1e-5 * abs(want), (trial, got, want)


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_training_loss_with_aux_equals_transformers(family, checkpoints, rng):
    """output_router_logits=True: our training loss is transformers' loss(labels) = CE + coef * aux, with the
    aux loss over the MoE layers and the attention mask, as transformers' *ForCausalLM computes it."""
    path, _ = checkpoints[family, "original"]
    hf = hf_f32(path, output_router_logits=True, router_aux_loss_coef=0.3)
    model = load_f32(path, output_router_logits=True, router_aux_loss_coef=0.3)
    ids, mask = _right_padded(rng)
    labels = np.where(mask > 0, ids, -100)
    with torch.no_grad():
        out = hf(torch.tensor(ids), attention_mask=torch.tensor(mask), labels=torch.tensor(labels))
    batch = {"input_ids": jnp.asarray(ids, jnp.int32), "labels": jnp.asarray(labels, jnp.int32),
             "attention_mask": jnp.asarray(mask, jnp.int32)}
    loss, _ = loss_and_count(model, batch)
    assert abs(float(loss) - out.loss.item()) < 1e-5 * out.loss.item()
    plain = load_f32(path)  # without the switch: the plain cross-entropy
    ce, _ = loss_and_count(plain, batch)
    assert abs(float(ce) + 0.3 * out.aux_loss.item() - out.loss.item()) < 1e-5 * out.loss.item()


# ---------------------------------------------------------------------------------------------- LoRA
def _peft_model(path, r=4, alpha=8, targets=("q_proj", "o_proj"), experts=tuple(EXPERTS), seed=0):
    model = load_f32(path)
    FastLanguageModel.get_peft_model(model, r=r, lora_alpha=alpha, target_modules=list(targets),
                                     target_parameters=list(experts), use_gradient_checkpointing=False,
                                     random_state=seed)
    key = jax.random.PRNGKey(seed)  # nonzero B everywhere, as after training
    for g in list(model.projections().values()) + list(model.expert_projections().values()):
        if g.lora_b is not None:
            key, k = jax.random.split(key)
            g.lora_b[...] = 0.1 * jax.random.normal(k, g.lora_b[...].shape)
    return model


@pytest.mark.parametrize("family,experts", [("qwen3_moe_all", EXPERTS), ("mixtral", EXPERTS), ("gpt_oss", EXPERTS),
                                             ("mixtral", EXPERTS[:1]), ("qwen3_moe_all", EXPERTS[1:])],
                         ids=["qwen3_moe-both", "mixtral-both", "gpt_oss-both", "mixtral-gate_up", "qwen3_moe-down"])
def test_adapter_loads_in_peft_and_merged_in_transformers(family, experts, checkpoints, tmp_path, rng):
    """LoRA on attention and the experts (both expert weights, or one: PEFT's wrappers then do not nest)."""
    path, hf = checkpoints[family, "original"]
    model = _peft_model(path, experts=experts, seed=int(rng.integers(1 << 30)))
    ids, mask = _right_padded(rng)
    real = mask.astype(bool)
    ours = np.asarray(model(ids, attention_mask=mask))
    assert rel_err(ours[real], torch_logits(hf, ids, mask)[real]) > 1e-2  # the adapter matters
    model.save_pretrained(tmp_path / "adapter", base_model_name_or_path=str(path))
    cfg = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == sorted(experts) and sorted(cfg["target_modules"]) == ["o_proj", "q_proj"]
    pm = peft.PeftModel.from_pretrained(hf_f32(path), str(tmp_path / "adapter"))
    wrapped = pm.base_model.model.model.layers[0].mlp.experts
    assert type(wrapped).__name__ == "ParamWrapper"  # PEFT put its LoRA on the fused expert weights
    assert rel_err(ours[real], torch_logits(pm, ids, mask)[real]) < 1e-5
    model.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    assert rel_err(ours[real], torch_logits(hf_f32(tmp_path / "merged"), ids, mask)[real]) < 1e-5
    back = load_f32(tmp_path / "adapter")  # and our own import of the adapter
    assert back.lora.target_parameters == tuple(experts)
    assert rel_err(np.asarray(back(ids, attention_mask=mask)), ours) < 1e-6


def test_peft_written_expert_adapter_imports(checkpoints, tmp_path, rng):
    """An adapter made by PEFT (target_parameters on the fused experts, random factors) loads through
    FastLanguageModel.from_pretrained(adapter_dir) with PEFT's logits."""
    path, _ = checkpoints["gpt_oss", "original"]
    pm = peft.get_peft_model(hf_f32(path), peft.LoraConfig(r=3, lora_alpha=5, target_modules=["k_proj"],
                                                        target_parameters=EXPERTS, task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(int(rng.integers(1 << 30)))
    with torch.no_grad():
        for _, p in pm.named_parameters():
            if p.requires_grad:
                p.copy_(p + 0.1 * torch.randn(p.shape, generator=gen))
    pm.eval()
    pm.save_pretrained(str(tmp_path / "peft"))
    cfg = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = str(path)
    (tmp_path / "peft" / "adapter_config.json").write_text(json.dumps(cfg))
    model = load_f32(tmp_path / "peft")
    ids, mask = _right_padded(rng)
    real = mask.astype(bool)
    assert rel_err(np.asarray(model(ids, attention_mask=mask))[real], torch_logits(pm, ids, mask)[real]) < 1e-5


def test_mixed_dense_layers_lora_and_the_peft_limit(checkpoints, tmp_path, rng):
    """Qwen3-MoE with dense layers: LoRA on attention + experts round-trips through PEFT; LoRA on the dense
    MLP projections trains and merges, but has no PEFT adapter form (PEFT maps gate/up/down_proj onto the
    experts), so save_pretrained refuses it."""
    path, _ = checkpoints["qwen3_moe", "original"]
    model = _peft_model(path, seed=1)
    ids, mask = _right_padded(rng)
    real = mask.astype(bool)
    ours = np.asarray(model(ids, attention_mask=mask))
    model.save_pretrained(tmp_path / "adapter", base_model_name_or_path=str(path))
    pm = peft.PeftModel.from_pretrained(hf_f32(path), str(tmp_path / "adapter"))
    assert rel_err(ours[real], torch_logits(pm, ids, mask)[real]) < 1e-5
    dense = _peft_model(path, targets=("q_proj", "gate_proj", "down_proj"), seed=2)
    assert dense.projections()["gate_proj"].lora_a is not None
    with pytest.raises(ConfigError, match="dense MLP projections"):
        dense.save_pretrained(tmp_path / "refused")
    assert not (tmp_path / "refused").exists()
    dense.save_pretrained_merged(tmp_path / "merged", None, dtype="float32")
    got = torch_logits(hf_f32(tmp_path / "merged"), ids, mask)
    assert rel_err(np.asarray(dense(ids, attention_mask=mask))[real], got[real]) < 1e-5


def test_moe_lora_training_loss_falls(checkpoints, rng):
    path, _ = checkpoints["mixtral", "original"]
    model = load_f32(path, output_router_logits=True)
    FastLanguageModel.get_peft_model(model, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                     target_parameters=EXPERTS, use_gradient_checkpointing=True,
                                     random_state=int(rng.integers(1 << 30)))
    ids = rng.integers(0, 256, size=(2, 2, 16)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)}
    opt = optax.adamw(3e-3)
    graphdef, trainable, frozen = lora.split(model)
    names = {".".join(map(str, p)) for p, _ in nnx.to_flat_state(trainable)}
    assert "model.layers.mlp.experts.gate_up_proj.lora_a" in names
    step = make_train_step(graphdef, opt, remat="full", donate=False)
    state = opt.init(trainable)
    losses = []
    for _ in range(20):  # over 16 seeds the loss fell to 0.56-0.63 of its start in 20 steps (0.74-0.79 in 12)
        trainable, state, m = step(trainable, frozen, state, batch)
        losses.append(float(m["loss"]))
        assert "aux_loss" in m and float(m["aux_loss"]) > 0
    assert losses[-1] < 0.8 * losses[0], losses
    nnx.update(model, trainable)
    b = model.expert_projections()["mlp.experts.down_proj"].lora_b[...]
    assert float(jnp.abs(b).max()) > 0  # the experts' LoRA trained


def test_trainer_logs_aux_loss(checkpoints, tmp_path, rng):
    """SFTTrainer on a MoE model with output_router_logits: log_history and metrics.jsonl carry TRL's
    aux_loss (the window mean of the steps' load-balancing losses); without the switch they do not."""
    from unsloth_jax import SFTTrainer, TrainingArguments

    path, _ = checkpoints["mixtral", "original"]
    data = [{"input_ids": [int(x) for x in rng.integers(4, 250, size=int(rng.integers(8, 20)))]} for _ in range(8)]
    for switch in (True, False):
        model = load_f32(path, output_router_logits=switch)
        FastLanguageModel.get_peft_model(model, r=2, lora_alpha=4, target_modules=["q_proj"],
                                         target_parameters=EXPERTS[1:], use_gradient_checkpointing=False)
        out = tmp_path / f"out_{switch}"
        args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, max_steps=2, logging_steps=1,
                                 save_steps=0, learning_rate=1e-3)
        trainer = SFTTrainer(model=model, train_dataset=data, max_seq_length=24, args=args)
        trainer.train()
        steps = [e for e in trainer.state.log_history if "loss" in e and "step" in e and "train_loss" not in e]
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert steps and records
        if switch:
            assert all(e["aux_loss"] > 0 for e in steps) and all(r["aux_loss"] > 0 for r in records)
        else:
            assert not any("aux_loss" in e for e in steps + records)


# ------------------------------------------------------------------------------------ refusals, ops
def test_moe_refusals(checkpoints, tmp_path):
    path, _ = checkpoints["qwen3_moe_all", "original"]
    model = _peft_model(path)
    with pytest.raises(UnsupportedArchitectureError, match="GGUF export of qwen3_moe is not supported"):
        model.save_pretrained_gguf(tmp_path / "gguf", None)
    with pytest.raises(ConfigError, match="4-bit"):
        load_f32(path, load_in_4bit=True)
    # full fine-tuning: the router, expert and sink weights have no gradient path, so it is refused
    with pytest.raises(ConfigError, match="full_finetuning=True is not supported for qwen3_moe"):
        load_f32(path, full_finetuning=True)
    with pytest.raises(ValueError, match="full fine-tuning of qwen3_moe"):
        lora.enable_full_finetuning(load_f32(path))
    with pytest.raises(ValueError, match="name no expert weight"):
        FastLanguageModel.get_peft_model(load_f32(path), target_parameters=["mlp.experts.w1"])
    with pytest.raises(ValueError, match="bias='none'"):
        FastLanguageModel.get_peft_model(load_f32(checkpoints["gpt_oss", "original"][0]), bias="all")
    from tests.hf_models import save_hf_model

    save_hf_model("llama", tmp_path / "llama")
    with pytest.raises(TypeError, match="mixture-of-experts"):
        load_f32(tmp_path / "llama", output_router_logits=True)
    with pytest.raises(ValueError, match="no expert weights"):
        FastLanguageModel.get_peft_model(load_f32(tmp_path / "llama"), target_parameters=EXPERTS)


def test_attention_sinks_xla_and_forced_pallas(rng):
    """ops.attention with sinks equals a direct softmax over [scores, sink]; a forced flash kernel or cuDNN
    cannot take sinks, so the call still runs (on XLA) and gives the same result."""
    b, s, hq, hkv, d = 2, 11, 4, 2, 8
    q, k, v = (jnp.asarray(rng.normal(size=(b, s, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    sinks = jnp.asarray(rng.normal(size=(hq,)), jnp.float32)
    kv = jnp.repeat(k, hq // hkv, axis=2), jnp.repeat(v, hq // hkv, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, kv[0]) * d ** -0.5
    causal = jnp.tril(jnp.ones((s, s), bool)) & (jnp.arange(s)[:, None] - jnp.arange(s)[None] < 5)
    scores = jnp.where(causal, scores, -jnp.inf)
    full = jnp.concatenate([scores, jnp.broadcast_to(sinks[None, :, None, None], (b, hq, s, 1))], axis=-1)
    want = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(full, axis=-1)[..., :-1], kv[1])
    got = ops.attention(q, k, v, scale=d ** -0.5, window=5, sinks=sinks)
    assert rel_err(got, want) < 1e-5
    try:
        ops.set_impl("attention", "pallas")
        assert rel_err(ops.attention(q, k, v, scale=d ** -0.5, window=5, sinks=sinks), want) < 1e-5
    finally:
        ops.set_impl("attention", "auto")
