"""`python -m unsloth_jax` / `unsloth-jax doctor`: is this machine ready to fine-tune?

Prints the versions of the stack (jax, jaxlib, flax, optax, orbax, transformers, ...), the devices and their
memory, bf16 support and the recommended dtype, and whether each Pallas kernel compiles and matches its
plain-jnp twin in `pallas_kernels.reference` at a tiny ragged shape on this device (interpret mode on the CPU):
the forward output, and on a GPU (or with --grads) every input gradient too. A kernel module that does not
import is reported as skipped. The exit code is 0 when nothing is broken and 1 otherwise, with the reasons
(2 for a bad command line). `--json` prints one machine-readable JSON object instead.
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable

PACKAGES = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "numpy", "safetensors", "tokenizers",
            "ml_dtypes", "torch", "peft", "gguf")
REQUIRED = ("jax", "jaxlib", "flax", "optax", "orbax-checkpoint", "transformers", "numpy", "safetensors")
# Kernels whose check runs through a matmul: TF32 dots on the GPU allow 1e-3 (DESIGN.md); elementwise 1e-5.
_DOT_KERNELS = {"lora_linear", "cross_entropy", "flash_attention"}


def _version(dist: str) -> str | None:
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _rel(out, ref) -> float:
    import numpy as np

    out = np.asarray(out, np.float64)
    ref = np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return float("inf")
    if not np.all(np.isfinite(out)):
        return float("inf")
    den = np.linalg.norm(ref)
    num = np.linalg.norm(out - ref)
    return float(num / den) if den > 0 else float(num)


# ---------------------------------------------------------------------------------------------- kernel checks
def _compare(kernel: Callable, reference: Callable, args: tuple, grad_argnums: tuple[int, ...], rng) -> float:
    """Largest relative error of kernel vs reference over the forward output and, for grad_argnums, the
    gradients of sum(out * cotangent) with a random cotangent."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    out = jax.jit(kernel)(*args)
    ref = jax.jit(reference)(*args)
    err = _rel(out, ref)
    if not grad_argnums:
        return err
    ct = jnp.asarray(rng.standard_normal(np.shape(ref)), jnp.float32)

    def loss(fn):
        return lambda *a: jnp.sum(fn(*a).astype(jnp.float32) * ct)

    g_out = jax.jit(jax.grad(loss(kernel), argnums=grad_argnums))(*args)
    g_ref = jax.jit(jax.grad(loss(reference), argnums=grad_argnums))(*args)
    return max([err] + [_rel(a, b) for a, b in zip(g_out, g_ref)])


def _normal(rng, *shape, scale=1.0):
    import numpy as np

    return (scale * rng.standard_normal(shape)).astype(np.float32)


def _check_rms_norm(rng, grads):
    import pallas_kernels.reference as reference
    from pallas_kernels.rms_norm import rms_norm

    x = _normal(rng, 2, 5, 96)
    w = 1.0 + _normal(rng, 96, scale=0.1)
    return _compare(lambda x, w: rms_norm(x, w, 1e-6), lambda x, w: reference.rms_norm(x, w, 1e-6), (x, w),
                    (0, 1) if grads else (), rng)


def _check_rope(rng, grads):
    import jax.numpy as jnp
    import numpy as np
    import pallas_kernels.reference as reference
    from pallas_kernels.rope import rope

    b, s, d = 2, 7, 32
    q = _normal(rng, b, s, 4, d)
    k = _normal(rng, b, s, 2, d)
    inv = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    ang = np.broadcast_to(np.arange(s)[None, :, None] * inv, (b, s, d // 2))
    emb = np.concatenate([ang, ang], -1)
    cos, sin = np.cos(emb).astype(np.float32), np.sin(emb).astype(np.float32)

    def fused(q, k):
        return jnp.concatenate([t.reshape(b, s, -1) for t in rope(q, k, cos, sin)], -1)

    def ref(q, k):
        return jnp.concatenate([t.reshape(b, s, -1) for t in reference.rope(q, k, cos, sin)], -1)

    return _compare(fused, ref, (q, k), (0, 1) if grads else (), rng)


def _check_glu(rng, grads, which: str):
    import pallas_kernels.glu as glu
    import pallas_kernels.reference as reference

    gate = _normal(rng, 3, 7, 80)
    up = _normal(rng, 3, 7, 80)
    argnums = (0, 1) if grads else ()
    if which == "swiglu":
        return _compare(glu.swiglu, reference.swiglu, (gate, up), argnums, rng)
    return _compare(lambda g, u: glu.geglu(g, u, approximate=True),
                    lambda g, u: reference.geglu(g, u, approximate=True), (gate, up), argnums, rng)


def _check_lora_linear(rng, grads):
    import pallas_kernels.reference as reference
    from pallas_kernels.lora_linear import lora_linear

    m, k, n, r = 24, 40, 48, 8
    x = _normal(rng, m, k)
    w = _normal(rng, k, n, scale=k ** -0.5)
    a = _normal(rng, k, r, scale=k ** -0.5)
    b = _normal(rng, r, n, scale=r ** -0.5)
    return _compare(lambda x, a, b: lora_linear(x, w, a, b, 2.0),
                    lambda x, a, b: reference.lora_linear(x, w, a, b, 2.0), (x, a, b),
                    (0, 1, 2) if grads else (), rng)


def _check_cross_entropy(rng, grads):
    import numpy as np
    import pallas_kernels.reference as reference
    from pallas_kernels.cross_entropy import cross_entropy

    t, d, v = 19, 32, 300
    h = _normal(rng, t, d)
    w = _normal(rng, v, d, scale=d ** -0.5)
    labels = rng.integers(0, v, size=t).astype(np.int32)
    labels[3] = -100
    return _compare(lambda h, w: cross_entropy(h, w, labels, softcap=30.0),
                    lambda h, w: reference.cross_entropy(h, w, labels, softcap=30.0), (h, w),
                    (0, 1) if grads else (), rng)


def _check_flash_attention(rng, grads):
    import pallas_kernels.reference as reference
    from pallas_kernels.flash_attention import flash_attention

    b, s, d = 1, 24, 32
    q = _normal(rng, b, s, 4, d)
    k = _normal(rng, b, s, 2, d)
    v = _normal(rng, b, s, 2, d)
    kw = dict(causal=True, sliding_window=9, softcap=20.0)
    return _compare(lambda q, k, v: flash_attention(q, k, v, **kw),
                    lambda q, k, v: reference.flash_attention(q, k, v, **kw), (q, k, v),
                    (0, 1, 2) if grads else (), rng)


def _check_nf4(rng, grads):
    import jax
    import jax.numpy as jnp
    import pallas_kernels.reference as reference
    from pallas_kernels.nf4 import dequantize_nf4
    from pallas_kernels.nf4_format import quantize_nf4

    w = _normal(rng, 48, 72)
    q = quantize_nf4(w, blocksize=64)
    out = jax.jit(lambda q: dequantize_nf4(q, jnp.float32))(q)
    err = _rel(out, jax.jit(lambda q: reference.dequantize_nf4(q, jnp.float32))(q))
    # NF4 keeps a weight within ~10%; far more means the codes or scales are wrong.
    if _rel(out, w) > 0.2:
        return float("inf")
    return err


_CHECKS: dict[str, tuple[str, Callable]] = {
    "rms_norm": ("pallas_kernels.rms_norm", _check_rms_norm),
    "rope": ("pallas_kernels.rope", _check_rope),
    "swiglu": ("pallas_kernels.glu", lambda rng, grads: _check_glu(rng, grads, "swiglu")),
    "geglu": ("pallas_kernels.glu", lambda rng, grads: _check_glu(rng, grads, "geglu")),
    "lora_linear": ("pallas_kernels.lora_linear", _check_lora_linear),
    "cross_entropy": ("pallas_kernels.cross_entropy", _check_cross_entropy),
    "flash_attention": ("pallas_kernels.flash_attention", _check_flash_attention),
    "nf4_dequantize": ("pallas_kernels.nf4", _check_nf4),
}
KERNELS = tuple(_CHECKS)


def check_kernel(name: str, seed: int = 0, grads: bool = True) -> dict:
    """{"status": "ok" | "failed" | "skipped", "rel_err", "tolerance", "seconds", "reason"} for one kernel:
    forward output (and with grads=True every input gradient) against pallas_kernels.reference."""
    import jax
    import numpy as np

    module, fn = _CHECKS[name]
    on_gpu = jax.default_backend() == "gpu"
    # dots: f32 accumulation order differs from XLA's even on the CPU (2e-5); TF32 on the GPU (1e-3)
    tol = (1e-3 if on_gpu else 2e-5) if name in _DOT_KERNELS else 1e-5
    try:
        importlib.import_module(module)
    except Exception as e:  # noqa: BLE001 - report any import problem as "skipped"
        return {"status": "skipped", "reason": f"{module} does not import: {type(e).__name__}: {e}"}
    t0 = time.perf_counter()
    try:
        err = fn(np.random.default_rng(seed), grads)
    except Exception as e:  # noqa: BLE001
        tb = traceback.format_exception_only(type(e), e)[-1].strip()
        return {"status": "failed", "reason": f"did not compile or run: {tb[:500]}",
                "seconds": round(time.perf_counter() - t0, 3)}
    out = {"rel_err": err, "tolerance": tol, "seconds": round(time.perf_counter() - t0, 3)}
    if not err <= tol:
        return {"status": "failed", "reason": f"relative error {err:.3g} exceeds {tol:g}", **out}
    return {"status": "ok", **out}


# ------------------------------------------------------------------------------------------------- report
def _devices() -> list[dict]:
    import jax

    out = []
    for d in jax.devices():
        info: dict[str, Any] = {"id": d.id, "platform": d.platform, "kind": getattr(d, "device_kind", "")}
        cc = getattr(d, "compute_capability", None)
        if cc is not None:
            info["compute_capability"] = str(cc)
        try:
            stats = d.memory_stats() or {}
        except Exception:  # noqa: BLE001 - some backends do not implement it
            stats = {}
        if "bytes_limit" in stats:
            info["memory_total_gib"] = round(stats["bytes_limit"] / 2**30, 2)
        if "bytes_in_use" in stats:
            info["memory_in_use_gib"] = round(stats["bytes_in_use"] / 2**30, 3)
        out.append(info)
    return out


def _host_memory_gib() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 2)
    except (ValueError, OSError, AttributeError):
        return None


def recommended_dtype() -> str:
    """bfloat16 where supported (Ampere+ GPUs, TPUs), float16 on older GPUs, float32 on the CPU."""
    import jax

    from unsloth_jax.backend import is_bfloat16_supported

    if is_bfloat16_supported():
        return "bfloat16"
    return "float16" if jax.default_backend() == "gpu" else "float32"


def run_checks(kernels: tuple[str, ...] = KERNELS, seed: int = 0, grads: bool | None = None) -> dict:
    """Everything `unsloth-jax doctor` reports, as a dict (see the module docstring). grads=None checks kernel
    gradients on a GPU and only forward outputs elsewhere (interpret mode compiles slowly on a CPU)."""
    report: dict[str, Any] = {"ok": True, "problems": [], "warnings": []}
    report["python"] = sys.version.split()[0]
    report["platform"] = platform.platform()
    report["versions"] = {name: _version(name) for name in PACKAGES}
    from unsloth_jax import __version__  # the package itself imports nothing heavy (lazy exports)

    report["versions"]["unsloth_jax"] = __version__
    for module in ("unsloth_jax.api", "unsloth_jax.train"):  # the model and training stack (jax, optax, ...)
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001
            report["problems"].append(f"{module} does not import: {type(e).__name__}: {e}")
    for name in REQUIRED:
        if report["versions"].get(name) is None:
            report["problems"].append(f"required package {name} is not installed (pip install {name})")
    try:
        import jax

        report["backend"] = jax.default_backend()
        report["devices"] = _devices()
    except Exception as e:  # noqa: BLE001
        report["problems"].append(f"jax cannot list devices: {type(e).__name__}: {e}")
        report["ok"] = False
        return report
    report["host_memory_gib"] = _host_memory_gib()
    try:
        from unsloth_jax.backend import is_bfloat16_supported

        report["bf16_supported"] = bool(is_bfloat16_supported())
        report["recommended_dtype"] = recommended_dtype()
    except Exception as e:  # noqa: BLE001
        report["problems"].append(f"cannot query bf16 support: {type(e).__name__}: {e}")
    report["interpret_mode"] = jax.default_backend() != "gpu"
    try:
        from unsloth_jax import ops

        report["impl_overrides"] = dict(ops.current_policy().forced)
    except ValueError as e:  # a malformed UNSLOTH_JAX_IMPL
        report["impl_overrides"] = {}
        report["problems"].append(str(e))
    if grads is None:
        grads = jax.default_backend() == "gpu"
    report["kernel_check"] = "forward+gradients" if grads else "forward"
    report["kernels"] = {}
    for name in kernels:
        res = check_kernel(name, seed, grads)
        report["kernels"][name] = res
        if res["status"] == "failed":
            report["problems"].append(f"kernel {name}: {res['reason']}")
        elif res["status"] == "skipped":
            report["warnings"].append(f"kernel {name} skipped: {res['reason']}")
    if report["backend"] == "cpu":
        report["warnings"].append("no GPU: JAX runs on the CPU (fine for the tiny model and tests; slow for real "
                                  "models). Install jax[cuda12] on an NVIDIA machine.")
    report["ok"] = not report["problems"]
    return report


def format_report(report: dict) -> str:
    lines = ["unsloth_jax doctor"]
    v = report.get("versions", {})
    lines.append("  python " + report.get("python", "?") + "  |  " + report.get("platform", ""))
    lines.append("  " + "  ".join(f"{k} {v[k]}" for k in PACKAGES + ("unsloth_jax",) if v.get(k)))
    missing = [k for k in PACKAGES if not v.get(k)]
    if missing:
        lines.append("  not installed: " + ", ".join(missing))
    if "backend" in report:
        lines.append(f"  backend: {report['backend']}" + ("  (Pallas kernels run in interpret mode)"
                                                        if report.get("interpret_mode") else ""))
    for d in report.get("devices", []):
        mem = ""
        if "memory_total_gib" in d:
            mem = f", {d['memory_total_gib']} GiB"
            if "memory_in_use_gib" in d:
                mem += f" ({d['memory_in_use_gib']} GiB in use)"
        cc = f", compute capability {d['compute_capability']}" if "compute_capability" in d else ""
        lines.append(f"  device {d['id']}: {d['platform']} {d['kind']}{cc}{mem}")
    if report.get("host_memory_gib") is not None:
        lines.append(f"  host memory: {report['host_memory_gib']} GiB")
    if "bf16_supported" in report:
        lines.append(f"  bf16 supported: {'yes' if report['bf16_supported'] else 'no'}; recommended dtype: "
                     f"{report.get('recommended_dtype')}")
    if report.get("impl_overrides"):
        lines.append("  op overrides: " + ", ".join(f"{k}={v}" for k, v in report["impl_overrides"].items()))
    if report.get("kernels"):
        what = "forward + gradients" if report.get("kernel_check") == "forward+gradients" else "forward"
        lines.append(f"  Pallas kernels (vs pallas_kernels.reference, {what}):")
        for name, r in report["kernels"].items():
            if r["status"] == "ok":
                lines.append(f"    {name:<16} ok      rel err {r['rel_err']:.1e} (tol {r['tolerance']:g}), "
                             f"{r['seconds']:.1f}s")
            else:
                lines.append(f"    {name:<16} {r['status']:<7} {r['reason']}")
    for w in report.get("warnings", []):
        lines.append(f"  note: {w}")
    if report.get("ok"):
        lines.append("OK: ready to fine-tune.")
    else:
        lines.append("PROBLEMS:")
        lines.extend(f"  - {p}" for p in report["problems"])
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"comma-separated kernels to check (default: all of {', '.join(KERNELS)}; '' for none)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random test inputs")
    parser.add_argument("--grads", action=argparse.BooleanOptionalAction, default=None,
                        help="also check every kernel gradient (default: on a GPU only)")


def run(args: argparse.Namespace) -> int:
    kernels = tuple(k for k in (s.strip() for s in args.kernels.split(",")) if k)
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        print(f"unsloth-jax doctor: unknown kernel(s) {', '.join(unknown)}; choose from {', '.join(KERNELS)}",
              file=sys.stderr)
        return 2
    report = run_checks(kernels, args.seed, args.grads)
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(format_report(report))
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m unsloth_jax", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
