"""README's example spec is the shipped main job, as it ships: every key the example sets has the
value studies/lr_bs.yaml gives it, and the README's sentence about `make run` names its budget."""
from __future__ import annotations

import re
from pathlib import Path

import yaml

from tests.test_docs import section

ROOT = Path(__file__).resolve().parents[1]


def _leaves(data: dict, prefix: str = "") -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_readme_example_spec_is_the_shipped_lr_bs():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    [block] = re.findall(r"```yaml\n(.*?)```", section(readme, "A study spec").split("### ")[0], flags=re.DOTALL)
    example = _leaves(yaml.safe_load(block))
    shipped = _leaves(yaml.safe_load((ROOT / "studies" / "lr_bs.yaml").read_text(encoding="utf-8")))
    differ = {k: (v, shipped.get(k, "<absent>")) for k, v in example.items() if shipped.get(k, "<absent>") != v}
    assert not differ, f"README example vs studies/lr_bs.yaml: {differ}"
    assert len(example) >= 15  # the example shows the spec, not a fragment of it


def test_the_readmes_make_run_sentence_names_the_shipped_budget():
    spec = yaml.safe_load((ROOT / "studies" / "lr_bs.yaml").read_text(encoding="utf-8"))
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    n, epochs = spec["budget"]["n_trials"], spec["train"]["epochs"]
    assert f"{n} trials of {epochs} epochs" in readme
    startup = spec["sampler"]["n_startup_trials"]
    assert f"({startup} random trials, then {n - startup} it guides)" in readme
