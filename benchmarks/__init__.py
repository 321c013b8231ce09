"""Side-by-side measurements of the sweeps stack; ``python -m benchmarks.run_all`` (``make bench``).

Every benchmark is a module ``benchmarks/bench_<name>.py`` with a ``run(ctx)`` function that
returns a result dict (schema in :mod:`benchmarks.common`); ``run_all`` runs each in its own
process and writes ``benchmarks/results/<name>.json`` and ``benchmarks/RESULTS.md``.
A benchmark reports; it never fails on speed.
"""
