"""Raises when imported: the warm runner's forkserver must survive it and say so."""

raise ImportError("this module refuses to be imported")
