"""Launching ranks: pure plan builders and the runner that starts them through torch elastic."""

from autotuner.launch.options import LaunchOptions
from autotuner.launch.plan import LaunchPlan, build_plan
from autotuner.launch.elastic import run_plan

__all__ = ["LaunchOptions", "LaunchPlan", "build_plan", "run_plan"]
