"""The GPT-2 example's model and data under DeepSpeed's engine or ours: only `initialize` differs.

    deepspeed --num_gpus 1 benchmarks/workloads/gpt2_dual_engine.py --engine deepspeed \
        --model_size gpt2-medium --seq_len 1024 --deepspeed --deepspeed_config ds.json
    launcher --nproc_per_node 1 benchmarks/workloads/gpt2_dual_engine.py --engine autotuner ... --deepspeed ds.json

The model is examples/hf_gpt2's randomly initialised Hugging Face GPT-2 (same presets), the data
its token blocks of standard-library text (the tokenizer is trained once and cached under
--output_dir). The micro-batch, gas, stage and precision come from the config (DeepSpeed's
autotuner passes it base64-encoded after --deepspeed_config; ours a path). With an `autotuning`
section enabled both engines stop by themselves after end_profile_step and write their metrics.
"""

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples" / "hf_gpt2"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from data import TokenBlocks, load_tokens  # noqa: E402
from train import PRESETS, build_model  # noqa: E402

sys.path.insert(0, str(ROOT / "benchmarks" / "workloads"))
from training_loop import engine_parser, parse_engine_args, train_batches  # noqa: E402


def parse_args() -> tuple[argparse.Namespace, str]:
    parser, engine_name = engine_parser(__doc__)
    parser.add_argument("--model_size", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=1000, help="optimizer steps (autotuning stops earlier)")
    parser.add_argument("--output_dir", default="output/hf_gpt2", help="where the token cache lives")
    parser.add_argument("--corpus_mb", type=float, default=8.0)
    parser.add_argument("--tokenizer_vocab", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=42)
    return parse_engine_args(parser, engine_name), engine_name


def main() -> None:
    import torch

    args, engine_name = parse_args()
    torch.manual_seed(args.seed)
    tokens, vocab = load_tokens(Path(args.output_dir) / "cache", args.tokenizer_vocab, args.corpus_mb)
    model = build_model(args.model_size, args.seq_len, vocab)
    data = TokenBlocks(tokens, args.seq_len)
    # Imported by name here: the launcher reads a script's own imports to tell its engine.
    if engine_name == "deepspeed":
        import deepspeed as engine_module
    else:
        import autotuner as engine_module
    engine, _, loader, _ = engine_module.initialize(args=args, model=model,
                                                                 model_parameters=model.parameters(), training_data=data)

    def batch_loss(batch):
        batch = batch.to(engine.device)
        return engine(input_ids=batch, labels=batch).loss

    loss = train_batches(engine, loader, args.steps, batch_loss)
    if engine.global_rank == 0:
        print(f"done ({engine_name}): {engine.global_steps} steps, last loss {loss.item():.4f}", flush=True)


if __name__ == "__main__":
    main()
