"""Measurements live in benchmarks/data/, not beside the code: no result files under bench/ or a source package, and
every data file benchmarks/data/index.json names exists and holds JSON lines that say where they came from."""
from __future__ import annotations

import json
import pathlib
import re

from bench import add_results

ROOT = pathlib.Path(__file__).resolve().parent.parent
DATA = ROOT / "benchmarks" / "data"
RESULT_SUFFIXES = {".json", ".jsonl", ".txt", ".log"}
CODE_TREES = ["bench", "unsloth_jax", "pallas_kernels", "scripts", "tests"]
INPUTS = [ROOT / "unsloth_jax" / "assets"]  # bundled model and datasets: package data, not results


def test_no_result_files_under_bench_or_a_source_package():
    assert not (ROOT / "bench" / "results").exists(), "results go to benchmarks/data/ (bench/add_results.py)"
    found = []
    for tree in CODE_TREES:
        for path in (ROOT / tree).rglob("*"):
            rel = path.relative_to(ROOT)
            if any(part.startswith(".") or part == "__pycache__" for part in rel.parts):
                continue
            if any(path.is_relative_to(d) for d in INPUTS):
                continue
            if path.is_file() and path.suffix in RESULT_SUFFIXES:
                found.append(str(rel))
    assert not found, f"result files outside benchmarks/data/: {found}"


def test_every_indexed_data_file_exists_and_is_json_lines_with_provenance():
    index = json.loads((DATA / "index.json").read_text())
    files = index["files"]
    assert files
    on_disk = {p.name for p in DATA.glob("*.jsonl")}
    assert on_disk == set(files), f"data files not in the index or missing: {on_disk ^ set(files)}"
    for name in files:
        lines = (DATA / name).read_text().splitlines()
        assert lines, name
        for n, line in enumerate(lines, 1):
            rec = json.loads(line)
            where = f"{name}:{n}"
            assert isinstance(rec, dict), where
            assert list(rec)[:3] == ["date", "session", "source"], where
            assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", rec["date"]), where
            assert isinstance(rec["session"], int) and rec["session"] > 0, where
            assert rec["source"].startswith(rec["date"]), where
    assert (DATA / index["logs"]["dir"]).is_dir()


def test_add_results_files_lines_with_provenance(tmp_path):
    src = tmp_path / "speed.jsonl"
    src.write_text('{"step_ms": 1.5}\nnot json\n\n')
    recs = [add_results.with_provenance(r, "2026-12-04", 16, "2026-12-04_speed.jsonl")
            for r in add_results.records(src.open())]
    assert recs == [{"date": "2026-12-04", "session": 16, "source": "2026-12-04_speed.jsonl", "step_ms": 1.5},
                    {"date": "2026-12-04", "session": 16, "source": "2026-12-04_speed.jsonl", "log": "not json"}]
    (tmp_path / "train.jsonl").write_text("")
    assert add_results.append("train.jsonl", recs, data=tmp_path) == 2
    assert [json.loads(x) for x in (tmp_path / "train.jsonl").read_text().splitlines()] == recs
    try:
        add_results.with_provenance({"source": "x"}, "2026-12-04", 16, "s")
    except ValueError:
        pass
    else:
        raise AssertionError("a record that already has a provenance field must be refused")
