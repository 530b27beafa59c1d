"""What the running edged daemon does when systemd changes its state, under a real systemd 252
with the shipped units (see daemon_units.py for what is replaced and why): a reload under load
swaps the model without failing a request, a failed reload keeps serving and says why, the
watchdog restarts a wedged daemon, and a stop drains the requests in flight (socket-activated
and self-bound). Each test boots its own systemd; the boot_systemd fixture stops the units and
kills that namespace's init by its PID afterwards.

Waits poll a condition against a deadline (tests.helpers.wait_for); nothing sleeps to
synchronise. Latency figures are printed, and bounded only generously: speed is measured in
bench/, these tests prove behaviour.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from daemon_units import (
    SERVICE,
    SOCKET,
    SOCKET_UNIT,
    TEST_RUN,
    Edged,
    Stream,
    boot_edged,
    matches,
    onnx_reference,
    request_outcomes,
)
from lifecycle_inputs import DET_PROFILE, X, frame
from systemd_ns import Boot

from edged.errors import EdgedError
from edged.tools.demo import make_tiny_mlp
from tests.helpers import wait_for

pytestmark = pytest.mark.system

EXIT_FILE = f"{TEST_RUN}/exit"


def collapse(states: list[str]) -> list[str]:
    return [s for i, s in enumerate(states) if i == 0 or states[i - 1] != s]


class StatePoller:
    """Records (time, ActiveState, StatusText) until stopped: a thread polling systemctl show,
    both properties read in one call so each sample is one consistent view."""

    def __init__(self, edged: Edged) -> None:
        self.edged = edged
        self.samples: list[tuple[float, str, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="state-poller", daemon=True)

    def __enter__(self) -> StatePoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    @property
    def states(self) -> list[str]:
        return [state for _, state, _ in self.samples]

    def _run(self) -> None:
        while not self._stop.is_set():
            p = self.edged.show("ActiveState", "StatusText")
            self.samples.append((time.monotonic(), p["ActiveState"], p["StatusText"]))


# --- 1. reload under load ----------------------------------------------------------------------


def per_client_switch_once(answers: list[list[str]]) -> None:
    """Each client sees the old model, then the new one, never the old one again: the swap is
    atomic and nothing is answered by a half-swapped model."""
    for i, seq in enumerate(answers):
        if "new" in seq:
            assert "old" not in seq[seq.index("new") :], f"client {i} went back to the old model"


def test_reload_under_load_swaps_the_model_without_failing_a_request(boot_systemd: Boot, tmp_path: Path) -> None:
    edged = boot_edged(boot_systemd)
    old_src = make_tiny_mlp(tmp_path / "tiny_a.onnx")
    new_src = make_tiny_mlp(tmp_path / "tiny_b.onnx", hidden=64)
    ref_old, ref_new = onnx_reference(old_src, {"x": X}), onnx_reference(new_src, {"x": X})
    assert not matches(ref_old, ref_new)
    edged.write_config(
        {
            # Worker threads (not inline on the loop), so the old model's queue has to drain.
            "server": {"inline_threshold_us": 0},
            # Only `systemctl reload` may trigger the reload here, not the file watcher.
            "lifecycle": {"watch_files": False},
            "models.tiny": {"path": edged.install(old_src, "models/tiny.onnx")},
        }
    )
    edged.start()
    pid = edged.main_pid()

    def classify(out: dict[str, np.ndarray]) -> str:
        return "old" if matches(out, ref_old) else "new" if matches(out, ref_new) else f"wrong: {out}"

    with Stream(edged, "tiny", {"x": X}, classify) as load, StatePoller(edged) as poller:
        wait_for(lambda: load.failures or load.count("old") >= 50, 30, what="requests before the reload")
        edged.install(new_src, "models/tiny.onnx")  # a new model file, then reload
        edged.ns.systemctl("reload", SERVICE, check=True)
        wait_for(lambda: load.failures or load.count("new") >= 50, 60, what="answers from the new model")
        wait_for(lambda: poller.states[-1] == "active", 30, what="the unit to be active again")
    assert not load.failures, load.failures[:5]
    labels = {label for seq in load.answers for label in seq}
    assert labels == {"old", "new"}, labels
    per_client_switch_once(load.answers)
    states = collapse(poller.states)
    texts = list(dict.fromkeys(text for _, _, text in poller.samples))
    print(
        f"\n{sum(map(len, load.answers))} requests on {load.clients} connections; states {states}; StatusText {texts}"
    )
    assert states[0] == "active" and "reloading" in states and states[-1] == "active", states
    # ExecReload= alone shows "reloading" only while `kill -HUP` runs; edged's RELOADING=1 keeps
    # it there until READY=1. Every sample taken while edged said it was reloading (its STATUS=)
    # must show the unit reloading, never active.
    mid_reload = [state for _, state, text in poller.samples if text.startswith("reloading")]
    assert mid_reload and set(mid_reload) == {"reloading"}, list(
        dict.fromkeys((state, text) for _, state, text in poller.samples)
    )
    assert edged.main_pid() == pid and edged.prop("NRestarts") == "0"
    assert edged.prop("StatusText") == "1 models ready"
    outcomes = request_outcomes(edged)
    assert {o for (m, o), n in outcomes.items() if m == "tiny" and n} == {"ok"}, outcomes


# --- 2. failed reload -----------------------------------------------------------------------------


def test_failed_reload_keeps_serving_and_says_why(boot_systemd: Boot, tmp_path: Path) -> None:
    edged = boot_edged(boot_systemd)
    src = make_tiny_mlp(tmp_path / "tiny.onnx")
    ref = onnx_reference(src, {"x": X})
    good = {"lifecycle": {"watch_files": False}, "models.tiny": {"path": edged.install(src, "models/tiny.onnx")}}
    edged.write_config(good)
    edged.start()
    pid = edged.main_pid()

    def classify(out: dict[str, np.ndarray]) -> str:
        return "ok" if matches(out, ref) else f"wrong: {out}"

    with Stream(edged, "tiny", {"x": X}, classify) as load:
        wait_for(lambda: load.failures or load.count("ok") >= 20, 30, what="requests before the reload")
        edged.write_config({**good, "models.tiny": {**good["models.tiny"], "precison": "int8"}})
        edged.ns.systemctl("reload", SERVICE, check=True)
        wait_for(lambda: "reload failed" in edged.prop("StatusText"), 30, what="StatusText to say why")
        edged.ns.wait_state(SERVICE, "active")
        before = load.count("ok")
        wait_for(lambda: load.failures or load.count("ok") >= before + 20, 30, what="requests after the failed reload")
    assert not load.failures, load.failures[:5]
    assert {label for seq in load.answers for label in seq} == {"ok"}
    text = edged.prop("StatusText")
    print(f"\nStatusText after the bad reload: {text}")
    assert text.startswith("1 models ready; reload failed: ")
    assert "models.tiny.precison: unknown key" in text
    assert edged.main_pid() == pid and edged.prop("NRestarts") == "0"

    # Fixing the file and reloading again clears the complaint.
    edged.write_config(good)
    edged.ns.systemctl("reload", SERVICE, check=True)
    wait_for(lambda: edged.prop("StatusText") == "1 models ready", 30, what="the complaint to clear")
    edged.ns.wait_state(SERVICE, "active")


# --- 3. watchdog ------------------------------------------------------------------------------------


def test_watchdog_restarts_a_wedged_daemon(boot_systemd: Boot, tmp_path: Path) -> None:
    wedge = f"{TEST_RUN}/wedge"
    edged = boot_edged(
        boot_systemd,
        extra=f"""[Service]
WatchdogSec=4s
RestartSec=1s
LimitCORE=0
Environment=EDGED_TEST_WEDGE={wedge}
""",
    )
    src = make_tiny_mlp(tmp_path / "tiny.onnx")
    ref = onnx_reference(src, {"x": X})
    edged.write_config(
        {
            "server": {"inline_threshold_us": 0},  # the wedge works on worker threads only
            "lifecycle": {"stall_timeout_s": 1, "watch_files": False},
            "models.tiny": {"path": edged.install(src, "models/tiny.onnx")},
        }
    )
    edged.start()
    assert edged.prop("WatchdogUSec") == "4s"
    pid = edged.main_pid()
    with edged.client() as c:
        assert matches(c.infer("tiny", {"x": X}), ref)

    wedge_file = edged.path(wedge)
    wedge_file.touch()
    try:
        # The daemon reads the switch between watchdog pings: send until a request hangs.
        def hangs() -> bool:
            try:
                with edged.client(timeout=1.5) as c:
                    c.infer("tiny", {"x": X})
            except (TimeoutError, EdgedError):
                return True
            return False

        wait_for(hangs, 20, interval=0.05, what="a request to wedge a worker")
        wait_for(lambda: edged.prop("NRestarts") == "1", 30, what="systemd to restart edged")
        new_pid = wait_for(
            lambda: edged.state() == "active" and edged.main_pid(), 60, what="the restarted edged to be active"
        )
        assert new_pid != pid
    finally:
        wedge_file.unlink(missing_ok=True)
    with edged.client(timeout=30) as c:
        assert matches(c.infer("tiny", {"x": X}), ref)
    journal = edged.journal()
    console = edged.ns.console_log.read_text(errors="replace")
    assert "withholding watchdog pings" in journal
    assert "Fatal Python error: Aborted" in journal  # faulthandler's dump on the watchdog SIGABRT
    assert "Watchdog timeout" in console, console[-2000:]
    assert edged.prop("NRestarts") == "1" and edged.main_pid() == new_pid


# --- 4. stop drains -----------------------------------------------------------------------------------


@pytest.mark.parametrize("activation", ["socket", "self-bound"])
def test_stop_drains_in_flight_requests(boot_systemd: Boot, demo_models: Path, activation: str) -> None:
    record_exit = f"""[Service]
ExecStopPost=+/bin/sh -c 'echo "$SERVICE_RESULT $EXIT_CODE $EXIT_STATUS" > {EXIT_FILE}'
"""
    edged = boot_edged(boot_systemd, socket_unit=activation == "socket", extra=record_exit)
    edged.write_config(
        {
            "models.det": {
                "path": edged.install(demo_models, "models/det.onnx"),
                "backend": "onnxruntime",
                "instances": 1,
            },
            "models.det.profiles.x": DET_PROFILE,
        }
    )
    edged.start()
    assert edged.path(SOCKET).is_socket()
    img = frame(640)
    with edged.client() as c:
        want = c.infer("det", {"x": img})

    k = 5
    results: list[Any] = [None] * k
    finished: list[float] = [0.0] * k

    def send(i: int) -> None:
        try:
            with edged.client(timeout=60) as c:
                results[i] = c.infer("det", {"x": img})
        except Exception as e:
            results[i] = e
        finished[i] = time.monotonic()

    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(k)]
    for t in threads:
        t.start()

    def all_inside() -> bool:
        done = sum(1 for r in results if r is not None)  # read before the queue: never overcounts
        with edged.client() as c:
            queued = c.status()["models"]["det"]["queue"]
        return done + queued == k and queued >= 2

    wait_for(all_inside, 30, interval=0.005, what=f"{k} requests inside the daemon")
    stop_at = time.monotonic()
    stop = edged.ns.systemctl("stop", SERVICE, timeout=60)
    stopped_in = time.monotonic() - stop_at
    for t in threads:
        t.join(timeout=60)
    assert stop.returncode == 0, stop.stderr
    for i, r in enumerate(results):
        assert isinstance(r, dict) and matches(r, want), f"request {i}: {r!r}"
    drained = sum(1 for f in finished if f > stop_at)
    print(f"\n{activation}: systemctl stop took {stopped_in:.2f} s, {drained} of {k} requests finished after it began")
    assert drained >= 1, "no request was still in flight when the stop began"
    assert edged.state() == "inactive"
    # Read from ExecStopPost= (systemd may unload an unreferenced inactive unit, and with it
    # Result= and ExecMainStatus=): a clean exit 0 that systemd counts as success.
    exit_file = edged.path(EXIT_FILE)
    assert exit_file.read_text().split() == ["success", "exited", "0"], exit_file.read_text()
    if activation == "socket":
        # systemd owns the socket: it stays (RuntimeDirectoryPreserve=yes), ready for the next start.
        assert edged.path(SOCKET).is_socket()
        assert edged.ns.state(SOCKET_UNIT) == "active"
    else:
        assert not edged.path(SOCKET).exists(), "edged left its own socket behind"
        assert edged.path("/run/edged").is_dir()
