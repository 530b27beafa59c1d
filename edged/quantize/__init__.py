"""The INT8 pipeline: calibration, Q/DQ models, the accuracy gate, the mixed-precision
search, and the build child process that runs them."""
