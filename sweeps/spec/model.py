"""The study spec: one YAML file = one study (the format: STUDY_SPEC.md in the design docs).

:func:`sweeps.spec.load.load_spec` reads a file, checks every rule and returns a :class:`StudySpec`, or
raises :class:`sweeps.errors.SpecError` listing *every* problem at once, each naming the
field path, the value, what is allowed and (for a misspelt key) what was probably meant.
Loading creates no files and touches no storage: the CLI calls it before anything else.

Types, defaults and single-field rules live in the section models below; the rules
that span several fields (task arguments, train vs search, backend vs sampler/pruner)
and the translation of pydantic's errors into those messages live in
:mod:`sweeps.spec.checks` and :mod:`sweeps.spec.messages`; the search-parameter rules in
:mod:`sweeps.spec.search_space`.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from core.config import SuggestRule, TrainConfig, apply_overrides
from core.tasks.base import make_task
from sweeps.durations import parse_duration
from sweeps.errors import UnsafeNameError
from sweeps.safe_names import safe_component
from sweeps.spec import search_space as ss
from sweeps.spec.objectives import Bound, DeploySection, ObjectiveSection, is_deploy_metric, settle_objectives
from sweeps.spec.search_space import SearchParam
from sweeps.store_urls import RDB_DIALECTS, redact_url

if TYPE_CHECKING:
    from core.tasks.base import Task

NAME_RE = re.compile(r"[A-Za-z0-9_.-]+")  # always fullmatch: "$" would let "tiny\n" through
NAME_MAX = 100
DEFAULT_TRACKING_URI = "sqlite:///runs/mlflow.db"  # relative to the working directory, like storage
SAMPLERS = ("tpe", "random", "grid", "cmaes", "gp", "qmc")
BACKEND_SAMPLERS = {"optuna": SAMPLERS, "ray": ("random", "grid", "tpe")}
BACKEND_PRUNERS = {"optuna": ("none", "median", "percentile", "asha", "hyperband"),
                   "ray": ("none", "median", "asha", "hyperband", "pbt")}
PACK_AUTO = 16  # resources.pack: auto (32 MLPs gained 4.5x over one at a time, 16 gained 3.1x: issue 41)
_SET_ONLY = ("objectives", "constraints", "deploy")  # in spec_hash only when not at their defaults
_URL_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
_ENCODED_RE = re.compile(r"%(?:25)*(?:2e|2f|5c)", re.I)  # %2e = '.', %2f = '/', %5c = '\', also double-encoded


def _safe_name(value: str, what: str) -> str:
    """The checks `sweeps run` applies to a name that becomes a folder (sweeps.safe_names), as
    a ValueError, so pydantic reports it at its field while the spec is validated."""
    try:
        return safe_component(value, what)
    except UnsafeNameError as exc:
        raise ValueError(str(exc)) from None


class _Section(BaseModel):
    # strict: YAML gives real types, so "3" is not silently the int 3 and true is not 1.0.
    model_config = ConfigDict(extra="forbid", strict=True)


class TaskSection(_Section):
    """Which task builds the model and the data: a built-in ``name`` or a ``target`` (module:callable)."""

    name: str | None = None
    target: str | None = None
    model: str | None = None
    args: dict[str, Any] = Field(default_factory=dict)


class SamplerSection(_Section):
    name: Literal["tpe", "random", "grid", "cmaes", "gp", "qmc"] = "tpe"
    seed: int | None = 0
    # tpe/gp: how many first trials are drawn at random before the model guides the search
    # (None: Optuna's default, 10). A small study needs fewer for the search to concentrate.
    n_startup_trials: int | None = Field(None, ge=1)

    def model_options(self) -> dict[str, Any]:
        """Keyword arguments for Optuna's TPESampler/GPSampler: only what the spec sets, so an
        unset option keeps Optuna's own default."""
        return {} if self.n_startup_trials is None else {"n_startup_trials": self.n_startup_trials}


class PrunerSection(_Section):
    """Early stopping of bad trials. Each option applies to some pruners only (see :meth:`options`);
    setting one the chosen pruner ignores, to a non-default value, is an error."""

    name: Literal["none", "median", "percentile", "asha", "hyperband", "pbt"] = "median"
    warmup_epochs: int = Field(1, ge=0)  # median/percentile: never prune before this many epochs
    percentile: float = Field(25.0, gt=0, lt=100)  # percentile: prune below this percentile
    min_resource: int = Field(1, ge=1)  # asha/hyperband: epochs every trial gets
    reduction_factor: int = Field(3, ge=2)  # asha/hyperband: keep 1/reduction_factor per rung
    perturbation_interval: int = Field(2, ge=1)  # pbt: epochs between exploit/explore steps

    def option_names(self, backend: str) -> tuple[str, ...]:
        """Options the chosen pruner reads under ``backend`` (Ray's HyperBand has no min_resource)."""
        return {"none": (), "median": ("warmup_epochs",), "percentile": ("warmup_epochs", "percentile"),
                "asha": ("min_resource", "reduction_factor"),
                "hyperband": ("reduction_factor",) if backend == "ray" else ("min_resource", "reduction_factor"),
                "pbt": ("perturbation_interval",)}[self.name]

    def options(self, backend: str = "optuna") -> dict[str, int | float]:
        """The chosen pruner's options with defaults filled in, e.g. ``{"warmup_epochs": 1}``."""
        return {k: getattr(self, k) for k in self.option_names(backend)}


class BudgetSection(_Section):
    n_trials: int = Field(10, ge=1)  # finished trials in total, across invocations and workers
    timeout: float | int | str | None = None  # wall clock of this invocation; see sweeps.durations
    max_failures: int = Field(3, ge=1)  # failures in a row before the study stops
    trial_timeout: float | int | str | None = None  # a trial with no progress for this long is stopped
    oom_retry_smaller_batch: bool = False  # retry a CUDA-OOM trial once at half the batch size

    @field_validator("timeout", "trial_timeout", mode="before")
    @classmethod
    def _duration(cls, value: Any) -> Any:
        parse_duration(value)  # raises ValueError with the fix
        return value


class ResourcesSection(_Section):
    devices: Literal["auto", "cpu"] | list[int] = "auto"
    gpus_per_trial: float = Field(1.0, gt=0)
    workers: Literal["auto"] | int = "auto"
    cpus_per_trial: Literal["auto"] | float = "auto"
    ray_address: str | None = None
    # Trials asked at once by a worker and trained as one population when their models have the
    # same shapes (core/population.py); null: one trial at a time. "auto" is PACK_AUTO.
    pack: Literal["auto"] | int | None = None

    @field_validator("pack", mode="before")
    @classmethod
    def _pack(cls, v: Any) -> Any:
        if v is None or v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"{v!r} is not allowed; use a number of trials trained together (2 or more, e.g. 16), "
                         "auto, or null for one trial at a time")

    def pack_size(self) -> int:
        """How many trials a worker asks for at once (1: packing is off)."""
        return PACK_AUTO if self.pack == "auto" else int(self.pack or 1)

    @field_validator("devices", mode="before")
    @classmethod
    def _devices(cls, v: Any) -> Any:
        if v in ("auto", "cpu"):
            return v
        if (isinstance(v, list) and v
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in v)
                and len(set(v)) == len(v)):  # after the type check: set() needs hashable items
            return v
        raise ValueError(f"{v!r} is not allowed; use auto, cpu, or a list of distinct GPU indices like [0, 1]")

    @field_validator("gpus_per_trial", mode="after")
    @classmethod
    def _gpus(cls, v: float) -> float:
        # A fraction must pack whole trials onto one GPU; above 1 a trial gets whole GPUs.
        share_ok = v < 1 and abs(round(1 / v) * v - 1) < 1e-6
        if not (share_ok or float(v).is_integer()):
            raise ValueError(f"{v!r} is not allowed; use a whole number of GPUs or a fraction that divides "
                             "one GPU evenly (0.5, 0.25, ...)")
        return v

    @field_validator("workers", mode="before")
    @classmethod
    def _workers(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
            return v
        raise ValueError(f"{v!r} is not allowed; use auto or a number of parallel trials >= 1")

    @field_validator("cpus_per_trial", mode="before")
    @classmethod
    def _cpus(cls, v: Any) -> Any:
        if v == "auto" or (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):
            return v if v == "auto" else float(v)
        raise ValueError(f"{v!r} is not allowed; use auto or a positive number of CPU cores")


class LrFinderSection(_Section):
    """Study-level LR range test run once before the trials.

    With ``narrow_search`` the search range of ``lr`` becomes
    ``[suggestion / narrow_factor, suggestion * narrow_factor]`` intersected with the spec's
    ``[low, high]`` (see :meth:`narrowed_range`); without it the curve and the suggestion are
    only recorded.
    """

    enabled: bool = False
    start_lr: float = Field(1.0e-7, gt=0, allow_inf_nan=False)
    end_lr: float = Field(10.0, gt=0, allow_inf_nan=False)
    num_steps: int = Field(100, ge=2)
    rule: SuggestRule = "minimum"
    narrow_search: bool = True
    narrow_factor: float = Field(10.0, gt=1, allow_inf_nan=False)

    def narrowed_range(self, suggestion: float, low: float, high: float) -> tuple[float, float] | None:
        """The narrowed ``lr`` range, or None when it does not meet ``[low, high]`` (the caller
        must then say so and keep the spec's range or stop; it must not guess)."""
        new_low, new_high = max(low, suggestion / self.narrow_factor), min(high, suggestion * self.narrow_factor)
        return (new_low, new_high) if new_low <= new_high else None


class TrackingSection(_Section):
    uri: str | None = None  # default: $MLFLOW_TRACKING_URI, else DEFAULT_TRACKING_URI
    experiment: str | None = None  # default: the study name

    @field_validator("experiment", mode="after")
    @classmethod
    def _experiment(cls, v: str | None) -> str | None:
        # With a local store the experiment names its artifact folder (runs/mlartifacts/<experiment>),
        # where `sweeps run` refuses an unsafe one; refused here for every store, so that
        # `sweeps validate` says so and a run stops before it creates anything.
        return None if v is None else _safe_name(v, "experiment name")


class WarmStartSection(BaseModel):
    """``warm_start: {from: lr_bs, top: 3}`` enqueues the 3 best completed trials of study ``lr_bs``
    (found in this spec's storage: the default ``runs/lr_bs.journal``, or the same database) as the
    new study's first trials. The search spaces may differ: the parameters both search, with a value
    inside the new range or choices, are carried over; the others are drawn by the sampler."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)

    study: str = Field(alias="from")  # the earlier study's name (its latest version)
    top: int = Field(5, ge=1)  # how many of its best completed trials to start from


class StudySpec(_Section):
    """A validated study. Build it with :func:`load_spec` or :func:`spec_from_dict`, which also
    enforce the rules spanning several fields; constructing it directly skips those."""

    name: str
    description: str = ""
    task: TaskSection
    train: dict[str, Any] = Field(default_factory=dict)
    search: dict[str, SearchParam] = Field(default_factory=dict)
    objective: ObjectiveSection = Field(default_factory=ObjectiveSection)
    objectives: list[ObjectiveSection] | None = None  # several: sweeps/spec/objectives.py
    constraints: dict[str, Bound] = Field(default_factory=dict)
    deploy: DeploySection = Field(default_factory=DeploySection)
    backend: Literal["optuna", "ray"] = "optuna"
    sampler: SamplerSection = Field(default_factory=SamplerSection)
    pruner: PrunerSection = Field(default_factory=PrunerSection)
    budget: BudgetSection = Field(default_factory=BudgetSection)
    resources: ResourcesSection = Field(default_factory=ResourcesSection)
    lr_finder: LrFinderSection = Field(default_factory=LrFinderSection)
    tracking: TrackingSection = Field(default_factory=TrackingSection)
    storage: str | None = None  # default runs/<name>.journal
    warm_start: WarmStartSection | None = None  # start from an earlier study's best (backends/optuna_study.py)
    _path: Path | None = PrivateAttr(default=None)
    _text: str | None = PrivateAttr(default=None)

    @field_validator("name", mode="before")
    @classmethod
    def _name(cls, v: Any) -> Any:
        if not isinstance(v, str) or not NAME_RE.fullmatch(v) or v in (".", "..") or len(v) > NAME_MAX:
            raise ValueError(f"{v!r} is not allowed; use 1-{NAME_MAX} of A-Z a-z 0-9 _ . - (not '.' or '..'), "
                             "e.g. lr_bs; it names the Optuna study, the MLflow experiment and files under runs/")
        return _safe_name(v, "study name")

    @model_validator(mode="after")
    def _several_objectives(self) -> StudySpec:
        return settle_objectives(self)  # `objective` becomes the primary one (sweeps.spec.objectives)

    @field_validator("storage", mode="before")
    @classmethod
    def _storage(cls, v: Any) -> Any:
        if v is not None:
            check_storage(v)
        return v

    # -- where things are
    @property
    def path(self) -> Path | None:
        """The spec file this was loaded from (None when built from a dict)."""
        return self._path

    @property
    def text(self) -> str | None:
        """The file's text as it was read and validated: the study's one snapshot of its spec,
        handed to every worker and logged with the study (None when built from a dict)."""
        return self._text

    def storage_url(self) -> str:
        """What Optuna opens: a journal-file path (default ``runs/<name>.journal``) or an RDB URL."""
        return self.storage if self.storage is not None else f"runs/{self.name}.journal"

    def is_rdb_storage(self) -> bool:
        return _URL_RE.match(self.storage_url()) is not None

    def journal_path(self) -> Path | None:
        """The journal file (relative to the working directory unless absolute); None for an RDB URL."""
        return None if self.is_rdb_storage() else Path(self.storage_url())

    def tracking_uri(self) -> str:
        """The tracking URI as written (``tracking.uri``, else $MLFLOW_TRACKING_URI, else the default)."""
        return self.tracking.uri or os.environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI

    def tracking_store_uri(self) -> str:
        """The URI to open: a relative ``sqlite:///`` path made absolute against the current
        directory. MLflow caches one store per URI string in a process, so a relative URI
        would keep pointing at the first folder it was opened from."""
        uri = self.tracking_uri()
        if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
            return "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
        return uri

    def experiment_name(self) -> str:
        return self.tracking.experiment or self.name

    # -- one trial
    def resolved_train_config(self, params: dict[str, Any] | None = None) -> TrainConfig:
        """TrainConfig = defaults <- ``train:`` <- the sampled params that are train fields."""
        train_params, _ = ss.split_params(params or {})
        return apply_overrides(apply_overrides(TrainConfig(), self.train), train_params)

    def task_args(self, params: dict[str, Any] | None = None) -> dict[str, Any]:
        """``task.args`` with the sampled ``task.<arg>`` params on top (``model`` too if searched)."""
        return {**self.task.args, **ss.split_params(params or {})[1]}

    def make_task(self, params: dict[str, Any] | None = None) -> Task:
        """Build the trial's :class:`core.tasks.Task` from the task section and sampled params."""
        args = self.task_args(params)
        model = args.pop("model", self.task.model)
        return make_task(self.task.name, target=self.task.target, model=model, args=args)

    # -- objectives
    def objective_list(self) -> list[ObjectiveSection]:
        """``objectives``, or the single ``objective`` as a one-element list."""
        return list(self.objectives) if self.objectives else [self.objective]

    def directions(self) -> list[Literal["maximize", "minimize"]]:
        return [o.direction for o in self.objective_list()]

    def deploy_metrics_needed(self) -> bool:
        """Whether trials measure the deployment figures (an objective or a constraint names one)."""
        return bool(self.constraints) or any(is_deploy_metric(o.metric) for o in self.objective_list())

    def timeout_seconds(self) -> float | None:
        return parse_duration(self.budget.timeout)

    def trial_timeout_seconds(self) -> float | None:
        return parse_duration(self.budget.trial_timeout)

    # -- identity
    def spec_hash(self) -> str:
        """sha256 of the canonical JSON of everything but ``description`` (tags runs with their spec)."""
        # At their defaults the new sections are left out, so a spec written before them keeps its hash.
        unset = {k for k in _SET_ONLY if getattr(self, k) == StudySpec.model_fields[k].get_default(
            call_default_factory=True)}
        exclude: dict[str, Any] = {"description": True, **dict.fromkeys(unset, True)}
        if self.resources.pack is None:  # a spec written before resources.pack keeps its hash
            exclude["resources"] = {"pack"}
        data = self.model_dump(mode="json", exclude=exclude)
        return hashlib.sha256(json.dumps(data, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def check_storage(value: Any) -> None:
    """Raise ValueError unless ``value`` is a safe journal path or an RDB URL Optuna can open."""
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{value!r} is not allowed; use a journal file path like runs/study.journal "
                         "or an RDB URL like postgresql://user@host/db")
    match = _URL_RE.match(value)
    rest = match.group(2).rpartition("@")[2] if match else value  # a password may hold %2F: not a path
    bad = ("a NUL byte" if "\x00" in value else "a backslash" if "\\" in value
           else "a percent-encoded '.', '/' or '\\'" if _ENCODED_RE.search(rest)
           else "a '..' component" if ".." in rest.split("/") else None)
    if bad:
        raise ValueError(f"{value!r} is refused: it contains {bad}; use a plain path inside the project "
                         "such as runs/study.journal, or an absolute path without '..'")
    if match:
        dialect = match.group(1).split("+")[0].lower()
        if dialect == "postgres":
            raise ValueError(f"{value!r}: SQLAlchemy needs postgresql://, not postgres://")
        if dialect not in RDB_DIALECTS:
            raise ValueError(f"{value!r} is not an RDB URL Optuna can open; use a journal file path, or "
                             f"one of {', '.join(d + '://' for d in RDB_DIALECTS)}")
    elif value.endswith("/"):
        raise ValueError(f"{value!r} is a folder; name the journal file, e.g. {value}study.journal")


def dump_spec_dict(spec: StudySpec, redact: bool = True) -> dict[str, Any]:
    """The validated spec as plain JSON-able data, with the resolved storage, tracking URI and
    experiment under ``resolved``; passwords in URLs are masked unless ``redact`` is False."""
    data = spec.model_dump(mode="json")
    data["resolved"] = {"storage": spec.storage_url(), "tracking_uri": spec.tracking_uri(),
                        "experiment": spec.experiment_name(), "spec_hash": spec.spec_hash(),
                        "timeout_s": spec.timeout_seconds(), "trial_timeout_s": spec.trial_timeout_seconds()}
    if redact:
        for section, key in (("resolved", "storage"), ("resolved", "tracking_uri"), ("tracking", "uri")):
            if data[section].get(key):
                data[section][key] = redact_url(data[section][key])
        if data.get("storage"):
            data["storage"] = redact_url(data["storage"])
    return data
