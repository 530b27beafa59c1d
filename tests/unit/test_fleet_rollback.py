"""The rollback policy: gate figures, and a new version's traffic against the previous one's."""

from __future__ import annotations

from edged.fleet.rollback import Policy, Window, gate_failure, since, traffic_verdict

POLICY = Policy(watch_s=60, min_requests=50, max_error_rate_increase=0.02, max_p99_increase=0.5)


def test_a_failed_gate_or_another_precision_is_a_failure() -> None:
    assert gate_failure("int8", "int8", {"passed": True, "rel_l2": 0.01}) is None
    why = gate_failure("int8", "fp32", {"passed": False, "rel_l2": 0.010745180353920334, "samples": 2})
    assert why == "failed its accuracy gate (rel_l2 0.01075, samples 2); serving fp32 instead of int8"
    assert gate_failure("int8", "fp32", None) == "asked for int8, the build serves fp32"
    assert gate_failure("auto", "fp16", None) is None


def test_traffic_waits_for_enough_requests_then_compares_with_the_margins() -> None:
    before = Window(1000, 10, 2.0)  # 1% errors, p99 2 ms
    assert traffic_verdict(before, Window(49, 49, 9.0), POLICY) is None  # too few to judge
    assert traffic_verdict(before, Window(100, 2, 2.5), POLICY) is None  # 2%: within 1% + 2%
    err = traffic_verdict(before, Window(100, 4, 2.5), POLICY)
    assert err is not None and err.startswith("error rate 4.0%")
    slow = traffic_verdict(before, Window(100, 0, 3.1), POLICY)
    assert slow is not None and "limit 3.00 ms" in slow
    assert traffic_verdict(None, Window(100, 0, 50.0), POLICY) is None  # no p99 to compare with


def test_since_subtracts_cumulative_counters() -> None:
    assert since(Window(150, 7, None), Window(100, 5, None), 3.0) == Window(50, 2, 3.0)
