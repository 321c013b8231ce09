"""The study-spec loader: shipped studies validate, every malformed spec is refused with a
message that names the field, the value and the fix, and loading creates nothing."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from core.config import TrainConfig
from sweeps.errors import SpecError
from sweeps.spec.load import load_spec, parse_yaml_text, spec_from_dict
from sweeps.spec.model import StudySpec, dump_spec_dict
from sweeps.spec.search_space import signature
from sweeps.store_urls import redact_url

STUDIES = Path(__file__).resolve().parents[2] / "studies"

GOOD = """\
name: t
task: {name: digits, model: cnn, args: {val_fraction: 0.2}}
train: {epochs: 3, optimizer: sgd, num_workers: 0}
search:
  lr: {type: float, low: 1.0e-3, high: 1.0, log: true}
  batch_size: {type: categorical, choices: [16, 32]}
"""


def write(folder: Path, text: str, name: str = "spec.yaml") -> Path:
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def problems_of(folder: Path, text: str) -> list[str]:
    with pytest.raises(SpecError) as info:
        load_spec(write(folder, text))
    assert info.value.exit_code == 2
    return info.value.problems


# ------------------------------------------------------------------------------- shipped
def test_every_shipped_study_validates():
    files = sorted(STUDIES.glob("*.yaml"))
    assert len(files) >= 4
    for path in files:
        spec = load_spec(path)
        assert spec.path == path
        header = path.read_text().splitlines()[:6]
        assert any(line.startswith("# Run: sweeps run studies/") for line in header), path


def test_lr_bs_study_keeps_the_agreed_storage_and_tracking():
    spec = load_spec(STUDIES / "lr_bs.yaml")
    assert spec.storage_url() == "runs/lr_bs.journal" and not spec.is_rdb_storage()
    assert spec.tracking.uri == "sqlite:///runs/mlflow.db"
    assert spec.train["num_workers"] == 0 and spec.train["scheduler"] == "onecycle"


# ----------------------------------------------------------------- malformed, one at a time
SEARCH_LR = "search:\n  lr: {type: float, low: 1.0e-3, high: 1.0, log: true}\n"
BASE = "name: t\ntask: {name: digits, model: cnn}\n"
CASES = {
    "unknown key, did-you-mean": (BASE + "objective: {metrc: val_acc}\n",
                                  ["objective.metrc: unknown key", "did you mean 'metric'", "allowed here"]),
    "misspelt section": (BASE + "serach:\n  lr: {type: float, low: 0.001, high: 1.0}\n",
                         ["serach: unknown section", "did you mean 'search'"]),
    "misspelt param key": (BASE + "search:\n  lr: {type: float, lo: 0.001, high: 1.0}\n",
                           ["search.lr.lo: unknown key", "did you mean 'low'"]),
    "log with low <= 0": (BASE + "search:\n  lr: {type: float, low: 0.0, high: 1.0, log: true}\n",
                          ["search.lr.low: 0.0 with log: true", "needs low > 0", "log: false"]),
    "step and log": (BASE + "search:\n  lr: {type: float, low: 0.1, high: 1.0, log: true, step: 0.1}\n",
                     ["search.lr: step 0.1 and log: true together", "remove step"]),
    "low above high": (BASE + "search:\n  weight_decay: {type: float, low: 1.0e-3, high: 1.0e-4}\n",
                       ["search.weight_decay.low: 0.001 is above high 0.0001", "use low <= high"]),
    "empty choices": (BASE + "search:\n  batch_size: {type: categorical, choices: []}\n",
                      ["search.batch_size.choices: [] is empty", "at least one choice"]),
    "bad param type": (BASE + "search:\n  lr: {type: flaot, low: 0.1, high: 1.0}\n",
                       ["search.lr.type: 'flaot' is not a parameter type", "did you mean 'float'"]),
    "in train and search": (BASE + "train: {lr: 0.1}\n" + SEARCH_LR,
                            ["search.lr: also fixed in train (train.lr = 0.1)", "remove it from one"]),
    "unknown search field": (BASE + "search:\n  lrr: {type: float, low: 0.001, high: 1.0}\n",
                             ["search.lrr: not a train-config field or task.<arg>", "did you mean 'lr'"]),
    "bad task arg": (BASE + "search:\n  task.widht: {type: int, low: 16, high: 64}\n",
                     ["search.task.widht: task 'digits' has no argument 'widht'", "did you mean 'task.width'"]),
    "bad task.args key": (BASE.replace("cnn}", "cnn, args: {val_frac: 0.2}}"),
                          ["task.args.val_frac: task 'digits' has no argument", "did you mean 'val_fraction'"]),
    "task value refused by the task": (BASE.replace("cnn}", "cnn, args: {val_fraction: 5}}"),
                                       ["task.args.val_fraction: 5 must be in (0, 1)"]),
    "model not offered": (BASE.replace("model: cnn", "model: cnnn"),
                          ["task.model: 'cnnn' is not offered by task 'digits'", "cnn, mlp"]),
    "unimportable target": ("name: t\ntask: {target: 'no_such_pkg_xyz.tasks:make'}\n",
                            ["task.target: cannot import module 'no_such_pkg_xyz.tasks'"]),
    "name and target": ("name: t\ntask: {name: digits, target: 'a.b:c'}\n",
                        ["task: give exactly one of name", "or target"]),
    "metric not reported": (BASE + "objective: {metric: val_accuracy}\n",
                            ["objective.metric: task 'digits' does not report 'val_accuracy'",
                             "did you mean 'val_acc'"]),
    "direction contradicts the metric's": (BASE + "objective: {metric: val_acc, direction: minimize}\n",
                                           ["objective.direction: minimize contradicts 'val_acc' of task 'digits'",
                                            "better when higher", "use direction: maximize"]),
    "monitor not reported": (BASE + "train: {monitor: val_rmse}\nobjective: {metric: val_acc}\n",
                             ["train.monitor: task 'digits' does not report 'val_rmse'"]),
    "loss maximized by default": (BASE + "objective: {metric: val_loss}\n",
                                  ["objective.direction: not set", "maximize val_loss", "direction: minimize"]),
    "pbt on optuna": (BASE + SEARCH_LR + "pruner: {name: pbt}\n",
                      ["pruner.name: 'pbt' does not run on backend optuna", "or backend: ray"]),
    "percentile on ray": (BASE + SEARCH_LR + "backend: ray\npruner: {name: percentile}\n",
                          ["pruner.name: 'percentile' does not run on backend ray", "or backend: optuna"]),
    "cmaes on ray": (BASE + SEARCH_LR + "backend: ray\nsampler: {name: cmaes}\n",
                     ["sampler.name: 'cmaes' does not run on backend ray", "random, grid, tpe"]),
    "pbt with tpe": (BASE + SEARCH_LR + "backend: ray\npruner: {name: pbt}\n",
                     ["sampler.name: 'tpe' cannot be combined with pruner pbt", "use random or grid"]),
    "checkpoints every few epochs on ray": (BASE + SEARCH_LR + "backend: ray\ntrain: {checkpoint_every: 5}\n",
                                            ["train.checkpoint_every: 5 is not supported on backend ray",
                                             "use backend: optuna"]),
    "checkpoints every few epochs searched on ray": (
        BASE + "search:\n  checkpoint_every: {type: int, low: 1, high: 5}\nbackend: ray\n",
        ["search.checkpoint_every: searched on backend ray, which does not support it"]),
    "checkpoints every 0 epochs": (BASE + SEARCH_LR + "train: {checkpoint_every: 0}\n",
                                   ["checkpoint_every", "use 1 (every epoch) or more epochs"]),
    "pbt without lr or momentum": (BASE + "search:\n  weight_decay: {type: float, low: 0.0, high: 0.1}\n"
                                   "backend: ray\nsampler: {name: random}\npruner: {name: pbt}\n",
                                   ["pruner.name: pbt perturbs lr or momentum", "add lr or momentum to search"]),
    "cmaes with categorical": (BASE + "search:\n  batch_size: {type: categorical, choices: [16, 32]}\n"
                               "sampler: {name: cmaes}\n",
                               ["sampler.name: 'cmaes' cannot sample categorical parameters (batch_size)"]),
    "grid with continuous float": (BASE + SEARCH_LR + "sampler: {name: grid}\n",
                                   ["search.lr: a float without step has no finite grid", "add step"]),
    "option the pruner ignores": (BASE + "pruner: {name: median, percentile: 40}\n",
                                  ["pruner.percentile: 40.0 is set but pruner median", "applies to percentile"]),
    "bad name": ("name: a/b\ntask: {name: digits}\n", ["name: 'a/b' is not allowed", "A-Z a-z 0-9 _ . -"]),
    "name dotdot": ("name: '..'\ntask: {name: digits}\n", ["name: '..' is not allowed"]),
    "missing name": ("task: {name: digits}\n", ["name: required"]),
    "storage dotdot": (BASE + "storage: runs/../../etc/x.journal\n",
                       ["storage: 'runs/../../etc/x.journal' is refused", "'..' component"]),
    "storage encoded dotdot": (BASE + "storage: runs/%2e%2e/x.journal\n", ["storage:", "percent-encoded"]),
    "storage backslash": (BASE + "storage: 'runs\\x.journal'\n", ["storage:", "backslash"]),
    "storage NUL": (BASE + 'storage: "runs/x\\0.journal"\n', ["storage:", "NUL byte"]),
    "storage postgres://": (BASE + "storage: postgres://u@h/db\n", ["storage:", "postgresql://"]),
    "train wrong type": (BASE + "train: {epochs: ten}\n", ["train.epochs: expected an integer, got 'ten'"]),
    "train unknown field": (BASE + "train: {epoch: 3}\n", ["train.epoch: unknown train-config field", "'epochs'"]),
    "optimizer: no": (BASE + "train: {optimizer: no}\n", ["train.optimizer: 'no' is not one of sgd, adam, adamw"]),
    "export_onnx: yes": (BASE + "train: {export_onnx: yes}\n",
                         ["train.export_onnx: expected true or false, got 'yes'", "only true and false"]),
    "float param on int field": (BASE + "search:\n  batch_size: {type: float, low: 16, high: 64}\n",
                                 ["search.batch_size: type float draws non-integers", "use type: int"]),
    "search value invalid for field": (BASE + "search:\n  weight_decay: {type: float, low: -1.0, high: 0.1}\n",
                                       ["search.weight_decay.low: -1.0 is not valid for train.weight_decay"]),
    "int step does not divide": (BASE + "search:\n  task.width: {type: int, low: 16, high: 60, step: 16}\n",
                                 ["search.task.width.step: 16 does not divide high - low = 44"]),
    "ray step grid": (BASE + "backend: ray\nsearch:\n  task.width: {type: int, low: 10, high: 42, step: 16}\n",
                      ["search.task.width.low: 10 is not a multiple of step 16", "backend ray"]),
    "duration": (BASE + "budget: {timeout: '1:30'}\n", ["budget.timeout: '1:30' is not a duration", "1h30m"]),
    "n_trials 0": (BASE + "budget: {n_trials: 0}\n", ["budget.n_trials: 0 is out of range", ">= 1"]),
    "gpu share": (BASE + "resources: {gpus_per_trial: 0.3}\n",
                  ["resources.gpus_per_trial: 0.3 is not allowed", "0.5, 0.25"]),
    "devices": (BASE + "resources: {devices: [0, -1]}\n", ["resources.devices: [0, -1] is not allowed"]),
    "ray_address on optuna": (BASE + "resources: {ray_address: auto}\n",
                              ["resources.ray_address: 'auto' is set but backend is optuna"]),
    "lr finder without lr": (BASE + "lr_finder: {enabled: true}\n",
                             ["lr_finder.narrow_search: true but lr is not in search"]),
    "bool as string field": (BASE.replace("name: t", "name: true"), ["name: True is not allowed"]),
    "startup trials on random": (BASE + "sampler: {name: random, n_startup_trials: 4}\n",
                                 ["sampler.n_startup_trials: 4 is set but sampler random does not use it"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_malformed_spec_is_refused_with_its_message(tmp_path, case):
    text, expected = CASES[case]
    problems = problems_of(tmp_path, text)
    assert any(all(part in p for part in expected) for p in problems), "\n".join(problems)


def test_problem_names_the_line(tmp_path):
    problems = problems_of(tmp_path, BASE + "search:\n  lr: {type: float, low: 0.0, high: 1.0, log: true}\n")
    assert problems == ["search.lr.low: 0.0 with log: true; a log scale needs low > 0 (e.g. 1.0e-6), "
                        "or set log: false (line 4)"]


def test_several_problems_are_reported_together(tmp_path):
    text = """\
    name: a/b
    serach: {}
    task: {name: digits, model: cnnn}
    train: {epochs: ten, lr: 0.1}
    search:
      lr: {type: float, low: 0.0, high: 1.0, log: true}
      wd: {type: float, low: 0.0, high: 1.0}
      momentum: {type: flaot, low: 0.1, high: 0.9}
    objective: {metric: val_accuracy}
    pruner: {name: pbt}
    storage: ../x.journal
    """
    problems = problems_of(tmp_path, text)
    for start in ("name:", "serach:", "task.model:", "train.epochs:", "search.lr:", "search.lr.low:",
                  "search.wd:", "search.momentum.type:", "objective.metric:", "pruner.name:", "storage:"):
        assert any(p.startswith(start) for p in problems), (start, problems)
    assert len(problems) >= 11


# ---------------------------------------------------------------------------- YAML level
def test_yaml_syntax_error_has_line_and_column(tmp_path):
    problems = problems_of(tmp_path, "name: t\ntask: {name: digits\nsearch: {}\n")
    assert len(problems) == 1 and "YAML syntax error" in problems[0]
    assert problems[0].startswith("line 3, column ")


def test_duplicate_key_is_an_error(tmp_path):
    problems = problems_of(tmp_path, "name: t\ntask: {name: digits}\nname: u\n")
    assert problems == ["line 3, column 1: duplicate key 'name' (first at line 1); "
                        "each key may appear once in a mapping"]


def test_python_tag_is_refused_and_never_executed(tmp_path):
    marker = tmp_path / "pwned"
    problems = problems_of(tmp_path, f"name: !!python/object/apply:os.system ['touch {marker}']\n")
    assert "the tag '!!python/object/apply:os.system' is refused" in problems[0]
    assert problems[0].startswith("line 1, column 7")
    assert not marker.exists()


@pytest.mark.parametrize("text,expected", [
    ("", "the file is empty"),
    ("- a\n- b\n", "the top level is a list, not a mapping"),
    ("a: &x [*x]\n", "expands to more than"),
    ("a: !!binary aGk=\n", "the tag '!!binary' is refused"),
])
def test_yaml_shape_problems(tmp_path, text, expected):
    assert expected in problems_of(tmp_path, text)[0]


def test_missing_file(tmp_path):
    with pytest.raises(SpecError, match="no such file"):
        load_spec(tmp_path / "nope.yaml")


def test_yaml_1_2_scalars(tmp_path):
    data, _ = parse_yaml_text("a: 1e-3\nb: 1.0e3\nc: no\nd: on\ne: true\nf: 1:30\ng: 010\nh: 2024-01-01\n")
    assert data == {"a": 0.001, "b": 1000.0, "c": "no", "d": "on", "e": True, "f": "1:30", "g": "010",
                    "h": "2024-01-01"}
    assert isinstance(data["a"], float)
    spec = load_spec(write(tmp_path, BASE + "search:\n  lr: {type: float, low: 1e-3, high: 1e-1, log: true}\n"))
    assert spec.search["lr"].low == 0.001


# ------------------------------------------------------------------------- nothing created
def test_loading_creates_no_files(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative defaults (runs/...) would land here
    good = write(tmp_path, GOOD, "good.yaml")
    bad = write(tmp_path, GOOD + "pruner: {name: pbt}\nstorage: ../x\n", "bad.yaml")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    load_spec(good)
    with pytest.raises(SpecError):
        load_spec(bad)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


# -------------------------------------------------------------------------------- helpers
def test_defaults_and_resolved_values(tmp_path, monkeypatch):
    spec = load_spec(write(tmp_path, GOOD))
    assert spec.storage_url() == "runs/t.journal" and spec.journal_path() == Path("runs/t.journal")
    assert spec.experiment_name() == "t"
    assert (spec.backend, spec.sampler.name, spec.sampler.seed, spec.pruner.name) == ("optuna", "tpe", 0, "median")
    assert spec.pruner.options() == {"warmup_epochs": 1}
    assert spec.budget.n_trials == 10 and spec.timeout_seconds() is None
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert spec.tracking_uri() == "sqlite:///runs/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert spec.tracking_uri() == "http://mlflow:5000"


def test_rdb_storage_and_durations(tmp_path):
    spec = load_spec(write(tmp_path, GOOD + "storage: postgresql://u:secret@db/optuna\n"
                                             "budget: {timeout: 1h30m, trial_timeout: 90}\n"))
    assert spec.is_rdb_storage() and spec.journal_path() is None
    assert spec.storage_url() == "postgresql://u:secret@db/optuna"
    assert spec.timeout_seconds() == 5400.0 and spec.trial_timeout_seconds() == 90.0
    dumped = dump_spec_dict(spec)
    assert "secret" not in json.dumps(dumped) and dumped["resolved"]["storage"] == "postgresql://u:***@db/optuna"
    assert redact_url("sqlite:///runs/x.db") == "sqlite:///runs/x.db"


def test_trial_config_and_task_args(tmp_path):
    spec = load_spec(write(tmp_path, GOOD.replace("  batch_size", "  task.width: {type: int, low: 16, high: 32, "
                                                                "step: 16}\n  batch_size")))
    params = {"lr": 0.05, "batch_size": 32, "task.width": 32}
    cfg = spec.resolved_train_config(params)
    assert isinstance(cfg, TrainConfig) and (cfg.lr, cfg.batch_size, cfg.epochs, cfg.num_workers) == (0.05, 32, 3, 0)
    assert spec.task_args(params) == {"val_fraction": 0.2, "width": 32}
    assert spec.make_task(params).width == 32


def test_spec_hash_and_search_signature(tmp_path):
    a = load_spec(write(tmp_path, GOOD, "a.yaml"))
    b = load_spec(write(tmp_path, "description: other words\n" + GOOD, "b.yaml"))
    c = load_spec(write(tmp_path, GOOD.replace("high: 1.0", "high: 0.5"), "c.yaml"))
    assert a.spec_hash() == load_spec(tmp_path / "a.yaml").spec_hash() == b.spec_hash()
    assert len(a.spec_hash()) == 64 and c.spec_hash() != a.spec_hash()
    assert signature(a.search) == signature(b.search) != signature(c.search)
    assert list(signature(a.search)) == ["batch_size", "lr"]  # canonical: sorted keys


def test_dump_is_json_and_round_trips(tmp_path):
    spec = load_spec(write(tmp_path, GOOD + "pruner: {name: asha, min_resource: 2}\n"))
    dumped = json.loads(json.dumps(dump_spec_dict(spec, redact=False)))
    dumped.pop("resolved")
    again = spec_from_dict(dumped)
    assert isinstance(again, StudySpec) and again.spec_hash() == spec.spec_hash() and again.path is None


def test_user_task_target_is_checked_without_being_built(tmp_path, monkeypatch):
    (tmp_path / "mytasks_for_spec_test.py").write_text(textwrap.dedent("""\
        from core.tasks.base import Task, task

        class Mine(Task):
            name = "mine"
            models = ("tiny",)

        @task
        def make(model: str = "tiny", depth: int = 2) -> Mine:
            raise AssertionError("the loader must not build a user's task")
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    ok = "name: t\ntask: {target: 'mytasks_for_spec_test:make', model: tiny}\n" \
         "search:\n  task.depth: {type: int, low: 1, high: 4}\n"
    assert load_spec(write(tmp_path, ok)).task.target == "mytasks_for_spec_test:make"
    problems = problems_of(tmp_path, ok.replace("model: tiny", "model: huge").replace("type: int", "type: float"))
    assert any("task.model: 'huge' is not offered" in p for p in problems)
    assert any("search.task.depth: type float draws non-integers" in p for p in problems)
    assert not (tmp_path / "__pycache__").exists()  # importing the target wrote no bytecode


def test_empty_sections_mean_defaults(tmp_path):
    spec = load_spec(write(tmp_path, "name: t\ntask: {name: digits}\ntrain:\nsearch:\npruner:\n"))
    assert spec.train == {} and spec.search == {} and spec.pruner.name == "median"


@pytest.mark.parametrize("value,seconds", [(90, 90.0), ("90", 90.0), ("90s", 90.0), ("30m", 1800.0),
                                           ("2h", 7200.0), ("1h30m", 5400.0), ("1.5h", 5400.0)])
def test_durations(value, seconds):
    from sweeps.durations import parse_duration

    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["1:30", "1h30", "", "soon", 0, -5, True])
def test_bad_durations(value):
    from sweeps.durations import parse_duration

    with pytest.raises(ValueError, match="duration"):
        parse_duration(value)


@pytest.mark.parametrize("task", ["task: {name: digits, model: cnn, args: {val_fraction: 0.2}}",
                                  "task: {name: synthetic, model: resnet18, args: {shape: [3, 32, 32]}}",
                                  "task: {name: cifar10, model: resnet18, args: {root: data}}",
                                  "task: {name: imagefolder, model: resnet18, args: {root: data}}"])
def test_validating_a_built_in_task_and_opening_the_optuna_backend_do_not_import_torch(tmp_path, task):
    """`sweeps run` validates its spec and runs the study without torch (2 to 3 s of imports on
    its critical path before the workers' go): only workers train. A bad value is still caught."""
    import subprocess
    import sys

    spec = write(tmp_path, GOOD.replace("task: {name: digits, model: cnn, args: {val_fraction: 0.2}}", task))
    bad = write(tmp_path, GOOD.replace("val_fraction: 0.2", "val_fraction: 1.5"), name="bad.yaml")
    code = textwrap.dedent(f"""
        import sys
        from sweeps.errors import SpecError
        from sweeps.spec.load import load_spec
        import sweeps.backends.optuna_backend, sweeps.live, sweeps.parent_run
        load_spec({str(spec)!r})
        try:
            load_spec({str(bad)!r})
        except SpecError as exc:
            print("refused:", exc.problems)
        print("torch imported:", "torch" in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr
    assert "refused:" in out.stdout and "val_fraction" in out.stdout
    assert "torch imported: False" in out.stdout, out.stdout


def test_n_startup_trials_reaches_the_tpe_and_gp_samplers(tmp_path):
    from sweeps.backends.optuna_sampler import make_sampler

    for name in ("tpe", "gp"):
        spec = load_spec(write(tmp_path, GOOD + f"sampler: {{name: {name}, seed: 0, n_startup_trials: 4}}\n"))
        assert make_sampler(spec).sampler_for(0)._n_startup_trials == 4
    spec = load_spec(write(tmp_path, GOOD + "sampler: {name: tpe, seed: 0}\n"))
    assert make_sampler(spec).sampler_for(0)._n_startup_trials == 10  # Optuna's default when unset
