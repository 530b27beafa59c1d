"""A real mosquitto broker for tests: its own config, a free loopback port, started and stopped
by PID.

The broker listens on 127.0.0.1 only, lets anonymous clients in, sets TCP_NODELAY (design
section 2: without it a QoS 1 round trip costs tens of milliseconds) and keeps a persistence
file so a restart mid-test keeps sessions, subscriptions and queued QoS 1 messages.

    from tests.integration.mosquitto import broker  # a pytest fixture
    def test_x(broker): broker.port ...

It also holds ``Peer``, a paho client that records what it receives and waits on a condition
with a deadline (never a sleep) for what it expects, and ``need``, which finds mosquitto's programs:
a test without them is skipped with the reason, and under CI (which installs them) fails.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from tests.helpers import unavailable

START_TIMEOUT_S = 10.0


def need(program: str, package: str) -> str:
    """The path of one of mosquitto's programs (mosquitto lives in /usr/sbin, off a user's PATH);
    without it the test is skipped, saying which package brings it, or fails under CI."""
    found = shutil.which(program) or shutil.which(program, path="/usr/sbin:/sbin")
    if found is None:
        unavailable(f"{program} is not installed (Debian package '{package}')")
    return found


def free_port() -> int:
    """A port the kernel just handed out on loopback; the broker binds it right after."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(host: str, port: int, deadline: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    """Until a TCP connect succeeds, the process died, or the deadline passed."""
    while True:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"mosquitto exited with {proc.returncode} before listening")
        try:
            with socket.create_connection((host, port), timeout=0.2):
                return
        except OSError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"nothing listens on {host}:{port}") from None
            time.sleep(0.02)  # poll interval of a condition wait, not a synchronisation sleep


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=30)


def make_tls(directory: Path) -> TlsFiles:
    """A throw-away CA, a server certificate for 127.0.0.1 and a client certificate (P-256,
    which openssl makes in milliseconds)."""
    directory.mkdir(parents=True, exist_ok=True)
    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ca, ca_key = directory / "ca.crt", directory / "ca.key"
    _openssl("req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=edged test CA")
    out = {}
    for name, extra in (("server", ("-addext", "subjectAltName=IP:127.0.0.1")), ("client", ())):
        key, csr, crt = (directory / f"{name}.{ext}" for ext in ("key", "csr", "crt"))
        _openssl("req", *ec, "-keyout", key, "-out", csr, "-subj", f"/CN=edged test {name}", *extra)
        _openssl(
            "x509",
            "-req",
            "-in",
            csr,
            "-CA",
            ca,
            "-CAkey",
            ca_key,
            "-CAcreateserial",
            "-out",
            crt,
            "-days",
            "2",
            "-copy_extensions",
            "copy",
        )
        out[name] = (crt, key)
    return TlsFiles(ca, *out["server"], *out["client"])


def write_config(directory: Path, port: int, tls: TlsFiles | None = None, users: dict[str, str] | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    conf = directory / "mosquitto.conf"
    secure: list[str] = []
    if tls is not None:  # clients must show a certificate the CA signed
        secure += [
            f"cafile {tls.ca}",
            f"certfile {tls.server_cert}",
            f"keyfile {tls.server_key}",
            "require_certificate true",
        ]
    if users:
        passwd = directory / "passwd"
        passwd.write_text("")
        for user, password in users.items():
            subprocess.run(["mosquitto_passwd", "-b", str(passwd), user, password], check=True, timeout=30)
        secure += [f"password_file {passwd}"]
    conf.write_text(
        "\n".join(
            [
                f"listener {port} 127.0.0.1",
                *secure,
                f"allow_anonymous {'false' if users else 'true'}",
                "set_tcp_nodelay true",
                "persistence true",
                f"persistence_location {directory}/",
                "persistence_file mosquitto.db",
                # Enough room for a burst of queued QoS 1 requests while a client is away.
                "max_queued_messages 100000",
                "max_inflight_messages 0",
                f"log_dest file {directory}/mosquitto.log",
                "log_type error",
                "log_type warning",
                "log_type notice",
                "log_type information",
                "connection_messages true",
                # Started as root by CI: stay root so the files above stay writable.
                "user root" if os.geteuid() == 0 else "",
                "",
            ]
        )
    )
    return conf


class Broker:
    """One mosquitto process; restart() keeps the port and the persistence file."""

    host = "127.0.0.1"

    def __init__(
        self, directory: Path, port: int | None = None, tls: TlsFiles | None = None, users: dict[str, str] | None = None
    ) -> None:
        self.dir = directory
        self.port = port or free_port()
        self.conf = write_config(directory, self.port, tls, users)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def log(self) -> str:
        path = self.dir / "mosquitto.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def start(self) -> None:
        with open(self.dir / "mosquitto.stderr", "ab") as err:
            self.proc = subprocess.Popen(
                [need("mosquitto", "mosquitto"), "-c", str(self.conf)], stdout=subprocess.DEVNULL, stderr=err
            )
        try:
            wait_port(self.host, self.port, time.monotonic() + START_TIMEOUT_S, self.proc)
        except (RuntimeError, TimeoutError) as e:
            self.stop()
            stderr = (self.dir / "mosquitto.stderr").read_text(errors="replace")
            raise RuntimeError(f"{e}:\n{stderr[-2000:]}{self.log[-2000:]}") from None

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM makes mosquitto write its persistence file before it exits."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        os.kill(proc.pid, sig)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)

    def restart(self) -> None:
        self.stop()
        self.start()


def _running(directory: Path) -> Iterator[Broker]:
    need("mosquitto", "mosquitto")
    b = Broker(directory)
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    """A broker of the test's own (a test that restarts it disturbs nobody else)."""
    yield from _running(tmp_path / "broker")


@pytest.fixture(scope="module")
def module_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for a test module's daemons and clients."""
    yield from _running(tmp_path_factory.mktemp("broker"))


# --- MQTT clients ------------------------------------------------------------------------------


@dataclass
class Received:
    topic: str
    payload: bytes
    retain: bool = False
    correlation: bytes | None = None
    content_type: str = ""
    user: dict[str, str] = field(default_factory=dict)

    def json(self) -> Any:
        return json.loads(self.payload)


def _nodelay(client: mqtt.Client, userdata: Any, sock: Any) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class Peer:
    """A paho client that records every message it receives; waits are on a condition."""

    def __init__(
        self,
        port: int,
        v5: bool = True,
        client_id: str = "",
        session_expiry: int = 0,
        tls: TlsFiles | None = None,
        auth: tuple[str, str] | None = None,
    ) -> None:
        self.port = port
        self.v5 = v5
        self.session_expiry = session_expiry
        self.cond = threading.Condition()
        self.received: list[Received] = []
        self.connects = 0
        self._subacks: set[int] = set()
        self.client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id or f"test-{uuid.uuid4().hex[:10]}",
            protocol=MQTTProtocolVersion.MQTTv5 if v5 else MQTTProtocolVersion.MQTTv311,
            clean_session=None if v5 else session_expiry == 0,
        )
        # paho annotates the delays as int; it takes seconds as any number (it sleeps on them).
        self.client.reconnect_delay_set(0.05, 0.5)  # type: ignore[arg-type]
        if tls is not None:
            self.client.tls_set(ca_certs=str(tls.ca), certfile=str(tls.client_cert), keyfile=str(tls.client_key))
        if auth is not None:
            self.client.username_pw_set(*auth)
        self.client.on_socket_open = _nodelay
        self.client.on_message = self._on_message
        self.client.on_connect = self._on_connect
        self.client.on_subscribe = self._on_subscribe

    def __enter__(self) -> Peer:
        props = None
        kwargs: dict[str, Any] = {}
        if self.v5:
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            if self.session_expiry:
                props.SessionExpiryInterval = self.session_expiry
            kwargs = {"clean_start": self.session_expiry == 0, "properties": props}
        self.client.connect_async("127.0.0.1", self.port, 30, **kwargs)
        self.client.loop_start()
        self.wait(lambda: self.connects > 0, 10, "connection")
        return self

    def __exit__(self, *exc: object) -> None:
        self.client.disconnect()
        self.client.loop_stop()

    def _on_connect(self, client: mqtt.Client, userdata: Any, flags: Any, reason: Any, props: Any) -> None:
        with self.cond:
            self.connects += 1
            self.cond.notify_all()

    def _on_subscribe(self, client: mqtt.Client, userdata: Any, mid: int, codes: Any, props: Any) -> None:
        with self.cond:
            self._subacks.add(mid)
            self.cond.notify_all()

    def _on_message(self, client: mqtt.Client, userdata: Any, msg: mqtt.MQTTMessage) -> None:
        r = Received(msg.topic, bytes(msg.payload), bool(msg.retain))
        if msg.properties is not None:
            r.correlation = getattr(msg.properties, "CorrelationData", None)
            r.content_type = getattr(msg.properties, "ContentType", "")
            r.user = dict(getattr(msg.properties, "UserProperty", ()))
        with self.cond:
            self.received.append(r)
            self.cond.notify_all()

    def wait(self, pred: Callable[[], Any], timeout: float, what: str) -> Any:
        with self.cond:
            value = self.cond.wait_for(pred, timeout)
        if not value:
            raise AssertionError(f"timed out after {timeout:.1f} s waiting for {what}")
        return value

    def subscribe(self, topic: str, qos: int = 1) -> None:
        _, mid = self.client.subscribe(topic, qos)
        self.wait(lambda: mid in self._subacks, 10, f"SUBACK for {topic}")

    def on(self, topic: str) -> list[Received]:
        with self.cond:
            return [r for r in self.received if r.topic == topic]

    def first(self, topic: str, pred: Callable[[Received], bool] = lambda r: True, timeout: float = 10) -> Received:
        def found() -> Received | None:
            return next((r for r in self.received if r.topic == topic and pred(r)), None)

        return self.wait(found, timeout, f"a message on {topic}")

    def request(
        self,
        topic: str,
        payload: bytes | str,
        response_topic: str = "",
        correlation: bytes | None = None,
        content_type: str = "",
        user: Iterable[tuple[str, str]] = (),
        qos: int = 1,
        expiry: int | None = None,
    ) -> None:
        props = None
        if self.v5:
            props = Properties(PacketTypes.PUBLISH)  # type: ignore[no-untyped-call]
            if response_topic:
                props.ResponseTopic = response_topic
            if correlation is not None:
                props.CorrelationData = correlation
            if content_type:
                props.ContentType = content_type
            if user:
                props.UserProperty = list(user)
            if expiry is not None:
                props.MessageExpiryInterval = expiry
        self.client.publish(topic, payload, qos=qos, properties=props)

    def replies(self, topic: str) -> dict[bytes, Received]:
        """By correlation data; a QoS 1 duplicate counts once."""
        with self.cond:
            return {r.correlation: r for r in self.received if r.topic == topic and r.correlation is not None}
