"""Rank program for the multi-rank engine tests: one launch runs a check under every ZeRO stage.

    python -m autotuner --nproc_per_node 2 tests/workers/engine_checks.py --check parity --out result.json
"""

import argparse
import json
import math
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn as nn

import autotuner

STAGES = (0, 1, 2, 3)


class Net(nn.Module):
    def __init__(self, width: int = 24, depth: int = 3):
        super().__init__()
        self.stem = nn.Linear(8, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        x = torch.tanh(self.stem(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x)


class NetWithUnused(Net):
    """A pooler that forward never uses, like a Hugging Face encoder's: it never gets a gradient."""

    def __init__(self):
        super().__init__()
        self.pooler = nn.Linear(24, 24)


class Block(nn.Module):
    """A pre-norm MLP block with dropout: recomputed in backward, its masks must match the forward's."""

    def __init__(self, width: int, dropout: float = 0.1):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.drop = nn.Dropout(dropout)

    def forward(self, x):
        return x + self.drop(self.down(nn.functional.gelu(self.up(self.norm(x)))))


class BlockNet(Net):
    def __init__(self, width: int = 24, depth: int = 3, dropout: float = 0.1):
        super().__init__(width, depth)
        self.layers = nn.ModuleList(Block(width, dropout) for _ in range(depth))


POLICIES = ("none", "full", "selective")


def batch(step: int, micro: int, size: int, rank: int | None = None):
    """Deterministic data for (optimizer step, micro-step) on this rank (or the one given)."""
    rank = dist.get_rank() if rank is None else rank
    generator = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    return torch.randn(size, 8, generator=generator), torch.randn(size, 1, generator=generator)


def config(stage: int, micro: int = 4, gas: int = 1, optimizer: str = "AdamW", **extra):
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "steps_per_print": 1000,
        "optimizer": {"type": optimizer, "params": {"lr": 0.05}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 0.05, "warmup_num_steps": 4, "warmup_type": "linear"}},
        "zero_optimization": {"stage": stage},
        **extra,
    }


def train_steps(engine, first_step: int, steps: int) -> list[float]:
    losses = []
    micro_size = engine.train_micro_batch_size_per_gpu()
    for step in range(first_step, first_step + steps):
        total = 0.0
        for micro in range(engine.gradient_accumulation_steps()):
            x, y = (t.to(engine.device) for t in batch(step, micro, micro_size))
            loss = nn.functional.mse_loss(engine(x).float(), y)
            engine.backward(loss)
            engine.step()
            total += loss.item()
        losses.append(total)
    return losses


def full_parameters(engine) -> dict[str, list]:
    out = {}
    for name, param in engine.module.named_parameters():
        tensor = param.full_tensor() if hasattr(param, "full_tensor") else param
        out[name.removeprefix("module.")] = tensor.detach().cpu().flatten().tolist()
    return out


def full_parameters_of(model_cls) -> dict[str, list]:
    torch.manual_seed(0)
    return {name: p.detach().flatten().tolist() for name, p in model_cls().named_parameters()}


def check_parity() -> dict:
    losses = {}
    for stage in STAGES:
        torch.manual_seed(0)
        engine, *_ = autotuner.initialize(model=Net(), config=config(stage))
        losses[stage] = train_steps(engine, 0, 5)
    return {"losses": losses}


def check_gas() -> dict:
    """micro 2 x gas 2 must give the parameters of micro 4 x gas 1 after one step (SGD: scale-sensitive)."""
    result = {}
    for stage in STAGES:
        params = {}
        for micro, gas in ((4, 1), (2, 2)):
            torch.manual_seed(0)
            settings = config(stage, micro, gas, optimizer="SGD")
            del settings["scheduler"]  # warm-up would start at lr 0 and hide any difference
            engine, *_ = autotuner.initialize(model=Net(), config=settings)
            x, y = (t.to(engine.device) for t in batch(0, 0, 4))
            for index in range(gas):
                part = slice(index * micro, (index + 1) * micro)
                engine.backward(nn.functional.mse_loss(engine(x[part]), y[part]))
                engine.step()
            assert engine.global_steps == 1
            params[f"{micro}x{gas}"] = full_parameters(engine)
        params["initial"] = full_parameters_of(Net)
        result[stage] = params
    return result


def check_checkpoint(directory: str, model_cls=Net) -> dict:
    """Train 3 steps, save, train 2 more: a fresh engine that loads must give the same losses."""
    result = {}
    for stage in STAGES:
        torch.manual_seed(0)
        engine, *_ = autotuner.initialize(model=model_cls(), config=config(stage))
        train_steps(engine, 0, 3)
        engine.save_checkpoint(f"{directory}/z{stage}", client_state={"note": "three steps"})
        continued = train_steps(engine, 3, 2)
        torch.manual_seed(99)  # a different initialisation, overwritten by the load
        fresh, *_ = autotuner.initialize(model=model_cls(), config=config(stage))
        path, client_state = fresh.load_checkpoint(f"{directory}/z{stage}")
        resumed = train_steps(fresh, 3, 2)
        result[stage] = {
            "continued": continued,
            "resumed": resumed,
            "client_state": client_state,
            "global_steps": fresh.global_steps,
            "lr": fresh.get_lr()[0],
            "lr_continued": engine.get_lr()[0],
        }
    return result


def check_checkpoint_state(directory: str) -> dict:
    """What a resume must keep as it was (a review of 2026-11-27): a MultiStepLR's milestones (a
    Counter with int keys), a client_state's tuples and int keys, a number as a tag; and what it must
    not keep: the micro-step count of a half-accumulated step, when gas changes on resume."""
    result = {}
    for stage in (0, 3):
        torch.manual_seed(0)
        settings = {**sgd_config(stage), "gradient_accumulation_steps": 2}
        engine, *_ = autotuner.initialize(
            model=Net(), config=settings,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4], gamma=0.1))
        for step in range(3):  # 3 optimizer steps, then half of a fourth
            for micro in range(2):
                x, y = (t.to(engine.device) for t in batch(step, micro, 4))
                engine.backward(nn.functional.mse_loss(engine(x), y))
                engine.step()
        x, y = (t.to(engine.device) for t in batch(3, 0, 4))
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step()
        engine.save_checkpoint(f"{directory}/z{stage}", tag=7, client_state={"pos": (3, 4), "per_class": {0: 0.5}})
        torch.manual_seed(0)
        fresh, *_ = autotuner.initialize(
            model=Net(), config={**sgd_config(stage), "gradient_accumulation_steps": 4},
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[4], gamma=0.1))
        path, client_state = fresh.load_checkpoint(f"{directory}/z{stage}", tag=7)
        boundaries = []
        for micro in range(4):  # a whole window of the new gas: the step falls on its fourth micro-step
            x, y = (t.to(fresh.device) for t in batch(3, micro, 4))
            fresh.backward(nn.functional.mse_loss(fresh(x), y))
            boundaries.append(fresh.is_gradient_accumulation_boundary())
            fresh.step()
        result[str(stage)] = {"tag_dir": Path(path).name, "client_state_types": {
            "pos": type(client_state["pos"]).__name__, "per_class_keys": [type(k).__name__ for k in client_state["per_class"]]},
            "boundaries": boundaries, "global_steps": fresh.global_steps, "lr": fresh.get_lr()[0]}
        # The same model with its parameters split into two groups (no decay for the biases): the
        # saved single group's rate would go to the first group alone. Refused, nothing loaded.
        from autotuner.core.errors import AutotunerError

        torch.manual_seed(1)
        model = Net()
        groups = [{"params": [p for n, p in model.named_parameters() if not n.endswith("bias")]},
                  {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0}]
        split, *_ = autotuner.initialize(model=model, model_parameters=groups, config=sgd_config(stage))
        before = [t.detach().clone() for t in split.module.parameters()]
        try:
            split.load_checkpoint(f"{directory}/z{stage}", tag=7)
            result[str(stage)]["split_groups"] = "loaded"
        except AutotunerError as err:
            result[str(stage)]["split_groups"] = str(err)
        result[str(stage)]["split_untouched"] = all(torch.equal(a, b.detach()) for a, b in
                                                    zip(before, split.module.parameters()))
    return result


class KeywordLR(torch.optim.lr_scheduler.LRScheduler):
    """A schedule that takes DeepSpeed's lr_kwargs (Megatron's `increment`, a token count) and records them."""

    def __init__(self, optimizer):
        self.received = []
        super().__init__(optimizer)

    def step(self, increment=None, consumed_tokens=None):
        if increment is not None:
            self.received.append([increment, consumed_tokens])
        super().step()

    def get_lr(self):
        return [0.01 for _ in self.base_lrs]


class NetWithFrozen(Net):
    def __init__(self):
        super().__init__()
        self.stem.requires_grad_(False)


class NetRenamedHead(Net):
    """Net with its head renamed `out`: a checkpoint of Net's does not match it key for key."""

    def __init__(self):
        super().__init__()
        self.out = self.head
        del self.head

    def forward(self, x):
        x = torch.tanh(self.stem(x))
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.out(x)


def check_deepspeed_signatures(directory: str) -> dict:
    """DeepSpeed's keyword arguments, honoured: step(lr_kwargs), backward(retain_graph, scale_wrt_gas)
    and its return value, save_checkpoint(save_latest, exclude_frozen_parameters) and
    load_checkpoint(load_module_strict, load_lr_scheduler_states, load_module_only, custom_load_fn)."""
    from autotuner.core.errors import AutotunerError

    result = {}
    for stage in STAGES:
        record = {}
        torch.manual_seed(0)
        model = Net()
        schedule = None

        def keyword_schedule(optimizer):
            nonlocal schedule
            schedule = KeywordLR(optimizer)
            return schedule

        settings = config(stage, micro=2, gas=2)
        del settings["scheduler"]
        engine, *_ = autotuner.initialize(model=model, config=settings, lr_scheduler=keyword_schedule)
        x, y = (t.to(engine.device) for t in batch(0, 0, 2))
        loss = nn.functional.mse_loss(engine(x), y)
        returned = engine.backward(loss, retain_graph=True)
        record["backward_returns"] = [returned.item(), loss.item()]
        engine.backward(loss, scale_wrt_gas=False)  # retain_graph kept the graph for a second backward
        engine.step(lr_kwargs={"increment": 1, "consumed_tokens": 64})
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step(lr_kwargs={"increment": 1, "consumed_tokens": 128})
        record["lr_kwargs_received"] = schedule.received

        # A schedule whose step takes no keywords: DeepSpeed steps it with the train batch size.
        torch.manual_seed(0)
        engine, *_ = autotuner.initialize(model=Net(), config=config(stage))
        train_steps(engine, 0, 1)
        x, y = (t.to(engine.device) for t in batch(1, 0, 4))
        engine.backward(nn.functional.mse_loss(engine(x), y))
        engine.step(lr_kwargs={"increment": 1})
        record["fallback_last_epoch"] = engine.lr_scheduler.last_epoch
        record["train_batch_size"] = engine.train_batch_size()

        # Frozen weights left out of a checkpoint; `latest` kept at the earlier tag.
        torch.manual_seed(0)
        engine, *_ = autotuner.initialize(model=NetWithFrozen(), config=config(stage))
        train_steps(engine, 0, 2)
        save_dir = f"{directory}/z{stage}"
        engine.save_checkpoint(save_dir, tag="first")
        train_steps(engine, 2, 1)
        engine.save_checkpoint(save_dir, tag="second", save_latest=False, exclude_frozen_parameters=True,
                               client_state={"k": 1})
        record["latest"] = open(f"{save_dir}/latest").read().strip()
        trained = full_parameters(engine)
        torch.manual_seed(99)
        fresh, *_ = autotuner.initialize(model=NetWithFrozen(), config=config(stage))
        fresh_params = full_parameters(fresh)
        try:
            fresh.load_checkpoint(save_dir, tag="second")
            record["strict_refused"] = None
        except AutotunerError as err:
            record["strict_refused"] = str(err)
        path, client_state = fresh.load_checkpoint(save_dir, tag="second", load_module_strict=False,
                                                   load_lr_scheduler_states=False)
        loaded = full_parameters(fresh)
        record["client_state"] = client_state
        frozen = ("stem.weight", "stem.bias")
        record["non_strict_loaded_trained"] = all(loaded[name] == trained[name] for name in trained if name not in frozen)
        record["frozen_kept_fresh"] = [loaded[name] == fresh_params[name] for name in frozen]
        # The schedule's own position stays the fresh one's (the step count is the checkpoint's).
        record["steps_and_schedule_after_load"] = [fresh.global_steps, fresh.lr_scheduler.last_epoch,
                                                   engine.lr_scheduler.last_epoch]

        # Weights alone: no step count, no optimizer state.
        torch.manual_seed(99)
        weights_only, *_ = autotuner.initialize(model=Net(), config=config(stage))
        torch.manual_seed(0)
        engine, *_ = autotuner.initialize(model=Net(), config=config(stage))
        train_steps(engine, 0, 2)
        engine.save_checkpoint(f"{directory}/w{stage}")
        weights_only.load_checkpoint(f"{directory}/w{stage}", load_module_only=True)
        record["module_only"] = [weights_only.global_steps, len(weights_only.optimizer.state),
                                 full_parameters(weights_only) == full_parameters(engine)]
        calls = []

        def custom_load_fn(src, dst):
            calls.append(sorted(src))
            dst.load_state_dict(src)

        torch.manual_seed(99)
        custom, *_ = autotuner.initialize(model=Net(), config=config(stage))
        custom.load_checkpoint(f"{directory}/w{stage}", custom_load_fn=custom_load_fn)
        record["custom_load_fn"] = [calls, full_parameters(custom) == full_parameters(engine)]

        # As DeepSpeed's: given the checkpoint's own weights (here a layer the model has renamed),
        # with load_module_strict (default True) not applied.
        renamed_calls = []

        def renaming_load_fn(src, dst):
            from torch.distributed.tensor import DTensor, distribute_tensor

            renamed_calls.append(sorted(src))
            targets = dict(dst.named_parameters())
            moved = {}
            for key, value in src.items():
                key = key.replace("head.", "out.")
                if isinstance(targets[key], DTensor) and not isinstance(value, DTensor):
                    value = distribute_tensor(value.to(targets[key].device), targets[key].device_mesh,
                                              targets[key].placements)
                moved[key] = value
            dst.load_state_dict(moved)

        torch.manual_seed(99)
        renamed, *_ = autotuner.initialize(model=NetRenamedHead(), config=config(stage))
        renamed.load_checkpoint(f"{directory}/w{stage}", load_optimizer_states=False, custom_load_fn=renaming_load_fn)
        trained = {name.replace("head.", "out."): value for name, value in full_parameters(engine).items()}
        record["custom_load_fn_renamed"] = [renamed_calls, full_parameters(renamed) == trained]
        result[stage] = record
    return result


def checkpointed_blocks(model) -> int:
    """How many of the model's blocks carry torch's composable checkpoint."""
    from torch.distributed._composable.contract import _get_registry

    return sum("checkpoint" in (_get_registry(block) or {}) for block in model.layers)


def check_activation_checkpointing(directory: str) -> dict:
    """Each policy at each stage: the losses of no checkpointing, with dropout on, every block
    checkpointed; and a checkpoint saved under one policy loads under another."""
    result = {}
    for stage in STAGES:
        losses, applied = {}, {}
        for policy in POLICIES:
            torch.manual_seed(0)
            model = BlockNet()
            engine, *_ = autotuner.initialize(model=model, config=config(
                stage, activation_checkpointing={"policy": policy}))
            losses[policy] = train_steps(engine, 0, 4)
            applied[policy] = checkpointed_blocks(model)
            if policy == "full":
                engine.save_checkpoint(f"{directory}/z{stage}")
                torch.manual_seed(7)  # dropout's masks: the RNG state is not part of a checkpoint
                continued = train_steps(engine, 4, 2)
        torch.manual_seed(99)
        fresh, *_ = autotuner.initialize(model=BlockNet(), config=config(
            stage, activation_checkpointing={"policy": "selective"}))
        fresh.load_checkpoint(f"{directory}/z{stage}")
        torch.manual_seed(7)
        result[stage] = {"losses": losses, "checkpointed_blocks": applied, "continued": continued,
                         "resumed_under_selective": train_steps(fresh, 4, 2)}
    return result


def check_compile() -> dict:
    """Compiled blocks (inductor) train like eager ones: through the config's compile section at
    stages 0 and 2 (DDP, FSDP2), through engine.compile() at 1 and 3. No dropout: inductor draws
    its masks from its own generator, so compiled and eager masks differ by design."""
    result = {}
    for stage in STAGES:
        losses = {}
        for compiled in (False, True):
            torch.manual_seed(0)
            through_config = compiled and stage in (0, 2)
            engine, *_ = autotuner.initialize(model=BlockNet(dropout=0.0), config=config(
                stage, compile={"enabled": through_config, "backend": "inductor"}))
            if compiled and not through_config:
                engine.compile(backend="inductor")
            losses["compiled" if compiled else "eager"] = train_steps(engine, 0, 4)
            if compiled:
                losses["is_compiled"] = engine.is_compiled
        result[stage] = losses
    return result


def check_bf16() -> dict:
    """bf16 under every stage trains (autocast for DDP, MixedPrecisionPolicy for FSDP2)."""
    losses = {}
    for stage in STAGES:
        torch.manual_seed(0)
        engine, *_ = autotuner.initialize(model=Net(), config=config(stage, bf16={"enabled": True}))
        losses[stage] = train_steps(engine, 0, 5)
    return {"losses": losses}


def check_non_finite() -> dict:
    """A step whose gradients hold an inf: skipped (weights, optimizer state and schedule unchanged,
    counted in skipped_steps) at ZeRO 1-3 and under bf16, applied at stage 0 in fp32, as DeepSpeed
    0.19.8 does (its engine, run on one CPU rank, gives the same table); "bf16_unchecked" is bf16
    with check_grad_overflow false, "_no_norm" compute_grad_norm false (ZeRO 1-2 only), with the
    norm get_global_grad_norm() gave appended."""
    result = {}
    for stage in STAGES:
        variants = ("fp32", "bf16", "bf16_unchecked") + (("fp32_no_norm", "bf16_no_norm") if stage in (1, 2) else ())
        for precision in variants:
            torch.manual_seed(0)
            extra = {"bf16": {"enabled": True, "check_grad_overflow": precision != "bf16_unchecked"}} \
                if precision.startswith("bf16") else {}
            settings = config(stage, **extra)
            if precision.endswith("_no_norm"):
                settings["zero_optimization"]["compute_grad_norm"] = False
                settings["gradient_clipping"] = 0.0
            engine, *_ = autotuner.initialize(model=Net(), config=settings)
            train_steps(engine, 0, 1)
            before = full_parameters(engine)
            x, _ = (t.to(engine.device) for t in batch(1, 0, 4))
            engine.backward(engine(x).float().sum() * float("inf"))
            engine.step()
            after = full_parameters(engine)
            finite = all(math.isfinite(v) for values in after.values() for v in values)
            record = [engine.was_step_applied(), engine.skipped_steps, after == before, finite,
                      engine.lr_scheduler.last_epoch]
            norm = engine.get_global_grad_norm()
            later = train_steps(engine, 2, 1)  # training goes on
            result[f"{stage}_{precision}"] = [*record, math.isfinite(later[0])]
            if precision.endswith("_no_norm"):
                result[f"{stage}_{precision}"].append(norm)
    return result


def check_offload() -> dict:
    """ZeRO 2/3 with CPU offload (FSDP2 CPUOffloadPolicy) give the losses of the same stage without it.
    DeepSpeed offloads parameters only at stage 3, so stage 2 offloads the optimizer alone."""
    losses, devices = {}, {}
    for stage in (2, 3):
        for offload in (False, True):
            torch.manual_seed(0)
            settings = config(stage)
            if offload:
                settings["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
                if stage == 3:
                    settings["zero_optimization"]["offload_param"] = {"device": "cpu", "pin_memory": True}
            engine, *_ = autotuner.initialize(model=Net(), config=settings)
            key = f"{stage}{'_offload' if offload else ''}"
            losses[key] = train_steps(engine, 0, 5)
            param = next(engine.module.parameters())
            devices[key] = (param.to_local() if hasattr(param, "to_local") else param).device.type
    return {"losses": losses, "parameter_devices": devices}


def sgd_config(stage: int) -> dict:
    settings = config(stage, optimizer="SGD")
    del settings["scheduler"]
    return settings


def reference_parameters(model_cls, steps: int) -> dict[str, list]:
    """Plain torch SGD in one process on every rank's data at once: the mean over the concatenated
    batch is the average of the ranks' means, which is what data-parallel training must compute;
    its gradient clipped to norm 1.0, DeepSpeed's default gradient_clipping, over the whole model."""
    torch.manual_seed(0)
    model = model_cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        parts = [batch(step, 0, 4, rank) for rank in range(int(os.environ.get("WORLD_SIZE", 1)))]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        nn.functional.mse_loss(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}


def train_with(forward_through: str, model_cls, stage: int, steps: int = 3) -> dict:
    """Train through the engine's forward, or (as a GAN script does) the raw module's."""
    torch.manual_seed(0)
    model = model_cls()
    engine, *_ = autotuner.initialize(model=model, config=sgd_config(stage))
    for step in range(steps):
        x, y = (t.to(engine.device) for t in batch(step, 0, 4))
        output = engine(x) if forward_through == "engine" else model(x)
        engine.backward(nn.functional.mse_loss(output, y))
        engine.step()
    params = full_parameters(engine)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, params)
    return {"params": params, "ranks_agree": all(g == gathered[0] for g in gathered)}


def train_mixed(model_cls, stage: int, steps: int = 3) -> dict:
    """Two micro-steps a step: the first through the engine, the boundary's through the raw module."""
    torch.manual_seed(0)
    model = model_cls()
    engine, *_ = autotuner.initialize(model=model, config={**sgd_config(stage), "gradient_accumulation_steps": 2})
    for step in range(steps):
        for micro in range(2):
            x, y = (t.to(engine.device) for t in batch(step, micro, 4))
            engine.backward(nn.functional.mse_loss(engine(x) if micro == 0 else model(x), y))
            engine.step()
    params = full_parameters(engine)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, params)
    return {"params": params, "ranks_agree": all(g == gathered[0] for g in gathered)}


def reference_two_micro_steps(model_cls, steps: int) -> dict[str, list]:
    """reference_parameters with two micro-batches a step: the mean over both on every rank."""
    torch.manual_seed(0)
    model = model_cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(steps):
        parts = [batch(step, micro, 4, rank) for micro in range(2) for rank in range(int(os.environ.get("WORLD_SIZE", 1)))]
        x, y = torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
        nn.functional.mse_loss(model(x), y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {name: p.detach().flatten().tolist() for name, p in model.named_parameters()}


def check_raw_forward() -> dict:
    """Gradients are reduced whether forward went through the engine or the raw module, also when
    only the accumulation boundary's went through the raw one ("mixed")."""
    result = {"reference": reference_parameters(Net, 3), "reference_two_micro_steps": reference_two_micro_steps(Net, 3)}
    for stage in STAGES:
        result[stage] = {mode: train_with(mode, Net, stage) for mode in ("engine", "raw")}
        result[stage]["mixed"] = train_mixed(Net, stage)
    return result


def check_unused() -> dict:
    """A parameter that never gets a gradient: training goes on and the others train as usual."""
    result = {"reference": reference_parameters(NetWithUnused, 3)}
    for stage in STAGES:
        result[stage] = {"engine": train_with("engine", NetWithUnused, stage)}
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    names = ("parity", "gas", "checkpoint", "checkpoint_state", "bf16", "non_finite", "offload", "raw_forward", "unused", "checkpoint_unused",
             "activation_checkpointing", "compile", "deepspeed_signatures")
    parser.add_argument("--check", required=True,
                        help=f"one of {', '.join(names)}, or several joined by commas (one launch runs them in turn)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args()
    wanted = args.check.split(",")
    unknown = [name for name in wanted if name not in names]
    if unknown:
        parser.error(f"--check: unknown {unknown}")
    # Each check that saves gets its own directory, so several in one launch do not meet.
    checks = {"parity": check_parity, "gas": check_gas, "checkpoint": lambda: check_checkpoint(args.out + ".ckpt"),
              "checkpoint_state": lambda: check_checkpoint_state(args.out + ".state.ckpt"),
              "bf16": check_bf16, "non_finite": check_non_finite, "offload": check_offload, "raw_forward": check_raw_forward,
              "unused": check_unused,
              "checkpoint_unused": lambda: check_checkpoint(args.out + ".unused.ckpt", NetWithUnused),
              "activation_checkpointing": lambda: check_activation_checkpointing(args.out + ".ac.ckpt"),
              "compile": check_compile,
              "deepspeed_signatures": lambda: check_deepspeed_signatures(args.out + ".sig.ckpt")}
    if len(wanted) == 1:
        result = checks[wanted[0]]()
    else:
        result = {"checks": {name: checks[name]() for name in wanted}}
    result["world_size"] = dist.get_world_size()
    if dist.get_rank() == 0:
        with open(args.out, "w") as handle:
            json.dump(result, handle)

if __name__ == "__main__":
    main()
