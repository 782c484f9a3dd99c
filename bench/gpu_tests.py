"""The GPU suite (bench/gpu_session.sh's `tests` stage, issue 47): pytest-xdist workers sized to the card, then the
tests that ran out of memory or time beside the others retried alone.

    python bench/gpu_tests.py --out /tmp/out/pytest_gpu.txt              # what `bash bench/gpu_session.sh tests` runs
    python bench/gpu_tests.py --dry-run                                   # the plan and the pytest command only
    python bench/gpu_tests.py --workers 8 --marks gpu tests/kernels       # the old `-m gpu` selection, 8 workers
    python bench/gpu_tests.py --shard 1/3                                 # a third of the files (one call each)

Selection: `-m "gpu or gpu_suite"` (--marks): the gpu-marked tests and the CPU test files of code with GPU paths
(tests/conftest.py marks the engine, vision and long-context files gpu_suite; their float32 matmuls run at full
precision on the GPU there).

Workers share the card. Each is a separate jax process, so each has its own allocator, and jax's allocator keeps
what it took (XLA_PYTHON_CLIENT_PREALLOCATE=false only delays taking it): without a cap, workers that grew early
starve the later ones (83 of 169 tests failed with CUDA OOM beside 12 workers on an 80 GB card). So:
- the worker count (--workers, default) is one per --gib-per-worker (12) GiB of the card's free memory
  (nvidia-smi), at most the CPU count, at least 1;
- each worker gets XLA_PYTHON_CLIENT_MEM_FRACTION = its share: 0.95 x free memory less ~0.75 GiB of CUDA context
  per process, divided among the workers, as a fraction of the card's total (an H100 80GB: 6 workers of ~11.7 GiB;
  an H200 141GB: 11 workers of ~11.4 GiB), so none can take another's memory;
- XLA_PYTHON_CLIENT_PREALLOCATE=false, and COLUMNS wide enough that pytest's summary lines keep the error text;
- XLA's GEMM autotuning off (--autotune-level 0, when this XLA takes the flag): the suite compiles many small
  programs, and 2026-12-06's run on an H100 took 210 s for 33 of its 288 tests with it on (about 38 s a test per
  worker; how much autotuning cost there was not measured).
Then every test that failed with an out-of-memory error (RESOURCE_EXHAUSTED, "out of memory") or hit the per-test
timeout is run again alone, in one process with 0.9 of the card, in the time left (--retry-reserve seconds are kept
for it). The last line sums both runs: "gpu tests: P passed, F failed, S skipped (R retried alone: ...)".
The memory the suite's tests took (tests/conftest.py's GPU peak report) is at the end of the pytest output.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT_GIB = 0.75  # CUDA context + cuBLAS/cuDNN handles of one process, outside jax's allocator
RETRY_PATTERN = re.compile(r"RESOURCE_EXHAUSTED|out of memory|OUT_OF_MEMORY|Failed: Timeout", re.I)


def card_gib() -> tuple[float, float] | None:
    """(free, total) GiB of GPU 0 from nvidia-smi, or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    free, total = (float(x) / 1024 for x in out.stdout.splitlines()[0].split(","))
    return free, total


def plan(free_gib: float, total_gib: float, cpus: int, gib_per_worker: float,
         workers: int | None = None) -> tuple[int, float]:
    """(workers, XLA_PYTHON_CLIENT_MEM_FRACTION of each) for a card with free_gib of total_gib (module docstring)."""
    if workers is None:
        workers = int(free_gib // gib_per_worker)
    workers = max(1, min(workers, cpus))
    share = (0.95 * free_gib - CONTEXT_GIB * workers) / workers
    fraction = max(0.01, min(0.9, share / total_gib))
    return workers, float(f"{fraction - 0.0005:.3f}")  # rounded down


def retry_ids(pytest_output: str) -> list[str]:
    """Node ids of the short summary's FAILED / ERROR lines whose error is out of memory or the per-test timeout."""
    ids = []
    for line in pytest_output.splitlines():
        m = re.match(r"^(?:FAILED|ERROR) (\S+?)(?: - (.*))?$", line.strip())
        if m and m.group(2) and RETRY_PATTERN.search(m.group(2)) and m.group(1) not in ids:
            ids.append(m.group(1))
    return ids


def counts(pytest_output: str) -> dict[str, int]:
    """The final "== N passed, M failed, ... in S s ==" line's counts (passed, failed, error(s), skipped, ...)."""
    found: dict[str, int] = {}
    for line in pytest_output.splitlines():
        if re.search(r"\d+ (passed|failed|errors?|skipped)\b.* in [\d.]+s", line):
            found = {k.rstrip("s") if k.startswith("error") else k: int(n)
                     for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|deselected|xfailed|xpassed)", line)}
    if not found:  # stopped before its last line: the -v progress lines' outcomes so far
        for word in re.findall(r"^(?:\[gw\d+\] \[\s*\d+%\] )?(PASSED|FAILED|ERROR|SKIPPED) \S+::", pytest_output, re.M):
            key = "error" if word == "ERROR" else word.lower()
            found[key] = found.get(key, 0) + 1
        if found:
            found["stopped"] = 1
    return found


def run_pytest(cmd: list[str], env: dict, timeout: float, out_path: str) -> str:
    """Run pytest (its own process group: a timeout ends its workers too), write its output to out_path."""
    t0 = time.time()
    with open(out_path, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n# XLA_PYTHON_CLIENT_MEM_FRACTION={env.get('XLA_PYTHON_CLIENT_MEM_FRACTION')}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            proc.wait(timeout=max(timeout, 1))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()
            f.write(f"\n# stopped after {timeout:.0f} s (the stage's time)\n")
    print(f"== pytest ran {time.time() - t0:.0f} s, output in {out_path}", flush=True)
    with open(out_path, errors="replace") as f:
        return f.read()


def xla_flag_ok(flag: str, env: dict) -> bool:
    """Whether this jax's XLA starts with `flag` added to XLA_FLAGS (an unknown flag aborts every process)."""
    probe = dict(env, XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} {flag}".strip())
    code = "import jax.numpy as jnp; jnp.ones(2).block_until_ready()"
    return subprocess.run([sys.executable, "-c", code], env=probe, capture_output=True, timeout=120).returncode == 0


def collect(env: dict, marks: str, paths: list[str]) -> dict[str, int]:
    """{test file: its selected tests} (pytest --collect-only)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-m", marks,
                          *paths], env=env, capture_output=True, text=True, cwd=ROOT).stdout
    per_file: dict[str, int] = {}
    for line in out.splitlines():
        if "::" in line:
            f = line.split("::", 1)[0]
            per_file[f] = per_file.get(f, 0) + 1
    return per_file


def assign_shards(per_file: dict[str, int], n: int) -> list[list[str]]:
    """The files in n parts, each file whole (its module fixtures are built once), largest files first to the part
    with the fewest tests so far; each part sorted."""
    loads, owned = [0] * n, [[] for _ in range(n)]
    for f, c in sorted(per_file.items(), key=lambda kv: (-kv[1], kv[0])):
        i = loads.index(min(loads))
        loads[i] += c
        owned[i].append(f)
    return [sorted(part) for part in owned]


def _shard(text: str) -> tuple[int, int]:
    k, n = (int(x) for x in text.split("/"))
    if not 1 <= k <= n:
        raise argparse.ArgumentTypeError(f"--shard K/N with 1 <= K <= N, got {text}")
    return k, n


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("paths", nargs="*", default=["tests"])
    ap.add_argument("--marks", default="gpu or gpu_suite", help="pytest -m expression")
    ap.add_argument("--workers", type=int, help="pytest-xdist workers (default: from the card's free memory)")
    ap.add_argument("--gib-per-worker", type=float, default=12.0)
    ap.add_argument("--timeout", type=float, default=480.0, help="seconds for the whole stage, retries included")
    ap.add_argument("--per-test-timeout", type=float, default=150.0, help="pytest-timeout's limit (0: none)")
    ap.add_argument("--retry-reserve", type=float, default=90.0, help="seconds kept for the retries")
    ap.add_argument("--out", default="/tmp/out/pytest_gpu.txt", help="pytest's output (the retry's: *_retry.txt)")
    ap.add_argument("--free-gib", type=float, help="override nvidia-smi's free memory (planning without a GPU)")
    ap.add_argument("--total-gib", type=float)
    ap.add_argument("--dry-run", action="store_true", help="print the plan and the command; run nothing")
    ap.add_argument("--autotune-level", type=int, default=0,
                    help="XLA's GPU GEMM autotuning for the tests (--xla_gpu_autotune_level; 0: off, compiles faster; "
                         "-1: XLA's default); results do not depend on it")
    ap.add_argument("--shard", type=_shard, help="K/N: only the K-th of N parts of the selected test files")
    a = ap.parse_args(argv)
    t_start = time.time()
    card = (a.free_gib, a.total_gib or a.free_gib) if a.free_gib else card_gib()
    cpus = os.cpu_count() or 1
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false", PYTHONUNBUFFERED="1", COLUMNS="400",
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    if card is None:  # no GPU: the gpu tests skip themselves; plain workers
        workers, fraction = max(1, min(a.workers or 2, cpus)), None
        print("gpu tests: no nvidia-smi; the gpu-marked tests will skip", flush=True)
    else:
        workers, fraction = plan(card[0], card[1], cpus, a.gib_per_worker, a.workers)
        if "XLA_PYTHON_CLIENT_MEM_FRACTION" in os.environ:  # set by hand: kept
            fraction = float(os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"])
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = str(fraction)
        print(f"gpu tests: card {card[0]:.1f} of {card[1]:.1f} GiB free, {cpus} CPUs -> {workers} workers, "
              f"XLA_PYTHON_CLIENT_MEM_FRACTION={fraction} ({fraction * card[1]:.1f} GiB each)", flush=True)
    if card is not None and a.autotune_level >= 0 and "autotune_level" not in env.get("XLA_FLAGS", ""):
        flag = f"--xla_gpu_autotune_level={a.autotune_level}"
        if xla_flag_ok(flag, env):
            env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
            print(f"gpu tests: {flag}", flush=True)
    paths = a.paths
    if a.shard:
        per_file = collect(env, a.marks, a.paths)
        paths = assign_shards(per_file, a.shard[1])[a.shard[0] - 1]
        print(f"gpu tests: shard {a.shard[0]}/{a.shard[1]}: {len(paths)} files, "
              f"{sum(per_file[f] for f in paths)} of {sum(per_file.values())} tests", flush=True)
    base = [sys.executable, "-m", "pytest", "-v", "-p", "no:cacheprovider", "--tb=short", "-rfE"]
    if a.per_test_timeout > 0:  # pytest-timeout
        base += ["--timeout", f"{a.per_test_timeout:g}"]
    cmd = base + ["-m", a.marks, "--continue-on-collection-errors", "--durations=15", "-n", str(workers), *paths]
    if a.dry_run:
        print(shlex.join(cmd))
        return 0
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    first = run_pytest(cmd, env, a.timeout - a.retry_reserve, a.out)
    first_counts = counts(first)
    ids = retry_ids(first)
    retried: dict[str, str] = {}
    retry_counts: dict[str, int] = {}
    left = a.timeout - (time.time() - t_start)
    if ids and left > 20:
        renv = dict(env, XLA_PYTHON_CLIENT_MEM_FRACTION="0.9") if fraction is not None else env
        print(f"== {len(ids)} test(s) out of memory or time beside the others: run again alone ({left:.0f} s left)",
              flush=True)
        out2 = re.sub(r"(\.txt)?$", "_retry.txt", a.out, count=1)
        second = run_pytest(base + ["-n", "0", *ids], renv, left - 5, out2)
        retry_counts = counts(second)
        for nid in ids:
            m = re.search(rf"^{re.escape(nid)} (PASSED|FAILED|ERROR|SKIPPED)", second, re.M)
            retried[nid] = m.group(1) if m else "not run"
    elif ids:
        retried = {nid: "not run (no time left)" for nid in ids}
    passed = first_counts.get("passed", 0) + sum(v == "PASSED" for v in retried.values())
    failed = first_counts.get("failed", 0) + first_counts.get("error", 0) - len(ids) \
        + sum(v != "PASSED" for v in retried.values())
    skipped = first_counts.get("skipped", 0) + retry_counts.get("skipped", 0)
    still = [nid for nid, v in retried.items() if v != "PASSED"]
    summary = (f"gpu tests: {passed} passed, {failed} failed, {skipped} skipped ({workers} workers"
               + (f", {len(ids)} retried alone: {sum(v == 'PASSED' for v in retried.values())} passed" if ids else "")
               + ")" + (" (the first run stopped before its end: counts so far)" if first_counts.get("stopped")
                        else "" if first_counts else " (the first run printed no counts: stopped or crashed)"))
    for line in first.splitlines():
        if line.startswith(("FAILED ", "ERROR ")) and not any(line.startswith(f"FAILED {n}") or
                                                              line.startswith(f"ERROR {n}") for n in ids):
            print(line[:300])
    for nid in still:
        print(f"FAILED alone too: {nid} ({retried[nid]})")
    print(summary, flush=True)
    return 0 if failed == 0 and first_counts and not first_counts.get("stopped") else 1


if __name__ == "__main__":
    sys.exit(main())
