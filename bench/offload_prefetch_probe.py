"""Host offload of checkpointed layer inputs in plain JAX (no project code): does fetching the next layer's
input from pinned host memory while the current layer's backward runs hide the copies?

    python bench/offload_prefetch_probe.py [--layers 32 --tokens 4096 --hidden 4096 --intermediate 14336]

Variants (one JSON line each: step ms, XLA's temp bytes, the process's peak GiB (run one variant per process
for a per-variant peak), gradient norms and the max gradient difference from the first variant run):
- device: lax.scan of jax.checkpoint(nothing_saveable) layers; layer inputs stay on the device.
- offload_policy: the same with jax's offload policy (layer input to pinned host), what the project's "unsloth"
  mode was until 2026-12-02.
- custom_vjp_fetch: a custom VJP over the scan: the forward stores each layer input in pinned host memory; the
  backward scan copies layer i's input back at the start of its iteration (what the policy does, by hand).
- custom_vjp_prefetch: as custom_vjp_fetch, but iteration i copies layer i-1's input while layer i's backward
  runs and carries it to the next iteration, so the copy is off the critical path if XLA runs it async
  (custom_vjp_stack says how, with the scans' own slicing). unsloth_jax.models.offload is this variant plus an
  ordering barrier before each forward copy (the real step needed it; this probe's step did not wait without).
A layer: RMSNorm, a SwiGLU MLP with frozen bf16 weights and a rank-16 LoRA beside it; only LoRA is trained.
"""
from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp


def layer(h, frozen, lora):
    """h [T, D] bf16; frozen = (gate [D, F], up [D, F], down [F, D]); lora = (a [D, r], b [r, D]) -> [T, D]."""
    x = h.astype(jnp.float32)
    x = (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + 1e-6)).astype(h.dtype)
    gate, up, down = frozen
    a, b = lora
    y = (jax.nn.silu(x @ gate) * (x @ up)) @ down + ((x @ a.astype(x.dtype)) @ b.astype(x.dtype))
    return h + y


def to_memory(x, kind: str):
    return jax.device_put(x, jax.sharding.SingleDeviceSharding(jax.devices()[0], memory_kind=kind))


def checkpoint_stack(policy):
    body = jax.checkpoint(lambda h, p: (layer(h, *p), None), policy=policy)
    return lambda h, frozen, lora: jax.lax.scan(body, h, (frozen, lora))[0]


def custom_vjp_stack(prefetch: bool, host: str):
    """The layer stack with a hand-written VJP that keeps layer inputs in `host` memory. Every host read and
    write is a scan's own xs / ys slicing (offset = the loop counter), the pattern XLA turns into memcpys.

    prefetch=False: saved[i] = the input of layer i; the backward's iteration i copies it back and uses it.
    prefetch=True: the forward carries the previous layer's input and saves it, so saved[i] = the input of
    layer i-1 (saved[0] = the stack's input, unused) and the last layer's input stays on the device; the
    backward's iteration i runs layer i's backward on the input carried from iteration i+1 while copying
    saved[i] back for iteration i-1."""

    @jax.custom_vjp
    def stack(h, frozen, lora):
        return jax.lax.scan(lambda h, p: (layer(h, *p), None), h, (frozen, lora))[0]

    def grads(x, g, p_frozen, p_lora):
        _, vjp = jax.vjp(lambda x, l: layer(x, p_frozen, l), x, p_lora)
        return vjp(g)

    def fwd(h, frozen, lora):
        if not prefetch:
            h_out, saved = jax.lax.scan(lambda h, p: (layer(h, *p), to_memory(h, host)), h, (frozen, lora))
            return h_out, (saved, None, frozen, lora)

        def body(carry, p):
            h, h_prev = carry
            return (layer(h, *p), h), to_memory(h_prev, host)

        (h_out, last_input), saved = jax.lax.scan(body, (h, h), (frozen, lora))
        return h_out, (saved, last_input, frozen, lora)

    def bwd(res, g):
        saved, last_input, frozen, lora = res
        if not prefetch:
            def body(g, xs):
                x_host, p_frozen, p_lora = xs
                return grads(to_memory(x_host, "device"), g, p_frozen, p_lora)
            g, g_lora = jax.lax.scan(body, g, (saved, frozen, lora), reverse=True)
            return g, jax.tree.map(jnp.zeros_like, frozen), g_lora

        def body(carry, xs):
            g, x = carry
            below_host, p_frozen, p_lora = xs
            below = to_memory(below_host, "device")  # the input of the layer below, used next iteration
            gx, gl = grads(x, g, p_frozen, p_lora)
            return (gx, below), gl
        (g, _), g_lora = jax.lax.scan(body, (g, last_input), (saved, frozen, lora), reverse=True)
        return g, jax.tree.map(jnp.zeros_like, frozen), g_lora

    stack.defvjp(fwd, bwd)
    return stack


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=14336)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--profile", metavar="DIR", help="also trace 2 steps per variant into DIR/<variant> and add "
                    "bench/trace_summary's per-stream and per-category milliseconds to its line")
    ap.add_argument("--variants", default="device,offload_policy,custom_vjp_fetch,custom_vjp_prefetch")
    ap.add_argument("--dump", metavar="DIR", help="also write XLA's HLO (as text, before and after optimization, "
                    "with the schedule) into DIR/<variants>-<n>: where the host copies' starts and dones sit in the loop bodies")
    a = ap.parse_args()
    if a.dump:  # XLA reads its flags when the backend starts, which is below; one new folder per run
        run = 0
        while os.path.exists(dump := os.path.join(a.dump, f"{a.variants.replace(',', '+')}-{run}")):
            run += 1
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text" \
                                   " --xla_dump_hlo_module_re=jit_loss"
    gpu = jax.default_backend() == "gpu"
    host = "pinned_host" if gpu else "unpinned_host"
    L, T, D, F, r = a.layers, a.tokens, a.hidden, a.intermediate, 16
    keys = jax.random.split(jax.random.key(0), 6)
    scale = lambda n: 1.0 / n ** 0.5  # noqa: E731
    frozen = tuple((jax.random.normal(k, s, jnp.float32) * scale(s[1])).astype(jnp.bfloat16)
                   for k, s in zip(keys[:3], [(L, D, F), (L, D, F), (L, F, D)]))
    lora = (jax.random.normal(keys[3], (L, D, r)) * scale(D), jax.random.normal(keys[4], (L, r, D)) * 0.01)
    h0 = jax.random.normal(keys[5], (T, D), jnp.bfloat16)
    offload = jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[], names_which_can_be_offloaded=["layer_input"],
        offload_src="device", offload_dst=host)

    stacks = {
        "device": checkpoint_stack(jax.checkpoint_policies.nothing_saveable),
        "offload_policy": _named_input_stack(offload),
        "custom_vjp_fetch": custom_vjp_stack(False, host),
        "custom_vjp_prefetch": custom_vjp_stack(True, host),
    }
    reference = None
    for name in a.variants.split(","):
        stack = stacks[name]

        def loss(lora, frozen, h0):
            return jnp.mean(stack(h0, frozen, lora).astype(jnp.float32) ** 2)

        step = jax.jit(jax.value_and_grad(loss))
        t0 = time.perf_counter()
        value, grad = jax.block_until_ready(step(lora, frozen, h0))
        compile_s = time.perf_counter() - t0
        times = []
        for _ in range(a.steps):
            t0 = time.perf_counter()
            jax.block_until_ready(step(lora, frozen, h0))
            times.append((time.perf_counter() - t0) * 1e3)
        if reference is None:
            reference = grad
        err = max(float(jnp.max(jnp.abs(g - r_))) / (float(jnp.max(jnp.abs(r_))) + 1e-30)
                  for g, r_ in zip(jax.tree.leaves(grad), jax.tree.leaves(reference)))
        analysis = step.lower(lora, frozen, h0).compile().memory_analysis()
        stats = jax.devices()[0].memory_stats() or {}
        profile = {}
        if a.profile:
            from pathlib import Path

            from bench.trace_summary import newest_trace, summarize
            jax.profiler.start_trace(f"{a.profile}/{name}")
            for _ in range(2):
                jax.block_until_ready(step(lora, frozen, h0))
            jax.profiler.stop_trace()
            summary = summarize(newest_trace(Path(f"{a.profile}/{name}")), steps=2, top=8)
            profile = {k: summary[k] for k in ("busy_ms_per_step", "span_ms_per_step", "ms_per_step_by_stream",
                                               "ms_per_step_by_category", "busiest_stream_idle", "top_kernels")}
        print(json.dumps(profile | {"name": "offload_prefetch_probe", "variant": name, "step_ms": round(sorted(times)[len(times) // 2], 2),
                          "step_ms_all": [round(t, 2) for t in times], "compile_s": round(compile_s, 1),
                          "loss": float(value), "grad_rel_err_vs_first": err,
                          "grad_norms": [float(jnp.linalg.norm(g)) for g in jax.tree.leaves(grad)],
                          "temp_gib": round(analysis.temp_size_in_bytes / 2 ** 30, 3),
                          "host_temp_gib": round(getattr(analysis, "host_temp_size_in_bytes", 0) / 2 ** 30, 3),
                          "peak_gib": round(stats.get("peak_bytes_in_use", 0) / 2 ** 30, 3),
                          "layers": L, "tokens": T, "hidden": D, "intermediate": F,
                          "backend": jax.default_backend(), "jax": jax.__version__}), flush=True)


def _named_input_stack(policy):
    from jax.ad_checkpoint import checkpoint_name

    body = jax.checkpoint(lambda h, p: (layer(checkpoint_name(h, "layer_input"), *p), None), policy=policy)
    return lambda h, frozen, lora: jax.lax.scan(body, h, (frozen, lora))[0]


if __name__ == "__main__":
    main()
