"""A token classifier whose best micro-batch is in the middle of the grid, for the tuning-quality
benchmark: it checks that a tuner does not simply take the largest micro-batch that fits.

    launcher --nproc_per_node 2 benchmarks/workloads/knee.py --micro_batch_size 32 --deepspeed ds.json

Two costs pull in opposite directions (the global batch is fixed, so samples/s ~ 1 / step time):
- per micro-batch, a fixed cost: the embedding table (196608 x 48, 36 MiB) gets a dense gradient
  on every backward, whatever the micro-batch; small micro-batches (more accumulation steps) pay
  it more often;
- per sample, a cost that jumps at micro-batch 64: eager attention materialises the
  (12 heads, 128, 128) scores as several tensors of 768 KiB per sample. At 64 each is 48 MiB, over
  glibc malloc's 32 MiB mmap ceiling, so each is a fresh mmap whose pages fault in on first touch;
  at 32 (24 MiB) they are reused from the heap. (The 36 MiB embedding gradient faults in the same
  way, 9216 pages per backward.) One rank alone, 1 thread: ~1400 minor faults per sample at 64,
  ~300-600 at 32.

Measured with benchmarks/tuning_quality.py's own grid runs (2 CPU ranks, OMP_NUM_THREADS=1,
profile steps 3..8, max_train_batch_size 128, gas = 128 / (2 x micro)): samples/s, median
(min-max) of 3 interleaved rounds, and the highest peak RSS per rank. Load average 0.95 before,
1.80 after (1 min; our 2 ranks included; another user's tests shared the 2 cores):

    stage | micro 8            | micro 16           | micro 32           | micro 64
      0   | 222 (187-230) 650M | 277 (273-289) 695M | 305 (241-309) 783M | 253 (202-275) 667M
      1   | 217 (177-234) 662M | 285 (271-286) 701M | 291 (255-303) 753M | 206 (204-232) 671M
      2   | 119 (112-121) 575M | 175 (168-188) 661M | 260 (254-271) 745M | 225 (201-237) 634M
      3   |  75 (73-78)   593M | 127 (124-130) 656M | 192 (189-194) 805M | 196 (174-212) 633M

The best is z0 at micro 32; at stages 0-2 micro 64 is 13-29% slower than 32, and at stage 0 32
beat 64 in each of the 3 rounds (and in all 5 rounds of a draft with the same shapes).
Stage 3 gathers parameters again each micro-step, so it alone prefers 64. All fits in 900 MiB.
"""


import torch
import torch.nn as nn
from torch.utils.data import TensorDataset

from training_loop import train, workload_parser


class AttentionBlock(nn.Module):
    """Pre-norm transformer block with eager attention, as GPT-2's "eager" implementation: the
    scores are materialised, scaled, masked and soft-maxed as separate tensors."""

    def __init__(self, width: int, heads: int, seq: int):
        super().__init__()
        self.heads = heads
        self.register_buffer("causal", torch.ones(seq, seq, dtype=torch.bool).tril(), persistent=False)
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))

    def forward(self, x):
        batch, seq, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(batch, seq, 3, self.heads, width // self.heads).permute(2, 0, 3, 1, 4)
        scores = (q @ k.transpose(-1, -2)) / (width // self.heads) ** 0.5
        scores = scores.masked_fill(~self.causal[:seq, :seq], torch.finfo(scores.dtype).min)
        attended = (scores.softmax(dim=-1) @ v).transpose(1, 2).reshape(batch, seq, width)
        x = x + self.out(attended)
        return x + self.mlp(self.norm2(x))


class TokenClassifier(nn.Module):
    def __init__(self, vocab: int, width: int, heads: int, depth: int, seq: int, classes: int = 10):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.zeros(seq, width))
        self.blocks = nn.ModuleList(AttentionBlock(width, heads, seq) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, classes)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=1))


def main() -> None:
    parser = workload_parser(__doc__)
    parser.add_argument("--vocab", type=int, default=196608, help="embedding rows: the per-micro-batch cost")
    parser.add_argument("--seq", type=int, default=128, help="tokens per sample")
    parser.add_argument("--width", type=int, default=48)
    parser.add_argument("--heads", type=int, default=12, help="score tensors are heads x seq x seq per sample")
    parser.add_argument("--depth", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (2048, args.seq), generator=generator)
    labels = torch.randint(0, 10, (2048,), generator=generator)
    model = TokenClassifier(args.vocab, args.width, args.heads, args.depth, args.seq)
    train(args, model, TensorDataset(tokens, labels), nn.functional.cross_entropy)


if __name__ == "__main__":
    main()
