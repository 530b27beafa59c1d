"""KServe v2 over gRPC: Triton's ``inference.GRPCInferenceService`` (grpc_service.proto), served
by grpcio's asyncio server on the daemon's event loop (docs/architecture.md says why)."""
