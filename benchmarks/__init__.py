"""insitu-gs benchmarks: ``python -m benchmarks CASE [options]`` (see benchmarks/README.md)."""
