"""Kernels earn their default: every Pallas kernel module opens its docstring (the paragraph after its title) with
where it wins, citing BENCHMARKS.md sections that exist, and the default dispatch (ops.PALLAS_WINS) picks it only
there; a kernel that wins nowhere is never picked by default (it stays tested and selectable with ops.set_impl), nor
is one not measured yet ("Wins: not measured on a GPU yet", naming the bench script that will measure it).
Imports jax and unsloth_jax.ops only (no flax), so it runs on every jax the kernels support."""
from __future__ import annotations

import ast
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from unsloth_jax import ops

ROOT = Path(__file__).resolve().parents[1]
# kernel module (pallas_kernels/NAME.py) -> the op whose ops.PALLAS_WINS entry picks it by default
KERNEL_OPS = {"rms_norm": "rms_norm", "rope": "rope", "glu": "glu", "glu_fp8": "glu_fp8", "lora_linear": "linear",
              "cross_entropy": "cross_entropy", "flash_attention": "attention", "nf4": "nf4_matmul",
              "grouped_matmul": "grouped_matmul", "decode_attention": "paged_attention",
              "decode_linear": "decode_linear", "nf4_decode": "nf4_decode", "gated_delta_state": "gated_delta"}
BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
# What each winning kernel's docstring says its default is: probes (dtype, last dim) picked / not picked.
WHERE_PICKED = {
    "rms_norm": ([(BF16, 1536), (BF16, 4096)], [(BF16, 2304), (BF16, 128), (F16, 4096), (F32, 1536)]),
    "cross_entropy": ([(BF16, 1536), (BF16, 4096)], [(F16, 1536), (F32, 4096)]),
    "attention": ([(BF16, 64), (BF16, 96), (BF16, 128), (F16, 256)], [(F32, 128), (BF16, 512)]),
    "nf4_matmul": ([(BF16, 1536), (BF16, 4096)], [(F16, 4096), (F32, 4096)]),
    "grouped_matmul": ([(BF16, 2048), (F16, 768)], [(F32, 2048)]),
    "paged_attention": ([(BF16, 64), (BF16, 128), (F16, 256)], [(F32, 128), (BF16, 96), (BF16, 512)]),
    "decode_linear": ([(BF16, 1536), (F16, 4096)], [(F32, 1536)]),
    "nf4_decode": ([(BF16, 1536), (F16, 4096)], [(F32, 1536)]),
    "gated_delta": ([(BF16, 128)], [(F16, 128), (F32, 128), (BF16, 64), (BF16, 256)]),
}
HEADINGS = {line[3:].strip() for line in (ROOT / "BENCHMARKS.md").read_text().splitlines() if line.startswith("## ")}
UNMEASURED = "Wins: not measured on a GPU yet"
KERNEL_MODULES = sorted(f.stem for f in (ROOT / "pallas_kernels").glob("*.py") if "pallas_call(" in f.read_text())


def _probe(dtype, last: int):
    return jax.ShapeDtypeStruct((2, 16, 4, last), dtype)


def wins_paragraph(module: str) -> str:
    """The paragraph after the docstring's title, whitespace folded."""
    doc = ast.get_docstring(ast.parse((ROOT / "pallas_kernels" / f"{module}.py").read_text())) or ""
    paragraphs = doc.split("\n\n")
    return " ".join(paragraphs[1].split()) if len(paragraphs) > 1 else ""


@pytest.mark.parametrize("module", KERNEL_MODULES)
def test_kernel_module_opens_with_where_it_wins(module):
    assert module in KERNEL_OPS, (f"pallas_kernels/{module}.py holds Pallas kernels: add it to KERNEL_OPS here, and "
                                  "open its docstring with where it wins (see the other kernel modules)")
    text, op = wins_paragraph(module), KERNEL_OPS[module]
    assert text.startswith("Wins"), (f"pallas_kernels/{module}.py: the paragraph after the docstring's title must "
                                     f"say where the kernel wins (\"Wins: ...\" or \"Wins nowhere ...\"); got {text[:80]!r}")
    assert f'ops.PALLAS_WINS["{op}"]' in text, f"pallas_kernels/{module}.py: name its default, ops.PALLAS_WINS[\"{op}\"]"
    probes = [_probe(dt, d) for dt in (BF16, F16, F32) for d in (64, 96, 128, 256, 768, 1536, 2048, 2304, 4096)]
    picked = [p for p in probes if ops.PALLAS_WINS[op](p)]
    if text.startswith(UNMEASURED):
        scripts = [s for s in re.findall(r"bench/[\w./]+\.py", text) if (ROOT / s).is_file()]
        assert scripts, f"pallas_kernels/{module}.py is not measured yet: name the bench/ script that measures it"
        assert not picked, f"ops.PALLAS_WINS[{op!r}] picks pallas_kernels/{module}.py, not measured yet, for {picked}"
        return
    cited = re.findall(r'BENCHMARKS\.md, "([^"]+)"', text)
    assert cited, f"pallas_kernels/{module}.py: cite the BENCHMARKS.md section, as BENCHMARKS.md, \"<section title>\""
    missing = [c for c in cited if c not in HEADINGS]
    assert not missing, f"pallas_kernels/{module}.py cites BENCHMARKS.md sections that do not exist: {missing}"
    if text.startswith("Wins nowhere"):
        assert not picked, f"ops.PALLAS_WINS[{op!r}] picks pallas_kernels/{module}.py, which wins nowhere, for {picked}"
    else:
        assert op in WHERE_PICKED, f"add {op!r}: where its docstring says the default picks it, to WHERE_PICKED"


@pytest.mark.parametrize("op", sorted(WHERE_PICKED))
def test_the_default_picks_a_winning_kernel_only_where_its_docstring_says(op):
    yes, no = WHERE_PICKED[op]
    assert all(ops.PALLAS_WINS[op](_probe(*p)) for p in yes), f"ops.PALLAS_WINS[{op!r}] should pick {yes}"
    assert not any(ops.PALLAS_WINS[op](_probe(*p)) for p in no), f"ops.PALLAS_WINS[{op!r}] should not pick {no}"
    modules = [m for m, o in KERNEL_OPS.items() if o == op and m in KERNEL_MODULES]
    assert modules and not wins_paragraph(modules[0]).startswith("Wins nowhere")
