"""NF4 storage vs the real bitsandbytes (CPU): codes, statistics, dequantization and checkpoint tensors.

Skipped when bitsandbytes (a test-only dependency) or torch is not importable. Shapes whose last dim is a
multiple of 16 but not of 64 are avoided: bitsandbytes' CPU dequantize_4bit is wrong for them on AVX-512.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
bnb = pytest.importorskip("bitsandbytes")
F = pytest.importorskip("bitsandbytes.functional")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import pallas_kernels.nf4 as nf4  # noqa: E402
import pallas_kernels.nf4_format as fmt  # noqa: E402
import pallas_kernels.reference as ref  # noqa: E402

TORCH_DT = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
JAX_DT = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}

# numel a multiple of 64; numel odd and not a multiple of 64 (with all-zero blocks); > 256 blocks (partial
# nested block); 1-D with an odd numel; several nested blocks.
SHAPES = [(96, 130), (33, 67), (257, 192), (4099,), (300, 640)]
_ref_dequant = jax.jit(ref.dequantize_nf4)
_dequant = jax.jit(nf4.dequantize_nf4)


def _weight(rng, shape, dtype, zero_blocks=False):
    """Gaussian weight with per-row scales spanning two decades (exercises the absmax statistics)."""
    w = rng.standard_normal(shape).astype(np.float32)
    if len(shape) == 2:
        w *= np.exp(rng.uniform(-2.3, 2.3, (shape[0], 1))).astype(np.float32)
    flat = w.reshape(-1)
    if zero_blocks:
        flat[64:128] = 0.0  # an all-zero full block
        tail = flat.size % 64 or 64
        flat[-tail:] = 0.0  # an all-zero last block (partial when numel % 64 != 0)
    t = torch.from_numpy(flat.reshape(shape)).to(TORCH_DT[dtype])
    return t, jnp.asarray(t.float().numpy()).astype(JAX_DT[dtype])


def _f32_ulps(a, b) -> int:
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return int(np.max(np.abs(ia - ib)))


def _bnb_tensors(packed, state) -> dict[str, np.ndarray]:
    out = {"weight": packed.numpy()}
    for k, v in state.as_dict(packed=True).items():
        out["weight." + k] = v.numpy()
    return out


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_matches_bitsandbytes(rng, shape, dtype):
    w_t, w_j = _weight(rng, shape, dtype, zero_blocks=(shape == (33, 67)))
    packed_b, st_b = F.quantize_4bit(w_t, quant_type="nf4", blocksize=64, compress_statistics=True)
    _, st_plain = F.quantize_4bit(w_t, quant_type="nf4", blocksize=64, compress_statistics=False)

    q = fmt.quantize_nf4(w_j, blocksize=64, double_quant=True)
    q_plain = fmt.quantize_nf4(w_j, blocksize=64, double_quant=False)

    # 4-bit codes (first element in the high nibble) and the float32 absmax: always identical.
    assert np.array_equal(np.asarray(q.codes), packed_b.numpy().reshape(-1))
    assert np.array_equal(np.asarray(q_plain.codes), packed_b.numpy().reshape(-1))
    assert np.array_equal(np.asarray(q_plain.absmax).view(np.uint32), st_plain.absmax.numpy().view(np.uint32))

    # Double quantization. Given bitsandbytes' offset, our 8-bit codes and nested scales are identical.
    off_b = np.float32(st_b.offset.item())
    qa, nested = fmt._double_quant(jnp.asarray(st_plain.absmax.numpy()), jnp.float32(off_b))
    assert np.array_equal(np.asarray(qa), st_b.absmax.numpy())
    assert np.array_equal(np.asarray(nested).view(np.uint32), st_b.state2.absmax.numpy().view(np.uint32))
    # Our own offset is the correctly rounded float32 sum / n; torch's float32 sum (torch.mean) agrees
    # except for rare last-bit differences at large block counts (not reached by these shapes).
    ulps = _f32_ulps(q.offset, off_b)
    assert ulps <= 2, (float(q.offset), float(off_b))
    if ulps == 0:
        assert np.array_equal(np.asarray(q.absmax), st_b.absmax.numpy())
        assert np.array_equal(np.asarray(q.nested_absmax).view(np.uint32),
                              st_b.state2.absmax.numpy().view(np.uint32))

    # Dequantization: ours of bitsandbytes' tensors == bitsandbytes' dequantize_4bit, bit for bit, and
    # ours of our own tensors too when the offsets agree.
    deq_b = F.dequantize_4bit(packed_b, st_b).float().numpy()
    q_from_b = fmt.nf4_from_bnb_tensors(_bnb_tensors(packed_b, st_b))
    deq_ours_of_b = _dequant(q_from_b)
    assert deq_ours_of_b.dtype == JAX_DT[dtype] and deq_ours_of_b.shape == tuple(shape)
    assert np.array_equal(np.asarray(deq_ours_of_b.astype(jnp.float32)), deq_b)
    assert np.array_equal(np.asarray(_ref_dequant(q_from_b).astype(jnp.float32)), deq_b)
    if ulps == 0:
        assert np.array_equal(np.asarray(_dequant(q).astype(jnp.float32)), deq_b)
    # Without double quantization too.
    deq_plain_b = F.dequantize_4bit(packed_b, st_plain).float().numpy()
    assert np.array_equal(np.asarray(_ref_dequant(q_plain).astype(jnp.float32)), deq_plain_b)


def test_quantize_float32_matches_bitsandbytes(rng):
    w_t, w_j = _weight(rng, (64, 200), "float32")
    packed_b, st_b = F.quantize_4bit(w_t, quant_type="nf4", blocksize=64, compress_statistics=True)
    q = fmt.quantize_nf4(w_j)
    assert np.array_equal(np.asarray(q.codes), packed_b.numpy().reshape(-1))
    if _f32_ulps(q.offset, st_b.offset.item()) == 0:
        assert np.array_equal(np.asarray(q.absmax), st_b.absmax.numpy())
    deq_b = F.dequantize_4bit(packed_b, st_b).numpy()
    q_from_b = fmt.nf4_from_bnb_tensors(_bnb_tensors(packed_b, st_b))
    assert np.array_equal(np.asarray(_ref_dequant(q_from_b)), deq_b)
    assert np.array_equal(np.asarray(_dequant(q_from_b)), deq_b)


def test_8bit_rule_is_bitsandbytes_cpu_rule(rng):
    """Our threshold form of the 8-bit absmax quantizer equals bitsandbytes' CPU quantize_blockwise on values
    crowded around every decision point (block absmax forced to 1 so the normalized value is exact)."""
    t = fmt._DYN_THRESHOLDS
    vals = [t]
    for direction in (np.float32(2), np.float32(-2)):
        x = t.copy()
        for _ in range(4):
            x = np.nextafter(x, direction).astype(np.float32)
            vals.append(x)
    vals.append(rng.uniform(-1, 1, 50_000).astype(np.float32))
    vals.append((rng.standard_normal(20_000) * 1e-3).astype(np.float32))
    v = np.clip(np.concatenate(vals), -1, 1)
    nb = -(-v.size // 255)
    v = np.concatenate([v, np.zeros(nb * 255 - v.size, np.float32)]).reshape(nb, 255)
    a = np.concatenate([np.ones((nb, 1), np.float32), v], axis=1).reshape(-1)
    codes_b, st = F.quantize_blockwise(torch.from_numpy(a), blocksize=256)
    assert np.all(st.absmax.numpy() == 1.0)
    codes, amax = jax.jit(fmt._quant_codes_8bit)(jnp.asarray(a))
    assert np.array_equal(np.asarray(codes), codes_b.numpy())
    # and the hard-coded dynamic map is bitsandbytes' own
    assert np.array_equal(F.create_dynamic_map().numpy().view(np.uint32), fmt.DYNAMIC_MAP.view(np.uint32))
    assert np.array_equal(F.get_4bit_type("nf4", device="cpu").numpy().view(np.uint32), fmt.NF4_CODE.view(np.uint32))


@pytest.mark.parametrize("double_quant", [True, False])
def test_bnb_tensor_round_trip(rng, double_quant):
    """bitsandbytes' checkpoint tensors -> NF4Weight -> tensors is byte-identical, and our tensors load in
    bitsandbytes (QuantState.from_dict) and dequantize to our values."""
    shape = (70, 258)
    w_t, w_j = _weight(rng, shape, "bfloat16")
    lin = bnb.nn.Linear4bit(shape[1], shape[0], bias=False, compute_dtype=torch.bfloat16,
                            compress_statistics=double_quant, quant_type="nf4")
    lin.weight.data = w_t.clone()
    lin = lin.to("cpu")
    sd = {"model.layers.3.mlp.down_proj." + k: v.numpy() for k, v in lin.state_dict().items()}
    q = fmt.nf4_from_bnb_tensors(sd)
    assert q.shape == shape and q.dtype == "bfloat16" and q.blocksize == 64 and q.double_quant == double_quant
    back = fmt.nf4_to_bnb_tensors(q)
    assert set(back) == {k.replace("model.layers.3.mlp.down_proj.", "") for k in sd}
    for k, v in back.items():
        orig = sd["model.layers.3.mlp.down_proj." + k]
        assert v.dtype == orig.dtype and v.shape == orig.shape, k
        assert v.tobytes() == orig.tobytes(), k

    # ours -> bitsandbytes
    q_ours = fmt.quantize_nf4(w_j, double_quant=double_quant)
    tens = fmt.nf4_to_bnb_tensors(q_ours)
    state = {k[len("weight."):]: torch.from_numpy(np.array(v)) for k, v in tens.items() if k != "weight"}
    qs = F.QuantState.from_dict(state, device=torch.device("cpu"))
    deq_b = F.dequantize_4bit(torch.from_numpy(np.array(tens["weight"])), qs).float().numpy()
    ours = np.asarray(nf4.dequantize_nf4(q_ours).astype(jnp.float32))
    assert np.array_equal(ours, deq_b)
