"""Issue 7's benchmark harness: edged against PyTriton, a hand-written FastAPI server and the
in-process floor, on the same ONNX models, in one interleaved run. Entry point: scripts/bench.sh."""
