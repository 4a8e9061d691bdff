"""Train a randomly initialised Hugging Face GPT-2 through autotuner's DeepSpeed-style engine.

Arguments are named like transformers' run_clm.py, so DeepSpeed's tutorial arg_mappings
work unchanged. Nothing is downloaded: the model is built from a GPT2Config and the data
is text already on this machine (see data.py).

    launcher --autotuning run --nproc_per_node 2 examples/hf_gpt2/train.py --model_size tiny \
        --max_steps 300 --output_dir output/gpt2 --deepspeed examples/hf_gpt2/ds_config.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the hub, not even to check
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

import autotuner
from autotuner.config import fill_auto

sys.path.insert(0, str(Path(__file__).resolve().parent))
from data import TokenBlocks, load_tokens  # noqa: E402

# (n_layer, n_embd, n_head, vocab) with the real dimensions; "tiny" takes seconds per step on CPU.
PRESETS = {
    "tiny": (2, 128, 4, 4096),
    "gpt2": (12, 768, 12, 50257),
    "gpt2-medium": (24, 1024, 16, 50257),
    "gpt2-large": (36, 1280, 20, 50257),
    "gpt2-xl": (48, 1600, 25, 50257),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model_size", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--n_layer", type=int, default=None, help="overrides the preset's number of blocks")
    parser.add_argument("--n_embd", type=int, default=None,
                        help="overrides the preset's width (a multiple of its number of heads)")
    parser.add_argument("--per_device_train_batch_size", type=int, default=None)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=None)
    parser.add_argument("--learning_rate", type=float, default=None, help="overrides optimizer.params.lr")
    parser.add_argument("--max_steps", type=int, default=-1, help="optimizer steps; -1: use --num_train_epochs")
    parser.add_argument("--num_train_epochs", type=float, default=1.0)
    parser.add_argument("--seq_len", "--block_size", dest="seq_len", type=int, default=128)
    parser.add_argument("--output_dir", default="output/hf_gpt2")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--corpus_mb", type=float, default=8.0, help="MB of standard-library text to train on")
    parser.add_argument("--tokenizer_vocab", type=int, default=4096, help="BPE vocabulary trained on the corpus")
    parser.add_argument("--target_loss", type=float, default=None,
                        help="train until the held-out loss (the corpus's last --eval_blocks blocks, kept out of "
                             "training) is at most this, evaluated every --eval_every steps with the timer paused; "
                             "then --result_out gets the training time, steps and samples (no checkpoint is saved)")
    parser.add_argument("--eval_every", type=int, default=10, help="optimizer steps between held-out evaluations")
    parser.add_argument("--eval_blocks", type=int, default=64)
    parser.add_argument("--result_out", default=None)
    parser.add_argument("--local_rank", type=int, default=-1, help="set by the launcher (as DeepSpeed's does)")
    autotuner.add_config_arguments(parser)
    args = parser.parse_args()
    heads = PRESETS[args.model_size][2]
    if args.n_embd is not None and (args.n_embd <= 0 or args.n_embd % heads):
        parser.error(f"--n_embd {args.n_embd}: must be a positive multiple of {args.model_size}'s {heads} heads")
    return args


def build_model(size: str, seq_len: int, tokenizer_vocab: int, blocks: int | None = None,
                width: int | None = None) -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    n_layer, n_embd, n_head, vocab = PRESETS[size]
    n_layer, n_embd = blocks or n_layer, width or n_embd
    config = GPT2Config(n_layer=n_layer, n_embd=n_embd, n_head=n_head, n_positions=max(seq_len, 1024),
                        vocab_size=max(vocab, tokenizer_vocab), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    # Initialise on this rank's GPU where there is one: random init of gpt2-large on the CPU
    # takes longer than the profile steps that follow. Elsewhere on the default device: the CPU,
    # or the meta device under `--autotuning plan --hardware`, which allocates nothing.
    if torch.cuda.is_available() and torch.get_default_device().type != "meta":
        with torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))):
            return GPT2LMHeadModel(config)
    return GPT2LMHeadModel(config)


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    config = fill_auto(args.deepspeed_config or args.deepspeed, {
        "train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
        "gradient_accumulation_steps": args.gradient_accumulation_steps,
    })
    if args.learning_rate is not None and config.get("optimizer"):
        config["optimizer"].setdefault("params", {})["lr"] = args.learning_rate
    output_dir = Path(args.output_dir)
    tokens, vocab = load_tokens(output_dir / "cache", args.tokenizer_vocab, args.corpus_mb)
    model = build_model(args.model_size, args.seq_len, vocab, args.n_layer, args.n_embd)
    held_out = None
    if args.target_loss is not None:  # the last blocks are the held-out set, never trained on
        cut = len(tokens) - args.eval_blocks * args.seq_len
        tokens, held_out = tokens[:cut], tokens[cut:].view(args.eval_blocks, args.seq_len)
    engine, _, loader, _ = autotuner.initialize(model=model, config=config,
                                                training_data=TokenBlocks(tokens, args.seq_len))
    steps_per_epoch = len(loader) // engine.gradient_accumulation_steps()
    max_steps = args.max_steps if args.max_steps > 0 else int(args.num_train_epochs * steps_per_epoch)
    if engine.global_rank == 0:
        params = sum(p.numel() for p in model.parameters())
        print(f"GPT-2 {args.model_size}: {params / 1e6:.2f} M parameters, {len(tokens):,} tokens, "
              f"ZeRO {engine.zero_stage}, micro-batch {engine.train_micro_batch_size_per_gpu()} x gas "
              f"{engine.gradient_accumulation_steps()} x {engine.world_size} ranks, {max_steps} steps", flush=True)

    epoch, running, window_start = 0, 0.0, time.perf_counter()
    print_every = engine.config.steps_per_print
    target = TargetLoss(engine, held_out, args) if held_out is not None else None
    while engine.global_steps < max_steps and not (target and target.reached):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            batch = batch.to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            running += loss.item() / engine.gradient_accumulation_steps()
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if not boundary:
                continue
            if engine.global_steps % print_every == 0 and engine.global_rank == 0:
                elapsed = time.perf_counter() - window_start
                rate = print_every * engine.train_batch_size() / elapsed
                print(f"step {engine.global_steps}/{max_steps}: loss {running / print_every:.3f}, "
                      f"{rate:.1f} samples/s", flush=True)
                running, window_start = 0.0, time.perf_counter()
            elif engine.global_steps % print_every == 0:
                running = 0.0
            if target is not None and engine.global_steps % args.eval_every == 0 and target.check():
                break
            if engine.global_steps >= max_steps:
                break
        epoch += 1
    if target is not None:
        target.write()
        return
    path = engine.save_checkpoint(output_dir / "checkpoints")
    if engine.global_rank == 0:
        print(f"saved checkpoint to {path}", flush=True)


class TargetLoss:
    """Training time to a held-out loss: rank 0 evaluates, the timer paused, and every rank stops
    at the same step once it is reached."""

    def __init__(self, engine, held_out: torch.Tensor, args: argparse.Namespace):
        self.engine, self.held_out, self.args = engine, held_out, args
        self.training_s, self.started, self.reached, self.losses = 0.0, time.perf_counter(), None, []
        self.first_batch = engine.train_batch_size()

    def check(self) -> bool:
        engine = self.engine
        self.training_s += time.perf_counter() - self.started
        with torch.no_grad():
            engine.module.eval()
            losses = [engine.module(input_ids=block, labels=block).loss.item()
                      for block in self.held_out.to(engine.device).split(16)]
            engine.module.train()
        loss = sum(losses) / len(losses)
        self.losses.append((engine.global_steps, engine.global_samples, round(loss, 4)))
        stop = torch.tensor([float(loss <= self.args.target_loss)])
        if torch.distributed.is_initialized():
            torch.distributed.broadcast(stop, src=0)  # rank 0's verdict: every rank stops at this step
        if stop.item():
            self.reached = {"training_s": self.training_s, "steps": engine.global_steps,
                            "samples": engine.global_samples, "held_out_loss": loss}
        self.started = time.perf_counter()
        return bool(stop.item())

    def write(self) -> None:
        engine = self.engine
        if engine.global_rank != 0:
            return
        print(f"done: {engine.global_steps} steps, global batch {self.first_batch} -> {engine.train_batch_size()}, "
              + (f"target {self.args.target_loss} reached after {self.reached['samples']} samples in "
                 f"{self.reached['training_s']:.2f} s" if self.reached else "target not reached"), flush=True)
        if self.args.result_out:
            with open(self.args.result_out, "w") as handle:
                json.dump({"micro_batch_size": engine.train_micro_batch_size_per_gpu(),
                           "gradient_accumulation_steps": engine.gradient_accumulation_steps(),
                           "first_global_batch": self.first_batch, "global_batch": engine.train_batch_size(),
                           "reached": self.reached, "held_out_losses": self.losses}, handle)


if __name__ == "__main__":
    main()
