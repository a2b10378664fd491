"""Data-parallel training with torchpar: the backend plus its C++ DDP.

    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --steps 200
    torchrun --standalone --nproc_per_node=2 examples/train_ddp.py --backend gloo
    python examples/train_ddp.py   # one process

Each rank trains the same MLP on its own slice of a synthetic regression problem;
gradients are averaged during backward, so the replicas stay identical (checked at the end).
"""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn

import torchpar
from torchpar.parallel import DistributedDataParallel


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="torchpar")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=64, help="per rank")
    p.add_argument("--width", type=int, default=512)
    p.add_argument("--bucket-cap-mb", type=float, default=25)
    args = p.parse_args()

    if "RANK" not in os.environ:  # plain `python examples/train_ddp.py`: one process
        os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(29500 + os.getpid() % 1000))
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)  # the same teacher everywhere; DDP broadcasts rank 0's student anyway
    teacher = nn.Linear(args.width, 1)
    model = nn.Sequential(nn.Linear(args.width, args.width), nn.GELU(), nn.Linear(args.width, 1))
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_cap_mb)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    data = torch.Generator().manual_seed(1000 + rank)  # each rank its own slice

    start = time.perf_counter()
    for step in range(1, args.steps + 1):
        x = torch.randn(args.batch, args.width, generator=data)
        with torch.no_grad():
            y = teacher(x)
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % 50 == 0 or step == args.steps:
            avg = loss.detach().clone()
            dist.all_reduce(avg, op=dist.ReduceOp.AVG)
            if rank == 0:
                ms = (time.perf_counter() - start) / step * 1e3
                print(f"step {step:5d}  loss {avg.item():.5f}  {ms:.1f} ms/step", flush=True)

    # Every replica took the same steps: their weights must agree exactly.
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    mine, lowest = flat.clone(), flat.clone()
    dist.all_reduce(lowest, op=dist.ReduceOp.MIN)
    assert torch.equal(mine, lowest), "replicas diverged"
    if rank == 0:
        print(f"{world} replicas identical after {args.steps} steps on backend {dist.get_backend()!r} "
              f"(torchpar {torchpar.__version__})")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
