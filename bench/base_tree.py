"""edged's package as of another commit (or a folder holding it), served by a daemon of this
tree's benchmark: the ``edged-base`` lane of ``overhead`` and ``batching``, a before/after of a
change to edged's code in one interleaved run."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from bench.edged_server import EdgedServer
from bench.models import ModelSpec

REPO = Path(__file__).resolve().parent.parent


def _first_on_path(folder: Path) -> str:
    """``folder`` first on the daemon's path, then this checkout and the caller's own path
    (scripts/bench_offline.sh puts its private site-packages there)."""
    return os.pathsep.join(p for p in (str(folder), str(REPO), os.environ.get("PYTHONPATH", "")) if p)


class BaseEdged(EdgedServer):
    """edged's package from another commit, found before this tree's on the daemon's path."""

    def __init__(
        self,
        work: Path,
        specs: dict[str, ModelSpec],
        commit: str,
        server: dict[str, Any] | None = None,
        options: dict[str, dict[str, Any]] | None = None,
    ) -> None:
        self.tree = work / "base-tree"
        export(commit, self.tree)
        super().__init__(work, specs, options, label="edged-base", server=server)
        self.cwd = self.tree  # its children too (the build worker is `python -m edged.quantize.worker`)

    def extra_env(self) -> dict[str, str]:
        return dict(super().extra_env(), PYTHONPATH=_first_on_path(self.tree))

    def command(self) -> list[str]:
        # Not ``python -m edged``: -m puts the working directory (this checkout) first on
        # sys.path, ahead of PYTHONPATH, so the daemon would run this tree's edged, not the base's.
        # The tree goes first explicitly, and the daemon refuses to start if edged comes from
        # anywhere else.
        boot = tree_boot("sys.argv[0] = 'edged'; runpy.run_module('edged', run_name='__main__', alter_sys=True)")
        return [self.python, "-c", boot, str(self.tree), *super().command()[3:]]


def tree_boot(then: str) -> str:
    """A ``python -c`` program that puts its first argument (a folder holding edged/) first on
    sys.path, imports edged from there (refusing to go on if it came from anywhere else), drops
    that argument and runs ``then`` (Python, with runpy and sys imported)."""
    return (
        "import runpy, sys; sys.path.insert(0, sys.argv.pop(1)); import edged; "
        "assert edged.__file__.startswith(sys.path[0] + '/'), ('the tree measured runs', edged.__file__); " + then
    )


def export(commit: str, dest: Path) -> None:
    """edged/ as of ``commit`` into ``dest`` (the benchmark and its helpers stay this tree's).
    ``commit`` may also be a folder holding an edged/ package (a machine without the git
    history: export it here with ``git archive COMMIT edged | tar -x -C data/base``)."""
    dest.mkdir(parents=True, exist_ok=True)
    if (Path(commit) / "edged" / "__init__.py").is_file():
        shutil.copytree(Path(commit) / "edged", dest / "edged", ignore=shutil.ignore_patterns("__pycache__"))
        return
    archive = dest / "edged.tar"
    subprocess.run(["git", "-C", str(REPO), "archive", "-o", str(archive), commit, "edged"], check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(dest, filter="data")
    archive.unlink()
