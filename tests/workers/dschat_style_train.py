"""A supervised fine-tuning script in DeepSpeed-Chat's shape (step 1's main.py and its dschat utils),
with only its deepspeed imports swapped for ours (`--engine deepspeed` keeps DeepSpeed's own):

- the DeepSpeed config is built in code (dschat's get_train_ds_config: the stage from --zero_stage,
  the batch sizes from the script's own flags) and passed as initialize(config=ds_config);
- with --hf_deepspeed_config the model is created under transformers' HfDeepSpeedConfig at ZeRO 3,
  so transformers builds it under DeepSpeed's own zero.Init (as dschat does at stage 3);
- LoRA layers (dschat's LinearLayer_LoRA) train with the base weights frozen (--only_optimize_lora)
  and are fused at the end under GatheredParameters(modifier_rank=0), with the ds_id test;
- engine.gradient_checkpointing_enable() reaches the model through the engine;
- rank 0 saves model.module.state_dict() (save_hf_format), and at ZeRO 3 every rank then gathers each
  parameter that has a ds_id (save_zero_three_model); every rank then ends the process group.

A tiny OPT is built from its config (no download); the data are random tokens, each rank's drawn from
its own seed, so every stage trains on the same global batches. For the tests it also writes
`losses.json` and, on rank 0, what the engine's attribute pass-through gave (`engine_attributes.json`).
"""

import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModelForCausalLM, OPTConfig

ENGINE = "deepspeed" if "--engine" in sys.argv and sys.argv[sys.argv.index("--engine") + 1] == "deepspeed" else "autotuner"
if ENGINE == "deepspeed":
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
else:
    import autotuner as deepspeed
    from autotuner.runtime.zero.partition_parameters import ZeroParamStatus


# ----- dschat/utils/ds_utils.py -----
def get_train_ds_config(offload, dtype, stage=2, micro_batch_size=4, global_batch_size=32):
    device = "cpu" if offload else "none"
    zero_opt_dict = {
        "stage": stage,
        "overlap_comm": True,
        "offload_param": {"device": device},
        "offload_optimizer": {"device": device},
        "stage3_param_persistence_threshold": 1e4,
    }
    config = {
        "train_batch_size": global_batch_size,
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "steps_per_print": 10,
        "zero_optimization": zero_opt_dict,
        "gradient_clipping": 1.0,
        "prescale_gradients": False,
        "wall_clock_breakdown": False,
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


# ----- dschat/utils/module/lora.py -----
class LinearLayer_LoRA(nn.Module):
    def __init__(self, weight, lora_dim=0, lora_scaling=1, lora_droppout=0, bias=None):
        super().__init__()
        self.weight = weight
        self.bias = bias
        try:
            rows, columns = weight.ds_shape
        except AttributeError:
            rows, columns = weight.shape
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, lora_dim))
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, rows))
        self.lora_scaling = lora_scaling / lora_dim
        self.lora_dropout = nn.Dropout(lora_droppout) if lora_droppout > 0 else nn.Identity()
        self.reset_parameters()
        self.weight.requires_grad = False
        self.fuse_lora = False

    def reset_parameters(self):
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        # dschat zeroes the left factor; a small non-zero one makes the fuse visible in the weights.
        nn.init.normal_(self.lora_left_weight, std=0.02)

    def fuse_lora_weight(self):
        if not self.fuse_lora:
            self.weight.data += self.lora_scaling * torch.matmul(self.lora_left_weight.t(), self.lora_right_weight.t())
        self.fuse_lora = True

    def forward(self, input):
        if self.fuse_lora:
            return F.linear(input, self.weight, self.bias)
        return F.linear(input, self.weight, self.bias) + (
            self.lora_dropout(input) @ self.lora_right_weight @ self.lora_left_weight) * self.lora_scaling


def recursive_getattr(model, module_name):
    output = model
    for name in module_name.split("."):
        output = getattr(output, name)
    return output


def recursive_setattr(model, module_name, module):
    split_list = module_name.split(".")
    output = model
    for name in split_list[:-1]:
        output = getattr(output, name)
    output.__setattr__(split_list[-1], module)


def convert_linear_layer_to_lora(model, part_module_name, lora_dim=0, lora_scaling=1, lora_droppout=0):
    replace_name = [name for name, module in model.named_modules()
                    if isinstance(module, nn.Linear) and part_module_name in name]
    for name in replace_name:
        module = recursive_getattr(model, name)
        tmp = LinearLayer_LoRA(module.weight, lora_dim, lora_scaling, lora_droppout, module.bias)
        recursive_setattr(model, name, tmp)
    return model


def _z3_params_to_fetch(param_list):
    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def convert_lora_to_linear_layer(model):
    replace_name = [name for name, module in model.named_modules() if isinstance(module, LinearLayer_LoRA)]
    for name in replace_name:
        module = recursive_getattr(model, name)
        zero_stage_3 = hasattr(module.weight, "ds_id")
        with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([
                module.weight, module.bias, module.lora_left_weight, module.lora_right_weight]),
                modifier_rank=0, enabled=zero_stage_3):
            module.fuse_lora_weight()
    return model


def only_optimize_lora_parameters(model, force_optimize_params=()):
    for name, param in model.named_parameters():
        param.requires_grad = "lora_right_weight" in name or "lora_left_weight" in name or name in force_optimize_params
    return model


def make_model_gradient_checkpointing_compatible(model):
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    return model


# ----- dschat/utils/utils.py -----
def save_hf_format(model, args, sub_folder=""):
    model_to_save = model.module if hasattr(model, "module") else model
    output_dir = os.path.join(args.output_dir, sub_folder)
    os.makedirs(output_dir, exist_ok=True)
    save_dict = model_to_save.state_dict()
    for key in list(save_dict.keys()):
        if "lora" in key:
            del save_dict[key]
    torch.save(save_dict, os.path.join(output_dir, "pytorch_model.bin"))
    model_to_save.config.to_json_file(os.path.join(output_dir, "config.json"))


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    zero_stage_3 = zero_stage == 3
    os.makedirs(save_dir, exist_ok=True)
    output_model_file = os.path.join(save_dir, "pytorch_model.bin")
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    if not zero_stage_3:
        if global_rank == 0:
            torch.save(model_to_save.state_dict(), output_model_file)
    else:
        output_state_dict = {}
        for k, v in model_to_save.named_parameters():
            if hasattr(v, "ds_id"):
                with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage_3):
                    v_p = v.data.cpu()
            else:
                v_p = v.cpu()
            if global_rank == 0 and "lora" not in k:
                output_state_dict[k] = v_p
        if global_rank == 0:
            torch.save(output_state_dict, output_model_file)
        del output_state_dict


def create_hf_model(ds_config, hf_deepspeed_config):
    config = OPTConfig(vocab_size=128, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                       max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)
    dschf = None
    if hf_deepspeed_config and ds_config is not None:
        from transformers.integrations import HfDeepSpeedConfig

        # dschat builds it at ZeRO 3 only; here at every stage, so that a stage-0 run built the same
        # way (under DeepSpeed's own zero.Init) is the reference for a stage-3 one.
        zero3 = {**ds_config, "zero_optimization": {**ds_config["zero_optimization"], "stage": 3}}
        dschf = HfDeepSpeedConfig(zero3)  # noqa: F841 - alive while the model is built, as in dschat
    # Each rank its own seed: the engine must start every rank from rank 0's weights, as DeepSpeed's does.
    torch.manual_seed(1234 + torch.distributed.get_rank())
    return AutoModelForCausalLM.from_config(config)


# ----- training/step1_supervised_finetuning/main.py -----
def parse_args():
    parser = argparse.ArgumentParser(description="DeepSpeed-Chat step 1 shaped fine-tuning")
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--num_steps", type=int, default=4)
    parser.add_argument("--zero_stage", type=int, default=0)
    parser.add_argument("--dtype", type=str, default="fp32", choices=["fp32", "bf16"])
    parser.add_argument("--offload", action="store_true")
    parser.add_argument("--lora_dim", type=int, default=0)
    parser.add_argument("--lora_module_name", type=str, default="decoder.layers.")
    parser.add_argument("--only_optimize_lora", action="store_true")
    parser.add_argument("--gradient_checkpointing", action="store_true")
    parser.add_argument("--hf_deepspeed_config", action="store_true")
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--engine", choices=["autotuner", "deepspeed"], default="autotuner")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    deepspeed.init_distributed()
    args.global_rank = torch.distributed.get_rank()
    world = torch.distributed.get_world_size()
    ds_config = get_train_ds_config(offload=args.offload, dtype=args.dtype, stage=args.zero_stage)
    ds_config["train_micro_batch_size_per_gpu"] = args.per_device_train_batch_size
    ds_config["train_batch_size"] = args.per_device_train_batch_size * world * args.gradient_accumulation_steps
    ds_config["gradient_accumulation_steps"] = args.gradient_accumulation_steps
    torch.distributed.barrier()

    model = create_hf_model(ds_config, args.hf_deepspeed_config)
    if args.lora_dim > 0:
        torch.manual_seed(4321 + args.global_rank)
        model = convert_linear_layer_to_lora(model, args.lora_module_name, args.lora_dim)
        if args.only_optimize_lora:
            model = only_optimize_lora_parameters(model)
            model = make_model_gradient_checkpointing_compatible(model)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    if ENGINE == "deepspeed":
        args.deepspeed_config = None  # the tuner's file is named, and the script's own dict wins (DeepSpeed takes one)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             config=ds_config, dist_init_required=True)
    if args.gradient_checkpointing:
        model.gradient_checkpointing_enable()

    if args.global_rank == 0 and ENGINE == "autotuner" and args.output_dir:
        os.makedirs(args.output_dir, exist_ok=True)
        with open(os.path.join(args.output_dir, "engine_attributes.json"), "w") as handle:
            json.dump({
                # The engine's own names first: its config is the DeepSpeed config, not the model's.
                "config_is_the_engines": type(model.config).__name__,
                "model_config_type": type(model.module.config).__name__,
                "gradient_checkpointing": bool(model.module.is_gradient_checkpointing),
                "generate_is_the_models": model.generate.__func__ is type(model.module).generate,
                "missing_raises": _raises_attribute_error(model),
                "parameter_dtypes": sorted({str(p.dtype) for p in model.module.parameters()}),
            }, handle)

    losses = []
    for step in range(args.num_steps):
        total = 0.0
        for micro in range(args.gradient_accumulation_steps):
            generator = torch.Generator().manual_seed(1000 * step + 10 * micro + args.global_rank)
            tokens = torch.randint(0, 128, (args.per_device_train_batch_size, 16), generator=generator)
            outputs = model(input_ids=tokens, labels=tokens, use_cache=False)
            model.backward(outputs.loss)
            model.step()
            total += outputs.loss.detach().item()
        mean = torch.tensor(total / args.gradient_accumulation_steps)
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)

    if args.output_dir is not None:
        model = convert_lora_to_linear_layer(model)
        if args.global_rank == 0:
            save_hf_format(model, args)
            with open(os.path.join(args.output_dir, "losses.json"), "w") as handle:
                json.dump(losses, handle)
        if args.zero_stage == 3:
            save_zero_three_model(model, args.global_rank, args.output_dir, zero_stage=args.zero_stage)
    # Not in dschat, but in many scripts: a rank done first ends the group while rank 0 may still save.
    torch.distributed.destroy_process_group()


def _raises_attribute_error(engine):
    try:
        engine.no_such_attribute_anywhere
    except AttributeError as err:
        return str(err)
    return ""


if __name__ == "__main__":
    main()
