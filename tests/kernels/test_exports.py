"""The package's top-level names: each public kernel function, imported lazily from its submodule."""
from __future__ import annotations

import importlib
import inspect
import subprocess
import sys

import pytest

import pallas_kernels
from tests.helpers import subprocess_env

KERNELS = ("rms_norm", "rope", "swiglu", "geglu", "lora_linear", "cross_entropy", "flash_attention", "quantize_nf4",
           "dequantize_nf4", "nf4_matmul", "qlora_linear", "NF4Weight", "grouped_matmul", "glu_fp8_matmul", "stacked_linear", "nf4_decode_linear",
           "paged_decode_attention",
           "nf4_fp8_matmul", "gated_delta_rule", "chunked_gated_delta_rule")


@pytest.mark.parametrize("name", KERNELS)
def test_top_level_name_is_the_submodule_function(name):
    obj = getattr(pallas_kernels, name)
    assert obj.__module__.startswith("pallas_kernels.")
    module = importlib.import_module(obj.__module__)
    assert obj is getattr(module, name)
    assert getattr(pallas_kernels, name) is obj  # still the function once its submodule is loaded
    assert callable(obj) and not inspect.ismodule(obj)
    assert name in pallas_kernels.__all__ and name in dir(pallas_kernels)
    doc = inspect.getdoc(obj) or ""
    assert doc and "[" in doc and "dtype" in doc, f"{name}: the docstring should state shapes and dtypes"


def test_from_import_gives_functions():
    from pallas_kernels import cross_entropy, flash_attention, lora_linear, rms_norm, rope

    for f in (rms_norm, rope, lora_linear, cross_entropy, flash_attention):
        assert inspect.isfunction(f), f


def test_unknown_name_raises_attribute_error():
    with pytest.raises(AttributeError, match="no_such_kernel"):
        pallas_kernels.no_such_kernel  # noqa: B018


def test_package_import_is_cheap_and_order_independent():
    """`import pallas_kernels` imports no jax; importing a submodule before the top-level name (as
    `from pallas_kernels.rms_norm import ...` does) still leaves the function there."""
    code = (
        "import sys\n"
        "import pallas_kernels\n"
        "assert 'jax' not in sys.modules, 'import pallas_kernels imported jax'\n"
        "from pallas_kernels.rms_norm import rms_norm_with_config\n"
        "import pallas_kernels.flash_attention\n"
        "from pallas_kernels import flash_attention, rms_norm\n"
        "assert rms_norm is sys.modules['pallas_kernels.rms_norm'].rms_norm, rms_norm\n"
        "assert flash_attention is sys.modules['pallas_kernels.flash_attention'].flash_attention, flash_attention\n"
    )
    run = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr
