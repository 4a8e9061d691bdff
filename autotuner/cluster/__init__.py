"""Experiments on a cluster: placement as data, and the Ray backend."""
