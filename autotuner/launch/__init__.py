"""Launching ranks: pure plan builders and the runner that starts them through torch elastic."""

from autotuner.launch.plan import LaunchOptions, LaunchPlan, build_plan
from autotuner.launch.elastic import run_plan

__all__ = ["LaunchOptions", "LaunchPlan", "build_plan", "run_plan"]
