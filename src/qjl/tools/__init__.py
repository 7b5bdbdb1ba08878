"""The ``qjl`` command line and what it runs: evaluation, benchmarks, statistics, reports, model loading."""
