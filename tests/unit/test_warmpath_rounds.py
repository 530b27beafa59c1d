"""How often the warm-up sends a model's requests through the path: within a budget of runs."""

from __future__ import annotations

import math

from edged.lifecycle.path_warmup import PATH_BUDGET_US, ROUNDS, SOCKET_ROUNDS, rounds_within


def test_cheap_models_take_every_round() -> None:
    assert rounds_within(20.0, 2, ROUNDS) == ROUNDS  # the tiny MLP
    assert rounds_within(4_800.0, 2, ROUNDS) == ROUNDS  # conv640 on the 2-core machine
    assert rounds_within(20.0, 1, SOCKET_ROUNDS) == SOCKET_ROUNDS


def test_a_costly_model_runs_once() -> None:
    assert rounds_within(117_000.0, 2, ROUNDS) == 1  # the detector on the 2-core machine: six runs take 0.7 s
    assert rounds_within(117_000.0, 1, SOCKET_ROUNDS) == 1


def test_rounds_fill_the_budget_and_no_more() -> None:
    per_round = 2
    cost = PATH_BUDGET_US / (per_round * 2)  # exactly two rounds fit
    assert rounds_within(cost, per_round, 8) == 2
    assert rounds_within(cost * 1.01, per_round, 8) == 1


def test_an_unknown_cost_takes_every_round() -> None:
    assert rounds_within(None, 2, ROUNDS) == ROUNDS  # no warm-up runs measured it
    assert rounds_within(math.inf, 1, SOCKET_ROUNDS) == SOCKET_ROUNDS
    assert rounds_within(0.0, 1, SOCKET_ROUNDS) == SOCKET_ROUNDS
