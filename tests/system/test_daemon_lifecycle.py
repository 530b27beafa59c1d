"""The real edged daemon's lifecycle under a real systemd 252: start, build status, reload,
watchdog, stop and socket activation, with the shipped units (see daemon_units.py for what is
replaced and why). Each test boots its own systemd; the boot_systemd fixture stops the units
and kills that namespace's init by its PID afterwards.

Waits poll a condition against a deadline (tests.helpers.wait_for); nothing sleeps to
synchronise. Latency figures are printed, and bounded only generously: speed is measured in
bench/, these tests prove behaviour.
"""

from __future__ import annotations

import statistics
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
from systemd_ns import Boot

from edged.errors import EdgedError
from edged.tools.demo import make_tiny_mlp
from tests.helpers import wait_for

pytestmark = pytest.mark.system

DET_PROFILE = {"min": [1, 3, 32, 32], "opt": [1, 3, 320, 320], "max": [1, 3, 640, 640]}
EXIT_FILE = f"{TEST_RUN}/exit"
X = np.linspace(-1.0, 1.0, 16, dtype=np.float32).reshape(1, 16)


def frame(size: int) -> np.ndarray:
    return np.random.default_rng(3).random((1, 3, size, size), dtype=np.float32)


def usec(seconds: float) -> int:
    """time.monotonic() in systemd's *TimestampMonotonic unit (both CLOCK_MONOTONIC)."""
    return int(seconds * 1_000_000)


def tiny_and_detector(edged: Edged, tmp_path: Path, detector: Path) -> dict[str, dict[str, Any]]:
    """tiny (loaded first: higher priority) and the demo detector, on ONNX Runtime."""
    return {
        "models.tiny": {
            "path": edged.install(make_tiny_mlp(tmp_path / "tiny.onnx"), "models/tiny.onnx"),
            "priority": 90,
        },
        "models.det": {"path": edged.install(detector, "models/det.onnx"), "backend": "onnxruntime"},
        "models.det.profiles.x": DET_PROFILE,
    }


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


# --- 1. start ---------------------------------------------------------------------------------


def test_active_only_once_warm_and_every_model_warmed_before_ready(
    boot_systemd: Boot, demo_models: Path, tmp_path: Path
) -> None:
    edged = boot_edged(boot_systemd)
    edged.write_config(tiny_and_detector(edged, tmp_path, demo_models) | {"models.det.warmup": {"iterations": 5}})
    img = frame(320)
    want = onnx_reference(demo_models, {"x": img})

    edged.start()  # Type=notify: returns once READY=1 has arrived
    with edged.client() as c:
        first = c.infer("det", {"x": img})
    assert matches(first, want), "the first answer differs from ONNX Runtime's"

    assert edged.state() == "active"
    with edged.client() as c:
        assert c.ready()
        models = c.status()["models"]
        assert matches(c.infer("tiny", {"x": X}), onnx_reference(tmp_path / "tiny.onnx", {"x": X}))
    for name, m in models.items():
        assert m["state"] == "ready", (name, m)
        assert m["infer_us"] is not None, f"{name} was not warmed before READY=1"
    # warm_request_path pushed requests through the HTTP app before READY=1; they are not
    # traffic, so the counts hold only ours (one det request so far).
    assert models["det"]["requests"] == 1 and models["tiny"]["requests"] == 0, models

    # systemd counted the unit active only after every model had started warming: the journal
    # (MODEL=/PHASE= fields) against the monotonic time systemd entered "active".
    shown = edged.show("ActiveEnterTimestampMonotonic", "ExecMainStartTimestampMonotonic")
    active_at = int(shown["ActiveEnterTimestampMonotonic"])
    warming = {
        e["MODEL"]: int(e["__MONOTONIC_TIMESTAMP"])
        for e in edged.ns.journal(f"_SYSTEMD_UNIT={SERVICE}", "PHASE=warming")
    }
    assert set(warming) == {"tiny", "det"}, warming
    assert all(int(shown["ExecMainStartTimestampMonotonic"]) < t < active_at for t in warming.values())


# The promise: the first request after READY=1 costs what a request does on a daemon that has
# served. Both are taken after the same idle gap on a new connection (an idle daemon's threads and
# caches go cold whatever the warm-up did), on a model that runs about a millisecond here, so that
# the model and not timer noise or the socket is what is compared. One first request is one
# sample of a noisy machine: the median over fresh starts, against the median of the requests
# after the gap, is what the bound holds (the same measure as bench/first_request.py).
STARTS, AFTER_GAP_PER_START, GAP_S, FIRST_BOUND = 7, 3, 0.5, 1.5


def make_conv(path: Path, size: int = 512) -> tuple[Path, np.ndarray]:
    """Conv(3→8, s2) → Relu → Conv(8→16, s2) → Relu → GlobalAveragePool → Flatten on 1x3xSxS."""
    from onnx import TensorProto, helper, numpy_helper

    from edged.tools.demo import save_graph

    rng = np.random.default_rng(512)
    inits, nodes, prev, chans = [], [], "x", 3
    for i, out in enumerate((8, 16)):
        w = (rng.standard_normal((out, chans, 3, 3)) * (2 / (9 * chans)) ** 0.5).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"w{i}"), numpy_helper.from_array(np.zeros(out, np.float32), f"b{i}")]
        nodes += [
            helper.make_node(
                "Conv", [prev, f"w{i}", f"b{i}"], [f"c{i}"], kernel_shape=[3, 3], strides=[2, 2], pads=[1] * 4
            ),
            helper.make_node("Relu", [f"c{i}"], [f"r{i}"]),
        ]
        prev, chans = f"r{i}", out
    nodes += [helper.make_node("GlobalAveragePool", [prev], ["g"]), helper.make_node("Flatten", ["g"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "conv",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 3, size, size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, chans])],
        inits,
    )
    return save_graph(graph, path), frame(size)


def timed_infer(edged: Edged, x: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    """One request as a client that just started sends it: a new connection, the tensor in the
    body. Seconds, and the answer."""
    t0 = time.perf_counter()
    with edged.client() as c:
        out = c.infer("conv", {"x": x})
    return time.perf_counter() - t0, out


def test_the_first_request_after_ready_costs_what_a_request_after_the_same_idle_gap_does(
    boot_systemd: Boot, tmp_path: Path
) -> None:
    edged = boot_edged(boot_systemd)
    model, x = make_conv(tmp_path / "conv.onnx")
    edged.write_config({"models.conv": {"path": edged.install(model, "models/conv.onnx")}})
    want = onnx_reference(model, {"x": x})
    firsts: list[float] = []
    after_gap: list[float] = []
    runs: list[float] = []
    for i in range(STARTS):
        edged.ns.systemctl("restart" if i else "start", SERVICE, check=True, timeout=120)  # until READY=1
        time.sleep(GAP_S)  # the idle gap being measured, not synchronisation
        first_s, out = timed_infer(edged, x)
        assert matches(out, want), "the first answer differs from ONNX Runtime's"
        firsts.append(first_s)
        for _ in range(AFTER_GAP_PER_START):
            time.sleep(GAP_S)  # the same gap, on a daemon that has served
            seconds, out = timed_infer(edged, x)
            assert matches(out, want)
            after_gap.append(seconds)
        with edged.client() as c:
            runs.append(c.status()["models"]["conv"]["infer_us"] / 1e6)
    first, after = statistics.median(firsts), statistics.median(after_gap)
    ratio = first / after
    print(
        f"\nconv {x.shape[-1]}x{x.shape[-1]} (warm-up run {statistics.median(runs) * 1000:.2f} ms): "
        f"first request after READY=1 "
        f"median {first * 1000:.2f} ms over {STARTS} starts ({', '.join(f'{v * 1000:.2f}' for v in firsts)}); "
        f"after the same {GAP_S} s gap median {after * 1000:.2f} ms over {len(after_gap)}; ratio {ratio:.2f}"
    )
    assert ratio <= FIRST_BOUND, (
        f"the first request after READY=1 costs {ratio:.2f}x a request after the same idle gap "
        f"(medians {first * 1000:.2f} vs {after * 1000:.2f} ms; firsts {[round(v * 1000, 2) for v in firsts]}, "
        f"after the gap {[round(v * 1000, 2) for v in after_gap]})"
    )


# --- 2. STATUS= while building -----------------------------------------------------------------


def test_status_text_follows_a_slow_build_while_activating(
    boot_systemd: Boot, demo_models: Path, tmp_path: Path
) -> None:
    from tests.integration.test_int8 import render_text_images

    edged = boot_edged(boot_systemd)
    pages = edged.install(render_text_images(tmp_path / "pages", 10), "pages")
    edged.write_config(
        {
            "models.det": {
                "path": edged.install(demo_models, "models/det.onnx"),
                "backend": "onnxruntime",
                "precision": "int8",
            },
            "models.det.profiles.x": DET_PROFILE,
            # "percentile" at 320x320: about 4 s here. ("entropy" took 50 s on 6 images; "minmax"
            # at 160x160 under 2 s.)
            "models.det.calibration": {
                "data": pages,
                "method": "percentile",
                "resize": [320, 320],
                "mean": [0.485, 0.456, 0.406],
                "std": [0.229, 0.224, 0.225],
            },
            # Thresholds for a segmentation map, as in tests/integration/test_int8.py.
            "models.det.gate": {"max_rel_l2": 0.5, "min_cosine": 0.9},
        }
    )

    seen: list[tuple[float, str, str]] = []

    def active() -> bool:
        p = edged.show("ActiveState", "StatusText")
        seen.append((time.monotonic(), p["ActiveState"], p["StatusText"]))
        if p["ActiveState"] == "failed":
            raise AssertionError(f"edged failed to start:\n{edged.diagnostics()}")
        return p["ActiveState"] == "active"

    edged.ns.systemctl("start", "--no-block", SERVICE, check=True)
    wait_for(active, 180, interval=0.01, what="edged to finish building and become active")

    texts = list(dict.fromkeys(text for _, state, text in seen if state == "activating"))
    print("\nStatusText while activating:\n  " + "\n  ".join(texts))
    building = [
        (t, text) for t, state, text in seen if state == "activating" and text.startswith("building det int8 (1/1)")
    ]
    assert building, f"no 'building det int8 (1/1)' status while activating; saw {texts}"
    assert any(text.startswith("building det int8 (1/1): ") for _, text in building), (
        f"no build progress phase in STATUS=; saw {texts}"
    )
    print(f"building shown for {building[-1][0] - building[0][0]:.1f} s")
    assert edged.prop("StatusText") == "1 models ready"
    with edged.client() as c:
        det = c.status()["models"]["det"]
    assert det["precision"] == "int8" and det["state"] == "ready", det


# --- 3. reload under load ----------------------------------------------------------------------


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


# --- 4. failed reload -----------------------------------------------------------------------------


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


# --- 5. watchdog ------------------------------------------------------------------------------------


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


# --- 6. stop drains -----------------------------------------------------------------------------------


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


# --- 7. socket activation ---------------------------------------------------------------------------


def test_a_request_sent_before_the_daemon_exists_is_answered_once_warm(
    boot_systemd: Boot, demo_models: Path, tmp_path: Path
) -> None:
    edged = boot_edged(boot_systemd)
    # A detector that warms for a while, so "answered once ready" differs from "answered at once".
    edged.write_config(tiny_and_detector(edged, tmp_path, demo_models) | {"models.det.warmup": {"iterations": 20}})
    ref = onnx_reference(tmp_path / "tiny.onnx", {"x": X})
    edged.ns.systemctl("start", SOCKET_UNIT, check=True)
    assert edged.state() == "inactive"
    assert edged.path(SOCKET).is_socket()

    sent_at = time.monotonic()
    with edged.client(timeout=120) as c:
        out = c.infer("tiny", {"x": X})  # connects to systemd's socket; edged starts on demand
    answered_at = time.monotonic()
    assert matches(out, ref)

    edged.ns.wait_state(SERVICE, "active")
    shown = edged.show("ExecMainStartTimestampMonotonic", "ActiveEnterTimestampMonotonic", "NRestarts")
    started, active = int(shown["ExecMainStartTimestampMonotonic"]), int(shown["ActiveEnterTimestampMonotonic"])
    print(
        f"\nsent -> daemon exec {(started - usec(sent_at)) / 1000:.0f} ms, "
        f"-> READY=1 {(active - usec(sent_at)) / 1000:.0f} ms, -> answer {(answered_at - sent_at) * 1000:.0f} ms"
    )
    assert usec(sent_at) < started, "the request was sent after the daemon had started"
    # READY=1 is sent just before waiting requests resume, and systemd may read it late: the
    # answer came after the detector's warm-up was half done (it began warming at `warming`),
    # not at once. Both ends are this start's own, whatever the machine's speed.
    warmings = edged.ns.journal(f"_SYSTEMD_UNIT={SERVICE}", "PHASE=warming", "MODEL=det")
    assert warmings, "no PHASE=warming entry for det in the journal"
    warming = min(int(e["__MONOTONIC_TIMESTAMP"]) for e in warmings)
    print(f"detector warming -> READY=1 {(active - warming) / 1000:.0f} ms")
    assert started < warming < active
    assert usec(answered_at) >= (warming + active) // 2, "answered before the detector's warm-up was half done"
    assert shown["NRestarts"] == "0"
