"""``sweeps rerun --seeds``: the spread over seeds is the sample standard deviation, and one seed
has none (not a spread of 0)."""
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
