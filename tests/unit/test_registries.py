"""The tuner and backend registries: what a plugin may add, and what it may not take over."""

from __future__ import annotations

import argparse

import pytest

from autotuner.app.settle import check_tuner_type
from autotuner.core.errors import ConfigError, UsageError
from autotuner.app.backend_options import backend_options
from autotuner.execution.backends import (BACKENDS, BackendOptions, BackendSpec, Flag, add_backend_flags, check_backend,
                                         register_backend)
from autotuner.tuning.tuners import TUNERS, TunerSpec, register_tuner


def test_a_taken_tuner_name_is_refused(monkeypatch):
    monkeypatch.setattr("autotuner.tuning.tuners.TUNERS", dict(TUNERS))
    with pytest.raises(ValueError, match="gridsearch"):
        register_tuner(TunerSpec("gridsearch", lambda a: None, "another grid"))


def test_an_unknown_tuner_type_lists_every_registered_one():
    with pytest.raises(ConfigError) as err:
        check_tuner_type("bohb", "ds.json")
    assert str(err.value).startswith('ds.json: autotuning.tuner_type: got "bohb"; expected one of "gridsearch"')
    assert all(f'"{name}"' in str(err.value) for name in TUNERS)


def _parse(*argv: str) -> BackendOptions:
    parser = argparse.ArgumentParser()
    parser.add_argument("--autotuning", default=None)
    for name in ("--hostfile", "--include", "--exclude"):
        parser.add_argument(name, default=None)
    add_backend_flags(parser)
    return backend_options(parser.parse_args(list(argv)))


def test_a_backends_flags_and_name_come_from_its_spec(monkeypatch):
    monkeypatch.setattr("autotuner.execution.backends.BACKENDS", dict(BACKENDS))
    register_backend(BackendSpec("toy", "a toy", lambda request: None, flags=(Flag("--toy_depth", {"type": int,
                                                                                                     "default": 1}),)))
    args = _parse("--autotuning", "tune", "--backend", "toy", "--toy_depth", "3")
    assert args.value("toy_depth") == 3 and args.picks_hosts is False
    check_backend(args)
    with pytest.raises(UsageError, match="^--toy_depth: only with --backend toy$"):
        check_backend(_parse("--autotuning", "tune", "--toy_depth", "3"))
    with pytest.raises(UsageError, match="^--backend toy: runs the experiments of --autotuning tune"):
        check_backend(_parse("--backend", "toy"))
    with pytest.raises(ValueError, match="--ray_address belongs to backend 'ray'"):
        register_backend(BackendSpec("other", "x", lambda request: None, flags=(Flag("--ray_address"),)))


def test_ray_keeps_its_own_refusals():
    with pytest.raises(UsageError, match="--ray_max_concurrent: got 0"):
        check_backend(_parse("--autotuning", "tune", "--backend", "ray", "--ray_max_concurrent", "0"))
    with pytest.raises(UsageError, match="drop --hostfile"):
        check_backend(_parse("--autotuning", "tune", "--backend", "ray", "--hostfile", "h"))
