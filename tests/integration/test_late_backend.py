"""A language model whose backend's library is installed while the daemon runs (scripts/demo.sh's
first run: llama-cpp-python compiles for minutes): the real daemon serves the real demo detector at
once, reports the real SmolLM2 as waiting for its backend, and, once llama-cpp-python appears in
the daemon's own environment, serves it too, with no restart and no failed request.

The environment is a real venv whose site-packages holds every package of the test's own venv
(links) but llama-cpp-python; installing it is copying the package and its metadata in, file by
file, into that site-packages while the daemon runs, as pip writes it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import sysconfig
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import orjson
import pytest

from tests.helpers import DaemonProcess, wait_for, write_config
from tests.integration.test_llm import llm_model, smollm2

pytestmark = [pytest.mark.integration, pytest.mark.slow]

__all__ = ["smollm2"]  # a fixture: imported so that pytest finds it

LM = "smollm2"
VISION = "ocr_det"
GENERATE = orjson.dumps({"text_input": "Name a colour.", "parameters": {"max_tokens": 4, "temperature": 0}})


@dataclass
class Venv:
    python: Path
    site: Path  # its site-packages
    held_back: list[Path]  # what of the test's site-packages it lacks: llama-cpp-python


@pytest.fixture(scope="module")
def venv_without_llama(tmp_path_factory: pytest.TempPathFactory) -> Venv:
    root = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True)
    ours = Path(sysconfig.get_paths()["purelib"])
    site = root / "lib" / f"python{sys.version_info[0]}.{sys.version_info[1]}" / "site-packages"
    held_back = [p for p in ours.iterdir() if p.name == "llama_cpp" or p.name.startswith("llama_cpp_python-")]
    assert len(held_back) == 2, held_back  # the package and its metadata
    for entry in ours.iterdir():
        if entry not in held_back:
            (site / entry.name).symlink_to(entry)
    python = root / "bin" / "python"
    probe = "import importlib.util as u; print(u.find_spec('llama_cpp') is None, u.find_spec('onnxruntime') is None)"
    assert subprocess.run([python, "-c", probe], capture_output=True, text=True, check=True).stdout.split() == [
        "True",
        "False",
    ]
    return Venv(python, site, held_back)


def install(venv: Venv) -> None:
    """What pip does, minus the build: the package's files written one by one, its metadata last."""
    for src in sorted(venv.held_back, key=lambda p: p.name.endswith(".dist-info")):
        shutil.copytree(src, venv.site / src.name, ignore=shutil.ignore_patterns("__pycache__"))


@dataclass
class Poller:
    """One client polling throughout, round after round: the detector's inference, the daemon's
    readiness, the status, the language model's readiness, and a generation on it.

    A failure is any of: a request that raises on the client side (refused, reset, timed out); an
    inference answered other than 200 or with an output that differs from ONNX Runtime's own run;
    /v2/health/ready answered other than 200; a status whose language model is in a state other
    than waiting or ready, or waiting (or not ready) after it was ready, or whose uptime went back
    (a restart); a generation answered other than 200 once the model was seen ready, or before
    that other than 503 model_not_ready naming the waiting state. Those 503s are the answer a
    model that is not ready yet gives, counted in ``not_ready``, not failures."""

    d: DaemonProcess
    frame: np.ndarray
    expected: np.ndarray
    stop: threading.Event = field(default_factory=threading.Event)
    failures: list[str] = field(default_factory=list)
    rounds: int = 0
    inferences: int = 0
    not_ready: int = 0
    generated: int = 0
    states: list[str] = field(default_factory=list)  # the language model's state, one per round
    lm_ready: bool = False
    uptime: float = 0.0

    def run(self) -> None:
        with self.d.client(timeout=60) as c:
            while not self.stop.is_set():
                for step in (self._infer, self._health, self._status, self._model_ready, self._generate):
                    try:
                        step(c)
                    except Exception as e:
                        self.failures.append(f"round {self.rounds} {step.__name__}: {e!r}")
                self.rounds += 1

    def _check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(f"round {self.rounds}: {what}")

    def _infer(self, c: Any) -> None:
        out = c.infer(VISION, {"x": self.frame})
        (name,) = out
        self._check(np.allclose(out[name], self.expected, atol=1e-4), "the detector's answer differs")
        self.inferences += 1

    def _health(self, c: Any) -> None:
        self._check(c.ready(), "/v2/health/ready is not 200")

    def _status(self, c: Any) -> None:
        st = c.status()
        state = st["models"][LM]["state"]
        self.states.append(state)
        self._check(state in ("waiting", "ready"), f"{LM} is {state}")
        self._check(not (self.lm_ready and state != "ready"), f"{LM} is {state} after it was ready")
        self._check(st["uptime_s"] >= self.uptime, f"uptime went from {self.uptime} to {st['uptime_s']}")
        self.uptime = st["uptime_s"]
        self.lm_ready = self.lm_ready or state == "ready"

    def _model_ready(self, c: Any) -> None:
        ready = c.model_ready(LM)
        self._check(ready or not self.lm_ready, f"/v2/models/{LM}/ready is not 200 after it was ready")
        self.lm_ready = self.lm_ready or ready

    def _generate(self, c: Any) -> None:
        status, body, _ = c.request("POST", f"/v2/models/{LM}/generate", GENERATE, {"Content-Type": "application/json"})
        doc = orjson.loads(body)
        if status == 200:
            self._check(doc.get("model_name") == LM and doc.get("text_output") is not None, f"generated {doc}")
            self.generated += 1
        elif not self.lm_ready and status == 503 and doc.get("code") == "model_not_ready":
            self._check(f"'{LM}' is waiting" in doc.get("error", ""), f"503 without the waiting state: {doc}")
            self.not_ready += 1
        else:
            self._check(False, f"generate answered {status}: {doc}")


def test_a_language_model_joins_the_running_daemon_once_its_backend_is_installed(
    tmp_path: Path,
    daemons: list[DaemonProcess],
    venv_without_llama: Venv,
    demo_models: Path,
    smollm2: Path,
) -> None:
    profile = {"min": [1, 3, 32, 32], "opt": [1, 3, 64, 64], "max": [1, 3, 1280, 1280]}
    tables: dict[str, dict[str, Any]] = {
        "server": {"socket": str(tmp_path / "edged.sock")},
        "cache": {"dir": str(tmp_path / "cache")},
        "lifecycle": {"watch_files": False},
        f"models.{VISION}": {"path": str(demo_models), "backend": "onnxruntime", "priority": 80},
        f"models.{VISION}.profiles.x": profile,
    }
    lm = llm_model(smollm2)
    tables[f"models.{LM}"] = {k: v for k, v in lm.items() if not isinstance(v, dict)}
    tables.update({f"models.{LM}.{k}": v for k, v in lm.items() if isinstance(v, dict)})
    cfg = write_config(tmp_path / "edged.toml", tables)
    d = DaemonProcess(cfg, tmp_path / "edged.sock", tmp_path / "edged.log", python=str(venv_without_llama.python))
    daemons.append(d)
    d.start(timeout=120)  # ready: the detector serves, the language model waits
    assert d.proc is not None
    pid = d.proc.pid

    with d.client() as c:
        st = c.status()
        models = st["models"]
        assert st["ready"] and models[VISION]["state"] == "ready"
        waiting = models[LM]
        assert waiting["state"] == "waiting" and waiting["backend"] == "llama", waiting
        assert "llama_cpp" in waiting["reason"] and "llama-cpp-python" in waiting["reason"], waiting
        assert "waiting: backend llama is not installed yet" in st["status"]

    frame = np.random.default_rng(3).random((1, 3, 64, 64), dtype=np.float32)
    session = ort.InferenceSession(str(demo_models), providers=["CPUExecutionProvider"])
    poller = Poller(d, frame, session.run(None, {"x": frame})[0])
    thread = threading.Thread(target=poller.run)
    thread.start()
    try:
        wait_for(lambda: poller.not_ready >= 5, 60, what="the client seeing the language model wait")
        install(venv_without_llama)
        wait_for(lambda: poller.generated >= 3 or poller.failures, 240, 0.1, what=f"{LM} joining")
    finally:
        poller.stop.set()
        thread.join(90)
    assert not thread.is_alive()
    assert poller.failures == [], "\n".join(poller.failures[:20]) + "\n--- daemon log ---\n" + d.log()
    # It waited, then served, in that order, and the detector served all along.
    first_ready = poller.states.index("ready")
    assert first_ready > 0 and set(poller.states[:first_ready]) == {"waiting"}
    assert poller.inferences == poller.rounds and poller.not_ready >= 5 and poller.generated >= 3
    assert d.proc.poll() is None and d.proc.pid == pid  # the same process: no restart
    with d.client() as c:
        joined = c.status()["models"][LM]
    assert joined["state"] == "ready" and joined["backend"] == "llama" and joined["precision"] == "q4_1", joined
    assert d.stop() == 0
