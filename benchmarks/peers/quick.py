"""A few arms of the peer benchmark on one study, in the order given, printed as they finish:
a quick look between full runs (``benchmarks.run_all --only peers`` is the measurement).

    .venv/bin/python -m benchmarks.peers.quick lr_bs_nopruning "sweeps run" "script n_jobs=2" "sweeps run"

Studies: lr_bs, lr_bs_nopruning, big_cnn; arms: "sweeps run" and the keys of bench_peers.PEERS.
"sweeps run@DIR" runs ``sweeps run`` from the source tree DIR (e.g. ``git archive main | tar -x -C
DIR``), to compare two commits side by side, arms alternated by the order given."""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from benchmarks import bench_peers


class _FullSize:
    """What ``bench_peers.studies`` reads of a benchmark context: full sizes, one study."""

    def __init__(self, study: str) -> None:
        self.options = {"studies": [study]}

    def pick(self, quick, full):
        return full


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__)
        return 2
    spec = bench_peers.studies(_FullSize(argv[0]))[argv[0]]
    root = Path(tempfile.mkdtemp(prefix="peers-quick-"))
    for i, arm in enumerate(argv[1:]):
        name, _, source = arm.partition("@")
        res = bench_peers.run_arm(name, spec, root / str(i), 900, Path(source) if source else None)
        error = f"; {res['error'][:300]}" if "error" in res else ""
        epochs = bench_peers.epochs_trained(res)
        first = "" if res.get("first_trial_s") is None else (
            f", first trial at {res['first_trial_s']:.1f} s, first step at {res['first_step_s']:.1f} s, "
            f"first epoch done at {res['first_epoch_s']:.1f} s")
        print(f"{arm}: {res['wall_s']:.1f} s, {res['trials']} trials, {epochs} epochs{first}{error}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
