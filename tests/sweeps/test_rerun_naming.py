"""``sweeps rerun``: the spread over seeds is the sample standard deviation, and one seed
has none (not a spread of 0); each rerun has a name of its own."""
from __future__ import annotations

import math
import statistics

from sweeps.rerun import seed_statistics


def test_one_seed_has_a_mean_and_no_spread():
    mean, std = seed_statistics([0.95])
    assert mean == 0.95 and math.isnan(std)


def test_several_seeds_give_the_sample_standard_deviation_of_the_finite_values():
    mean, std = seed_statistics([0.9, math.nan, 0.96, 0.93])
    assert mean == statistics.fmean([0.9, 0.96, 0.93]) and std == statistics.stdev([0.9, 0.96, 0.93])


def test_each_rerun_of_a_trial_gets_its_own_name_with_its_seed_and_threads():
    from types import SimpleNamespace

    from sweeps.rerun import _rerun_name

    def run(name: str) -> SimpleNamespace:
        return SimpleNamespace(info=SimpleNamespace(run_name=name, run_id="a" * 32, experiment_id="1"))

    earlier: list[SimpleNamespace] = []
    reader = SimpleNamespace(find_runs=lambda experiment_id, tags: earlier)
    original = run("trial-3")
    assert _rerun_name(reader, original, 0, 1) == "rerun-trial-3-seed0-threads1"
    earlier.append(run("rerun-trial-3-seed0-threads1"))
    assert _rerun_name(reader, original, 0, 1) == "rerun-trial-3-seed0-threads1-2"  # the same again: told apart
    assert _rerun_name(reader, original, 0, 4) == "rerun-trial-3-seed0-threads4"
    assert _rerun_name(reader, original, 1, None) == "rerun-trial-3-seed1"  # on a GPU: no thread count
