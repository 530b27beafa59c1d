"""Language models: what a generation request is (prompt, sampling, stops) and how its
tokens stream back; the GGUF header. The llama.cpp backend runs the jobs."""
