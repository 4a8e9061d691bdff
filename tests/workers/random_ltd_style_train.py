"""A fine-tuning script shaped like DeepSpeedExamples' data-efficiency GPT one, with only its imports
changed (`import autotuner as deepspeed`, the helper from `autotuner.runtime...`): it imports the
random-LTD helpers, steps with token-based lr_kwargs on every step, and rank 0 alone saves the
model with `save_without_random_ltd` at the very end, random-LTD or not.

For the test, every rank also takes the whole weights collectively before rank 0's save (torch's
full state dict), and rank 0 writes them beside the saved model as the reference.
"""

import argparse
import json
import os

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from transformers import GPT2Config, GPT2LMHeadModel, get_scheduler

import autotuner as deepspeed
from autotuner.runtime.data_pipeline.data_routing.helper import convert_to_random_ltd, save_without_random_ltd


def parse_args():
    parser = argparse.ArgumentParser(description="data-efficiency style GPT fine-tuning")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--num_steps", type=int, default=4)
    parser.add_argument("--per_device_train_batch_size", type=int, default=2)
    parser.add_argument("--random_ltd", action="store_true")
    parser.add_argument("--token_based_lr_decay", action="store_true")
    parser.add_argument("--midway_save_after", type=int, default=None,
                        help="rank 0 also saves after this step, while the others go on to the next one")
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def main():
    args = parse_args()
    torch.manual_seed(1234)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=16, vocab_size=101)
    model = GPT2LMHeadModel(config)
    if args.random_ltd:
        model = convert_to_random_ltd(model, type(model.transformer.h[0]))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    lr_scheduler = get_scheduler("linear", optimizer, num_warmup_steps=1, num_training_steps=100)
    model, optimizer, _, lr_scheduler = deepspeed.initialize(model=model, optimizer=optimizer, args=args,
                                                             lr_scheduler=lr_scheduler, dist_init_required=True)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    consumed_token, losses, lrs = 0, [], []
    for step in range(args.num_steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        tokens = torch.randint(0, config.vocab_size, (args.per_device_train_batch_size, 16), generator=generator)
        outputs = model(input_ids=tokens, labels=tokens)
        model.backward(outputs.loss)
        consumed_token += tokens.numel() * world
        if args.token_based_lr_decay:
            model.step(lr_kwargs={"increment": 1, "consumed_tokens": consumed_token})
        else:
            model.step()
        mean = outputs.loss.detach().clone()
        torch.distributed.all_reduce(mean)
        losses.append(mean.item() / world)
        lrs.append([lr_scheduler.get_last_lr()[0], optimizer.param_groups[0]["lr"]])
        if step + 1 == args.midway_save_after:
            midway = get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if rank == 0:
                os.makedirs(args.output_dir, exist_ok=True)
                torch.save(midway, os.path.join(args.output_dir, "midway_reference.bin"))
                torch.save(save_without_random_ltd(model.module), os.path.join(args.output_dir, "midway.bin"))

    reference = get_model_state_dict(model.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if torch.distributed.get_rank() == 0:
        if not os.path.isdir(args.output_dir):
            os.makedirs(args.output_dir)
        torch.save(reference, os.path.join(args.output_dir, "reference.bin"))
        with open(os.path.join(args.output_dir, "losses.json"), "w") as handle:
            json.dump({"losses": losses, "lrs": lrs}, handle)
    # The end of DeepSpeedExamples' script, as it is: rank 0 alone saves.
    if torch.distributed.get_rank() == 0:
        model_to_save = model.module if hasattr(model, "module") else model
        output_model_file = os.path.join(args.output_dir, "pytorch_model.bin")
        torch.save(save_without_random_ltd(model_to_save), output_model_file)
        model_to_save.config.to_json_file(os.path.join(args.output_dir, "config.json"))


if __name__ == "__main__":
    main()
