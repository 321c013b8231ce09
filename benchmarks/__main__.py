"""``python -m benchmarks NAME [--quick] [--out PATH] [--opt KEY=JSON]``: one benchmark alone
(``python -m benchmarks.run_all`` runs the suite, each benchmark through this entry point)."""
from benchmarks.common import bench_main

raise SystemExit(bench_main())
