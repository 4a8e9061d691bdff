"""The toy script (toy_train.py) on DeepSpeed's engine where DeepSpeed imports, else on ours: the
`try: import deepspeed` fallback scripts use to run without DeepSpeed installed."""

import sys

try:
    import deepspeed
except ImportError:
    import autotuner as deepspeed

from toy_train import main

if __name__ == "__main__":
    if deepspeed.__name__ == "deepspeed":
        sys.argv.append("--use_deepspeed")
    main()
