"""Transports: the Unix socket (HTTP, Open Inference Protocol) and MQTT. They call the service and
know nothing of backends."""
