"""edged's gRPC service against a bare grpcio server and against edged's HTTP, side by side.

  scripts/bench.sh grpc [--quick] [--rounds 10] [--out bench-results/grpc.json]

Servers: edged (HTTP on its Unix socket, gRPC on ``[server] grpc_socket`` and on a
``grpc_tcp`` loopback port) and the gRPC floor (bench/grpc_floor.py: grpcio's asyncio server of
the same service, answering edged's own answer's bytes, no edged code), on a Unix socket and a
loopback port too. Lanes, every one in every round, the order rotating between rounds:

  * the tiny MLP (1x16 FP32 in, 1x4 out) through Triton's generated stub
    (``service_pb2_grpc.GRPCInferenceServiceStub``, one channel, the same request message every
    call): the floor and edged, each on the Unix socket and on TCP;
  * the same through the stub to the floor behind edged's relay (``grpc_floor.py --relay``, on
    both listeners): what a grpcio server that knows its Unix peers and bounds grpcio's buffers
    pays before any work of its own. The report splits edged's time over the floor into the
    relay's share (relayed floor / floor) and the handler's (edged / relayed floor);
  * the same through the stub to the relayed floor that also runs the model on each request's
    input (``grpc_floor.py --relay --run``, the ``limit`` lanes): the least a grpcio server behind
    the relay does for the model, the bound of the floor target (the report says whether that
    bound is itself past it);
  * the same through ``tritonclient.grpc`` (the client users run), floor and edged, Unix socket;
  * the same over edged's HTTP on its Unix socket: a pre-encoded request with the binary tensor
    extension on one keep-alive connection (bench/wire.py, the client of every HTTP benchmark);
  * a 1x3x640x640 FP32 frame (conv640) through a registered POSIX shared memory region, the
    producer's copy into it inside the timing: gRPC on edged's Unix socket against HTTP;
  * with ``--base COMMIT|FOLDER``, a daemon of edged's package as of that commit (or folder,
    bench/base_tree.py) serving the same models: its tiny stub lanes on both listeners, and
    edged over base, a before/after of a change to the gRPC path in one interleaved run.

Targets: edged's gRPC p50 / the floor's p50 <= 1.3 (each listener against the floor's same
kind), edged's gRPC p50 / edged's HTTP p50 <= 1.5 (tiny, and the frame). Answers are checked
against ONNX Runtime in this process before any timing.

Run it as ``python -m bench grpc``, never as ``python bench/grpc.py``: a script's folder comes
first on sys.path, and this module would stand in for grpcio's ``grpc``.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import numpy as np
from tritonclient.grpc import service_pb2, service_pb2_grpc

from bench.base_tree import BaseEdged
from bench.edged_server import EdgedServer
from bench.models import ModelSpec, make_conv640, session, write_specs
from bench.peers import REPO, log, machine, running
from bench.servers import Server
from bench.wire import connect, decode_v2, roundtrip
from edged.client.shm import ShmRegion

Call = Callable[[], object]
OPTIONS = [("grpc.max_send_message_length", 2**31 - 1), ("grpc.max_receive_message_length", 2**31 - 1)]
TARGET_FLOOR, TARGET_HTTP = 1.3, 1.5
LISTENERS = ("uds", "tcp")  # the lanes' suffixes: edged's and each floor's Unix socket and TCP port


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def specs(folder: Path) -> dict[str, ModelSpec]:
    from edged.tools.demo import make_tiny_mlp

    tiny, conv = folder / "tiny.onnx", folder / "conv640.onnx"
    if not tiny.exists():
        make_tiny_mlp(tiny)
    if not conv.exists():
        make_conv640(conv)
    cores = len(os.sched_getaffinity(0))
    return {
        "tiny": ModelSpec("tiny", str(tiny.resolve()), "x", (1, 16), ("probs",), 1, False),
        "conv640": ModelSpec("conv640", str(conv.resolve()), "x", (1, 3, 640, 640), ("logits",), cores, True),
    }


class FloorServer(Server):
    """bench/grpc_floor.py as a child process."""

    name = "grpc-floor"
    answers = False

    def __init__(self, work: Path, response: bytes, relayed: bool = False, run: ModelSpec | None = None) -> None:
        if relayed:
            self.name = "grpc-floor-relayed" if run is None else "grpc-limit"
        super().__init__(work, {})
        self.relayed = relayed
        self.port = free_port()
        self.response_file = self.dir / "response.bin"
        self.response_file.write_bytes(response)
        self.run: list[str] = []
        if run is not None:
            self.run = ["--run", str(write_specs(self.dir / "specs.json", {run.name: run})), run.name]

    @property
    def addr(self) -> str:
        return str(self.dir / "floor.sock")

    def command(self) -> list[str]:
        relay = ["--relay"] if self.relayed else []
        argv = [str(self.response_file), self.addr, str(self.port), *relay, *self.run]
        return [self.python, "-m", "bench.grpc_floor", *argv]

    def is_ready(self) -> bool:
        with grpc.insecure_channel(f"unix:{self.addr}") as ch:
            stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
            try:
                return bool(stub.ServerReady(service_pb2.ServerReadyRequest(), timeout=1).ready)
            except grpc.RpcError:
                return False  # not listening yet


def infer_request(spec: ModelSpec, x: np.ndarray) -> Any:
    return service_pb2.ModelInferRequest(
        model_name=spec.name,
        inputs=[service_pb2.ModelInferRequest.InferInputTensor(name=spec.input, datatype="FP32", shape=x.shape)],
        outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=spec.outputs[0])],
        raw_input_contents=[np.ascontiguousarray(x).tobytes()],
    )


def answer(response: Any, spec: ModelSpec) -> np.ndarray:
    out = response.outputs[0]
    return np.frombuffer(response.raw_output_contents[0], np.float32).reshape(tuple(out.shape))


class Lanes:
    """The channels, clients and requests of every lane, opened once; ``calls`` maps a lane's
    name to one request of it."""

    def __init__(self, edged: EdgedServer, grpc_tcp: str, specs: dict[str, ModelSpec]) -> None:
        self.edged, self.specs = edged, specs
        self.channels: list[grpc.Channel] = []
        self.closers: list[Callable[[], None]] = []
        self.targets = {"edged_uds": f"unix:{edged.addr}.grpc", "edged_tcp": grpc_tcp}
        self.bases: list[str] = []  # the base daemon's lanes, when there is one
        self.calls: dict[str, Call] = {}
        tiny = specs["tiny"]
        self.x = tiny.sample()
        self.request = infer_request(tiny, self.x)

    def stub(self, target: str) -> Any:
        ch = grpc.insecure_channel(target, options=OPTIONS)
        self.channels.append(ch)
        return service_pb2_grpc.GRPCInferenceServiceStub(ch)

    def edged_response(self) -> bytes:
        """edged's answer to the tiny request, as the floor will send it."""
        got = self.stub(self.targets["edged_uds"]).ModelInfer(self.request, timeout=30)
        return bytes(got.SerializeToString())

    def add_tiny(self, floor: FloorServer, relayed: FloorServer, limit: FloorServer) -> None:
        for name, server in (("floor", floor), ("relayed", relayed), ("limit", limit)):
            self.targets |= {f"{name}_uds": f"unix:{server.addr}", f"{name}_tcp": f"127.0.0.1:{server.port}"}
        for kind in LISTENERS:
            for name in ("floor", "relayed", "limit", "edged"):
                self.calls[f"tiny/stub/{name}_{kind}"] = self.stub_call(self.targets[f"{name}_{kind}"])
        for lane in ("floor_uds", "edged_uds"):
            self.calls[f"tiny/tritonclient/{lane}"] = self.tritonclient_call(self.targets[lane])
        sock = connect(self.edged.addr)
        self.closers.append(sock.close)
        http = self.edged.request(self.specs["tiny"], self.x)
        self.calls["tiny/http/edged_uds"] = lambda: roundtrip(sock, http)

    def add_base(self, base: EdgedServer, grpc_tcp: str) -> None:
        self.targets |= {"base_uds": f"unix:{base.addr}.grpc", "base_tcp": grpc_tcp}
        for lane in ("base_uds", "base_tcp"):
            self.calls[f"tiny/stub/{lane}"] = self.stub_call(self.targets[lane])
            self.bases.append(f"tiny/stub/{lane}")

    def stub_call(self, target: str) -> Call:
        stub, req = self.stub(target), self.request
        return lambda: stub.ModelInfer(req, timeout=30)

    def tritonclient_call(self, target: str) -> Call:
        import tritonclient.grpc as tc

        client = tc.InferenceServerClient(target)
        self.closers.append(client.close)
        inp = tc.InferInput("x", list(self.x.shape), "FP32")
        inp.set_data_from_numpy(self.x)
        out = [tc.InferRequestedOutput("probs")]
        return lambda: client.infer("tiny", [inp], outputs=out).as_numpy("probs")

    def add_frame(self) -> np.ndarray:
        spec = self.specs["conv640"]
        frame = spec.sample(1)
        conn = self.edged.frame_conn(spec, frame, 0)  # a POSIX region, registered over HTTP
        sock = connect(self.edged.addr)
        self.closers.append(sock.close)
        assert conn.before is not None
        before, http = conn.before, conn.request

        def over_http() -> object:
            before()
            return roundtrip(sock, http)

        self.calls["frame/http/edged_uds"] = over_http
        self.calls["frame/grpc/edged_uds"] = self.grpc_frame_call(spec, frame)
        return frame

    def grpc_frame_call(self, spec: ModelSpec, frame: np.ndarray) -> Call:
        region = ShmRegion("grpc-frame", frame.nbytes)
        self.closers.append(region.close)
        stub = self.stub(self.targets["edged_uds"])
        stub.SystemSharedMemoryRegister(
            service_pb2.SystemSharedMemoryRegisterRequest(name=region.name, key=region.key, byte_size=frame.nbytes),
            timeout=30,
        )
        params = {
            "shared_memory_region": service_pb2.InferParameter(string_param=region.name),
            "shared_memory_byte_size": service_pb2.InferParameter(int64_param=frame.nbytes),
        }
        tensor = service_pb2.ModelInferRequest.InferInputTensor(
            name=spec.input, datatype="FP32", shape=frame.shape, parameters=params
        )
        req = service_pb2.ModelInferRequest(
            model_name=spec.name,
            inputs=[tensor],
            outputs=[service_pb2.ModelInferRequest.InferRequestedOutputTensor(name=spec.outputs[0])],
        )
        src = np.ascontiguousarray(frame).reshape(-1).view(np.uint8)

        def call() -> object:
            np.copyto(region.array_view[: src.nbytes], src)  # the producer writing its frame
            return stub.ModelInfer(req, timeout=30)

        return call

    def check(self, frame: np.ndarray) -> None:
        """Every edged lane's answer is ONNX Runtime's (the floor's is edged's, by construction)."""
        for name, x in (("tiny", self.x), ("conv640", frame)):
            spec = self.specs[name]
            want = session(spec).run([spec.outputs[0]], {spec.input: x})[0]
            mine = [k for k in self.calls if "edged" in k or k in self.bases]
            lanes = [k for k in mine if k.startswith("tiny" if name == "tiny" else "frame")]
            for lane in lanes:
                got = self.calls[lane]()
                if isinstance(got, tuple):  # HTTP: (head, body)
                    got = decode_v2(*got)[spec.outputs[0]]
                elif not isinstance(got, np.ndarray):
                    got = answer(got, spec)
                if not np.allclose(got, want, rtol=1e-4, atol=1e-5):
                    raise AssertionError(f"{lane}: wrong answer (max diff {np.abs(got - want).max()})")

    def close(self) -> None:
        for close in self.closers:
            close()
        for ch in self.channels:
            ch.close()


def timed(call: Call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        call()
        out.append(time.perf_counter() - t0)
    return out


def interleave(calls: dict[str, Call], rounds: int, per: dict[str, int]) -> dict[str, list[list[float]]]:
    """Each lane's seconds, one list per round; every lane warmed once first, unrecorded."""
    keys = list(calls)
    for k in keys:
        timed(calls[k], max(2, per[k] // 5))
    out: dict[str, list[list[float]]] = {k: [] for k in keys}
    for r in range(rounds):
        shift = r % len(keys)
        for k in keys[shift:] + keys[:shift]:
            out[k].append(timed(calls[k], per[k]))
    return out


def summary(per_round: list[list[float]]) -> dict[str, Any]:
    ms = np.concatenate([np.asarray(r) for r in per_round]) * 1000
    return {
        "p50_ms": float(np.percentile(ms, 50)),
        "p99_ms": float(np.percentile(ms, 99)),
        "mean_ms": float(ms.mean()),
        "n": int(ms.size),
        "round_p50_ms": [float(np.percentile(np.asarray(r) * 1000, 50)) for r in per_round],
    }


def ratio(lanes: dict[str, dict[str, Any]], a: str, b: str, target: float | None) -> dict[str, Any]:
    """a's p50 over b's: pooled, and the median and worst of the rounds' ratios."""
    rounds = [x / y for x, y in zip(lanes[a]["round_p50_ms"], lanes[b]["round_p50_ms"]) if y]
    return {
        "of": a,
        "over": b,
        "p50_ratio": lanes[a]["p50_ms"] / lanes[b]["p50_ms"],
        "round_median": statistics.median(rounds),
        "round_worst": max(rounds),
        "target": target,
    }


# (lane, over lane, target: None for a share of another ratio, no target of its own)
Pair = tuple[str, str, float | None]
RATIOS: list[Pair] = [
    ("tiny/stub/edged_uds", "tiny/stub/floor_uds", TARGET_FLOOR),
    ("tiny/stub/edged_tcp", "tiny/stub/floor_tcp", TARGET_FLOOR),
    ("tiny/tritonclient/edged_uds", "tiny/tritonclient/floor_uds", TARGET_FLOOR),
    ("tiny/stub/edged_uds", "tiny/http/edged_uds", TARGET_HTTP),
    ("tiny/stub/edged_tcp", "tiny/http/edged_uds", TARGET_HTTP),
    ("frame/grpc/edged_uds", "frame/http/edged_uds", TARGET_HTTP),
]


# The floor target's bound: the relayed floor running the model, against the floor (the same
# target; past it, no grpcio server behind the relay meets it on this machine).
BOUNDS: list[Pair] = [(f"tiny/stub/limit_{k}", f"tiny/stub/floor_{k}", TARGET_FLOOR) for k in LISTENERS]


# Where edged's time over the floor goes, per listener: each lane over the one below it (the
# relay's share, the run's, edged's own). No target: the split of the one above.
_STEPS = (("relayed", "floor"), ("limit", "relayed"), ("edged", "limit"))
SHARES: list[Pair] = [(f"tiny/stub/{a}_{k}", f"tiny/stub/{b}_{k}", None) for k in LISTENERS for a, b in _STEPS]


BASE_RATIOS: list[Pair] = [(f"tiny/stub/edged_{k}", f"tiny/stub/base_{k}", 1.0) for k in LISTENERS]


def run(work: Path, rounds: int, per: int, frame_per: int, base: str | None) -> dict[str, Any]:
    models = specs(REPO / "data" / "bench")
    port, base_port = free_port(), free_port()
    edged = EdgedServer(work, models, server={"grpc_tcp": [f"127.0.0.1:{port}"]}, shm="posix")
    servers: list[Server] = [edged]
    if base is not None:
        based = BaseEdged(work, {"tiny": models["tiny"]}, base, server={"grpc_tcp": [f"127.0.0.1:{base_port}"]})
        servers.append(based)
    with running(servers):
        lanes = Lanes(edged, f"127.0.0.1:{port}", models)
        if base is not None:
            lanes.add_base(based, f"127.0.0.1:{base_port}")
        try:
            response = lanes.edged_response()
            floor, relayed = FloorServer(work, response), FloorServer(work, response, relayed=True)
            limit = FloorServer(work, response, relayed=True, run=models["tiny"])
            with running([floor, relayed, limit]):
                lanes.add_tiny(floor, relayed, limit)
                frame = lanes.add_frame()
                lanes.check(frame)
                counts = {k: frame_per if k.startswith("frame") else per for k in lanes.calls}
                log(f"{len(lanes.calls)} lanes, {rounds} rounds")
                raw = interleave(lanes.calls, rounds, counts)
        finally:
            lanes.close()
            edged.close_frames()
    result = {k: summary(v) for k, v in raw.items()}
    pairs = RATIOS + BOUNDS + SHARES + (BASE_RATIOS if base is not None else [])
    return {"lanes": result, "ratios": [ratio(result, a, b, t) for a, b, t in pairs], "base": base}


def report(r: dict[str, Any]) -> str:
    lines = [f"{'lane':<32} {'p50 ms':>9} {'p99 ms':>9} {'n':>7}"]
    lines += [f"{k:<32} {v['p50_ms']:>9.3f} {v['p99_ms']:>9.3f} {v['n']:>7}" for k, v in r["lanes"].items()]
    lines += ["", f"{'ratio of p50s':<60} {'pooled':>7} {'rounds':>7} {'worst':>7}  target"]
    for q in r["ratios"]:
        if q["over"].startswith("tiny/stub/base"):
            verdict = "before/after"
        elif q["target"] is None:
            verdict = "share"
        elif q["of"].startswith("tiny/stub/limit"):
            verdict = f"bound: {'within' if q['p50_ratio'] <= q['target'] else 'past'} {q['target']}"
        else:
            verdict = f"<= {q['target']} " + ("met" if q["p50_ratio"] <= q["target"] else "MISSED")
        name = f"{q['of']} / {q['over']}"
        lines.append(f"{name:<60} {q['p50_ratio']:>7.3f} {q['round_median']:>7.3f} {q['round_worst']:>7.3f}  {verdict}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="5 rounds of fewer requests")
    ap.add_argument("--rounds", type=int, default=0, help="rounds (default 10, 5 with --quick)")
    ap.add_argument("--out", default=str(REPO / "bench-results" / "grpc.json"))
    ap.add_argument(
        "--base", default=None, help="COMMIT or FOLDER: add a daemon of that edged beside this one (tiny lanes)"
    )
    args = ap.parse_args(argv)
    rounds, per, frame_per = (5, 200, 10) if args.quick else (10, 500, 30)
    rounds = args.rounds or rounds
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="edged-grpc-") as tmp:
        result = run(Path(tmp), rounds, per, frame_per, args.base)
    result |= {"machine": machine(), "rounds": rounds, "elapsed_s": time.monotonic() - started}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(report(result))
    log(f"results in {args.out}; the run took {result['elapsed_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
