"""One MQTT connection: a paho-mqtt 2.x client driven by the event loop, and the settings of the
[mqtt] table (protocol, session, credentials, TLS, keepalive, reconnect backoff).

paho runs without its network thread: its socket is registered with the loop (paho's documented
external-loop API: ``loop_read``/``loop_write``/``loop_misc`` and the socket callbacks), so a
message is read, answered and written on the loop with no thread hand-off. Measured on the
2-core machine, the network thread cost 0.1-0.15 ms a round trip in wake-ups and GIL
hand-overs (``python -m bench mqtt``). Only the blocking part of a (re)connect (DNS, TCP connect, TLS
handshake) runs in a worker thread, and the client is left alone while it does.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
from paho.mqtt.enums import CallbackAPIVersion, MQTTProtocolVersion
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties

from edged.config import MqttConfig, TlsConfig
from edged.errors import ConfigError
from edged.thread_to_loop import to_loop
from edged.transports.mqtt import props as mqtt_props
from edged.transports.mqtt.acks import Deliveries
from edged.transports.mqtt.journal import Journal

log = logging.getLogger(__name__)

OnMessage = Callable[["Link", mqtt.MQTTMessage], None]
MISC_INTERVAL_S = 1.0  # keepalive pings and the dead-broker check
STOP_TIMEOUT_S = 2.0
JOURNAL_SPARE = 16  # refused messages hold a slot for an instant beyond the in-flight limit


def _tls(client: mqtt.Client, tls: TlsConfig) -> None:
    """CA (empty: the system's), optional client certificate; errors are config errors."""
    try:
        client.tls_set(
            ca_certs=tls.ca or None, certfile=tls.cert or None, keyfile=tls.key or None, cert_reqs=ssl.CERT_REQUIRED
        )
    except (OSError, ssl.SSLError, ValueError) as e:
        raise ConfigError(f"mqtt.tls: {e}") from None
    if tls.insecure:
        client.tls_insecure_set(True)  # skips the host name check only; the CA still applies


class Link:
    """A connection that reconnects with backoff and reports (re)connections on the loop.

    ``persistent``: the broker keeps the session (subscriptions and queued QoS 1 messages)
    for ``session_expiry_s`` after a disconnect; otherwise the session ends with the connection.
    """

    def __init__(
        self,
        cfg: MqttConfig,
        loop: asyncio.AbstractEventLoop,
        client_id: str,
        persistent: bool,
        on_connected: Callable[[bool], None],
        on_message: OnMessage,
        will_topic: str = "",
        journal_dir: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.loop = loop
        self.name = client_id
        self.v5 = cfg.protocol == "5"
        self.persistent = persistent and cfg.session_expiry_s > 0
        self.connected = asyncio.Event()
        self.attempted = asyncio.Event()  # the first connect attempt has an outcome
        self.closing = False
        self._on_connected = on_connected
        self._connecting = False  # paho's reconnect() runs in a worker thread: hands off
        self._held: list[tuple[str, bytes, int, bool, Properties | None]] = []
        self._lost: asyncio.Future[None] | None = None
        self._accepted = False  # this connection got a successful CONNACK
        self._runner: asyncio.Task[None] | None = None
        self._misc: asyncio.Task[None] | None = None
        self._loop_thread = threading.get_ident()
        mqtt_props.install()  # PUBLISH properties parsed later, linearly (props.py says why)
        self.client = self._make_client(client_id, on_message, will_topic)
        # Only a persistent session is redelivered to a later run: only it keeps a journal.
        path = journal_dir / f"{client_id}.running" if journal_dir is not None and self.persistent else None
        self.deliveries = Deliveries(self._ack, cfg.dedup_window, Journal(path, cfg.max_inflight + JOURNAL_SPARE))

    def _make_client(self, client_id: str, on_message: OnMessage, will_topic: str) -> mqtt.Client:
        cfg = self.cfg
        client = mqtt.Client(
            CallbackAPIVersion.VERSION2,
            client_id=client_id,
            protocol=MQTTProtocolVersion.MQTTv5 if self.v5 else MQTTProtocolVersion.MQTTv311,
            clean_session=None if self.v5 else not self.persistent,
            # Acknowledged by the transport once answered or dropped (acks.py), so that a
            # message edged dies on is redelivered, recognised and dropped, not lost or rerun.
            manual_ack=True,
        )
        paho_log = logging.getLogger(f"{__name__}.paho")
        if paho_log.level == logging.NOTSET:
            paho_log.setLevel(logging.INFO)  # paho's DEBUG is a line per packet
        client.enable_logger(paho_log)
        # An exception escaping a callback would leave paho's packet reader mid-packet: paho logs
        # it (as an error, through the logger above) and carries on instead.
        client.suppress_exceptions = True
        if cfg.username:
            client.username_pw_set(cfg.username, cfg.password or None)
        if cfg.tls is not None:
            _tls(client, cfg.tls)
        if will_topic:
            client.will_set(will_topic, "offline", qos=cfg.qos, retain=True)
        client.on_socket_open = self._socket_open
        client.on_socket_close = self._socket_close
        client.on_socket_register_write = self._register_write
        client.on_socket_unregister_write = self._unregister_write
        client.on_connect = self._on_connect
        client.on_disconnect = self._on_disconnect
        client.on_message = lambda c, userdata, msg: on_message(self, msg)
        return client

    # --- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Connect in the background and keep reconnecting until stop()."""
        cfg = self.cfg
        if self.v5:
            props = Properties(PacketTypes.CONNECT)  # type: ignore[no-untyped-call]
            # The broker sends no more unacknowledged QoS 1/2 messages than this at once.
            props.ReceiveMaximum = cfg.max_inflight
            if self.persistent:
                props.SessionExpiryInterval = cfg.session_expiry_s
            self.client.connect_async(
                cfg.host, cfg.port, cfg.keepalive_s, clean_start=not self.persistent, properties=props
            )
        else:
            self.client.connect_async(cfg.host, cfg.port, cfg.keepalive_s)
        self._loop_thread = threading.get_ident()
        self._runner = self.loop.create_task(self._run())
        self._misc = self.loop.create_task(self._keepalive())

    async def stop(self) -> None:
        """Send DISCONNECT (the broker then drops the will) and wait for the socket to close."""
        self.closing = True
        if self._misc is not None:
            self._misc.cancel()
        runner = self._runner
        if runner is not None and not runner.done():
            if self._connecting or self.client.socket() is not None:
                if not self._connecting:  # otherwise _connect() disconnects when it returns
                    self.client.disconnect()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(asyncio.shield(runner), STOP_TIMEOUT_S)
            runner.cancel()
        self.connected.clear()
        self.deliveries.journal.close()

    async def _run(self) -> None:
        delay = self.cfg.reconnect_min_s
        while not self.closing:
            self._lost = self.loop.create_future()
            self._accepted = False
            if await self._connect():
                await self._lost
                if self._accepted:
                    delay = self.cfg.reconnect_min_s  # it was up: start the backoff over
            if self.closing:
                return
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.cfg.reconnect_max_s)

    async def _connect(self) -> bool:
        self._connecting = True
        try:
            await asyncio.to_thread(self.client.reconnect)
        except (OSError, ValueError) as e:  # refused, unreachable, TLS handshake failed
            log.warning("MQTT %s: cannot connect to %s:%d: %s", self.name, self.cfg.host, self.cfg.port, e)
            self.attempted.set()
            return False
        finally:
            self._connecting = False
        if self.closing:
            self.client.disconnect()
        held, self._held = self._held, []
        for args in held:  # CONNECT is queued: anything after it is in order
            self.publish(*args)
        return True

    async def _keepalive(self) -> None:
        while True:
            await asyncio.sleep(MISC_INTERVAL_S)
            if not self._connecting and self.client.socket() is not None:
                self.client.loop_misc()

    def _ack(self, mid: int, qos: int) -> None:
        if not self._connecting:  # otherwise void: the broker redelivers on the new connection
            self.client.ack(mid, qos)

    # --- publishing -----------------------------------------------------------------------------

    def publish(
        self, topic: str, payload: bytes, qos: int = 0, retain: bool = False, properties: Properties | None = None
    ) -> mqtt.MQTTMessageInfo | None:
        """paho's publish, except while a connect owns the client: QoS 1/2 messages then wait
        for it (paho resends them after CONNACK like any in-flight message), QoS 0 is dropped."""
        if self._connecting:
            if qos > 0:
                self._held.append((topic, payload, qos, retain, properties))
            return None
        return self.client.publish(topic, payload, qos=qos, retain=retain, properties=properties)

    # --- paho's socket callbacks: register the socket with the loop -----------------------------

    def _on_loop(self, fn: Callable[..., Any], *args: Any) -> None:
        if threading.get_ident() == self._loop_thread:
            fn(*args)
            return
        to_loop(self.loop, fn, *args)  # from the connect thread

    def _socket_open(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        # paho never sets TCP_NODELAY: with Nagle and delayed ACKs a QoS 1 round trip on
        # loopback took 88 ms instead of 0.55 ms (design section 2).
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except (OSError, AttributeError):  # not a TCP socket
            pass
        self._on_loop(self._add_reader, sock)

    def _current(self, sock: Any) -> bool:
        """The client's socket is still this one (a socket registered from the connect thread
        may have closed again before the loop got to it)."""
        return self.client.socket() is sock

    def _add_reader(self, sock: Any) -> None:
        if self._current(sock):
            self.loop.add_reader(sock, self._readable)

    def _readable(self) -> None:
        self.client.loop_read()
        # TLS may hold decrypted bytes the socket no longer signals: read them now.
        sock = self.client.socket()
        while isinstance(sock, ssl.SSLSocket) and sock.pending():
            self.client.loop_read()
            sock = self.client.socket()

    def _socket_close(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._on_loop(self._remove, sock)

    def _remove(self, sock: Any) -> None:
        self.loop.remove_reader(sock)
        self.loop.remove_writer(sock)

    def _register_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._on_loop(self._add_writer, sock)

    def _add_writer(self, sock: Any) -> None:
        if self._current(sock):
            self.loop.add_writer(sock, self.client.loop_write)

    def _unregister_write(self, client: mqtt.Client, userdata: Any, sock: Any) -> None:
        self._on_loop(self.loop.remove_writer, sock)

    # --- connection events (on the loop) --------------------------------------------------------

    def _on_connect(
        self, client: mqtt.Client, userdata: Any, flags: mqtt.ConnectFlags, reason: Any, properties: Any
    ) -> None:
        self.attempted.set()
        if reason.is_failure:
            log.error(
                "MQTT %s: broker %s:%d refused the connection: %s", self.name, self.cfg.host, self.cfg.port, reason
            )
            return
        if self.closing:
            return
        self._accepted = True
        self.deliveries.connected(bool(flags.session_present))
        self.connected.set()
        self._on_connected(bool(flags.session_present))

    def _on_disconnect(
        self, client: mqtt.Client, userdata: Any, flags: mqtt.DisconnectFlags, reason: Any, properties: Any
    ) -> None:
        if not self.closing:
            log.warning(
                "MQTT %s: connection to %s:%d lost (%s); reconnecting", self.name, self.cfg.host, self.cfg.port, reason
            )
        self.connected.clear()
        self.attempted.set()
        if self._lost is not None and not self._lost.done():
            self._lost.set_result(None)
