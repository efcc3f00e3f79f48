"""Config machinery: YAML + dotted overrides into typed dataclasses; errors name the key."""

from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Literal, Optional

import pytest

from megatron_dgpo.algorithm.losses import LossHyperparams
from megatron_dgpo.runtime.config import (Bounds, ConfigError, apply_overrides, check_bounds,
                                          describe, field_docs,
                                          from_dict, load_config, to_dict)


@dataclass
class Optim:
    lr: float = 1e-6
    """Learning rate (constant)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    """AdamW betas."""


@dataclass
class Algo:
    method: Literal["grpo", "dgpo"] = "dgpo"
    """Which F to use."""
    loss: LossHyperparams = field(default_factory=LossHyperparams)
    """The loss hyper-parameters."""


@dataclass
class Run:
    algorithm: Algo = field(default_factory=Algo)
    optimizer: Optim = field(default_factory=Optim)
    seed: int = 42
    """Seed of everything."""
    resume: Optional[str] = None
    """Checkpoint directory to resume from."""
    tags: dict[str, str] = field(default_factory=dict)
    out: Path = Path("runs/x")


def write(tmp_path, text):
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def test_yaml_then_overrides(tmp_path):
    path = write(tmp_path, "algorithm:\n  method: grpo\n  loss: {n: 2}\noptimizer:\n  lr: 2e-6\n")
    cfg = load_config(Run, path, ["algorithm.method=dgpo", "algorithm.loss.m=3", "seed=7",
                                  "optimizer.betas=[0.8, 0.9]", "resume=ckpt/a", "tags.k=v"])
    assert cfg.algorithm.method == "dgpo"
    assert cfg.algorithm.loss == LossHyperparams(n=2, m=3)
    assert cfg.optimizer.lr == 2e-6 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.betas == [0.8, 0.9]
    assert (cfg.seed, cfg.resume, cfg.tags) == (7, "ckpt/a", {"k": "v"})
    assert cfg.out == Path("runs/x")
    assert load_config(Run, path, ["resume=null"]).resume is None
    # round trip through plain data
    assert from_dict(Run, to_dict(cfg)) == cfg


@pytest.mark.parametrize("override, message", [
    (["algorithm.methd=grpo"], "unknown key 'algorithm.methd'; did you mean 'algorithm.method'"),
    (["algorithm.method=ppo"], "algorithm.method: expected one of 'grpo', 'dgpo', got 'ppo'"),
    (["seed=1.5"], "seed: expected an integer, got 1.5"),
    (["seed=true"], "seed: expected an integer, got True"),
    (["optimizer.lr=fast"], "optimizer.lr: expected a number, got 'fast'"),
    (["optimizer.betas=[0.9, x]"], r"optimizer.betas\[1\]: expected a number"),
    (["algorithm.loss.n=0"], "algorithm.loss.n must be >= 1, got 0"),
    (["seed.x=1"], "seed: expected an integer"),
    (["seed=1", "seed.x=1"], "seed is a value, not a section"),
    (["seed"], "not of the form key.sub=value"),
    (["algorithm=3"], "algorithm must be a mapping"),
])
def test_errors_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(Run, None, override)


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(Run, tmp_path / "missing.yaml")
    bad = write(tmp_path, "seed: [1\n")
    with pytest.raises(ConfigError, match="recipe.yaml: not valid YAML"):
        load_config(Run, bad)
    typo = write(tmp_path, "optimizer:\n  lrr: 1\n")
    with pytest.raises(ConfigError, match=r"recipe.yaml: unknown key 'optimizer.lrr'"):
        load_config(Run, typo)


def test_overrides_do_not_mutate_input():
    data = {"a": {"b": 1}}
    out = apply_overrides(data, ["a.b=2", "a.c=3"])
    assert data == {"a": {"b": 1}} and out == {"a": {"b": 2, "c": 3}}


def test_field_docs_and_describe():
    assert field_docs(Optim) == {"lr": "Learning rate (constant).", "betas": "AdamW betas."}
    rows = {key: (kind, doc) for key, kind, doc in describe(Run)}
    assert rows["algorithm.method"] == ("'grpo' | 'dgpo'", "Which F to use.")
    assert rows["algorithm.loss.n"][1].startswith("DGPO left-boundary decay power")
    assert rows["resume"] == ("str | null", "Checkpoint directory to resume from.")
    # every field of the loss hyper-parameters is documented where it is declared
    assert all(doc for key, _, doc in describe(LossHyperparams))


@dataclass
class Bounded:
    steps: Annotated[int, Bounds(ge=1)] = 2
    """Steps."""
    frac: Annotated[Optional[float], Bounds(gt=0, lt=1)] = None
    """A share."""

    def __post_init__(self):
        check_bounds(self)


@dataclass
class BoundedRun:
    section: Bounded = field(default_factory=Bounded)


def test_bounds_declared_beside_the_field_are_checked_on_load_and_in_code():
    assert from_dict(BoundedRun, {"section": {"steps": 1, "frac": 0.5}}).section.frac == 0.5
    assert from_dict(BoundedRun, {"section": {"frac": None}}).section.frac is None
    for value, message in ((0, "section.steps must be >= 1, got 0"),):
        with pytest.raises(ConfigError, match=message):
            from_dict(BoundedRun, {"section": {"steps": value}})
    for value, message in ((1.0, r"section.frac must be in \(0, 1\), got 1.0"),
                           (float("nan"), r"section.frac must be a finite number in \(0, 1\)")):
        with pytest.raises(ConfigError, match=message):
            from_dict(BoundedRun, {"section": {"frac": value}})
    with pytest.raises(ValueError, match="steps must be >= 1, got 0"):
        Bounded(steps=0)
    with pytest.raises(ValueError, match="^g must be >= 2, got 1: a group of one trains nothing$"):
        Bounds(ge=2, why="a group of one trains nothing").check("g", 1)
    assert ("section.steps", "int >= 1", "Steps.") in describe(BoundedRun)
