"""A `torch.compile`d model under DDP in a plain loop (inductor, the default backend: on CPU it writes and
builds C++ kernels on the first step, cached after that).

    diagnose run -- torchrun --nproc_per_node=2 examples/train_compiled.py --straggler-rank 1

`--straggler-rank R` makes rank R sleep before each backward.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stack_common, beside this file

from stack_common import Tokens, parse_args, straggle  # noqa: E402


def main() -> int:
    args = parse_args(__doc__)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.utils.data import DataLoader

    distributed = int(os.environ.get("WORLD_SIZE", 1)) > 1
    if distributed:
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # ranks share a small host
    model = nn.Sequential(nn.Embedding(128, 64), nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 64), nn.GELU(),
                          nn.Linear(64, 128))
    compiled = torch.compile(model)  # the model compiled, then wrapped (as torchtitan does per block)
    if distributed:
        compiled = nn.parallel.DistributedDataParallel(compiled)
    opt = torch.optim.SGD(compiled.parameters(), lr=1e-3)
    n = args.batch_size * args.grad_accum * (args.steps + 1)
    loader = DataLoader(Tokens(n, slow_ms=args.slow_getitem_ms), batch_size=args.batch_size, num_workers=0,
                        drop_last=True)
    done = 0
    for i, batch in enumerate(loader):
        logits = compiled(batch["input_ids"])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        straggle(args)
        loss.backward()
        if (i + 1) % args.grad_accum == 0:
            opt.step()
            opt.zero_grad()
            done += 1
            if done == args.steps:
                break
    if distributed:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
