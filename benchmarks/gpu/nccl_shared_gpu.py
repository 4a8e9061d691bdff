"""Can two nccl ranks share one GPU? Prints each rank's all-reduce, or NCCL's refusal."""

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29611")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=rank, world_size=2)
    tensor = torch.ones(1, device="cuda")
    dist.all_reduce(tensor)
    torch.cuda.synchronize()
    print(f"rank {rank}: all_reduce on a shared GPU gave {tensor.item()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(rank_main, nprocs=2)
