"""A small ConvNet on synthetic 32x32 images, for the tuning-quality benchmark.

    launcher --nproc_per_node 2 benchmarks/workloads/convnet.py --micro_batch_size 16 --deepspeed ds.json
"""


import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from training_loop import train, workload_parser


class ConvNet(nn.Module):
    def __init__(self, channels: int = 64, blocks: int = 4, classes: int = 10):
        super().__init__()
        self.stem = nn.Conv2d(3, channels, 3, padding=1)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(channels, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU())
            for _ in range(blocks)
        )
        self.head = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.stem(x)
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x.mean(dim=(2, 3)))


def main() -> None:
    parser = workload_parser(None)
    parser.add_argument("--channels", type=int, default=64)
    args = parser.parse_args()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(4096, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (4096,), generator=generator)
    train(args, ConvNet(args.channels), TensorDataset(images, labels), nn.functional.cross_entropy)


if __name__ == "__main__":
    main()
