"""The one orchestrator: profile -> memory model -> search (ask/run/tell) -> results, one layout
after another (tune.py), or the profiles and the costed candidates alone (plan.py)."""

from autotuner.tuning.orchestrator.tune import Autotuner, follow_the_launch

__all__ = ["Autotuner", "follow_the_launch"]
