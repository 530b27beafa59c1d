"""Building cache entries: the child process that calibrates, quantizes, builds and gates."""
