"""The parsed command line as a backend reads it: a typed record built here, so nothing below
app/ reads argparse's Namespace. Light: the command line checks the backend before torch loads."""

from __future__ import annotations

import argparse

from autotuner.execution.backends import BackendOptions


def backend_options(args: argparse.Namespace) -> BackendOptions:
    picks_hosts = any(getattr(args, name, None) for name in ("hostfile", "include", "exclude"))
    return BackendOptions.of(vars(args), getattr(args, "backend", "local"), picks_hosts,
                             getattr(args, "autotuning", None))
