"""The Open Inference Protocol's wire format: infer bodies decoded from untrusted bytes,
tensors checked before they are allocated, the rules a request must meet, answers encoded."""
