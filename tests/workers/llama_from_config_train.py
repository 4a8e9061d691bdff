"""A Llama built from its config and trained DeepSpeed's way (forward, backward, step), on our engine:
what `--autotuning plan --hardware` runs on the meta device. --size picks the published config
(8b, 70b: Llama 3's) or a small one for real CPU runs (tiny)."""
import argparse

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import autotuner as deepspeed

SIZES = {"8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                    num_attention_heads=32, num_key_value_heads=8),
         "70b": dict(vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                     num_attention_heads=64, num_key_value_heads=8),
         "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)}

p = argparse.ArgumentParser()
p.add_argument("--size", default="tiny", choices=SIZES)
p.add_argument("--seq", type=int, default=64)
p.add_argument("--steps", type=int, default=3)
p.add_argument("--materialise", action="store_true")  # load "weights" on the CPU first: the plan refuses it
p.add_argument("--local_rank", type=int, default=-1)
p = deepspeed.add_config_arguments(p)
args = p.parse_args()
deepspeed.init_distributed()
config = LlamaConfig(**SIZES[args.size], max_position_embeddings=args.seq, attn_implementation="sdpa")
model = LlamaForCausalLM(config)
if args.materialise:
    model = model.to_empty(device="cpu")
ids = torch.randint(0, config.vocab_size, (64, args.seq))
data = torch.utils.data.TensorDataset(ids)
engine, _, loader, _ = deepspeed.initialize(args=args, model=model, training_data=data)
step = 0
while step < args.steps:
    for (batch,) in loader:
        loss = engine(input_ids=batch, labels=batch).loss
        engine.backward(loss)
        engine.step()
        step += 1
        if step == args.steps:
            break
