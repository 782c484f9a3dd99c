"""Run notebooks top to bottom and store their outputs, as a user running them on a CPU sees them.

    python scripts/execute_notebooks.py notebooks/01_quickstart_lora.ipynb [more.ipynb ...]

Each notebook's old outputs are cleared, it runs with the python3 kernel of this environment (its default
settings; progress bars off, TQDM_DISABLE=1) in a fresh temporary working directory (its outputs/ folder is thrown
away), and the executed notebook replaces the file only once it has run to the end (written to a temporary file
beside it, then renamed). Left out of what is stored: the transient progress-bar redraws on stderr (the model
loader's bar ignores TQDM_DISABLE) and tqdm's warning that ipywidgets is missing, which names this machine's
paths. Prints each notebook's run time and size.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROGRESS_BAR = re.compile(r"^\s*$|^[^\n]*\d+%\|[^\n]*\|[^\n]*$|^[^\n]*TqdmWarning: IProgress not found[^\n]*\n"
                          r"\s*from \.autonotebook import tqdm as notebook_tqdm\s*$")


def _transient(output) -> bool:
    """A stderr stream output that is only a progress-bar redraw, blank, or tqdm's missing-ipywidgets warning."""
    return (output.get("output_type") == "stream" and output.get("name") == "stderr"
            and PROGRESS_BAR.match(output.get("text", "")) is not None)


def execute(path: Path, timeout: int) -> None:
    import nbclient
    import nbformat

    book = nbformat.read(path, as_version=4)
    for cell in book.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=f"{path.stem}-") as cwd:
        nbclient.NotebookClient(book, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": cwd}}).execute()
    seconds = time.perf_counter() - start
    for cell in book.cells:
        if cell.cell_type == "code":
            cell.outputs = [o for o in cell.outputs if not _transient(o)]
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            nbformat.write(book, f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise
    print(f"{path}: ran in {seconds:.0f}s, {path.stat().st_size / 1024:.0f} kB stored", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=600, help="seconds a cell may run")
    args = parser.parse_args(argv)
    missing = [str(p) for p in args.notebooks if not p.is_file()]
    if missing:
        parser.error(f"no such notebook: {', '.join(missing)}")
    os.environ["TQDM_DISABLE"] = "1"
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    for path in args.notebooks:
        execute(path.resolve(), args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
