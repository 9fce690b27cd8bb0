"""On-demand benchmarks (not part of ``make test``): ``python -m benchmarks.router_overhead``."""
