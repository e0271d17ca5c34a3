"""A real DDP job (Adam; gloo on CPU, NCCL on GPUs) that writes a checkpoint every N steps, as training scripts do.

    torchrun --nproc_per_node=2 examples/train_checkpoint.py --save-every 3 --save-mode direct

Save modes:
  direct   rank 0 torch.save()s straight to the final file name (the common, non-atomic way)
  atomic   rank 0 torch.save()s to a temporary name, then os.replace()s it onto the final name
  dcp      every rank writes its part with torch.distributed.checkpoint.save (synchronous)
  async    torch.distributed.checkpoint.async_save: only the staging blocks the loop

--extra-mb adds a non-trained buffer of that size to the saved state (a stand-in for the
larger model a real checkpoint holds), so the write takes measurable time on any disk.
The model has a known parameter count (printed with --print-params): 16 bytes per parameter
of weights + gradients + Adam moments in fp32.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    p.add_argument("--save-every", type=int, default=3, help="0: never")
    p.add_argument("--save-mode", choices=["direct", "atomic", "dcp", "async"], default="direct")
    p.add_argument("--save-dir", default=None, help="default: a temporary directory")
    p.add_argument("--extra-mb", type=float, default=32.0)
    p.add_argument("--log-every", type=int, default=0,
                   help="read the loss with .item() every N steps (a host-device sync on GPUs); 0: never")
    p.add_argument("--print-params", action="store_true")
    return p.parse_args(argv)


def build_model(dim: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 1))


def param_count(dim: int, hidden: int) -> int:
    return (dim * hidden + hidden) + (hidden * hidden + hidden) + (hidden + 1)


def save(args, step: int, model: nn.Module, opt, extra: torch.Tensor, rank: int, pending: list, pg=None) -> None:
    state = {"model": model.state_dict(), "optim": opt.state_dict(), "extra": extra, "step": step}
    if args.save_mode in ("direct", "atomic"):
        if rank != 0:
            return
        final = os.path.join(args.save_dir, f"ckpt_step{step}.pt")
        if args.save_mode == "direct":
            torch.save(state, final)
        else:
            tmp = final + ".tmp"
            torch.save(state, tmp)
            os.replace(tmp, final)
        return
    import torch.distributed.checkpoint as dcp

    path = os.path.join(args.save_dir, f"dcp_step{step}")
    flat = {"model": model.state_dict(), "extra": extra}
    if args.save_mode == "dcp":
        dcp.save(flat, checkpoint_id=path, process_group=pg)
    else:
        for f in pending:
            f.result()
        pending[:] = [dcp.async_save(flat, checkpoint_id=path, process_group=pg)]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.print_params:
        print(param_count(args.dim, args.hidden))
        return 0
    distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
    use_cuda = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    ckpt_pg = None
    if args.save_mode in ("dcp", "async"):
        import torch.distributed.checkpoint as dcp  # noqa: F401  (imported up front, as training scripts do)

        if distributed:
            # a group of its own: an async save's collectives run beside DDP's all-reduces
            ckpt_pg = dist.new_group(backend="gloo")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # ranks share a small host
    if args.save_dir is None:
        import tempfile

        args.save_dir = tempfile.mkdtemp(prefix="diagnose-ckpt-")
    os.makedirs(args.save_dir, exist_ok=True)
    model = build_model(args.dim, args.hidden).to(device)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = (torch.optim.Adam(model.parameters(), lr=1e-3) if args.optimizer == "adam"
           else torch.optim.SGD(model.parameters(), lr=1e-3))
    extra = torch.randn(int(args.extra_mb * 1024**2 / 4)) if args.extra_mb > 0 else torch.zeros(0)
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(args.batch_size, args.dim, generator=g).to(device)
    y = torch.randn(args.batch_size, 1, generator=g).to(device)
    pending: list = []
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        if args.log_every and step % args.log_every == 0 and rank == 0:
            print(f"step {step} loss {loss.item():.4f}")
        if args.save_every and step % args.save_every == 0:
            save(args, step, model.module if distributed else model, opt, extra, rank, pending, ckpt_pg)
    for f in pending:
        f.result()
    if rank == 0:
        print(f"trained {args.steps} steps in {time.perf_counter() - t0:.2f} s; checkpoints in {args.save_dir}")
    if distributed:
        dist.barrier()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
