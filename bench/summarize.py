"""Render kernel JSON lines (benchmarks/data/kernels.jsonl, or a bench's own output under $OUT) as a markdown
table of XLA against Pallas (for BENCHMARKS.md); --source keeps the lines of one session's file.

    python bench/summarize.py benchmarks/data/kernels.jsonl --source 2026-11-29_kernels_matmul.jsonl
"""
import argparse
import json


def rows(path, source=None):
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if source is None or rec.get("source") == source:
                yield rec


def kernel_table(records):
    out = ["| kernel / shape | XLA fwd ms | Pallas fwd ms | XLA fwd+bwd ms | Pallas fwd+bwd ms | fwd+bwd speedup | Pallas % of 3 TB/s |",
           "|---|---|---|---|---|---|---|"]
    by = {}
    for r in records:
        key = (r["name"], json.dumps(r.get("shape")), r.get("softcap"))
        by.setdefault(key, {})[r.get("impl")] = r
    for (name, shape, _), d in by.items():
        x, p = d.get("xla"), d.get("pallas")
        if not x or not p or not all(d.get(k) for d in (x, p) for k in ("fwd_ms", "fwdbwd_ms")):
            continue
        speed = x["fwdbwd_ms"] / p["fwdbwd_ms"]
        pct = p.get("pct_of_ceiling", "")
        out.append(f"| {name} {json.loads(shape)} | {x['fwd_ms']:.3f} | {p['fwd_ms']:.3f} | {x['fwdbwd_ms']:.3f} | "
                   f"{p['fwdbwd_ms']:.3f} | {speed:.2f}x | {pct} |")
    return "\n".join(out)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--source", help="only the lines whose provenance field source is this file name")
    a = ap.parse_args()
    print(kernel_table([r for p in a.files for r in rows(p, a.source)]))
