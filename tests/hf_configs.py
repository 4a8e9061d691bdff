"""Hugging Face's documented DeepSpeed configs, and what the tests that run its run_clm.py share:
the script's path, a tiny GPT-2 built on the machine, the tutorial's flags and the environment."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

from conftest import ROOT, launcher_env

RUN_CLM = ROOT.parent / "shared" / "clients" / "hf_run_clm" / "run_clm.py"
NEEDED = ("transformers", "accelerate", "datasets", "evaluate", "tokenizers", "deepspeed")
MISSING = [name for name in NEEDED if importlib.util.find_spec(name) is None]

# Hugging Face's documented ZeRO-2 and ZeRO-3 configs (transformers' DeepSpeed guide), "auto" and all.
HF_ZERO2 = {
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
             "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                 "warmup_num_steps": "auto"}},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "allgather_partitions": True, "allgather_bucket_size": 2e8, "overlap_comm": True,
                          "reduce_scatter": True, "reduce_bucket_size": "auto", "contiguous_gradients": True},
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "steps_per_print": 2000,
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "wall_clock_breakdown": False,
}
HF_ZERO3 = {
    **HF_ZERO2,
    "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                      "warmup_num_steps": "auto", "total_num_steps": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                          "offload_param": {"device": "cpu", "pin_memory": True}, "overlap_comm": True,
                          "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
                          "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
                          "stage3_gather_16bit_weights_on_model_save": True},
}
MAPPINGS = {"train_micro_batch_size_per_gpu": "--per_device_train_batch_size",
            "gradient_accumulation_steps": "--gradient_accumulation_steps"}

# Small enough for the suite: a 2-step profile window, micro-batches up to 4, no final re-measurement.
# DeepSpeed's fixed window (min_window_s 0): these runs have too few steps (--max_steps) for a
# window extended to a second, and an experiment must not reach the script's end and its saves.
TEST_SIZED = {"start_profile_step": 1, "end_profile_step": 2, "max_train_micro_batch_size_per_gpu": 4,
              "remeasure_rounds": 0, "exp_timeout_s": 120, "min_window_s": 0}

# Hugging Face's documented ZeRO-2 config, "auto" wherever the Trainer fills a value in; the optimizer
# stays on the CPU's own memory (the offload section is dropped there anyway).
# torch's AdamW rather than DeepSpeed's CPU Adam, whose JIT build takes ~50 s on 2 cores and which no
# test here is about (the lr stays "auto" for the Trainer either way).
HF_AUTO = {**HF_ZERO2, "zero_optimization": {key: value for key, value in HF_ZERO2["zero_optimization"].items()
                                             if key != "offload_optimizer"},
           "optimizer": {**HF_ZERO2["optimizer"], "params": {**HF_ZERO2["optimizer"]["params"], "torch_adam": True}},
           "autotuning": {"enabled": True, "arg_mappings": MAPPINGS}}


def write_tiny_gpt2(root: Path) -> Path:
    """A 2-layer GPT-2 (64 wide) with a 300-token byte-level BPE trained on the text it learns."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while seven tiny models learn to count".split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 30))) for _ in range(400)]
    (root / "train.txt").write_text("\n".join(lines) + "\n")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<|endoftext|>",
                                      eos_token="<|endoftext|>", unk_token="<|endoftext|>")
    wrapped.save_pretrained(root / "model")
    config = GPT2Config(n_layer=2, n_embd=64, n_head=2, n_positions=128, vocab_size=len(wrapped),
                        bos_token_id=0, eos_token_id=0)
    GPT2LMHeadModel(config).save_pretrained(root / "model")
    return root


def hf_env(tmp_path: Path) -> dict[str, str]:
    return {**launcher_env(), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
            "HF_HOME": str(tmp_path / "hf_home"), "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false",
            "OMP_NUM_THREADS": "1"}


def run_clm_args(model: Path, out: Path, *extra: str) -> list[str]:
    """The tutorial's flags, offline: a local model and text file instead of the hub's gpt2 and
    wikitext, no --do_eval, no --overwrite_output_dir (gone in transformers 5); --dataloader_drop_last
    so every measured micro-batch is full."""
    return [str(RUN_CLM), "--model_name_or_path", str(model / "model"), "--train_file", str(model / "train.txt"),
            "--do_train", *extra, "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "1",
            "--learning_rate", "2e-5", "--max_steps", "6", "--block_size", "32", "--dataloader_drop_last",
            "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--output_dir", str(out)]
