"""Two-dimensional parallelism as torchtitan composes it, on CPU with gloo: a 2-D device mesh
(`dp` x `tp`), each block's MLP tensor-parallel over `tp` (column-wise then row-wise: one
all-reduce of the activations a block in the forward and one in the backward, among the `tp`
ranks only) and the model FSDP2-sharded over `dp`. Two kinds of process group, each rank in one
of each: a rank's wait at a `tp` collective is for its tensor-parallel peer, not for every rank.

    diagnose run -- torchrun --nproc_per_node=4 examples/train_2d.py --tp 2 --straggler-rank 3

`--straggler-rank R` makes rank R sleep before each backward: its `tp` peer waits for it at the
backward's first tensor-parallel all-reduce, and every `dp` peer of theirs at the gradients'
reduce-scatter.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stack_common, beside this file

from stack_common import Tokens, parse_args, straggle  # noqa: E402


def main() -> int:
    def extra(p):
        p.add_argument("--tp", type=int, default=2, help="tensor-parallel ranks (the mesh's inner dimension)")
        p.add_argument("--blocks", type=int, default=2)
        p.add_argument("--width", type=int, default=256, help="each block's hidden width")

    args = parse_args(__doc__, extra=extra)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.data import DataLoader

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if world % args.tp:
        raise SystemExit(f"world size {world} is not a multiple of --tp {args.tp}")
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    torch.set_num_threads(1)  # ranks share a small host

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(64, args.width), nn.Linear(args.width, 64)

        def forward(self, x):
            return x + self.down(torch.relu(self.up(x)))

    blocks = [Block() for _ in range(args.blocks)]
    model = nn.Sequential(nn.Embedding(128, 64), *blocks, nn.Linear(64, 128))
    for block in blocks:
        parallelize_module(block, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    # each dp replica its own data; the tp ranks of a replica the same batch
    dp_rank = mesh["dp"].get_local_rank()
    n = args.batch_size * args.grad_accum * (args.steps + 1)
    data = torch.utils.data.Subset(Tokens(n * mesh["dp"].size()), range(dp_rank * n, (dp_rank + 1) * n))
    loader = DataLoader(data, batch_size=args.batch_size, num_workers=0, drop_last=True)
    done = 0
    for i, batch in enumerate(loader):
        logits = model(batch["input_ids"])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        straggle(args)
        loss.backward()
        if (i + 1) % args.grad_accum == 0:
            opt.step()
            opt.zero_grad()
            done += 1
            if done == args.steps:
                break
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
