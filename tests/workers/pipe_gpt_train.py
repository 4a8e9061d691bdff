"""A GPT-style PipelineModule: tied embedding and head, blocks, trained with train_batch; or the
same layers unsplit (--pp 0) trained with forward/backward/step. Prints each step's loss (rank 0)."""
import argparse, json, os
import torch, torch.nn as nn
import autotuner as deepspeed
from autotuner.pipe import PipelineModule, LayerSpec, TiedLayerSpec

V, D, T = 64, 32, 16

class Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(V, D) * 0.02)
    def forward(self, ids):
        return nn.functional.embedding(ids, self.weight)

def head(embed, x):
    return x @ embed.weight.t()

class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.LayerNorm(D); self.fc1 = nn.Linear(D, 4 * D); self.fc2 = nn.Linear(4 * D, D)
    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.ln(x))))

def loss_fn(logits, labels):
    return nn.functional.cross_entropy(logits.reshape(-1, V), labels.reshape(-1))

def layers(n):
    return [TiedLayerSpec("embed", Embed), *[LayerSpec(Block) for _ in range(n)], LayerSpec(nn.LayerNorm, D),
            TiedLayerSpec("embed", Embed, forward_fn=head)]

class Data(torch.utils.data.Dataset):
    def __init__(self, n=512):
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, V, (n, 1), generator=g)
        steps = torch.arange(T + 1).unsqueeze(0)
        self.ids = (start * 1 + steps * 3) % V  # a learnable sequence
    def __len__(self): return len(self.ids)
    def __getitem__(self, i): return self.ids[i, :-1], self.ids[i, 1:]

p = argparse.ArgumentParser()
p.add_argument("--pp", type=int, default=2); p.add_argument("--steps", type=int, default=4)
p.add_argument("--blocks", type=int, default=4); p.add_argument("--out", default=None)
p.add_argument("--local_rank", type=int, default=-1); p.add_argument("--partition", default="parameters")
p.add_argument("--eval", action="store_true")
p.add_argument("--dim", type=int, default=D); p.add_argument("--vocab", type=int, default=V)  # a tune's model sizes
p.add_argument("--seq", type=int, default=T)
p.add_argument("--refusals", action="store_true")
p.add_argument("--save", default=None); p.add_argument("--load", default=None); p.add_argument("--save16", default=None)
p.add_argument("--save_at", type=int, default=0)  # save --save after this step and train on (0: at the end)
deepspeed.add_config_arguments(p)
args = p.parse_args()
V, D, T = args.vocab, args.dim, args.seq
deepspeed.init_distributed()
torch.manual_seed(1)
losses = []
if args.refusals:  # each wrong request refused in one line (ConfigError/UnsupportedError, exit status 2)
    from autotuner.core.errors import AutotunerError
    from autotuner.pipe import PipeModelDataParallelTopology
    world = torch.distributed.get_world_size()
    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 0.01}}}
    attempts = {
        "stages_divide": lambda: PipelineModule(layers(2), num_stages=world - 1),
        "more_stages_than_layers": lambda: PipelineModule(layers(0), num_stages=world),
        "type_matches_nothing": lambda: PipelineModule(layers(2), num_stages=2, partition_method="type:conv"),
        "no_such_method": lambda: PipelineModule(layers(2), num_stages=2, partition_method="profile"),
        "v_eval": lambda: deepspeed.initialize(model=PipelineModule(layers(2), num_stages=2, loss_fn=loss_fn), config={
            **base, "pipeline": {"schedule": "ZBVZeroBubble"}})[0].eval_batch(iter([])),
        "model_axis_without_autotp": lambda: deepspeed.initialize(model=PipelineModule(
            layers(2), topology=PipeModelDataParallelTopology(num_pp=2, num_mp=2, num_dp=world // 4)), config=base),
    }
    engines = {
        "zero_2": {"zero_optimization": {"stage": 2}},
        "stages_disagree": {"pipeline": {"stages": 4}},
        "v_three_chunks": {"pipeline": {"schedule": "ZBVZeroBubble", "stages_per_rank": 3}},
        "dual_pipe_v_few": {"pipeline": {"schedule": "DualPipeV"}},
        "unknown_schedule": {"pipeline": {"schedule": "Zigzag"}},
        "chunks_under_1f1b": {"pipeline": {"schedule": "1F1B", "stages_per_rank": 2}},
        "more_chunks_than_layers": {"pipeline": {"schedule": "Interleaved1F1B", "stages_per_rank": 3}},
        "not_whole_rounds": {"gradient_accumulation_steps": 5, "pipeline": {"schedule": "Interleaved1F1B"}},
    }
    found = {}
    for name, attempt in attempts.items():
        try:
            attempt()
            found[name] = None
        except AutotunerError as err:
            found[name] = [str(err), err.exit_code]
    net = PipelineModule(layers(2), num_stages=2, loss_fn=loss_fn)
    for name, extra in engines.items():
        try:
            deepspeed.initialize(model=net, config={**base, **extra})
            found[name] = None
        except AutotunerError as err:
            found[name] = [str(err), err.exit_code]
    engine, _, _, _ = deepspeed.initialize(model=net, config=base)
    for call in ("forward", "backward", "step"):
        try:
            getattr(engine, call)(torch.zeros(1))
            found[call] = None
        except Exception as err:
            found[call] = [f"{type(err).__name__}: {err}", None]
    if int(os.environ["RANK"]) == 0:
        with open(os.path.join(os.path.dirname(args.out), "refusals.json"), "w") as f:
            json.dump(found, f)
elif args.pp > 0:
    net = PipelineModule(layers(args.blocks), num_stages=args.pp, loss_fn=loss_fn, seed_layers=True, base_seed=7,
                         partition_method=args.partition)
    engine, _, loader, _ = deepspeed.initialize(args=args, model=net, model_parameters=[q for q in net.parameters() if q.requires_grad], training_data=Data())
    if args.load:  # resume: the data iterator skips the batches the saved steps read
        path, client = engine.load_checkpoint(args.load)
        assert path is not None and client == {"note": "mid-run"}, (path, client)
        for _ in range(engine.global_steps * engine.gradient_accumulation_steps()):
            if engine.data_iterator is not None:
                next(engine.data_iterator)
    for step in range(1, args.steps + 1):
        loss = engine.train_batch()
        assert loss.dim() == 0, loss.shape  # every stage gets the mean loss, as DeepSpeed returns it
        losses.append(loss.item())
        if args.save and step == args.save_at:
            engine.save_checkpoint(args.save, client_state={"note": "mid-run"})
    if args.eval:  # forward only, the same data again: the trained model's mean loss on every stage
        losses.append(engine.eval_batch(iter(torch.utils.data.DataLoader(Data(), batch_size=4))).item())
    if args.save and not args.save_at:
        engine.save_checkpoint(args.save, client_state={"note": "mid-run"})
    if args.save16:
        engine.save_16bit_model(args.save16)
    with open(os.path.join(os.path.dirname(args.out or "."), f"stage_of_rank{os.environ['RANK']}.json"), "w") as f:
        json.dump({"stage": engine.stage_id, "first": engine.is_first_stage(), "last": engine.is_last_stage(),
                   "parts": net.partitions(), "names": sorted(n for n, _ in net.named_parameters())}, f)
else:
    # the same layers, built in one process in order with the same seeds: the unsplit model
    class Whole(nn.Module):
        def __init__(self):
            super().__init__()
            specs = layers(args.blocks)
            mods = []
            self.embed = None
            for i, spec in enumerate(specs):
                torch.manual_seed(7 + i)
                import random; random.seed(7 + i)
                if isinstance(spec, TiedLayerSpec) and self.embed is not None:
                    mods.append(None); continue
                m = spec.build(); mods.append(m)
                if isinstance(spec, TiedLayerSpec): self.embed = m
            self.blocks = nn.ModuleList([m for m in mods[1:-1]])
        def forward(self, ids):
            x = self.embed(ids)
            for b in self.blocks: x = b(x)
            return head(self.embed, x)
    net = Whole()
    engine, _, _, _ = deepspeed.initialize(args=args, model=net)
    data = Data()
    sampler = torch.utils.data.DistributedSampler(data, shuffle=False)
    it = iter(torch.utils.data.DataLoader(data, batch_size=engine.train_micro_batch_size_per_gpu(), sampler=sampler))
    gas = engine.gradient_accumulation_steps()
    for _ in range(args.steps):
        total = 0.0
        for _ in range(gas):
            ids, labels = next(it)
            loss = loss_fn(engine(ids), labels)
            engine.backward(loss); engine.step(); total += loss.item()
        mean = torch.tensor(total / gas)
        torch.distributed.all_reduce(mean)  # over the data-parallel ranks, as train_batch returns it
        losses.append(mean.item() / torch.distributed.get_world_size())
    if args.save16:
        engine.save_16bit_model(args.save16)
    if args.eval:  # the same forward-only pass as eval_batch's: the first gas micro-batches, in order
        engine.module.eval()
        with torch.no_grad():
            batches = iter(torch.utils.data.DataLoader(Data(), batch_size=4))
            losses.append(sum(loss_fn(engine(ids), labels).item() for ids, labels in
                              (next(batches) for _ in range(gas))) / gas)
if int(os.environ.get("RANK", 0)) == 0:
    print("LOSSES", json.dumps(losses))
    if args.out: open(args.out, "w").write(json.dumps(losses))
