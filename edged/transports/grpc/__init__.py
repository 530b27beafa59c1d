"""KServe v2 over gRPC: Triton's ``inference.GRPCInferenceService`` (grpc_service.proto), served
by grpcio's asyncio server on the daemon's event loop (docs/architecture.md says why).

gRPC core's fork support is turned off before grpcio loads. Its pthread_atfork handlers run on
every fork() of the daemon, which uvloop makes in the event loop's thread to start each build
child (libuv's spawn), while grpcio's threads are serving: they wait on gRPC's own threads in the
parent and reset gRPC's state in the child. The daemon's children exec another program at once
and never use gRPC, so the handlers can only cost: a daemon was seen stuck before READY=1, deaf
to SIGTERM, beside a forked child that had not yet exec'd. Set in the environment, so an operator
can still choose otherwise.
"""

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
