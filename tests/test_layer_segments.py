"""The layer stack runs per segment (ModelConfig.layer_segments): consecutive runs of layers repeating one group
of layer kinds are each one scan, so a non-periodic pattern compiles a few short scan bodies instead of one long
unrolled group. Values against transformers are checked by each family's tests (test_smollm3.py, test_glm4_moe.py,
test_model_parity.py); here the segmentation itself and the program's structure."""
from __future__ import annotations

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tests.helpers import rel_err
from unsloth_jax.config import periodic_segments
from unsloth_jax.families import text_config
from unsloth_jax.models.decoder import CausalLM
from unsloth_jax.models.layer_stack import LayerStackPolicy


def test_segments_of_known_patterns():
    """GLM-4.5's dense first layers: two scans; Gemma 3's 5:1 pattern over 26 layers: 4 groups of 6 and a tail;
    a pattern that never repeats: one group; one odd layer inside a run: three scans, never a long group. Every
    segment repeats its group exactly."""
    assert periodic_segments(tuple("dd" + "m" * 58)) == ((0, 1, 2), (2, 1, 58))
    assert periodic_segments(tuple("sssssg" * 4 + "ss")) == ((0, 6, 4), (24, 1, 2))
    assert periodic_segments(tuple("sg" * 3 + "s")) == ((0, 2, 3), (6, 1, 1))
    assert periodic_segments(tuple(range(5))) == ((0, 5, 1),)
    assert periodic_segments(tuple("a" * 10 + "b" + "a" * 10)) == ((0, 1, 10), (10, 1, 1), (11, 1, 10))
    rng = np.random.default_rng()
    for _ in range(20):
        kinds = tuple(rng.integers(0, 3, size=int(rng.integers(1, 40))).tolist())
        segs = periodic_segments(kinds)
        assert segs[0][0] == 0 and sum(p * g for _, p, g in segs) == len(kinds)
        for (first, period, groups), nxt in zip(segs, segs[1:] + ((len(kinds), 0, 0),)):
            assert first + period * groups == nxt[0]
            group = kinds[first:first + period]
            assert kinds[first:first + period * groups] == group * groups


def _subjaxprs(params):
    for value in params.values():
        for v in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(v, jax.extend.core.ClosedJaxpr):
                yield v.jaxpr
            elif isinstance(v, jax.extend.core.Jaxpr):
                yield v


def _scans(jaxpr):
    """(length, eqns in the body) of every scan in `jaxpr`, nested ones included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "scan":
            found.append((eqn.params["length"], eqn.params["jaxpr"].jaxpr))
        for sub in _subjaxprs(eqn.params):
            found += _scans(sub)
    return found


def _dots(jaxpr) -> int:
    n = sum(eqn.primitive.name == "dot_general" for eqn in jaxpr.eqns)
    return n + sum(_dots(sub) for eqn in jaxpr.eqns for sub in _subjaxprs(eqn.params))


@pytest.mark.parametrize("remat", ["none", "full"])
def test_a_non_periodic_pattern_scans_and_equals_the_unrolled_stack(remat):
    """SmolLM3 with only layer 0 NoPE over 8 layers (period 8: before segments, one unrolled group of 8 layers):
    two scans, of 1 and 7 groups of one layer, whose bodies hold one layer's matmuls each; the logits equal
    those of the same stack with layer_loop=unrolled."""
    cfg = text_config(dict(model_type="smollm3", vocab_size=64, hidden_size=32, intermediate_size=64,
                                     num_hidden_layers=8, num_attention_heads=2, num_key_value_heads=1,
                                     no_rope_layers=[0] + [1] * 7))
    assert cfg.layer_period == 8 and cfg.layer_segments == ((0, 1, 1), (1, 1, 7))
    model = CausalLM(cfg, rngs=nnx.Rngs(int(np.random.default_rng().integers(1 << 30))))
    ids = jnp.asarray(np.random.default_rng().integers(0, 64, size=(2, 9)), jnp.int32)
    graphdef, state = nnx.split(model)

    def logits(state, mode):
        m = nnx.merge(graphdef, state)
        return m.logits_from_hidden(m.hidden_states(ids, _batch(ids), remat_mode=LayerStackPolicy.parse(mode)))

    jaxpr = jax.make_jaxpr(lambda s: logits(s, remat))(state).jaxpr
    scans = _scans(jaxpr)
    assert sorted(length for length, _ in scans) == [1, 7]
    per_layer = _dots(scans[0][1])
    assert per_layer > 0 and all(_dots(body) == per_layer for _, body in scans)
    assert _dots(jaxpr) == 2 * per_layer + 1  # two layer bodies and the head: nothing unrolled 8 times
    got = jax.jit(lambda s: logits(s, remat))(state)
    want = jax.jit(lambda s: logits(s, remat + ",layer_loop=unrolled"))(state)
    assert rel_err(got, want) < 1e-6


def _batch(ids):
    from unsloth_jax.models.decoder import make_batch

    return make_batch(ids)
