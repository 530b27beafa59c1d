"""Serving the loaded models: the registry and admission, the scheduler's queues and worker
threads, the service both transports call, swaps, background builds, statistics and metrics."""
