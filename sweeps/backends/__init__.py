"""Study backends: Optuna (default) and Ray Tune, behind one small interface
(:class:`sweeps.backends.base.Backend`); :func:`sweeps.backends.by_name.get_backend` picks the one a
spec names."""
