"""DeepSpeed's import paths: the modules a script reaches as `deepspeed.*` (moe, pipe, ops, zero,
comm, accelerator, utils, runtime.zero, ...) when it runs `import autotuner as deepspeed`.

Each is a face: it re-exports the engine's API (autotuner.runtime), carries a small helper
DeepSpeed's scripts call, or stands in for a feature we do not carry, importable and refused
when used (unsupported.py). Scripts keep importing them at their DeepSpeed paths
(`autotuner.moe.layer`, `autotuner.runtime.zero.partition_parameters`): aliases.py maps those
names to the modules here. No subpackage imports this one (the engine never does); only the
package root does, to install the aliases.
"""
