"""The peers of ``benchmarks/bench_peers.py``: the study ``sweeps run`` runs, written the way a
competent user would write it with plain Optuna + MLflow, with optuna-integration's
``MLflowCallback``, and with Ray Tune + ``setup_mlflow``. Each is a script run in its own process:

    python -m benchmarks.peers.optuna_mlflow_script STUDY.json --n-jobs 2

``STUDY.json`` is what ``bench_peers`` derives from the sweeps spec (:func:`digits_cnn.study_config`).
"""
