"""bench/smoke.py, the GPU session's smoke stage (issue 47): its table, its scheduler (one failing, hanging or
blocked item never stops the others), and every row run at tiny shapes on this machine (`--tiny`, slow)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import smoke
from tests.helpers import ROOT, quick_codegen_flags, subprocess_env

ROWS = {"lora_qwen2_1.5b", "qlora_qwen2_1.5b", "qlora_llama3_8b", "vision_qwen2_5_vl_7b", "vision_gemma3_4b",
        "grpo_qwen2_1.5b", "fast_generate_16", "export_merged_gguf", "long_context_32k", "dpo_qwen2_1.5b",
        "lora_qwen3_5_9b", "lora_smollm3_3b", "lora_glm4_5_air_3l", "vision_qwen3_vl_8b", "lora_gemma4_e2b"}
FIELDS = {"name", "ran", "error", "tokens_per_s", "peak_gib", "seconds", "measures", "command"}


@pytest.mark.parametrize("tiny", [False, True], ids=["real", "tiny"])
def test_table(tiny):
    table = smoke.items(tiny, "/ck")
    names = [i.name for i in table]
    assert len(names) == len(set(names))
    assert {i.name for i in table if not i.prep} == ROWS
    preps = {i.name for i in table if i.prep}
    for item in table:
        assert set(item.needs) <= preps, item.name
        assert names.index(item.name) > max((names.index(n) for n in item.needs), default=-1)
    if not tiny:  # the real shapes
        cmd = {i.name: i.command() for i in table}
        assert "--batch 4 --seq 2048" in cmd["lora_qwen2_1.5b"] and "--load-in-4bit" in cmd["qlora_qwen2_1.5b"]
        assert "/ck/llama3-8b" in cmd["qlora_llama3_8b"] and "--seq 32768" in cmd["long_context_32k"]
        assert "--shape 7b" in cmd["vision_qwen2_5_vl_7b"] and "--shape 4b" in cmd["vision_gemma3_4b"]
        for row, ckpt in (("lora_qwen3_5_9b", "qwen3.5-9b"), ("lora_smollm3_3b", "smollm3-3b"),
                          ("lora_glm4_5_air_3l", "glm4.5-air-3l"), ("lora_gemma4_e2b", "gemma4-e2b")):
            assert f"/ck/{ckpt} --batch 4 --seq 2048" in cmd[row], row
        assert "--family qwen3_vl --shape 8b --checkpoint /ck/qwen3_vl-8b" in cmd["vision_qwen3_vl_8b"]


def test_list_dry_run_and_only():
    def run(*args):
        out = subprocess.run([sys.executable, "bench/smoke.py", *args], cwd=ROOT, env=subprocess_env(),
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout.splitlines()

    assert len(run("--list")) == len(smoke.items(False, "/tmp/ckpt"))
    lines = run("--dry-run", "--only", "dpo_qwen2_1.5b")
    assert [ln.split(":")[0] for ln in lines] == ["checkpoint_qwen2-1.5b", "dpo_qwen2_1.5b"]
    assert "_dpo /tmp/ckpt/qwen2-1.5b" in lines[1]


def _item(name, code, *, needs=(), timeout=30, prep=False):
    return smoke.Item(name, "test", [sys.executable, "-c", code], timeout=timeout, gib=1, needs=needs, prep=prep)


def test_one_failure_never_stops_the_others(tmp_path):
    ok = "import json; print(json.dumps({'name': 'x', 'tokens_per_s': 5.0, 'peak_gib': 1.5, 'extra': 1}))"
    table = [_item("prep_bad", "raise SystemExit(3)", prep=True),
             _item("prep_ok", "pass", prep=True),
             _item("fails", "import sys; print('noise', file=sys.stderr); raise ValueError('the last line')"),
             _item("hangs", "import time; time.sleep(60)", timeout=2),
             _item("blocked", ok, needs=("prep_bad",)),
             _item("silent", "print('no json here')"),
             _item("fine", ok, needs=("prep_ok",))]
    with open(tmp_path / "s.jsonl", "w") as f:
        records = smoke.run_stage(table, jobs=3, budget=120, mem_gib=float("inf"), log_dir=str(tmp_path),
                                  out_file=f, env=subprocess_env())
    by = {r["name"]: r for r in records}
    assert set(by) == {i.name for i in table}
    for r in records:
        assert FIELDS <= set(r), r
    assert by["fine"]["ran"] and by["fine"]["tokens_per_s"] == 5.0 and by["fine"]["peak_gib"] == 1.5
    assert by["fine"]["result"] == {"extra": 1}
    assert by["prep_ok"]["ran"] and not by["prep_bad"]["ran"]
    assert by["fails"]["error"] == "ValueError: the last line"
    assert by["hangs"]["error"].startswith("timed out after 2 s")
    assert by["blocked"]["error"] == "not run: prep_bad failed"
    assert by["silent"]["error"].startswith("no JSON line")
    assert len((tmp_path / "s.jsonl").read_text().splitlines()) == len(table)


def test_budget_spent_rows_are_reported():
    table = [_item("late", "pass")]
    records = smoke.run_stage(table, jobs=1, budget=10, mem_gib=1.0, log_dir="/tmp", out_file=None,
                              env=subprocess_env())
    assert records[0]["ran"] is False and "budget" in records[0]["error"]


@pytest.mark.slow
@pytest.mark.torch
def test_every_row_runs_at_tiny_shapes(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("gguf")
    extra = {"XLA_FLAGS": flags} if (flags := quick_codegen_flags()) else {}
    out = tmp_path / "smoke.jsonl"
    run = subprocess.run([sys.executable, "bench/smoke.py", "--tiny", "--jobs", "2", "--out", str(out),
                          "--ckpt-dir", str(tmp_path / "ckpt")], cwd=ROOT, env=subprocess_env(**extra),
                         capture_output=True, text=True, timeout=1500)
    records = [json.loads(line) for line in out.read_text().splitlines()]
    rows = {r["name"]: r for r in records if not r.get("prep")}
    assert set(rows) == ROWS, run.stdout[-3000:]
    failed = {n: r["error"] for n, r in rows.items() if not r["ran"]}
    assert not failed, (failed, run.stdout[-3000:])
    assert run.returncode == 0 and run.stdout.splitlines()[-1].startswith(f"smoke: {len(ROWS)} of {len(ROWS)} rows")
    for name, r in rows.items():
        assert FIELDS <= set(r), name
        assert r["seconds"] > 0 and (r["tokens_per_s"] or 0) > 0 or name == "export_merged_gguf", name
    assert rows["export_merged_gguf"]["result"]["checks_passed"]
    assert rows["grpo_qwen2_1.5b"]["result"]["generated_tokens_per_s"] > 0


@pytest.mark.parametrize("shape", ["qwen3.5-9b", "qwen3.5-tiny", "smollm3-3b", "smollm3-tiny", "glm4.5-air-3l",
                                   "glm4.5-tiny", "gemma4-e2b", "gemma4-tiny"])
def test_issue46_shapes_parse(shape):
    """transformers builds each issue-46 shape's config and unsloth_jax reads its config.json form (the rows'
    checkpoints are written from these); the real shapes keep their released layer pattern."""
    transformers = pytest.importorskip("transformers")
    from bench.shapes import SHAPES
    from unsloth_jax.families import text_config

    kw = dict(SHAPES[shape])
    raw = transformers.AutoConfig.for_model(kw.pop("model_type"), **kw).to_dict()
    cfg = text_config(json.loads(json.dumps(raw)))
    assert cfg.num_hidden_layers == kw["num_hidden_layers"] and cfg.vocab_size == kw["vocab_size"]
    if shape == "qwen3.5-9b":  # 8 x (3 gated DeltaNet + 1 gated attention), 64 rotary dims of 256
        assert cfg.layer_linear == (True, True, True, False) * 8 and cfg.rotary_dim == 64
    if shape == "gemma4-e2b":  # transformers writes its per_layer_config keys zero-padded ("04", ..., "34")
        assert "04" in raw["per_layer_config"] and (cfg.global_head_dim, cfg.global_kv_heads) == (512, 1)
        assert cfg.double_wide_mlp and cfg.layer_kv_source[15:] == (13, 13, 13, 13, 14) * 4


def test_checkpoints_wait_for_disk_and_unneeded_ones_are_removed(tmp_path):
    """A simulated 16 GiB disk (10 GiB a written checkpoint folder): B waits until the row that needs A has ended,
    then A is removed and B written; C never fits: it fails and its row is not run."""
    ck = tmp_path / "ck"

    def prep(name, disk):
        folder = ck / name
        code = f"import os; os.makedirs({str(folder)!r}); open({str(folder / 'config.json')!r}, 'w').close()"
        return smoke.Item(f"checkpoint_{name}", "test", [sys.executable, "-c", code], timeout=30, gib=1, prep=True,
                          skip_if=str(folder / "config.json"), disk=disk)

    def disk_free():
        return 16.0 - 10.0 * sum((d / "config.json").exists() for d in ck.iterdir()) if ck.exists() else 16.0

    row = "import time; time.sleep(1); print('{\"tokens_per_s\": 1.0}')"
    table = [prep("a", 10), prep("b", 10), prep("c", 20),
             _item("row_a", row, needs=("checkpoint_a",)), _item("row_b", row, needs=("checkpoint_b",)),
             _item("row_c", row, needs=("checkpoint_c",))]
    records = smoke.run_stage(table, jobs=3, budget=120, mem_gib=float("inf"), log_dir=str(tmp_path), out_file=None,
                              env=subprocess_env(), disk_free=disk_free)
    order = [r["name"] for r in records]
    by = {r["name"]: r for r in records}
    assert by["row_a"]["ran"] and by["row_b"]["ran"] and by["checkpoint_b"]["ran"]
    assert order.index("row_a") < order.index("checkpoint_b")
    assert not (ck / "a").exists() and (ck / "b" / "config.json").exists()
    assert by["checkpoint_c"]["error"].startswith("not started: ") and "it writes 20 GiB" in by["checkpoint_c"]["error"]
    assert by["row_c"]["error"] == "not run: checkpoint_c failed"


def test_qwen3_vl_8b_shape_parses():
    """The Qwen3-VL-8B row's checkpoint config (bench/vision_bench.py make) as unsloth_jax reads it: 36 text layers,
    27 tower blocks with DeepStack from blocks 8, 16 and 24."""
    pytest.importorskip("transformers")
    from bench import vision_bench
    from unsloth_jax.families.qwen3_vl import QWEN3_VL

    cfg = QWEN3_VL.parse_config(json.loads(json.dumps(vision_bench.hf_config("qwen3_vl", "8b").to_dict())))
    assert (cfg.text.num_hidden_layers, cfg.vision.depth) == (36, 27)
    assert tuple(cfg.vision.deepstack_visual_indexes) == (8, 16, 24)
