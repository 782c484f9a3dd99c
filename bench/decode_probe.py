"""Decode-step layout probe (plain JAX, random weights): how the weight layout and LoRA shape a decode step.

    XLA_PYTHON_CLIENT_PREALLOCATE=false python bench/decode_probe.py --shape qwen2-1.5b --rows 16 \
        --variants stacked,list,fused,stacked_lora

Each variant runs `--steps` greedy decode steps inside one jitted `lax.fori_loop` (the KV cache a carry, one
[B, T, Hkv, hd] array per layer, written in place), layers unrolled in Python:
  stacked       weights [L, in, out] as the trainer holds them, each layer a static slice
  list          one array per layer (what an unstacked copy would give)
  fused         one array per layer, q/k/v and gate/up concatenated (a merged copy's layout)
  stacked_lora  stacked + unmerged LoRA r=16 on the seven projections (q/k/v and gate/up A factors fused)
  list_lora     list + unmerged LoRA
Prints one JSON line per variant: ms per step (median of --repeats loop runs / steps), tokens/s, the weight-read
bound, and the compiled program's kernel-ish op counts (fusions, custom calls, copies).
"""
import argparse
import json
import re
import time

import jax
import jax.numpy as jnp
import numpy as np

SHAPES = {  # D, F, L, Hq, Hkv, hd, V
    "qwen2-1.5b": (1536, 8960, 28, 12, 2, 128, 151936),
    "llama-3-8b": (4096, 14336, 32, 32, 8, 128, 128256),
    "tiny": (64, 128, 2, 4, 2, 16, 256),
}
PROJS = ("q", "k", "v", "o", "gate", "up", "down")


def make_weights(shape, key, lora_rank=16):
    d, f, n_layers, hq, hkv, hd, v = shape
    dims = {"q": (d, hq * hd), "k": (d, hkv * hd), "v": (d, hkv * hd), "o": (hq * hd, d),
            "gate": (d, f), "up": (d, f), "down": (f, d)}
    keys = iter(jax.random.split(key, 32))
    w = {p: (0.02 * jax.random.normal(next(keys), (n_layers, *dims[p]), jnp.float32)).astype(jnp.bfloat16)
         for p in PROJS}
    w["norm1"] = jnp.ones((n_layers, d), jnp.bfloat16)
    w["norm2"] = jnp.ones((n_layers, d), jnp.bfloat16)
    w["embed"] = (0.02 * jax.random.normal(next(keys), (v, d), jnp.float32)).astype(jnp.bfloat16)
    lora = {p: ((0.02 * jax.random.normal(next(keys), (n_layers, dims[p][0], lora_rank))),
                (0.02 * jax.random.normal(next(keys), (n_layers, lora_rank, dims[p][1]))))
            for p in PROJS}
    return w, lora


def rms(x, w):
    xf = x.astype(jnp.float32)
    return (xf * jax.lax.rsqrt(jnp.mean(xf * xf, -1, keepdims=True) + 1e-6) * w.astype(jnp.float32)).astype(x.dtype)


def rope(x, pos, hd):
    inv = 1.0 / (10000.0 ** (jnp.arange(0, hd, 2, dtype=jnp.float32) / hd))
    ang = pos.astype(jnp.float32)[:, None, None] * inv
    cos, sin = jnp.concatenate([jnp.cos(ang)] * 2, -1), jnp.concatenate([jnp.sin(ang)] * 2, -1)
    xf = x.astype(jnp.float32)
    rot = jnp.concatenate([-xf[..., hd // 2:], xf[..., :hd // 2]], -1)
    return (xf * cos + rot * sin).astype(x.dtype)


def attend(q, ck, cv, length, hq, hkv, hd):
    b = q.shape[0]
    g = hq // hkv
    qg = q.reshape(b, hkv, g, hd)
    s = jnp.einsum("bhgd,bthd->bhgt", qg, ck, preferred_element_type=jnp.float32) / np.sqrt(hd)
    t = ck.shape[1]
    s = jnp.where((jnp.arange(t)[None, :] < length[:, None])[:, None, None], s, -1e30)
    p = jax.nn.softmax(s, -1)
    o = jnp.einsum("bhgt,bthd->bhgd", p.astype(cv.dtype), cv, preferred_element_type=jnp.float32)
    return o.reshape(b, hq * hd).astype(q.dtype)


def build(variant, shape, w, lora):
    d, f, n_layers, hq, hkv, hd, v = shape
    per_layer = variant.startswith(("list", "fused"))
    with_lora = variant.endswith("_lora")
    if per_layer:
        layers = [{p: w[p][i] for p in PROJS + ("norm1", "norm2")} for i in range(n_layers)]
        if variant == "fused":
            layers = [{"qkv": jnp.concatenate([l["q"], l["k"], l["v"]], 1), "o": l["o"],
                       "gate_up": jnp.concatenate([l["gate"], l["up"]], 1), "down": l["down"],
                       "norm1": l["norm1"], "norm2": l["norm2"]} for l in layers]
        params = {"layers": layers, "embed": w["embed"]}
    else:
        params = {"stack": {p: w[p] for p in PROJS + ("norm1", "norm2")}, "embed": w["embed"]}
    if with_lora:
        # factors cast once (outside the step) to bf16; A of q/k/v and of gate/up concatenated
        cast = {p: (a.astype(jnp.bfloat16), b.astype(jnp.bfloat16)) for p, (a, b) in lora.items()}
        params["lora"] = {"a_qkv": jnp.concatenate([cast[p][0] for p in ("q", "k", "v")], -1),
                          "a_gu": jnp.concatenate([cast[p][0] for p in ("gate", "up")], -1),
                          "a_o": cast["o"][0], "a_down": cast["down"][0],
                          "b": {p: cast[p][1] for p in PROJS}}

    def layer_weights(params, i):
        if per_layer:
            return params["layers"][i]
        return {p: a[i] for p, a in params["stack"].items()}

    def step(params, caches, tok, pos):
        x = params["embed"][tok]
        new = []
        for i in range(n_layers):
            lw = layer_weights(params, i)
            h = rms(x, lw["norm1"])
            if variant == "fused":
                qkv = h @ lw["qkv"]
                q, k, vv = jnp.split(qkv, [hq * hd, hq * hd + hkv * hd], -1)
            else:
                q, k, vv = h @ lw["q"], h @ lw["k"], h @ lw["v"]
            if with_lora:
                lo = params["lora"]
                r = lo["b"]["q"].shape[1]
                xa = h @ lo["a_qkv"][i]
                q = q + xa[:, :r] @ lo["b"]["q"][i]
                k = k + xa[:, r:2 * r] @ lo["b"]["k"][i]
                vv = vv + xa[:, 2 * r:] @ lo["b"]["v"][i]
            q = rope(q.reshape(-1, hq, hd), pos, hd)
            k = rope(k.reshape(-1, hkv, hd), pos, hd)
            ck, cv = caches[i]
            ck = jax.lax.dynamic_update_slice(ck, k[:, None], (0, pos[0], 0, 0))
            cv = jax.lax.dynamic_update_slice(cv, vv.reshape(-1, 1, hkv, hd), (0, pos[0], 0, 0))
            new.append((ck, cv))
            a = attend(q, ck, cv, pos + 1, hq, hkv, hd)
            o = a @ lw["o"]
            if with_lora:
                o = o + (a @ params["lora"]["a_o"][i]) @ params["lora"]["b"]["o"][i]
            x = x + o
            h = rms(x, lw["norm2"])
            if variant == "fused":
                gu = h @ lw["gate_up"]
                g_, u = gu[:, :f], gu[:, f:]
            else:
                g_, u = h @ lw["gate"], h @ lw["up"]
            if with_lora:
                lo = params["lora"]
                r = lo["b"]["gate"].shape[1]
                xa = h @ lo["a_gu"][i]
                g_ = g_ + xa[:, :r] @ lo["b"]["gate"][i]
                u = u + xa[:, r:] @ lo["b"]["up"][i]
            m = (jax.nn.silu(g_.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
            dn = m @ lw["down"]
            if with_lora:
                dn = dn + (m @ params["lora"]["a_down"][i]) @ params["lora"]["b"]["down"][i]
            x = x + dn
        logits = jnp.einsum("bd,vd->bv", x, params["embed"], preferred_element_type=jnp.float32)
        return new, jnp.argmax(logits, -1).astype(jnp.int32)

    def loop(params, caches, tok, pos, steps):
        def body(_, carry):
            caches, tok, pos = carry
            caches, tok = step(params, caches, tok, pos)
            return caches, tok, pos + 1
        return jax.lax.fori_loop(0, steps, body, (caches, tok, pos))

    return params, jax.jit(loop, static_argnums=(4,), donate_argnums=(1,))


def op_counts(hlo: str) -> dict:
    return {k: len(re.findall(p, hlo)) for k, p in
            (("fusions", r"= \S+ fusion\("), ("custom_calls", r"custom-call\("), ("copies", r"= \S+ copy\("),
             ("dynamic_slices", r"dynamic-slice\("), ("slices", r"= \S+ slice\("))}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen2-1.5b", choices=sorted(SHAPES))
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=320)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--variants", default="stacked,list,fused,stacked_lora")
    ap.add_argument("--tag", default="")
    ap.add_argument("--dump", default="", help="folder: write each variant's compiled HLO text there")
    a = ap.parse_args()
    shape = SHAPES[a.shape]
    d, f, n_layers, hq, hkv, hd, v = shape
    w, lora = make_weights(shape, jax.random.PRNGKey(0))
    weight_bytes = sum(int(np.prod(w[p].shape)) * 2 for p in PROJS) + v * d * 2
    bw = 4.3e12
    for variant in a.variants.split(","):
        params, fn = build(variant, shape, w, lora)
        caches = [(jnp.zeros((a.rows, a.ctx, hkv, hd), jnp.bfloat16),) * 2 for _ in range(n_layers)]
        caches = [(jnp.zeros_like(c[0]), jnp.zeros_like(c[1])) for c in caches]
        tok = jnp.arange(a.rows, dtype=jnp.int32) % v
        pos = jnp.full((a.rows,), 64, jnp.int32)
        t0 = time.perf_counter()
        compiled = fn.lower(params, caches, tok, pos, a.steps).compile()
        compile_s = time.perf_counter() - t0
        hlo = compiled.as_text()
        counts = op_counts(hlo)
        if a.dump:
            with open(f"{a.dump}/{a.shape}_{variant}_{a.rows}{a.tag}.hlo.txt", "w") as fh:
                fh.write(hlo)
        times = []
        for _ in range(a.repeats + 1):
            t0 = time.perf_counter()
            caches, tok, _ = compiled(params, caches, tok, pos)
            jax.block_until_ready(tok)
            times.append(time.perf_counter() - t0)
        ms = float(np.median(times[1:])) / a.steps * 1e3
        print(json.dumps({"name": "decode_probe", "tag": a.tag, "shape": a.shape, "variant": variant,
                          "rows": a.rows, "ctx": a.ctx, "ms_per_step": round(ms, 4),
                          "tokens_per_s": round(a.rows / ms * 1e3, 1),
                          "bound_ms": round(weight_bytes / bw * 1e3, 4), "compile_s": round(compile_s, 1),
                          **counts, "jax": jax.__version__, "device": jax.devices()[0].device_kind}), flush=True)
        del params, fn, compiled, caches


if __name__ == "__main__":
    main()
