"""llama.cpp's own HTTP server (``llama-server``) for bench/llm.py, built from the llama.cpp source
that the installed llama-cpp-python vendors, so that it runs the same engine code as edged.

The source is the sdist of that llama-cpp-python version (``pip download --no-binary :all:``; its
``vendor/llama.cpp``), or a tree given with ``--src``. Only the ``llama-server`` target is built
(Release, static, without curl, tests or the web UI's download), once per version: the binary is
kept under ``$XDG_CACHE_HOME/edged-bench/llama-server/<version>/`` (``~/.cache`` by default) and a
later run reuses it.

    .venv/bin/python -m bench.llama_server [--src PATH] [--rebuild]   # prints the binary's path
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from importlib import metadata
from pathlib import Path

PACKAGE = "llama-cpp-python"
# The engine options that matter for speed are llama.cpp's defaults here, as in the wheel that
# pip builds for llama-cpp-python (native CPU flags, OpenMP); the rest keeps the build offline
# (no curl, no prebuilt web UI fetched) and small (no tests, no examples).
REPO = Path(__file__).resolve().parent.parent
CMAKE_OPTIONS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
]


def version() -> str:
    """The installed llama-cpp-python's version: its vendored llama.cpp is the source."""
    return metadata.version(PACKAGE)


def cache_dir(ver: str) -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "edged-bench" / "llama-server" / ver


def vendored(src: Path) -> Path:
    """The llama.cpp tree in ``src``: the sdist's root or its ``vendor/llama.cpp`` itself."""
    for cand in (src / "vendor" / "llama.cpp", src):
        if (cand / "tools" / "server").is_dir() and (cand / "CMakeLists.txt").is_file():
            return cand
    raise RuntimeError(f"{src}: no llama.cpp source with tools/server")


def download_source(ver: str, into: Path) -> Path:
    """The sdist of ``llama-cpp-python==ver`` through pip, unpacked under ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "--dest", str(into)]
    subprocess.run([*pip, f"{PACKAGE}=={ver}"], check=True, stdout=sys.stderr)
    sdists = sorted(into.glob("llama_cpp_python-*.tar.gz"))
    if not sdists:
        raise RuntimeError(f"pip left no sdist of {PACKAGE}=={ver} in {into}")
    with tarfile.open(sdists[-1]) as tar:
        tar.extractall(into, filter="data")
    return vendored(into / sdists[-1].name.removesuffix(".tar.gz"))


def shared_options() -> list[str]:
    """The CMake options edged's llama-cpp-python is built with (scripts/llama_cmake_args.sh), so
    that llama-server runs the same kernels; the multimodal switch is not llama-server's."""
    script = REPO / "scripts" / "llama_cmake_args.sh"
    printed = subprocess.run(["bash", str(script)], check=True, capture_output=True, text=True).stdout
    return [a for a in printed.split() if not a.startswith("-DLLAVA")]


def build(src: Path, dest: Path, jobs: int) -> None:
    """Configure and build only the ``llama-server`` target; the binary goes to ``dest``."""
    with tempfile.TemporaryDirectory(prefix="llama-server-build-") as tmp:
        out = Path(tmp)
        gen = ["-G", "Ninja"] if shutil.which("ninja") else []
        t0 = time.monotonic()
        options = [*CMAKE_OPTIONS, *shared_options()]
        subprocess.run(["cmake", "-S", str(src), "-B", str(out), *gen, *options], check=True, stdout=sys.stderr)
        cmd = ["cmake", "--build", str(out), "--target", "llama-server", "--config", "Release", "-j", str(jobs)]
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        built = out / "bin" / "llama-server"
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        shutil.copy2(built, part)
        part.replace(dest)  # a binary that is there is a whole one
        info = {"source": str(src), "cmake": options, "build_s": round(time.monotonic() - t0, 1)}
        dest.with_name("build.json").write_text(json.dumps(info, indent=1))


def binary(src: Path | None = None, rebuild: bool = False) -> Path:
    """The cached ``llama-server`` of the installed llama-cpp-python's version, built if missing."""
    ver = version()
    dest = cache_dir(ver) / "llama-server"
    if dest.is_file() and not rebuild:
        return dest
    sys.stderr.write(f"building llama-server from the llama.cpp of {PACKAGE} {ver} (once; minutes)\n")
    jobs = len(os.sched_getaffinity(0))
    if src is not None:
        build(vendored(src), dest, jobs)
        return dest
    with tempfile.TemporaryDirectory(prefix="llama-cpp-python-sdist-") as tmp:
        build(download_source(ver, Path(tmp)), dest, jobs)
    return dest


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="build (once) and print the path of llama.cpp's llama-server")
    ap.add_argument("--src", type=Path, help="an unpacked llama-cpp-python sdist, or its vendor/llama.cpp")
    ap.add_argument("--rebuild", action="store_true", help="build again even when the binary is cached")
    args = ap.parse_args(argv)
    print(binary(args.src, args.rebuild))


if __name__ == "__main__":
    main()
