"""bench/qwen35_ab.py (issue 46's Qwen3.5 A/B beside transformers + PEFT) and gpu_session.sh's `qwen35` stage:
the summary line, the two sides' commands, transformers' side on a tiny model in this process, and the stage's
commands."""
from __future__ import annotations

import json
import subprocess
from types import SimpleNamespace

import pytest

from bench import qwen35_ab
from bench.shapes import SHAPES
from tests.helpers import ROOT, subprocess_env


def test_summary_ratios_and_errors():
    lines = [{"side": "ours", "tokens_per_s": 300.0, "peak_gib": 20.0},
             {"side": "hf", "tokens_per_s": 100.0, "peak_gib": 40.0}]
    out = qwen35_ab.summary(lines)
    assert out["speedup_ours_over_hf"] == 3.0 and out["peak_ratio_ours_over_hf"] == 0.5
    assert out["ours_tokens_per_s"] == 300.0 and out["hf_peak_gib"] == 40.0
    failed = qwen35_ab.summary([lines[0], {"side": "hf", "error": "exit 1: OutOfMemoryError"}])
    assert failed["hf_error"] == "exit 1: OutOfMemoryError" and "speedup_ours_over_hf" not in failed


def test_side_commands_share_the_run():
    a = SimpleNamespace(checkpoint="/ck/qwen3.5-9b", batch=4, seq=2048, steps=6, warmup=2)
    ours, hf = (" ".join(qwen35_ab.side_command(a, s)) for s in ("ours", "hf"))
    assert "bench/train_bench.py /ck/qwen3.5-9b --remat unsloth" in ours
    assert "qwen35_ab.py /ck/qwen3.5-9b --side hf" in hf
    for cmd in (ours, hf):
        assert cmd.endswith("--batch 4 --seq 2048 --steps 6 --warmup 2")


def test_bad_sides_refused(capsys):
    with pytest.raises(SystemExit):
        qwen35_ab.main(["/ck", "--sides", "ours,peft"])
    assert "unknown side(s) peft" in capsys.readouterr().err


@pytest.mark.torch
def test_hf_side_trains_the_seven_projections(tmp_path):
    """transformers' side on the tiny Qwen3.5 twin: LoRA on q/k/v/o of the one gated-attention layer and
    gate/up/down of all four (PEFT's count from the config), finite losses, and the DeltaNet path recorded."""
    pytest.importorskip("peft")
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kw = dict(SHAPES["qwen3.5-tiny"])
    cfg = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(tmp_path)
    out = qwen35_ab.run_hf(SimpleNamespace(checkpoint=str(tmp_path), batch=1, seq=32, steps=2, warmup=1))
    d, f, r = cfg.hidden_size, cfg.intermediate_size, 16
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    attention = r * ((d + 2 * q) + 2 * (d + kv) + (q + d))  # q_proj is twice as wide (query and gate)
    mlp = 3 * r * (d + f)
    assert out["trainable_params"] == attention * 1 + mlp * 4
    assert out["losses_finite"] and out["tokens_per_s"] > 0 and out["steps_timed"] == 1
    path = out["linear_attention"]
    assert path["layer"] == "Qwen3_5GatedDeltaNet" and set(path["packages"]) == {"fla", "causal_conv1d", "kernels"}
    if not path["packages"]["fla"]:  # transformers says it falls back to its torch loops
        assert any("chunk_gated_delta_rule" in w or "fast path" in w for w in out["transformers_warnings"])


def test_stage_commands(tmp_path):
    """`bash bench/gpu_session.sh qwen35` with a stand-in interpreter that logs its arguments: the gated delta
    bench with GDN_FLAGS, the checkpoint of QWEN35_MODEL written under CK, then the A/B on it with QWEN35_FLAGS
    split at +; each bench's stdout lands in its JSONL under $OUT (the scripts themselves: the tests above, the
    smoke stage's lora_qwen3_5_9b row, tests/kernels/test_gated_delta.py)."""
    log = tmp_path / "argv.txt"
    fake = tmp_path / "python"
    script = 'case "$1" in bench/*.py) echo "{\\"script\\": \\"$1\\"}";; esac'
    fake.write_text(f'#!/bin/bash\necho "$*" >> {log}\n{script}\n')
    fake.chmod(0o755)
    env = subprocess_env(OUT=str(tmp_path / "out"), CK=str(tmp_path / "ck"), PY=str(fake),
                         QWEN35_MODEL="qwen3.5-tiny", QWEN35_FLAGS="--batch+1+--seq+64", GDN_FLAGS="--tiny --sweep")
    run = subprocess.run(["bash", "bench/gpu_session.sh", "qwen35"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=60)
    assert run.returncode == 0, run.stderr[-2000:]
    calls = [ln for ln in log.read_text().splitlines() if ln.startswith("bench/")]
    ck = tmp_path / "ck" / "qwen3.5-tiny"
    assert calls == ["bench/gated_delta_bench.py --tiny --sweep", f"bench/make_checkpoint.py qwen3.5-tiny {ck}",
                     f"bench/qwen35_ab.py {ck} --batch 1 --seq 64"], calls
    out = tmp_path / "out"
    assert json.loads((out / "qwen35.jsonl").read_text()) == {"script": "bench/qwen35_ab.py"}
    assert json.loads((out / "gated_delta.jsonl").read_text()) == {"script": "bench/gated_delta_bench.py"}


def test_mfu_only_for_the_layouts_its_flop_count_models():
    """train_bench's MFU numerator counts a dense decoder (q/k/v/o and a GLU MLP in every layer): Qwen2's
    equals 6 x its matmul weights per token + 6 S Hq hd per layer; Qwen3.5 (linear-attention layers) gets none."""
    from bench.train_bench import mfu, model_flops_per_token
    from unsloth_jax.families import text_config

    qwen2 = text_config(dict(SHAPES["qwen2-1.5b"]))
    d, f, hd, hq, hkv, n = (qwen2.hidden_size, qwen2.intermediate_size, qwen2.head_dim, qwen2.num_attention_heads,
                            qwen2.num_key_value_heads, qwen2.num_hidden_layers)
    weights = n * (2 * d * hq * hd + 2 * d * hkv * hd + 3 * d * f) + qwen2.vocab_size * d
    assert model_flops_per_token(qwen2, 2048) == 6.0 * weights + n * 6.0 * 2048 * hq * hd
    qwen35 = text_config(dict(SHAPES["qwen3.5-9b"]))
    assert model_flops_per_token(qwen35, 2048) is None and mfu(1000.0, qwen35, 2048) is None
    assert 0 < mfu(40000.0, qwen2, 2048) < 1
