"""An FSDP2 script (`fully_shard` on each block, then on the root), as torchtitan writes them, on
CPU with gloo: a plain loop over a DataLoader, sharded parameters all-gathered before each block's
forward and backward, gradients reduce-scattered after.

    diagnose run -- torchrun --nproc_per_node=2 examples/train_fsdp2.py --straggler-rank 1

`--straggler-rank R` makes rank R sleep before each backward. `--mixed-precision bf16` computes in
bf16 and reduce-scatters the gradients in bf16 (MixedPrecisionPolicy); `bf16-fp32-reduce` computes
in bf16 but reduces in fp32 (reduce_dtype=torch.float32), twice the bytes on the wire.
`--blocks N --width W` size the model; `--prefetch` sets explicit forward prefetch (each block
all-gathers the next one's parameters during its own forward). Tried on the 2-core VM (2026-12-04,
`--blocks 6 --width 2048`, three pairs): the job's own step ranged 172-707 ms from run to run
without prefetch and 251-468 ms with it, so no prefetch verdict can be checked here.
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stack_common, beside this file

from stack_common import Tokens, parse_args, straggle  # noqa: E402


def main() -> int:
    def extra(p):
        p.add_argument("--mixed-precision", choices=("none", "bf16", "bf16-fp32-reduce"), default="none")
        p.add_argument("--blocks", type=int, default=3)
        p.add_argument("--width", type=int, default=256, help="each block's hidden width")
        p.add_argument("--prefetch", action="store_true",
                       help="each block all-gathers the next block's parameters during its own forward")

    args = parse_args(__doc__, extra=extra)
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.utils.data import DataLoader

    dist.init_process_group("gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # ranks share a small host
    blocks = [nn.Sequential(nn.Linear(64, args.width), nn.ReLU(), nn.Linear(args.width, 64))
              for _ in range(args.blocks)]
    model = nn.Sequential(nn.Embedding(128, 64), *blocks, nn.Linear(64, 128))
    mp = {} if args.mixed_precision == "none" else {"mp_policy": MixedPrecisionPolicy(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32 if args.mixed_precision == "bf16-fp32-reduce" else torch.bfloat16)}
    for block in blocks:
        fully_shard(block, **mp)
    fully_shard(model, **mp)
    if args.prefetch:  # explicit forward prefetch (FSDP2): the next block's all-gather is issued early
        for block, nxt in zip(blocks, blocks[1:]):
            block.set_modules_to_forward_prefetch([nxt])
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
