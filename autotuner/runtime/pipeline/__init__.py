"""Pipeline parallelism with DeepSpeed's API (`deepspeed.pipe`) on torch.distributed.pipelining:
the process grid (topology.py), how layers are split over stages (partition.py), the module each
rank builds its own stage of (module.py) and the engine that runs the schedule (engine.py)."""
