"""Ends the process that imports it: the warm runner's forkserver dies while preloading."""

import os

os._exit(3)
