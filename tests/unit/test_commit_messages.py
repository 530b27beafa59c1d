"""scripts/check_commits.py: the commit-message rule of CONTRIBUTING.md, on messages and on a real
repository's history."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "check_commits.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_commits", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


check = _load()

GOOD = "Bound gzip bodies by a shared budget\n\nEight concurrent bodies could each inflate to max_body.\n"


def test_a_message_that_follows_the_rule_passes() -> None:
    assert check.problems(GOOD) == []
    assert check.problems("Embed the seed in the manifest\n\nSo a rebuild is reproducible.") == []
    assert check.problems("Pass the peer's uid to the region\n\nWhy.\n# a comment git strips\n") == []


@pytest.mark.parametrize(
    ("message", "why"),
    [
        ("A" * 73 + "\n\nbody", "73 characters"),
        ("Added a budget for gzip bodies\n\nbody", "imperative"),
        ("Adds a budget for gzip bodies\n\nbody", "imperative"),
        ("Bounding gzip bodies\n\nbody", "imperative"),
        ("bound gzip bodies\n\nbody", "capitalised"),
        ("Bound gzip bodies.\n\nbody", "full stop"),
        ("Bound gzip bodies\n", "no body"),
        ("Bound gzip bodies\nby a budget\n", "no blank line"),
        ("\n\nbody", "empty"),
    ],
)
def test_a_message_that_breaks_the_rule_says_how(message: str, why: str) -> None:
    found = check.problems(message)
    assert found and any(why in p for p in found), found


def _repo(tmp_path: Path, messages: list[str]) -> None:
    def git(*args: str) -> None:
        subprocess.run(["git", "-C", str(tmp_path), *args], check=True, capture_output=True)

    git("init", "-q")
    for i, message in enumerate(messages):
        (tmp_path / "f").write_text(str(i))
        git("add", "f")
        git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", message)


def _run(tmp_path: Path, base: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, str(SCRIPT), "--base", base]
    return subprocess.run(cmd, cwd=tmp_path, capture_output=True, text=True, timeout=60)


def test_the_history_after_the_base_is_checked_and_before_it_is_not(tmp_path: Path) -> None:
    _repo(tmp_path, ["old history, long and lower case, before the rule." * 3, GOOD, "Fixed things"])
    first = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    run = _run(tmp_path, first)
    assert run.returncode == 1
    assert "2 commits checked, 1 break the rule" in run.stdout
    assert "Fixed things" in run.stdout and "old history" not in run.stdout


def test_a_clean_history_passes(tmp_path: Path) -> None:
    _repo(tmp_path, ["Start the repository\n\nSomething to build on.", GOOD])
    first = subprocess.run(
        ["git", "-C", str(tmp_path), "rev-list", "--max-parents=0", "HEAD"], capture_output=True, text=True, check=True
    ).stdout.strip()
    run = _run(tmp_path, first)
    assert run.returncode == 0, run.stdout
    assert "1 commits checked, 0 break the rule" in run.stdout
