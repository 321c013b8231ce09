"""The step clock, put first on an arm's PYTHONPATH by bench_peers (see sitecustomize)."""
