"""The Open Inference Protocol over HTTP/1.1 (Unix socket and TCP): the listeners, connection
bounds, routing, the infer route, Triton's and OpenAI's extensions."""
