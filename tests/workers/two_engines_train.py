"""The toy script (toy_train.py) on the engine an environment variable picks, as scripts that import
both engines and choose at run time do: USE_DS set trains on DeepSpeed's engine, unset on ours.

`--gradient_checkpointing true|false` stands for a script's own checkpointing flag (Hugging Face's),
which autotuning.arg_mappings may map activation_checkpointing.policy to; it is taken and ignored.
"""

import argparse
import os
import sys

if os.environ.get("USE_DS"):
    import deepspeed
else:
    import autotuner as deepspeed

from toy_train import main

if __name__ == "__main__":
    flags = argparse.ArgumentParser(add_help=False)
    flags.add_argument("--gradient_checkpointing", choices=("true", "false"), default="false")
    _, rest = flags.parse_known_args()
    sys.argv[1:] = rest
    if deepspeed.__name__ == "deepspeed":
        sys.argv.append("--use_deepspeed")
    main()
