"""DeepSpeed's flops profiler on torch's FlopCounterMode: parameters, MACs, forward latency and FLOPS
of a model and of each of its modules, printed in DeepSpeed's layout.

FLOPs are counted by torch's FlopCounterMode, which counts matrix products, convolutions and
attention (2 FLOPs per multiply-accumulate) and not element-wise operations; MACs are half of
them. DeepSpeed's own counter also adds element-wise FLOPs, so its "fwd flops" can be a little
higher for the same model. Latency per module comes from forward hooks.
"""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from typing import Any

import torch
import torch.nn as nn

PRECISION = 2
LINE = "{:<70}  {:<8}"


def number_to_string(num: float, precision: int = PRECISION) -> str:
    for magnitude, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K"), (1, ""), (1e-3, "m"), (1e-6, "u")):
        if abs(num) >= magnitude:
            return f"{round(num / magnitude, precision):g} {unit}"
    return f"{round(num, precision):g} "


def params_to_string(n: float) -> str:
    return number_to_string(n).replace("G", "B").strip()


def duration_to_string(seconds: float) -> str:
    return f"{number_to_string(seconds)}s"


def flops_to_string(flops: float) -> str:
    return f"{number_to_string(flops)}FLOPS"


def macs_to_string(macs: float) -> str:
    return f"{number_to_string(macs)}MACs"


class FlopsProfiler:
    """start_profile() before a forward, stop_profile() after it; then the getters or print_model_profile().

    `ds_engine`, when given, adds the engine's world size, micro-batch and backward/step latencies."""

    def __init__(self, model: nn.Module, ds_engine: Any = None, recompute_fwd_factor: float = 0.0):
        self.model = model
        self.ds_engine = ds_engine
        self.recompute_fwd_factor = recompute_fwd_factor
        self._counter = None
        self._hooks: list[Any] = []
        self._started: dict[int, list[float]] = defaultdict(list)
        self.durations: dict[str, float] = defaultdict(float)  # module name -> forward seconds
        self.flops_by_module: dict[str, float] = {}
        self.total_flops = 0.0
        self.bwd_latency: float | None = None  # set by the engine, seconds
        self.step_latency: float | None = None

    # ----- profiling -----
    def start_profile(self, ignore_list: Any = None) -> None:
        from torch.utils.flop_counter import FlopCounterMode

        self.reset_profile()
        cuda = next((p.device.type == "cuda" for p in self.model.parameters()), False)

        def clock() -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        for name, module in self.model.named_modules():
            if ignore_list and isinstance(module, tuple(ignore_list)):
                continue
            self._hooks.append(module.register_forward_pre_hook(
                lambda m, _args: self._started[id(m)].append(clock())))
            self._hooks.append(module.register_forward_hook(
                lambda m, _args, _out, name=name: self._finish(m, name, clock())))
        self._counter = FlopCounterMode(display=False)
        self._counter.__enter__()

    def _finish(self, module: nn.Module, name: str, now: float) -> None:
        if self._started[id(module)]:
            self.durations[name] += now - self._started[id(module)].pop()

    def stop_profile(self) -> None:
        if self._counter is None:
            return
        self._counter.__exit__(None, None, None)
        root = type(self.model).__name__
        for key, ops in self._counter.get_flop_counts().items():
            if key == root or key.startswith(root + "."):
                self.flops_by_module[key[len(root) + 1:]] = float(sum(ops.values()))
        self.total_flops = float(self._counter.get_total_flops())
        self._counter = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def reset_profile(self) -> None:
        self.durations.clear()
        self.flops_by_module.clear()
        self.total_flops = 0.0

    def end_profile(self) -> None:
        self.stop_profile()

    # ----- results, DeepSpeed's getters -----
    def get_total_flops(self, as_string: bool = False) -> Any:
        return number_to_string(self.total_flops) if as_string else self.total_flops

    def get_total_macs(self, as_string: bool = False) -> Any:
        return macs_to_string(self.total_flops / 2) if as_string else self.total_flops / 2

    def get_total_duration(self, as_string: bool = False) -> Any:
        return duration_to_string(self.durations.get("", 0.0)) if as_string else self.durations.get("", 0.0)

    def get_total_params(self, as_string: bool = False) -> Any:
        total = sum(p.numel() for p in self.model.parameters())  # a DTensor counts its global shape
        return params_to_string(total) if as_string else total

    # ----- printing -----
    def print_model_profile(self, profile_step: int = 1, module_depth: int = -1, top_modules: int = 1,
                            detailed: bool = True, output_file: str | None = None) -> None:
        lines = self._summary(profile_step) + self._aggregated(module_depth, top_modules)
        if detailed:
            lines += ["", "------------------------------ Detailed Profile per GPU ------------------------------",
                      "Each module profile is listed after its name in the following order: ",
                      "params, percentage of total params, MACs, percentage of total MACs, fwd latency, "
                      "percentage of total fwd latency, fwd FLOPS", ""]
            lines += self._detailed(module_depth)
        lines.append("------------------------------------------------------------------------------")
        text = "\n".join(lines) + "\n"
        if output_file:
            with open(output_file, "w") as handle:
                handle.write(text)
        else:
            sys.stdout.write(text)
            sys.stdout.flush()

    def _summary(self, step: int) -> list[str]:
        flops, params = self.total_flops, self.get_total_params()
        fwd = self.get_total_duration()
        engine = self.ds_engine
        lines = ["", "-------------------------- DeepSpeed Flops Profiler --------------------------",
                 f"Profile Summary at step {step}:", "Notations:",
                 "data parallel size (dp_size), model parallel size(mp_size),",
                 "number of parameters (params), number of multiply-accumulate operations(MACs),",
                 "number of floating-point operations (flops), floating-point operations per second (FLOPS),",
                 "fwd latency (forward propagation latency), bwd latency (backward propagation latency),",
                 "step (weights update latency), iter latency (sum of fwd, bwd and step latency)", ""]
        if engine is not None:
            lines += [LINE.format("world size: ", engine.world_size),
                      LINE.format("data parallel size: ", engine.dp_world_size),
                      LINE.format("model parallel size: ", engine.mp_world_size),
                      LINE.format("batch size per GPU: ", engine.train_micro_batch_size_per_gpu())]
        lines += [LINE.format("params per GPU: ", params_to_string(params)),
                  LINE.format("params of model = params per GPU * mp_size: ", params_to_string(params)),
                  LINE.format("fwd MACs per GPU: ", macs_to_string(flops / 2)),
                  LINE.format("fwd flops per GPU: ", number_to_string(flops)),
                  LINE.format("fwd flops of model = fwd flops per GPU * mp_size: ", number_to_string(flops)),
                  LINE.format("fwd latency: ", duration_to_string(fwd)),
                  LINE.format("fwd FLOPS per GPU = fwd flops per GPU / fwd latency: ",
                              flops_to_string(flops / fwd if fwd else 0))]
        if engine is not None and self.bwd_latency and self.step_latency is not None:
            factor = 2 + self.recompute_fwd_factor
            bwd, opt = self.bwd_latency, self.step_latency
            iteration = fwd + bwd + opt
            lines += [LINE.format("bwd latency: ", duration_to_string(bwd)),
                      LINE.format(f"bwd FLOPS per GPU = {factor:g} * fwd flops per GPU / bwd latency: ",
                                  flops_to_string(factor * flops / bwd)),
                      LINE.format(f"fwd+bwd FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / (fwd+bwd latency): ",
                                  flops_to_string((factor + 1) * flops / (fwd + bwd))),
                      LINE.format("step latency: ", duration_to_string(opt)),
                      LINE.format("iter latency: ", duration_to_string(iteration)),
                      LINE.format(f"FLOPS per GPU = {factor + 1:g} * fwd flops per GPU / iter latency: ",
                                  flops_to_string((factor + 1) * flops / iteration)),
                      LINE.format("samples/second: ", round(
                          engine.train_micro_batch_size_per_gpu() * engine.world_size / iteration, PRECISION))]
        return lines

    def _modules(self) -> list[tuple[str, int, nn.Module]]:
        return [(name, 0 if not name else name.count(".") + 1, module) for name, module in self.model.named_modules()]

    def _params(self, module: nn.Module) -> int:
        return sum(p.numel() for p in module.parameters())

    def _aggregated(self, module_depth: int, top_modules: int) -> list[str]:
        by_depth: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0, 0.0]))
        for name, depth, module in self._modules():
            entry = by_depth[depth][type(module).__name__]
            entry[0] += self.flops_by_module.get(name, 0.0) / 2
            entry[1] += self._params(module)
            entry[2] += self.durations.get(name, 0.0)
        depth = len(by_depth) - 1 if module_depth == -1 else min(module_depth, len(by_depth) - 1)
        lines = ["", "----------------------------- Aggregated Profile per GPU -----------------------------",
                 f"Top {top_modules} modules in terms of params, MACs or fwd latency at different model depths:"]
        for d in range(depth + 1):
            rows = by_depth[d].items()
            top = min(top_modules, len(rows))

            def best(index: int, fmt: Any) -> dict[str, str]:
                ranked = sorted(rows, key=lambda item: item[1][index], reverse=True)[:top]
                return {name: fmt(values[index]) for name, values in ranked}

            lines += [f"depth {d}:", f"    params      - {best(1, params_to_string)}",
                      f"    MACs        - {best(0, macs_to_string)}", f"    fwd latency - {best(2, duration_to_string)}"]
        return lines

    def _detailed(self, module_depth: int) -> list[str]:
        total_params = self._params(self.model) or 1
        total_macs = self.total_flops / 2 or 1
        total_time = self.durations.get("", 0.0) or 1
        lines = []
        for name, depth, module in self._modules():
            if module_depth != -1 and depth > module_depth:
                continue
            params, macs = self._params(module), self.flops_by_module.get(name, 0.0) / 2
            seconds = self.durations.get(name, 0.0)
            flops_per_s = 2 * macs / seconds if seconds else 0.0
            label = f"({name.rsplit('.', 1)[-1]}): " if name else ""
            lines.append(
                f"{'  ' * depth}{label}{type(module).__name__}("
                f"{params_to_string(params)} = {round(100 * params / total_params, PRECISION):g}% Params, "
                f"{macs_to_string(macs)} = {round(100 * macs / total_macs, PRECISION):g}% MACs, "
                f"{duration_to_string(seconds)} = {round(100 * seconds / total_time, PRECISION):g}% latency, "
                f"{flops_to_string(flops_per_s)})")
        return lines


def get_model_profile(model: nn.Module, input_shape: tuple | None = None, args: Any = None, kwargs: Any = None,
                      print_profile: bool = True, detailed: bool = True, module_depth: int = -1,
                      top_modules: int = 1, warm_up: int = 1, as_string: bool = True,
                      output_file: str | None = None, ignore_modules: Any = None, mode: str = "forward") -> tuple:
    """DeepSpeed's standalone profile of one forward: returns (flops, macs, params)."""
    args, kwargs = list(args or []), dict(kwargs or {})
    if input_shape is not None:  # DeepSpeed's: one tensor of that shape, in the model's dtype and device
        first = next(model.parameters())
        args = [torch.ones(tuple(input_shape), dtype=first.dtype, device=first.device)]
    call = model if mode == "forward" else getattr(model, mode)
    for _ in range(warm_up):
        call(*args, **kwargs)
    profiler = FlopsProfiler(model)
    profiler.start_profile(ignore_list=ignore_modules)
    call(*args, **kwargs)
    profiler.stop_profile()
    if print_profile:
        profiler.print_model_profile(profile_step=warm_up, module_depth=module_depth, top_modules=top_modules,
                                     detailed=detailed, output_file=output_file)
    flops, macs, params = profiler.get_total_flops(), profiler.get_total_macs(), profiler.get_total_params()
    if as_string:
        return number_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
