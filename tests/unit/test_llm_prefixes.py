"""Which prompt prefixes the batched context keeps (pure bookkeeping: no llama.cpp here)."""

from __future__ import annotations

import sys

from edged.backends.llama.prefixes import MIN_PREFIX, PrefixTable, common_length


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def test_the_longest_shared_start_is_reused_but_never_the_last_token() -> None:
    table = PrefixTable([10, 11], budget=1000)
    assert table.place(toks(0, 100)) == (10, [])
    assert table.place(toks(0, 40) + toks(500, 60)) == (11, [])
    prefix, n = table.match([*toks(0, 90), 7, 7])
    assert prefix is not None and prefix.seq_id == 10 and n == 90
    # The whole prompt kept: its last token is still fed, for the logits of the next one.
    prefix, n = table.match(toks(0, 100))
    assert prefix is not None and n == 99
    assert table.match([*toks(0, MIN_PREFIX - 1), 9999])[0] is None  # too short to bother


def test_extending_a_kept_prefix_replaces_it_and_the_pinned_one_stays() -> None:
    table = PrefixTable([20, 21, 22], budget=300)
    pinned = table.place(toks(0, 50), pinned=True)
    chat = table.place(toks(0, 120))
    assert pinned is not None and chat is not None
    longer = table.place(toks(0, 160))  # the next turn of the same chat
    assert longer is not None and [p.seq_id for p in longer[1]] == [chat[0]]
    assert {len(p.tokens) for p in table.entries.values()} == {50, 160}
    # Over budget: the least used unpinned prefix goes, never the pinned one.
    other = table.place(toks(1000, 200))
    assert other is not None and [len(p.tokens) for p in other[1]] == [160]
    assert table.find(toks(0, 50)) is not None and table.tokens <= 300
    # Larger than the budget, or only pinned prefixes to drop: not kept.
    assert table.place(toks(5000, 301)) is None
    assert PrefixTable([1], budget=100).place(toks(0, 10)) is None


def test_ids_are_bounded_and_returned() -> None:
    table = PrefixTable([30, 31], budget=10_000)
    first = table.place(toks(0, 40))
    table.place(toks(100, 40))
    third = table.place(toks(200, 40))  # out of ids: the least used goes
    assert first is not None and third is not None and third[0] == first[0]
    assert len(table.entries) == 2


def test_common_length() -> None:
    assert common_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_length([], [1]) == 0 and common_length([1, 2], [1, 2, 3]) == 2
    assert common_length(toks(0, 5000), [*toks(0, 4000), -1]) == 4000


def test_the_pure_parts_load_without_llama_cpp() -> None:
    import subprocess

    code = (
        "import sys; sys.modules['llama_cpp'] = None\n"
        "import edged.backends.llama.prefixes, edged.backends.llama.statefile\n"
        "import edged.backends.llama as pkg\n"
        "try:\n    pkg.LlamaBackend\nexcept ImportError:\n    print('lazy')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "lazy", out.stderr
