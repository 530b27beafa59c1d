"""The RPCs of GRPCInferenceService other than inference: health, metadata, configuration,
statistics, the repository, shared memory, log and trace settings. Each answers what its HTTP
route answers (the same service calls and documents, edged/serving/triton_docs.py)."""

from __future__ import annotations

import asyncio
from typing import Any

from google.protobuf.message import DecodeError

from edged.config import max_body_bytes
from edged.errors import BadRequestError, CudaSharedMemoryNotSupportedError, NotFoundError, PayloadTooLargeError
from edged.repository.load_request import PLAIN, LoadRequest, from_parameters
from edged.serving import triton_docs
from edged.serving.service import Service
from edged.serving.states import ModelState
from edged.transports.grpc.access import Access
from edged.transports.shm.regions import SharedMemoryRegistry
from edged.wire.kserve import to_message
from edged.wire.proto import grpc_service_pb2 as pb
from edged.wire.proto import model_config_pb2 as mc

Ctx = Any  # grpc.aio.ServicerContext (grpcio ships no type information)

_TRACE_OFF = {"trace_level": ["OFF"], "trace_rate": ["0"], "trace_count": ["0"], "log_frequency": ["0"]}


class Control:
    def __init__(self, service: Service, shm: SharedMemoryRegistry, access: Access) -> None:
        self.service, self.shm, self.access = service, shm, access
        self.max_body = max_body_bytes(service.registry.cfg)

    async def ServerLive(self, req: pb.ServerLiveRequest, ctx: Ctx) -> pb.ServerLiveResponse:
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, req: pb.ServerReadyRequest, ctx: Ctx) -> pb.ServerReadyResponse:
        return pb.ServerReadyResponse(ready=self.service.is_ready())

    async def ModelReady(self, req: pb.ModelReadyRequest, ctx: Ctx) -> pb.ModelReadyResponse:
        # Triton answers a model or version it does not serve as not ready, with an OK status:
        # its clients' is_model_ready() reads False rather than raising.
        try:
            rt = self.service.model(self.service.resolve(req.name, req.version))
        except NotFoundError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=rt.state == ModelState.READY and not self.service.stopping)

    async def ServerMetadata(self, req: pb.ServerMetadataRequest, ctx: Ctx) -> pb.ServerMetadataResponse:
        return pb.ServerMetadataResponse(**self.service.server_metadata())

    async def ModelMetadata(self, req: pb.ModelMetadataRequest, ctx: Ctx) -> pb.ModelMetadataResponse:
        doc = self.service.model_metadata(self.service.resolve(req.name, req.version))
        return pb.ModelMetadataResponse(**doc)

    async def ModelConfig(self, req: pb.ModelConfigRequest, ctx: Ctx) -> pb.ModelConfigResponse:
        doc = triton_docs.model_config(self.service, self.service.resolve(req.name, req.version))
        return pb.ModelConfigResponse(config=to_message(doc, mc.ModelConfig))

    async def ModelStatistics(self, req: pb.ModelStatisticsRequest, ctx: Ctx) -> pb.ModelStatisticsResponse:
        name = self.service.resolve(req.name, req.version) if req.name else None
        return to_message(triton_docs.statistics(self.service, name), pb.ModelStatisticsResponse)  # type: ignore[return-value]

    async def RepositoryIndex(self, req: pb.RepositoryIndexRequest, ctx: Ctx) -> pb.RepositoryIndexResponse:
        models = self.service.repository_index()
        if req.ready:
            models = [m for m in models if m["state"] == "READY"]
        return pb.RepositoryIndexResponse(models=[pb.RepositoryIndexResponse.ModelIndex(**m) for m in models])

    async def RepositoryModelLoad(self, data: bytes, ctx: Ctx) -> pb.RepositoryModelLoadResponse:
        """The request comes as bytes (server.py): a load may bring a model's files, so it is
        parsed only once its caller may load, and off the loop."""
        await self.access.admin(self.access.check(ctx), "load models")
        if len(data) > self.max_body:
            raise PayloadTooLargeError(
                f"the load request of {len(data)} bytes exceeds the limit of {self.max_body} (server.max_body)"
            )
        req, request = await asyncio.to_thread(load_request, data)
        await self.service.load(req.model_name, request)
        return pb.RepositoryModelLoadResponse()

    async def RepositoryModelUnload(
        self, req: pb.RepositoryModelUnloadRequest, ctx: Ctx
    ) -> pb.RepositoryModelUnloadResponse:
        await self.access.admin(self.access.check(ctx), "unload models")
        await self.service.unload(req.model_name)
        return pb.RepositoryModelUnloadResponse()

    # --- system shared memory: tied to the Unix peer, none over TCP (as on HTTP) ---

    async def SystemSharedMemoryStatus(
        self, req: pb.SystemSharedMemoryStatusRequest, ctx: Ctx
    ) -> pb.SystemSharedMemoryStatusResponse:
        peer = self.access.check(ctx)
        if peer is None:
            if req.name:  # as HTTP answers for a region nobody registered
                self.shm.status_for(None, req.name)
            return pb.SystemSharedMemoryStatusResponse()
        regions = self.shm.status_for(peer, req.name or None)
        out = pb.SystemSharedMemoryStatusResponse()
        for r in regions:
            status = out.regions[str(r["name"])]
            status.name, status.key = str(r["name"]), str(r["key"])
            status.offset, status.byte_size = int(r["offset"]), int(r["byte_size"])  # type: ignore[call-overload]
        return out

    async def SystemSharedMemoryRegister(
        self, req: pb.SystemSharedMemoryRegisterRequest, ctx: Ctx
    ) -> pb.SystemSharedMemoryRegisterResponse:
        peer = self.access.check(ctx)
        self.shm.register(peer, req.name, req.key, req.offset, req.byte_size)
        return pb.SystemSharedMemoryRegisterResponse()

    async def SystemSharedMemoryUnregister(
        self, req: pb.SystemSharedMemoryUnregisterRequest, ctx: Ctx
    ) -> pb.SystemSharedMemoryUnregisterResponse:
        peer = self.access.check(ctx)
        if peer is not None:
            self.shm.unregister_for(peer, req.name or None)
        return pb.SystemSharedMemoryUnregisterResponse()

    # --- CUDA shared memory: answered as HTTP answers it (triton.cuda_shared_memory) ---

    async def CudaSharedMemoryStatus(
        self, req: pb.CudaSharedMemoryStatusRequest, ctx: Ctx
    ) -> pb.CudaSharedMemoryStatusResponse:
        return pb.CudaSharedMemoryStatusResponse()

    async def CudaSharedMemoryRegister(
        self, req: pb.CudaSharedMemoryRegisterRequest, ctx: Ctx
    ) -> pb.CudaSharedMemoryRegisterResponse:
        raise CudaSharedMemoryNotSupportedError(triton_docs.CUDA_SHM_NOT_SUPPORTED)

    async def CudaSharedMemoryUnregister(
        self, req: pb.CudaSharedMemoryUnregisterRequest, ctx: Ctx
    ) -> pb.CudaSharedMemoryUnregisterResponse:
        return pb.CudaSharedMemoryUnregisterResponse()

    # --- log and trace settings ---

    async def LogSettings(self, req: pb.LogSettingsRequest, ctx: Ctx) -> pb.LogSettingsResponse:
        if req.settings:
            await self.access.admin(self.access.check(ctx), "change the log settings")
            doc = {k: parameter_value_of(v) for k, v in req.settings.items()}
            settings = triton_docs.update_log_settings(doc, "gRPC LogSettings")
        else:
            settings = triton_docs.log_settings()
        out = pb.LogSettingsResponse()
        for key, value in settings.items():
            field = (
                "bool_param"
                if isinstance(value, bool)
                else "uint32_param"
                if isinstance(value, int)
                else "string_param"
            )
            setattr(out.settings[key], field, value)
        return out

    async def TraceSetting(self, req: pb.TraceSettingRequest, ctx: Ctx) -> pb.TraceSettingResponse:
        """edged does not trace requests: the settings say so, and asking for a trace is refused."""
        for key, value in req.settings.items():
            values = list(value.value)
            if key not in _TRACE_OFF or (values and values != _TRACE_OFF[key] and key == "trace_level"):
                raise BadRequestError(f"edged does not trace requests: trace setting '{key}' cannot be set")
        out = pb.TraceSettingResponse()
        for key, values in _TRACE_OFF.items():
            out.settings[key].value.extend(values)
        return out


def parameter_value_of(v: pb.LogSettingsRequest.SettingValue) -> Any:
    which = v.WhichOneof("parameter_choice")
    return None if which is None else getattr(v, which)


def load_request(data: bytes) -> tuple[pb.RepositoryModelLoadRequest, LoadRequest]:
    """A load's message and its parameters, each ModelRepositoryParameter's value as it is set."""
    try:
        req = pb.RepositoryModelLoadRequest.FromString(data)
    except DecodeError as e:
        raise BadRequestError(f"the message is not a RepositoryModelLoadRequest: {e}") from None
    values: dict[str, object] = {}
    for key, param in req.parameters.items():
        which = param.WhichOneof("parameter_choice")
        values[key] = getattr(param, which) if which else None
    return req, from_parameters(req.model_name, values) if values else PLAIN
