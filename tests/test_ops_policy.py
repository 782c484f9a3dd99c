"""Op choice as a value: the policy is validated, part of every jit key, so set_impl takes effect on the next
call of an already-called model or train step."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from tests.helpers import rel_err
from unsloth_jax import lora, ops
from unsloth_jax.families import text_config
from unsloth_jax.models import CausalLM
from unsloth_jax.train import make_train_step
from unsloth_jax.train.step import loss_and_count

CFG = {"model_type": "llama", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture
def clean_policy(monkeypatch):
    monkeypatch.delenv(ops.ENV_VAR, raising=False)
    yield
    for op in ops.OPS:
        ops.set_impl(op, "auto")


def test_set_impl_after_a_first_call_takes_effect(clean_policy, rng):
    cfg = text_config(CFG)
    model = CausalLM(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    lora.add_lora(model, lora.LoraSettings(r=2, lora_alpha=4, target_modules=lora.ALL_TARGETS),
                  jax.random.PRNGKey(0))
    graphdef, t, f = lora.split(model)
    opt = optax.sgd(0.1)
    step = make_train_step(graphdef, opt, remat="none", donate=False)
    ids = rng.integers(0, 64, size=(1, 2, 16)).astype(np.int32)
    batch = {"input_ids": ids, "labels": ids, "attention_mask": np.ones_like(ids)}
    _, _, m_xla = step(t, f, opt.init(t), batch)
    assert ops.chosen_impls()["rms_norm"] == "xla"
    ops.set_impl("rms_norm", "pallas")
    _, _, m_pallas = step(t, f, opt.init(t), batch)  # the same step object, called again
    assert step.jitted._cache_size() == 2  # a new entry for the new policy, not the stale program
    assert ops.chosen_impls()["rms_norm"] == "pallas"
    assert rel_err(float(m_pallas["loss"]), float(m_xla["loss"])) < 1e-5
    # an eager model call reads the policy at call time too
    ops.set_impl("rms_norm", "auto")
    before = ops.chosen_impls().get("rms_norm")
    model(ids[0])
    assert ops.chosen_impls()["rms_norm"] == "xla" and before == "xla"


def test_policy_validation_and_precedence(clean_policy, monkeypatch):
    with pytest.raises(ValueError, match="unknown op 'rmsnorm'"):
        ops.set_impl("rmsnorm", "xla")
    with pytest.raises(ValueError, match="unknown implementation 'cuda' for glu"):
        ops.set_impl("glu", "cuda")
    monkeypatch.setenv(ops.ENV_VAR, "attention=flash")
    with pytest.raises(ValueError, match="UNSLOTH_JAX_IMPL"):
        ops.current_policy()
    monkeypatch.setenv(ops.ENV_VAR, "glu")
    with pytest.raises(ValueError, match="not of the form op=impl"):
        ops.current_policy()
    # table < set_impl < environment
    ops.set_impl("glu", "pallas")
    ops.set_impl("rope", "pallas")
    monkeypatch.setenv(ops.ENV_VAR, "glu=xla")
    policy = ops.current_policy()
    assert policy.requested("glu") == "xla" and policy.requested("rope") == "pallas"
    assert policy.requested("attention") == "auto"
    assert hash(policy) == hash(ops.current_policy()) and policy == ops.current_policy()
    assert policy.with_impl("rope", "auto").requested("rope") == "auto"

    # the layer stack's settings are not ops settings any more: asking for one here says where it went
    with pytest.raises(ValueError, match=r"layer_loop is not an ops setting any more.*layer-stack policy.*"
                                         r"\"offload,layer_loop=unrolled\""):
        ops.set_impl("layer_loop", "unrolled")
    monkeypatch.setenv(ops.ENV_VAR, "offload_weights=prefetch")
    with pytest.raises(ValueError, match=r"UNSLOTH_JAX_IMPL.*offload_weights is not an ops setting"):
        ops.current_policy()


def test_cudnn_attention_is_guarded_by_dtype_and_head_dim():
    def q(dtype, d):
        return jnp.zeros((1, 8, 2, d), dtype)

    assert ops._cudnn_serves(q(jnp.bfloat16, 128)) and ops._cudnn_serves(q(jnp.float16, 64))
    assert not ops._cudnn_serves(q(jnp.float32, 128))
    assert not ops._cudnn_serves(q(jnp.bfloat16, 256))
    assert not ops._cudnn_serves(q(jnp.bfloat16, 100))


def test_policy_jit_compiler_options_follow_the_policy_of_each_call(clean_policy):
    """compiler_options given as a function of the policy is read at every call: a policy whose options XLA
    rejects fails to compile, and the next call under the old policy runs its old program again."""
    seen = []

    def options(policy):
        seen.append(policy)
        return {"xla_cpu_enable_fast_math": "not-a-bool"} if policy.requested("rope") == "pallas" else None

    fn = ops.policy_jit(lambda x: x + 1, compiler_options=options)
    assert float(fn(jnp.float32(1))) == 2.0
    ops.set_impl("rope", "pallas")
    with pytest.raises(Exception, match="xla_cpu_enable_fast_math"):
        fn(jnp.float32(1))
    ops.set_impl("rope", "auto")
    assert float(fn(jnp.float32(1))) == 2.0
    assert [p.requested("rope") for p in seen[-3:]] == ["auto", "pallas", "auto"]


def test_recording_choices_sees_only_the_calls_traced_in_its_block(clean_policy, rng):
    """The run summary's kernel line: a bf16 model traced after an FP8 one under the same policy reports only
    its own linear=xla (chosen_impls, per policy, holds both)."""
    from unsloth_jax import quant

    cfg = text_config(CFG)
    ids = rng.integers(0, 64, size=(1, 8))
    fp8_model = quant.quantize_projections(CausalLM(cfg, rngs=nnx.Rngs(1)), "fp8")
    fp8_model(ids)
    with ops.recording_choices() as seen:
        CausalLM(cfg, rngs=nnx.Rngs(2))(ids)
    assert seen["linear"] == ["xla"] and set(ops.chosen_impls()["linear"].split("+")) == {"xla", "fp8"}
    assert "linear=xla" in ops.format_choices(seen) and ops.format_choices({}) == "none traced"


def test_fp8_gemm_output_dtype_follows_the_activation_unless_asked(clean_policy, monkeypatch):
    """auto: FP8 GEMMs write bf16 for 16-bit activations (the H200 A/B in BENCHMARKS.md) and float32 for float32
    ones; fp8_gemm=f32 keeps float32; fp8_gemm=bf16 leaves a float32 activation's GEMMs in float32."""
    x16, x32 = jnp.zeros((2, 4), jnp.bfloat16), jnp.zeros((2, 4), jnp.float32)
    with ops.recording_choices() as chosen:
        assert ops.fp8_gemm_out(x16) == "bfloat16"
    assert chosen["fp8_gemm"] == ["bf16"]
    assert ops.fp8_gemm_out(jnp.zeros((2, 4), jnp.float16)) == "bfloat16"
    assert ops.fp8_gemm_out(x32) == "float32"
    ops.set_impl("fp8_gemm", "f32")
    assert ops.fp8_gemm_out(x16) == "float32" and ops.fp8_gemm_out(x32) == "float32"
    monkeypatch.setenv(ops.ENV_VAR, "fp8_gemm=bf16")
    assert ops.fp8_gemm_out(x16) == "bfloat16" and ops.fp8_gemm_out(x32) == "float32"


@pytest.mark.parametrize("remat", ["full", "offload"])
def test_layer_loop_unrolled_matches_the_scan(clean_policy, rng, remat):
    """The layer-stack setting layer_loop=unrolled: the same loss and LoRA gradients as the layer scan, and the
    lowered program has no while loop for the layers (the scan's forward and backward loops are gone; the loss's chunk loop stays);
    also for "offload", whose custom-VJP layer scan (models.offload) unrolls both of its scans."""
    cfg = text_config(dict(CFG, num_hidden_layers=3))
    model = CausalLM(cfg, rngs=nnx.Rngs(int(rng.integers(1 << 30))))
    lora.add_lora(model, lora.LoraSettings(r=2, lora_alpha=4, target_modules=lora.ALL_TARGETS),
                  jax.random.PRNGKey(1))
    for lin in model.projections().values():
        lin.lora_b[...] = 0.1 * jax.random.normal(jax.random.PRNGKey(2), lin.lora_b[...].shape)
    graphdef, t, f = lora.split(model)
    ids = jnp.asarray(rng.integers(0, 64, size=(2, 16)).astype(np.int32))
    micro = {"input_ids": ids, "labels": ids, "attention_mask": jnp.ones_like(ids)}
    got = {}
    for loop in ("scan", "unrolled"):
        stack = f"{remat},layer_loop={loop}"  # the layer-stack setting (unsloth_jax.models.layer_stack)
        fn = jax.jit(jax.value_and_grad(
            lambda t_: loss_and_count(nnx.merge(graphdef, t_, f), micro, remat=stack)[0]))
        loops = fn.lower(t).as_text().count("stablehlo.while")
        value, grads = fn(t)
        got[loop] = (loops, float(value), [np.asarray(g) for g in jax.tree.leaves(grads)])
    assert got["unrolled"][0] == got["scan"][0] - 2, (got["scan"][0], got["unrolled"][0])
    assert abs(got["unrolled"][1] - got["scan"][1]) <= 1e-6 * abs(got["scan"][1])
    for a, b in zip(got["unrolled"][2], got["scan"][2]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_xla_attention_is_the_kernels_reference(clean_policy, rng):
    """ops.attention's XLA path is pallas_kernels.reference.attention (one XLA attention): equal to the flash
    kernel's twin on what both take (GQA, causal, window, softcap, segments), rows with no key give zeros, and
    a sink equals one more key whose score is the sink and whose value is zero."""
    import pallas_kernels.reference as reference

    b, s, hq, hkv, d = 2, 13, 4, 2, 8
    q, k, v = (jnp.asarray(rng.standard_normal((b, s, h, d)), jnp.float32) for h in (hq, hkv, hkv))
    seg = jnp.asarray(np.sort(rng.integers(1, 4, (b, s)), axis=1), jnp.int32)
    ops.set_impl("attention", "xla")
    got = ops.attention(q, k, v, scale=0.3, window=5, softcap=20.0, segment_ids=seg)
    want = reference.flash_attention(q, k, v, causal=True, sliding_window=5, softcap=20.0, segment_ids=seg,
                                     sm_scale=0.3)
    assert rel_err(got, want) < 1e-6
    none_valid = jnp.zeros((b, s), jnp.int32).at[:, 5:].set(1)  # left padding: rows 0-4 attend to nothing
    out = ops.attention(q, k, v, scale=0.3, kv_valid=none_valid)
    assert not np.any(np.asarray(out[:, :5])) and np.all(np.isfinite(np.asarray(out)))
    sinks = jnp.asarray(rng.standard_normal(hq), jnp.float32)
    with_sink = ops.attention(q, k, v, scale=0.3, sinks=sinks)
    # the sink as a key 0 before the sequence, seen by every query: an extra q dim of sinks[h] / scale against
    # k0's extra dim 1 scores sinks[h], and its value is zero (an extra zero v dim keeps q's and v's width equal)
    pad = lambda x, n: jnp.concatenate([x, jnp.zeros((*x.shape[:-1], n))], -1)  # noqa: E731
    q1 = pad(q, 1).at[..., d].set(jnp.broadcast_to(sinks / 0.3, (b, s, hq)))
    k1 = jnp.concatenate([jnp.zeros((b, 1, hkv, d + 1)).at[..., d].set(1.0), pad(k, 1)], 1)
    v1 = jnp.concatenate([jnp.zeros((b, 1, hkv, d + 1)), pad(v, 1)], 1)
    keep = (jnp.arange(s + 1)[None, :] <= jnp.arange(s)[:, None] + 1)[None]
    want = reference.attention(q1, k1, v1, keep, scale=0.3)[..., :d]
    assert rel_err(with_sink, want) < 1e-5
