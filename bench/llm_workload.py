"""What the language-model benchmark (bench/llm.py) asks of every server alike: the shared setup
(cores, slots, context per sequence, tokens per request) and the chat itself, a fixed system
prompt of about 300 tokens with a distinct user turn per request.

Each server, the in-process floor and the measurements read these, so that all of them are given
the same work.
"""

from __future__ import annotations

import os

CORES = len(os.sched_getaffinity(0))
MODEL = "llm"
CONTEXT = 2048  # per sequence
SLOTS = 4
DECODE_TOKENS = 64
TTFT_TOKENS = 4  # a TTFT request needs its first token only; a few more keep it a real stream
STREAMS = (1, 2, 4)
LOAD_PER_CLIENT = 2  # requests each of the four load clients sends back to back
READY_TIMEOUT_S = 300.0

SYSTEM = (
    "You are the maintenance assistant of a packaging plant, running on a small computer beside "
    "the line. Operators and technicians ask you about the machines: filler, capper, labeller, "
    "case packer, palletiser and the conveyors between them. Answer in plain English, in short "
    "sentences, and put the most important action first. When a question is about safety, say "
    "so at the start and tell the person to follow the lockout procedure before touching any "
    "moving part. Never guess a part number, a torque value or a setting that you were not given: "
    "say that it must be checked in the machine's manual. Each station logs temperature, vibration "
    "and motor current once a second; a slow rise in vibration usually means a worn bearing or a "
    "loose belt, a current spike usually means a jam, and a temperature well above the weekly mean "
    "usually means poor cooling or a failing motor. The night shift changes at ten in the evening "
    "and the day shift at six in the morning; planned stops are on Tuesday and Friday afternoons. "
    "Spare belts, bearings and fuses are kept in the store next to station four, and the store "
    "keeper records every part taken. If a technician reports a fault that has happened three "
    "times in one week, advise opening a maintenance ticket so that the cause is found rather "
    "than cleared again. Keep every answer under one hundred words unless a longer list is asked "
    "for, and end with the one thing to check first."
)

STATIONS = ("filler", "capper", "labeller", "case packer", "palletiser", "infeed conveyor", "outfeed conveyor")


def user_turn(i: int) -> str:
    """A distinct question per request: its tokens, after the shared system prompt, are new."""
    station = STATIONS[i % len(STATIONS)]
    return (
        f"Ticket {i}: the {station} at station {i % 11 + 1} showed a vibration rise of {i % 7 + 2} percent "
        f"since {i % 12 + 1} o'clock and a current spike at {i % 60:02d} minutes past. What should I check first?"
    )


def decode_turn(i: int) -> str:
    """A question a small model answers at length: decode speed."""
    station = STATIONS[i % len(STATIONS)]
    return f"Request {i}: write a numbered checklist of twenty steps for the weekly inspection of the {station}."


def cold_system(n: int) -> str:
    """The system prompt with another first word: no server has any of its prefix cached."""
    return f"Unit{n}" + SYSTEM[len("You") :]


def chat(user: str, system: str = SYSTEM) -> list[dict[str, str]]:
    return [{"role": "system", "content": system}, {"role": "user", "content": user}]
