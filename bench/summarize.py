"""Render the JSON lines under bench/results/ as markdown tables (for BENCHMARKS.md).

    python bench/summarize.py bench/results/2026-11-29_kernels_matmul.jsonl ...
"""
import json
import sys


def rows(path):
    for line in open(path):
        line = line.strip()
        if line.startswith("{"):
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                pass


def kernel_table(records):
    out = ["| kernel / shape | XLA fwd ms | Pallas fwd ms | XLA fwd+bwd ms | Pallas fwd+bwd ms | fwd+bwd speedup | Pallas % of 3 TB/s |",
           "|---|---|---|---|---|---|---|"]
    by = {}
    for r in records:
        key = (r["name"], json.dumps(r.get("shape")), r.get("softcap"))
        by.setdefault(key, {})[r.get("impl")] = r
    for (name, shape, _), d in by.items():
        x, p = d.get("xla"), d.get("pallas")
        if not x or not p:
            continue
        speed = x["fwdbwd_ms"] / p["fwdbwd_ms"]
        pct = p.get("pct_of_ceiling", "")
        out.append(f"| {name} {json.loads(shape)} | {x['fwd_ms']:.3f} | {p['fwd_ms']:.3f} | {x['fwdbwd_ms']:.3f} | "
                   f"{p['fwdbwd_ms']:.3f} | {speed:.2f}x | {pct} |")
    return "\n".join(out)


if __name__ == "__main__":
    recs = [r for p in sys.argv[1:] for r in rows(p)]
    print(kernel_table(recs))
