"""After a pytest-xdist run that failed: if every failure in its JUnit XML is a test that was running when its
worker process crashed ("worker 'gwN' crashed while running 'NODEID'"), run those tests again, alone, in one fresh
process, and exit with that run's status; any other failure (an assertion, an error) exits 1 at once.

Why: whole CI runs on this 2-core machine have lost a worker to a segfault inside XLA's CPU compiler (jax 0.10.2)
in long-lived workers, each time in a different test that passes alone (kernels, vision, image generation).
A crash is reported loudly and its test still has to pass; nothing else is retried.
Usage: python .ci/rerun_crashed.py JUNIT_XML"""
from __future__ import annotations

import re
import subprocess
import sys
import xml.etree.ElementTree as ET

CRASH = re.compile(r"worker '(\w+)' crashed while running '([^']+)'")


def failures(junit: str) -> tuple[list[str], list[str]]:
    """(node ids that were running when their worker crashed, other failing tests) of a JUnit XML report."""
    crashed, other = [], []
    for case in ET.parse(junit).iter("testcase"):
        for child in case:
            if child.tag not in ("failure", "error"):
                continue
            match = CRASH.search(child.get("message") or "")
            if match:
                crashed.append(match.group(2))
            else:
                other.append(f"{case.get('classname')}::{case.get('name')} ({child.tag})")
    return crashed, other


def main(junit: str) -> int:
    crashed, other = failures(junit)
    if other or not crashed:
        print(f"== {len(other)} test(s) failed (not a worker crash): no rerun", flush=True)
        return 1
    print(f"== {len(crashed)} test(s) were running when a pytest-xdist worker crashed (a segfault in XLA's CPU "
          f"compiler, seen before in whole runs only); running them again, alone, in a fresh process: "
          f"{', '.join(crashed)}", flush=True)
    return subprocess.call([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *crashed])


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
