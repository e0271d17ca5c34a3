"""An FSDP2 script (`fully_shard` on each block, then on the root), as torchtitan writes them, on
CPU with gloo: a plain loop over a DataLoader, sharded parameters all-gathered before each block's
forward and backward, gradients reduce-scattered after.

    diagnose run -- torchrun --nproc_per_node=2 examples/train_fsdp2.py --straggler-rank 1

`--straggler-rank R` makes rank R sleep before each backward. `--mixed-precision bf16` computes in
bf16 and reduce-scatters the gradients in bf16 (MixedPrecisionPolicy); `bf16-fp32-reduce` computes
in bf16 but reduces in fp32 (reduce_dtype=torch.float32), twice the bytes on the wire.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stack_common, beside this file

from stack_common import Tokens, parse_args, straggle  # noqa: E402


def main() -> int:
    args = parse_args(__doc__, extra=lambda p: p.add_argument(
        "--mixed-precision", choices=("none", "bf16", "bf16-fp32-reduce"), default="none"))
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.data import DataLoader

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # ranks share a small host
    blocks = [nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64)) for _ in range(3)]
    model = nn.Sequential(nn.Embedding(128, 64), *blocks, nn.Linear(64, 128))
    mp = {} if args.mixed_precision == "none" else {"mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32 if args.mixed_precision == "bf16-fp32-reduce" else torch.bfloat16)}
    for block in blocks:
        fully_shard(block, **mp)
    fully_shard(model, **mp)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n = args.batch_size * args.grad_accum * (args.steps + 1)
    loader = DataLoader(Tokens(n, slow_ms=args.slow_getitem_ms), batch_size=args.batch_size, num_workers=0,
                        drop_last=True)
    done = 0
    for i, batch in enumerate(loader):
        logits = model(batch["input_ids"])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())
        straggle(args)
        # FSDP2's own gradient accumulation: no reduce-scatter until the last micro-batch
        model.set_requires_gradient_sync((i + 1) % args.grad_accum == 0)
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
