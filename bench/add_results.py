"""Append a GPU session's JSON lines to the committed measurements, benchmarks/data/AREA.jsonl.

bench/gpu_session.sh and the benches print JSON lines (gpu_session.sh collects them under $OUT); after the session a
person commits them with this script. Every appended line starts with its provenance: "date" (YYYY-MM-DD),
"session" (the session's number in benchmarks/HISTORY.md) and "source" (the file the lines were written to, named
DATE[letter]_WHAT.jsonl, e.g. 2026-12-04_speed_rows_vs_all_xla.jsonl), then the bench's own fields unchanged. A line
that is not a JSON object (a log line that reached stdout) is kept as {"log": "..."}; blank lines are dropped.
The areas are the files named in benchmarks/data/index.json.

    python bench/add_results.py --area train --date 2026-12-04 --session 16 \
        --source 2026-12-04_speed_rows_vs_all_xla.jsonl $OUT/speed.jsonl

Text logs (pytest_gpu.txt, session.log) are copied by hand to benchmarks/data/logs/DATE[letter]_NAME.txt.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import re
import sys

DATA = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "data"
INDEX = DATA / "index.json"
PROVENANCE = ("date", "session", "source")
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def areas(index: pathlib.Path = INDEX) -> dict:
    """{file name: its index entry} of the data files benchmarks/data/index.json names."""
    return json.loads(index.read_text())["files"]


def records(lines):
    """The JSON objects of a bench's output; any other non-blank line as {"log": line}."""
    for line in lines:
        line = line.rstrip("\n")
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            rec = None
        yield rec if isinstance(rec, dict) else {"log": line}


def with_provenance(rec: dict, date: str, session, source: str) -> dict:
    if not DATE.match(date):
        raise ValueError(f"date {date!r}: expected YYYY-MM-DD")
    clash = [k for k in PROVENANCE if k in rec]
    if clash:
        raise ValueError(f"{source}: the record already has {clash}; rename them before adding it")
    return {"date": date, "session": session, "source": source, **rec}


def append(area: str, recs, data: pathlib.Path = DATA) -> int:
    n = 0
    with open(data / area, "a") as f:
        for rec in recs:
            f.write(json.dumps(rec) + "\n")
            n += 1
    return n


def main(argv=None) -> None:
    known = areas()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", help="JSON-lines files (e.g. under $OUT)")
    ap.add_argument("--area", required=True, help="one of: " + ", ".join(k.removesuffix(".jsonl") for k in known))
    ap.add_argument("--date", required=True, help="YYYY-MM-DD of the session")
    ap.add_argument("--session", required=True, type=int, help="the session's number (benchmarks/HISTORY.md)")
    ap.add_argument("--source", help="the name the lines are filed under (default: DATE_<file name>)")
    ap.add_argument("--dry-run", action="store_true", help="print the lines instead of appending them")
    a = ap.parse_args(argv)
    area = a.area if a.area.endswith(".jsonl") else a.area + ".jsonl"
    if area not in known:
        sys.exit(f"unknown area {a.area!r}: add it to {INDEX} first")
    for path in map(pathlib.Path, a.files):
        source = a.source or f"{a.date}_{path.name}"
        recs = [with_provenance(r, a.date, a.session, source) for r in records(path.open())]
        if a.dry_run:
            for r in recs:
                print(json.dumps(r))
        else:
            print(f"{path}: {append(area, recs)} lines -> {DATA / area}", file=sys.stderr)


if __name__ == "__main__":
    main()
