#!/usr/bin/env python3
"""Check commit messages against CONTRIBUTING.md's rule: a subject of at most 72 characters in the
imperative ("Bound gzip bodies by a shared budget"), a blank line, then a body that says why.

    scripts/check_commits.py                 every commit after the base (CI)
    scripts/check_commits.py --message FILE  one message (the commit-msg hook, .githooks/commit-msg)

The base is the newest tag that contains BASE, else BASE: the last commit made before the rule,
so the history before it is not judged. Merge commits are not checked. A shallow clone that lacks
the base checks HEAD alone and says so. Exit 1 when any message breaks the rule.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

BASE = "58375539eb7b7eaba78485d8978c992ad46bf085"
MAX_SUBJECT = 72

# Words that end like a past tense, a gerund or a third person but are imperatives themselves.
_NOT_INFLECTED = {
    "bed", "embed", "feed", "need", "proceed", "exceed", "seed", "shed", "shred", "speed", "succeed",
    "bring", "ring", "sing", "spring", "string",
    "access", "address", "alias", "bias", "bless", "bypass", "compress", "discuss", "dismiss",
    "express", "focus", "guess", "harness", "miss", "pass", "press", "process", "stress", "suppress",
}  # fmt: skip


def inflected(word: str) -> bool:
    """Whether ``word`` reads as "Added", "Adding" or "Adds" rather than "Add"."""
    w = word.lower()
    if w in _NOT_INFLECTED or not w.isalpha():
        return False
    return w.endswith(("ed", "ing")) or (w.endswith("s") and not w.endswith(("ss", "us", "is")))


def problems(message: str) -> list[str]:
    """What is wrong with one commit message; empty when it follows the rule."""
    lines = [line for line in message.splitlines() if not line.startswith("#")]
    while lines and not lines[-1].strip():
        lines.pop()
    if not lines or not lines[0].strip():
        return ["the subject is empty"]
    subject = lines[0]
    found = []
    if len(subject) > MAX_SUBJECT:
        found.append(f"the subject has {len(subject)} characters (at most {MAX_SUBJECT})")
    first = re.split(r"[\s:]", subject.strip(), maxsplit=1)[0]
    if not first[:1].isupper():
        found.append(f"the subject starts with '{first}', not a capitalised verb")
    elif inflected(first):
        found.append(f"the subject starts with '{first}': use the imperative ('Add', not 'Added' or 'Adds')")
    if subject.rstrip().endswith("."):
        found.append("the subject ends with a full stop")
    if len(lines) < 2 or lines[1].strip():
        found.append("no blank line after the subject" if len(lines) >= 2 else "no body saying why")
    elif not any(line.strip() for line in lines[2:]):
        found.append("no body saying why")
    return found


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], capture_output=True, text=True, check=True).stdout


def base(rule_start: str) -> str | None:
    """The newest tag that contains ``rule_start``, else it; None when this clone lacks it."""
    try:
        _git("cat-file", "-e", f"{rule_start}^{{commit}}")
    except subprocess.CalledProcessError:
        return None
    for tag in _git("tag", "--contains", rule_start, "--sort=-creatordate").split():
        return tag
    return rule_start


def commits(rule_start: str) -> list[str]:
    since = base(rule_start)
    if since is None:
        print(f"check_commits: this clone lacks {rule_start[:12]} (shallow?): checking HEAD only")
        return [_git("rev-parse", "HEAD").strip()]
    return _git("rev-list", "--no-merges", "--reverse", f"{since}..HEAD").split()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--message", type=Path, help="check this message file (a commit-msg hook)")
    parser.add_argument("--base", default=BASE, help="the last commit made before the rule (default: %(default)s)")
    args = parser.parse_args(argv)
    if args.message is not None:
        found = problems(args.message.read_text())
        for p in found:
            print(f"commit message: {p}", file=sys.stderr)
        return 1 if found else 0
    bad = 0
    checked = commits(args.base)
    for sha in checked:
        found = problems(_git("log", "-1", "--format=%B", sha))
        if found:
            bad += 1
            subject = _git("log", "-1", "--format=%s", sha).strip()
            print(f"{sha[:12]} {subject[:80]}")
            for p in found:
                print(f"    {p}")
    print(f"check_commits: {len(checked)} commits checked, {bad} break the rule (CONTRIBUTING.md)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
