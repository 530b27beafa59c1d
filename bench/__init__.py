"""The project's benchmarks, one subcommand each (bench/__main__.py lists them): edged against its
in-process floor and the servers users would pick instead, always interleaved in one run.
Entry point: ``scripts/bench.sh SUBCOMMAND`` (``python -m bench SUBCOMMAND``)."""
