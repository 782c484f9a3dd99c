"""The doctor: `python -m unsloth_jax --json` exits 0 on this machine with every field present; a kernel that
fails its numerical check makes it exit 1 with the reason; a kernel module that does not import is skipped."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import ROOT, subprocess_env
from unsloth_jax import doctor


def test_python_m_unsloth_jax_json_exit_0():
    proc = subprocess.run([sys.executable, "-m", "unsloth_jax", "--json"], cwd=ROOT, env=subprocess_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    for key in ("ok", "problems", "versions", "backend", "devices", "bf16_supported", "recommended_dtype",
                "kernels", "kernel_check", "interpret_mode", "host_memory_gib"):
        assert key in report, key
    assert report["ok"] is True and report["problems"] == []
    for pkg in ("jax", "jaxlib", "flax", "optax", "transformers", "unsloth_jax"):
        assert report["versions"][pkg], pkg
    assert report["devices"] and report["devices"][0]["platform"] == report["backend"]
    assert report["recommended_dtype"] in ("bfloat16", "float16", "float32")
    assert set(report["kernels"]) == set(doctor.KERNELS)
    for name, res in report["kernels"].items():
        assert res["status"] in ("ok", "skipped"), (name, res)
        if res["status"] == "ok":
            assert res["rel_err"] <= res["tolerance"]


def test_text_report_and_gradient_check(capsys):
    rc = doctor.main(["--kernels", "geglu,rms_norm", "--grads", "--seed", "3"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "geglu" in out and "rms_norm" in out and "forward + gradients" in out and "OK: ready" in out


def test_failing_kernel_gives_exit_1_with_reason(monkeypatch, capsys):
    monkeypatch.setitem(doctor._CHECKS, "swiglu", ("pallas_kernels.glu", lambda rng, grads: 0.5))
    report = doctor.run_checks(("swiglu",))
    assert not report["ok"]
    assert report["kernels"]["swiglu"]["status"] == "failed"
    assert any("swiglu" in p and "exceeds" in p for p in report["problems"])

    def broken(rng, grads):
        raise RuntimeError("lowering exploded")

    monkeypatch.setitem(doctor._CHECKS, "rope", ("pallas_kernels.rope", broken))
    rc = doctor.main(["--kernels", "rope"])
    out = capsys.readouterr().out
    assert rc == 1 and "lowering exploded" in out and "PROBLEMS" in out


def test_missing_kernel_module_is_skipped_not_fatal(monkeypatch):
    monkeypatch.setitem(doctor._CHECKS, "nf4_dequantize", ("pallas_kernels.not_written_yet", lambda r, g: 0.0))
    report = doctor.run_checks(("nf4_dequantize",))
    assert report["ok"]
    assert report["kernels"]["nf4_dequantize"]["status"] == "skipped"
    assert any("nf4_dequantize" in w for w in report["warnings"])


def test_unknown_kernel_name_is_a_usage_error(capsys):
    assert doctor.main(["--kernels", "warp_drive"]) == 2
    assert "warp_drive" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["doctor", "--json", "--kernels", ""]])
def test_cli_doctor_subcommand(argv, capsys):
    from unsloth_jax.cli import main

    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["kernels"] == {}


def test_broken_dependency_is_a_named_problem(tmp_path):
    """An installed but broken dependency (here a fake optax that raises on import) is reported as a problem
    naming the module that fails to import, with exit 1, instead of a traceback before the report."""
    fake = tmp_path / "optax"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('optax is broken for this test')\n")
    env = subprocess_env()
    env["PYTHONPATH"] = str(tmp_path) + os.pathsep + env["PYTHONPATH"]
    proc = subprocess.run([sys.executable, "-m", "unsloth_jax", "--json", "--kernels", ""], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(proc.stdout)
    assert any("unsloth_jax.train does not import: ImportError: optax is broken" in p for p in report["problems"])
