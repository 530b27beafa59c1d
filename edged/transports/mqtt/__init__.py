"""MQTT: one paho connection driven by the event loop, requests and their acknowledgements,
replies, telemetry, Home Assistant discovery, language-model streams."""
