"""The study spec: one YAML file = one study (the format: docs/STUDY_SPEC.md).

``model`` holds the pydantic :class:`~sweeps.spec.model.StudySpec` and its sections, ``objectives``
and ``search_space`` the objective, deploy and search-parameter sections with their rules, ``load``
reads and validates a file (every problem at once), ``checks`` and ``task_checks`` hold the rules
spanning several fields, ``messages`` how a problem reads."""
