"""A PPO script in DeepSpeed-Chat's step-3 shape (training/step3_rlhf_finetuning/main.py with its
dschat.rlhf package), with only its deepspeed imports swapped for ours:

- four engines in one process, each from its own config built in code (dschat's
  get_train_ds_config / get_eval_ds_config): the actor and the critic with an optimizer and a
  schedule, the reference and the reward models with none (forward only);
- the critic and reward models are dschat's RewardModel around an OPT body, loaded from step 2's
  checkpoint with dschat's load_state_dict_into_model; at ZeRO 3 they, and the actor and reference,
  are built while transformers' HfDeepSpeedConfig is alive, so under DeepSpeed's own zero.Init, and
  the load runs inside GatheredParameters(modifier_rank=0);
- each step generates with `actor.module.generate(...)` (synced_gpus at ZeRO 3), scores with
  `reward.forward_value` and `critic.forward_value` through the engines, trains the actor and
  the critic (the critic through `forward_value` again), reads `engine.optimizer.overflow` after
  the steps (get_overflow) and, with --align_overflow, calls `optimizer.check_overflow(external=True)`
  and sets `optimizer.skip_step` as dschat does;
- at the end rank 0 saves each trained model's `state_dict()` (save_hf_format), and at ZeRO 3 every
  rank gathers the parameters with a ds_id (save_zero_three_model).

A tiny OPT built from its config; the "step 1" actor and "step 2" critic checkpoints are written by
rank 0 from fixed seeds before anything is built. For the tests, rank 0 writes `record.json`.
"""

import argparse
import json
import math
import os

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel, AutoModelForCausalLM, OPTConfig

import autotuner as deepspeed
from autotuner.runtime.zero.partition_parameters import ZeroParamStatus

PAD, EOS, VOCAB, PROMPT, ANSWER = 1, 2, 128, 8, 8


# ----- dschat/utils/ds_utils.py -----
def get_train_ds_config(offload, dtype, stage=2, enable_hybrid_engine=False):
    device = "cpu" if offload else "none"
    dtype_key, dtype_config = {"fp16": ("fp16", {"enabled": True, "loss_scale_window": 100}),
                               "bf16": ("bfloat16", {"enabled": True}), "fp32": ("fp32", {"enabled": False})}[dtype]
    zero_opt_dict = {"stage": stage, "overlap_comm": True, "offload_param": {"device": device},
                     "offload_optimizer": {"device": device}, "stage3_param_persistence_threshold": 1e4,
                     "stage3_max_live_parameters": 3e7, "stage3_prefetch_bucket_size": 3e7,
                     "memory_efficient_linear": False}
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
              "zero_optimization": zero_opt_dict, "gradient_clipping": 1.0, "prescale_gradients": False,
              "wall_clock_breakdown": False,
              "hybrid_engine": {"enabled": enable_hybrid_engine, "max_out_tokens": 512, "inference_tp_size": 1,
                                "release_inference_cache": False, "pin_parameters": True,
                                "tp_gather_partition_size": 8}}
    if dtype != "fp32":
        config[dtype_key] = dtype_config
    return config


def get_eval_ds_config(offload, dtype, stage=0):
    device = "cpu" if offload else "none"
    config = {"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
              "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                                    "offload_param": {"device": device}, "memory_efficient_linear": False},
              "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False}
    if dtype == "fp16":
        config["fp16"] = {"enabled": True}
    elif dtype == "bf16":
        config["bfloat16"] = {"enabled": True}
    return config


# ----- dschat/utils/model/reward_model.py -----
class RewardModel(nn.Module):
    def __init__(self, base_model, num_padding_at_beginning=0):
        super().__init__()
        self.config = base_model.config
        self.num_padding_at_beginning = num_padding_at_beginning
        self.v_head = nn.Linear(self.config.word_embed_proj_dim, 1, bias=False)
        self.rwtransformer = base_model
        self.PAD_ID = PAD

    def gradient_checkpointing_enable(self):
        self.rwtransformer.gradient_checkpointing_enable()

    def forward_value(self, input_ids=None, attention_mask=None, past_key_values=None, head_mask=None,
                      inputs_embeds=None, return_value_only=False, prompt_length=0, use_cache=False):
        transformer_outputs = self.rwtransformer(input_ids, past_key_values=past_key_values,
                                                 attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                                 use_cache=use_cache, head_mask=head_mask)
        values = self.v_head(transformer_outputs[0]).squeeze(-1)
        if return_value_only:
            return values
        assert prompt_length > 1
        chosen_end_scores = []
        for i in range(values.size(0)):
            c_inds = (input_ids[i][prompt_length:] == self.PAD_ID).nonzero()
            c_ind = c_inds[0].item() + prompt_length if len(c_inds) > 0 else input_ids.shape[1]
            chosen_end_scores.append(values[i][c_ind - 1])
        return {"values": values, "chosen_end_scores": torch.stack(chosen_end_scores)}


# ----- dschat/utils/utils.py -----
def load_state_dict_into_model(model_to_load, state_dict, start_prefix="", zero_stage=0):
    state_dict = state_dict.copy()
    error_msgs = []

    def load(module, state_dict, prefix=""):
        args = (state_dict, prefix, {}, True, [], [], error_msgs)
        if len([key for key in state_dict if key.startswith(prefix)]) > 0:
            if zero_stage == 3:
                named_parameters = dict(module.named_parameters(prefix=prefix[:-1], recurse=False))
                params_to_gather = [named_parameters[k] for k in state_dict.keys() if k in named_parameters]
                if len(params_to_gather) > 0:
                    with deepspeed.zero.GatheredParameters(params_to_gather, modifier_rank=0):
                        if torch.distributed.get_rank() == 0:
                            module._load_from_state_dict(*args)
            else:
                module._load_from_state_dict(*args)
        for name, child in module._modules.items():
            if child is not None:
                load(child, state_dict, prefix + name + ".")

    load(model_to_load, state_dict, prefix=start_prefix)
    return error_msgs


def _z3_params_to_fetch(param_list):
    return [p for p in param_list if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_hf_format(model, output_dir):
    model_to_save = model.module if hasattr(model, "module") else model
    os.makedirs(output_dir, exist_ok=True)
    torch.save(model_to_save.state_dict(), os.path.join(output_dir, "pytorch_model.bin"))


def save_zero_three_model(model_ema, global_rank, save_dir, zero_stage=0):
    os.makedirs(save_dir, exist_ok=True)
    model_to_save = model_ema.module if hasattr(model_ema, "module") else model_ema
    output_state_dict = {}
    for k, v in model_to_save.named_parameters():
        if hasattr(v, "ds_id"):
            with deepspeed.zero.GatheredParameters(_z3_params_to_fetch([v]), enabled=zero_stage == 3):
                v_p = v.data.cpu()
        else:
            v_p = v.cpu()
        if global_rank == 0:
            output_state_dict[k] = v_p
    if global_rank == 0:
        torch.save(output_state_dict, os.path.join(save_dir, "pytorch_model.bin"))


# ----- dschat/utils/model/model_utils.py -----
def create_hf_model(model_class, model_path, ds_config=None, rlhf_training=False):
    config = OPTConfig.from_pretrained(model_path)
    dschf = None
    if ds_config is not None and ds_config["zero_optimization"]["stage"] == 3:
        from transformers.integrations import HfDeepSpeedConfig

        dschf = HfDeepSpeedConfig(ds_config)  # noqa: F841 - alive while the model is built, as in dschat
    if rlhf_training:
        torch.manual_seed(777 + torch.distributed.get_rank())  # whatever each rank draws: the load replaces it
        return model_class.from_config(config)
    return model_class.from_pretrained(model_path, config=config)


def create_critic_model(model_path, ds_config, num_padding_at_beginning, zero_stage):
    critic_model = RewardModel(create_hf_model(AutoModel, model_path, ds_config, rlhf_training=True),
                               num_padding_at_beginning=num_padding_at_beginning)
    state = torch.load(os.path.join(model_path, "pytorch_model.bin"), map_location="cpu", weights_only=True)
    load_state_dict_into_model(critic_model, state, "", zero_stage=zero_stage)
    return critic_model


# ----- the step 1 and step 2 outputs this run starts from -----
def write_checkpoints(root):
    config = OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=2,
                       max_position_embeddings=64, word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0,
                       pad_token_id=PAD, eos_token_id=EOS, bos_token_id=EOS)
    actor_dir, critic_dir = os.path.join(root, "actor_init"), os.path.join(root, "critic_init")
    if torch.distributed.get_rank() == 0 and not os.path.exists(os.path.join(critic_dir, "pytorch_model.bin")):
        torch.manual_seed(1234)
        AutoModelForCausalLM.from_config(config).save_pretrained(actor_dir)
        torch.manual_seed(4321)
        critic = RewardModel(AutoModel.from_config(config), num_padding_at_beginning=1)
        with torch.no_grad():
            critic.v_head.weight.normal_(std=0.5)  # a value head that scores
        config.save_pretrained(critic_dir)
        torch.save(critic.state_dict(), os.path.join(critic_dir, "pytorch_model.bin"))
    torch.distributed.barrier()
    return actor_dir, critic_dir


# ----- dschat/rlhf/rlhf_engine.py -----
class DeepSpeedRLHFEngine:
    def __init__(self, actor_path, critic_path, args):
        self.args = args
        self.actor = self._init_trained(AutoModelForCausalLM, actor_path, args.actor_zero_stage, lr=1e-3)
        self.ref = self._init_forward_only(actor_path, args.actor_zero_stage, critic=False)
        self.critic = self._init_trained(None, critic_path, args.critic_zero_stage, lr=5e-4)
        self.reward = self._init_forward_only(critic_path, args.critic_zero_stage, critic=True)

    def _batch(self, ds_config):
        ds_config["train_micro_batch_size_per_gpu"] = self.args.per_device_training_batch_size
        ds_config["train_batch_size"] = (self.args.per_device_training_batch_size * torch.distributed.get_world_size()
                                         * self.args.gradient_accumulation_steps)
        return ds_config

    def _init_trained(self, model_class, path, stage, lr):
        ds_config = self._batch(get_train_ds_config(False, self.args.dtype, stage))
        if model_class is None:  # the critic: built under the eval config, as dschat does
            eval_config = self._batch(get_eval_ds_config(False, self.args.dtype, stage))
            model = create_critic_model(path, eval_config, self.args.num_padding_at_beginning, stage)
        else:
            model = create_hf_model(model_class, path, ds_config)
        optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95))
        lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optim, lambda step: 1.0)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optim, lr_scheduler=lr_scheduler, config=ds_config)
        return engine

    def _init_forward_only(self, path, stage, critic):
        stage = stage if stage == 3 else 0  # dschat's: ZeRO 3 for everything, else the whole model
        ds_config = self._batch(get_eval_ds_config(False, self.args.dtype, stage))
        model = create_critic_model(path, ds_config, self.args.num_padding_at_beginning, stage) if critic else \
            create_hf_model(AutoModelForCausalLM, path, ds_config)
        engine, *_ = deepspeed.initialize(model=model, config=ds_config)
        return engine


# ----- dschat/rlhf/ppo_trainer.py -----
def gather_log_probs(logits, labels):
    log_probs = F.log_softmax(logits, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


class DeepSpeedPPOTrainer:
    def __init__(self, rlhf_engine, args):
        self.actor_model, self.critic_model = rlhf_engine.actor, rlhf_engine.critic
        self.ref_model, self.reward_model = rlhf_engine.ref, rlhf_engine.reward
        self.args = args
        self.z3_enabled = args.actor_zero_stage == 3
        self.kl_ctl, self.clip_reward_value, self.cliprange, self.cliprange_value = 0.1, 5, 0.2, 0.2
        self.gamma, self.lam = 1.0, 0.95

    def generate_experience(self, prompts, mask):
        self.eval()
        with torch.no_grad():
            seq = self.actor_model.module.generate(prompts, attention_mask=mask, max_length=PROMPT + ANSWER,
                                                   min_length=PROMPT + ANSWER, pad_token_id=PAD, do_sample=False,
                                                   synced_gpus=self.z3_enabled)
        self.prompt_length = prompts.shape[1]
        self.train()
        attention_mask = seq.not_equal(PAD).long()
        with torch.no_grad():
            output = self.actor_model(seq, attention_mask=attention_mask)
            output_ref = self.ref_model(seq, attention_mask=attention_mask)
            reward_score = self.reward_model.forward_value(seq, attention_mask,
                                                           prompt_length=self.prompt_length)["chosen_end_scores"]
            values = self.critic_model.forward_value(seq, attention_mask, return_value_only=True).detach()[:, :-1]
        return {"prompts": prompts, "logprobs": gather_log_probs(output.logits[:, :-1, :].float(), seq[:, 1:]),
                "ref_logprobs": gather_log_probs(output_ref.logits[:, :-1, :].float(), seq[:, 1:]),
                "value": values.float(), "rewards": reward_score.float(), "input_ids": seq,
                "attention_mask": attention_mask}

    def compute_rewards(self, prompts, log_probs, ref_log_probs, reward_score, action_mask):
        rewards = -self.kl_ctl * (log_probs - ref_log_probs)
        start = prompts.shape[1] - 1
        ends = start + action_mask[:, start:].sum(1) + 1
        reward_clip = torch.clamp(reward_score, -self.clip_reward_value, self.clip_reward_value)
        for j in range(log_probs.shape[0]):
            rewards[j, start:ends[j]][-1] += reward_clip[j]
        return rewards

    def train_rlhf(self, inputs):
        prompts, log_probs, ref_log_probs = inputs["prompts"], inputs["logprobs"], inputs["ref_logprobs"]
        reward_score, values, attention_mask, seq = (inputs["rewards"], inputs["value"], inputs["attention_mask"],
                                                     inputs["input_ids"])
        start = prompts.size()[-1] - 1
        action_mask = attention_mask[:, 1:]
        old_values = values
        with torch.no_grad():
            old_rewards = self.compute_rewards(prompts, log_probs, ref_log_probs, reward_score, action_mask)
            ends = start + action_mask[:, start:].sum(1) + 1
            for i in range(old_rewards.shape[0]):
                old_rewards[i, ends[i]:] = 0
                old_values[i, ends[i]:] = 0
            advantages, returns = self.get_advantages_and_returns(old_values, old_rewards, start)
        batch = {"input_ids": seq, "attention_mask": attention_mask}
        actor_prob = self.actor_model(**batch, use_cache=False).logits
        actor_log_prob = gather_log_probs(actor_prob[:, :-1, :].float(), seq[:, 1:])
        actor_loss = self.actor_loss_fn(actor_log_prob[:, start:], log_probs[:, start:], advantages,
                                        action_mask[:, start:])
        self.actor_model.backward(actor_loss)
        if not self.args.align_overflow:
            self.actor_model.step()
        value = self.critic_model.forward_value(**batch, return_value_only=True, use_cache=False)[:, :-1]
        critic_loss = self.critic_loss_fn(value[:, start:].float(), old_values[:, start:], returns,
                                          action_mask[:, start:])
        self.critic_model.backward(critic_loss)
        if self.args.align_overflow:
            actor_overflow = self.actor_model.optimizer.check_overflow(external=True)
            critic_overflow = self.critic_model.optimizer.check_overflow(external=True)
            if actor_overflow and not critic_overflow:
                self.critic_model.optimizer.skip_step = True
            elif not actor_overflow and critic_overflow:
                self.actor_model.optimizer.skip_step = True
            self.actor_model.step()
        self.critic_model.step()
        return actor_loss, critic_loss

    def get_overflow(self):
        if self.args.dtype == "bf16":
            return False, False
        return self.actor_model.optimizer.overflow, self.critic_model.optimizer.overflow

    def actor_loss_fn(self, logprobs, old_logprobs, advantages, mask):
        ratio = torch.exp((logprobs - old_logprobs) * mask)
        pg_loss1 = -advantages * ratio
        pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - self.cliprange, 1.0 + self.cliprange)
        return torch.sum(torch.max(pg_loss1, pg_loss2) * mask) / mask.sum()

    def critic_loss_fn(self, values, old_values, returns, mask):
        values_clipped = torch.clamp(values, old_values - self.cliprange_value, old_values + self.cliprange_value)
        vf_loss = torch.max((values - returns) ** 2, (values_clipped - returns) ** 2)
        return 0.5 * torch.sum(vf_loss * mask) / mask.sum()

    def get_advantages_and_returns(self, values, rewards, start):
        lastgaelam, advantages_reversed = 0, []
        length = rewards.size()[-1]
        for t in reversed(range(start, length)):
            nextvalues = values[:, t + 1] if t < length - 1 else 0.0
            delta = rewards[:, t] + self.gamma * nextvalues - values[:, t]
            lastgaelam = delta + self.gamma * self.lam * lastgaelam
            advantages_reversed.append(lastgaelam)
        advantages = torch.stack(advantages_reversed[::-1], dim=1)
        return advantages.detach(), advantages + values[:, start:]

    def train(self):
        self.actor_model.train()
        self.critic_model.train()

    def eval(self):
        for model in (self.actor_model, self.critic_model, self.reward_model, self.ref_model):
            model.eval()


# ----- training/step3_rlhf_finetuning/main.py -----
def parse_args():
    parser = argparse.ArgumentParser(description="DeepSpeed-Chat step 3 shaped PPO")
    parser.add_argument("--per_device_training_batch_size", type=int, default=2)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=1)
    parser.add_argument("--num_steps", type=int, default=3)
    parser.add_argument("--actor_zero_stage", type=int, default=0)
    parser.add_argument("--critic_zero_stage", type=int, default=0)
    parser.add_argument("--dtype", choices=["fp16", "bf16", "fp32"], default="fp16")
    parser.add_argument("--align_overflow", action="store_true")
    parser.add_argument("--num_padding_at_beginning", type=int, default=1)
    parser.add_argument("--checkpoints", type=str, required=True, help="where the step 1 and 2 models are")
    parser.add_argument("--output_dir", type=str, default=None)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def state_matches(module, expected):
    """The largest difference between the model's whole weights (rank 0's state_dict) and `expected`."""
    state = module.state_dict()
    assert sorted(state) == sorted(expected), sorted(set(state) ^ set(expected))
    return max(float((state[key].float() - expected[key].float()).abs().max()) for key in expected)


def main():
    args = parse_args()
    deepspeed.init_distributed()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    actor_path, critic_path = write_checkpoints(args.checkpoints)
    rlhf_engine = DeepSpeedRLHFEngine(actor_path, critic_path, args)
    trainer = DeepSpeedPPOTrainer(rlhf_engine, args)
    engines = (rlhf_engine.actor, rlhf_engine.ref, rlhf_engine.critic, rlhf_engine.reward)
    record = {"engines": [type(engine.optimizer).__name__ if engine.optimizer is not None else None
                          for engine in engines],
              "stages": [engine.zero_optimization_stage() for engine in engines],
              "micro_batches": [engine.train_micro_batch_size_per_gpu() for engine in engines]}
    expected = torch.load(os.path.join(critic_path, "pytorch_model.bin"), weights_only=True)
    if rank == 0:  # (at ZeRO 2-3 the other ranks serve rank 0's whole state_dict meanwhile)
        record["critic_and_reward_from_checkpoint"] = [state_matches(engine.module, expected)
                                                       for engine in (rlhf_engine.critic, rlhf_engine.reward)]
    try:
        rlhf_engine.ref.backward(torch.zeros((), requires_grad=True))
    except Exception as err:  # noqa: BLE001 - the refusal is what is recorded
        record["ref_backward"] = f"{type(err).__name__}: {err}"
    steps = []
    for step in range(args.num_steps):
        generator = torch.Generator().manual_seed(100 * step + rank)
        prompts = torch.randint(3, VOCAB, (args.per_device_training_batch_size, PROMPT), generator=generator)
        out = trainer.generate_experience(prompts, torch.ones_like(prompts))
        actor_loss, critic_loss = trainer.train_rlhf(out)
        overflow = trainer.get_overflow()
        figures = torch.tensor([actor_loss.item(), critic_loss.item(), out["rewards"].mean().item()])
        torch.distributed.all_reduce(figures)
        steps.append({"actor_loss": figures[0].item() / world, "critic_loss": figures[1].item() / world,
                      "reward": figures[2].item() / world, "overflow": [bool(o) for o in overflow]})
    record["steps"] = steps
    record["skipped"] = [rlhf_engine.actor.skipped_steps, rlhf_engine.critic.skipped_steps]
    if args.output_dir is not None:
        if rank == 0:
            save_hf_format(rlhf_engine.actor, os.path.join(args.output_dir, "actor"))
            save_hf_format(rlhf_engine.critic, os.path.join(args.output_dir, "critic"))
        if args.actor_zero_stage == 3:
            save_zero_three_model(rlhf_engine.actor, rank, os.path.join(args.output_dir, "actor"), 3)
        if args.critic_zero_stage == 3:
            save_zero_three_model(rlhf_engine.critic, rank, os.path.join(args.output_dir, "critic"), 3)
        if rank == 0:
            with open(os.path.join(args.output_dir, "record.json"), "w") as handle:
                json.dump(record, handle)
    torch.distributed.barrier()
    assert all(math.isfinite(s["actor_loss"]) for s in steps)  # the tests read the record; this stops a NaN run early


if __name__ == "__main__":
    main()
