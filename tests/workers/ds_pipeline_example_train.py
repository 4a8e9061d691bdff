"""DeepSpeedExamples' training/pipeline_parallelism/train.py in its shape, with only its deepspeed
imports swapped for ours: `-p N` trains AlexNet split into N stages by PipelineModule (DeepSpeed's
"parameters" partition) with engine.train_batch(); `-p 0` trains it whole with forward/backward/
step (the example's train_base). The data are synthetic, in CIFAR-10's classes and the example's
normalised image tensors (the example downloads CIFAR-10 and resizes it to 224; --image_size sets
the side here, so CPU runs stay short). Beside the imports, for the tests: --dropout (torchvision's
0.5 by default; 0 lets a split and an unsplit run draw no random masks, so their losses can be
compared) and --out, where rank 0 writes each step's loss. The example's torch.cuda.set_device is
left out: these runs are on CPU (--backend gloo)."""

import argparse
import json
import os

import torch
import torch.distributed as dist

import autotuner as deepspeed
from autotuner.pipe import PipelineModule
from autotuner.utils import RepeatingLoader

from alexnet import AlexNet  # torchvision.models.AlexNet in the example


class SyntheticCifar(torch.utils.data.Dataset):
    """CIFAR-10's shape after the example's transforms: (3, side, side) normalised images, 10 classes."""

    def __init__(self, size: int, side: int, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        self.images = torch.randn(size, 3, side, side, generator=g)
        self.labels = torch.randint(0, 10, (size,), generator=g)

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, i):
        return self.images[i], self.labels[i]


def get_args():
    parser = argparse.ArgumentParser(description='CIFAR')
    parser.add_argument('--local_rank', type=int, default=-1, help='local rank passed from distributed launcher')
    parser.add_argument('-s', '--steps', type=int, default=100, help='quit after this many steps')
    parser.add_argument('-p', '--pipeline-parallel-size', type=int, default=2, help='pipeline parallelism')
    parser.add_argument('--backend', type=str, default='nccl', help='distributed backend')
    parser.add_argument('--seed', type=int, default=1138, help='PRNG seed')
    parser.add_argument('--image_size', type=int, default=224)
    parser.add_argument('--dataset_size', type=int, default=256)
    parser.add_argument('--dropout', type=float, default=0.5)
    parser.add_argument('--out', default=None)
    parser = deepspeed.add_config_arguments(parser)
    return parser.parse_args()


def join_layers(vision_model):
    layers = [
        *vision_model.features,
        vision_model.avgpool,
        lambda x: torch.flatten(x, 1),
        *vision_model.classifier,
    ]
    return layers


def record(args, losses):
    if args.out and dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(losses, f)


def train_base(args):
    torch.manual_seed(args.seed)
    net = AlexNet(num_classes=10, dropout=args.dropout)
    trainset = SyntheticCifar(args.dataset_size, args.image_size)
    engine, _, dataloader, __ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    dataloader = RepeatingLoader(dataloader)
    data_iter = iter(dataloader)
    rank = dist.get_rank()
    gas = engine.gradient_accumulation_steps()
    criterion = torch.nn.CrossEntropyLoss()
    total_steps = args.steps * engine.gradient_accumulation_steps()
    step = 0
    losses, step_loss = [], 0.0
    for micro_step in range(total_steps):
        batch = next(data_iter)
        inputs = batch[0].to(engine.device)
        labels = batch[1].to(engine.device)
        outputs = engine(inputs)
        loss = criterion(outputs, labels)
        engine.backward(loss)
        engine.step()
        step_loss += loss.item() / gas
        if micro_step % gas == gas - 1:  # the step's mean loss over the data-parallel ranks
            mean = torch.tensor(step_loss)
            dist.all_reduce(mean)
            losses.append(mean.item() / dist.get_world_size())
            step_loss = 0.0
            step += 1
            if rank == 0 and (step % 10 == 0):
                print(f'step: {step:3d} / {args.steps:3d} loss: {loss}')
    record(args, losses)


def train_pipe(args, part='parameters'):
    torch.manual_seed(args.seed)
    deepspeed.runtime.utils.set_random_seed(args.seed)
    net = AlexNet(num_classes=10, dropout=args.dropout)
    net = PipelineModule(layers=join_layers(net), loss_fn=torch.nn.CrossEntropyLoss(),
                         num_stages=args.pipeline_parallel_size, partition_method=part,
                         activation_checkpoint_interval=0)
    trainset = SyntheticCifar(args.dataset_size, args.image_size)
    engine, _, _, _ = deepspeed.initialize(
        args=args, model=net, model_parameters=[p for p in net.parameters() if p.requires_grad],
        training_data=trainset)
    losses = []
    for step in range(args.steps):
        loss = engine.train_batch()
        losses.append(loss.item())
    record(args, losses)


if __name__ == '__main__':
    args = get_args()
    deepspeed.init_distributed(dist_backend=args.backend)
    args.local_rank = int(os.environ['LOCAL_RANK'])
    if args.pipeline_parallel_size == 0:
        train_base(args)
    else:
        train_pipe(args)
