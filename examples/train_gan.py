"""A small, real GAN trained with DDP: two optimizers an iteration, each after its own backward.

Each iteration steps the discriminator (its loss on real and generated samples, its backward, its
Adam step) and then the generator (its loss through the discriminator, its backward, its own Adam
step): two `Optimizer.step#Adam.step` spans an iteration, a backward before each. Runs on CPU with
gloo (or CUDA with NCCL when available).

    torchrun --nproc_per_node=2 examples/train_gan.py --straggler-rank 1 --straggler-ms 150 --trace-dir DIR

--trace-dir records a plain `torch.profiler.profile()` over --profile-active iterations after the
first --profile-skip (no schedule, no prof.step(): a trace without ProfilerStep#N, whose steps are
found from the optimizer steps). --straggler-rank R sleeps --straggler-ms before the generator's
backward on rank R (it arrives late at the generator's gradient all-reduce).
"""
from __future__ import annotations

import argparse
import itertools
import os
import time

import torch
import torch.distributed as dist
from torch import nn


def mlp(sizes: list[int], last: nn.Module | None = None) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(sizes):
        layers += [nn.Linear(a, b), nn.LeakyReLU(0.2)]
    layers[-1] = last if last is not None else nn.Identity()
    return nn.Sequential(*layers)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=10, help="iterations (each a discriminator and a generator step)")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--latent", type=int, default=32)
    p.add_argument("--dim", type=int, default=256, help="the data's dimension")
    p.add_argument("--straggler-rank", type=int, default=-1)
    p.add_argument("--straggler-ms", type=float, default=150.0)
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--profile-skip", type=int, default=3)
    p.add_argument("--profile-active", type=int, default=6)
    args = p.parse_args(argv)

    distributed = "RANK" in os.environ
    use_cuda = torch.cuda.is_available()
    if distributed:
        dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank() if distributed else 0
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu")
    torch.manual_seed(rank)
    torch.set_num_threads(1)

    gen = mlp([args.latent, 256, 512, 512, args.dim], nn.Tanh()).to(device)
    disc = mlp([args.dim, 512, 256, 1]).to(device)
    if distributed:
        gen, disc = nn.parallel.DistributedDataParallel(gen), nn.parallel.DistributedDataParallel(disc)
    opt_d = torch.optim.Adam(disc.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_g = torch.optim.Adam(gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
    loss_fn = nn.BCEWithLogitsLoss()
    ones = torch.ones(args.batch_size, 1, device=device)
    zeros = torch.zeros(args.batch_size, 1, device=device)

    prof = None
    for it in range(args.steps):
        if args.trace_dir and it == args.profile_skip:
            prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]
                                          + ([torch.profiler.ProfilerActivity.CUDA] if use_cuda else []),
                                          record_shapes=True)
            prof.start()
        real = torch.randn(args.batch_size, args.dim, device=device).tanh()
        z = torch.randn(args.batch_size, args.latent, device=device)
        # the discriminator's step: real against generated (the generator's graph cut)
        opt_d.zero_grad(set_to_none=True)
        fake = gen(z)
        loss_d = loss_fn(disc(real), ones) + loss_fn(disc(fake.detach()), zeros)
        loss_d.backward()
        opt_d.step()
        # the generator's step: its loss through the discriminator
        opt_g.zero_grad(set_to_none=True)
        loss_g = loss_fn(disc(fake), ones)
        if rank == args.straggler_rank:
            time.sleep(args.straggler_ms / 1000.0)
        loss_g.backward()
        opt_g.step()
        if prof is not None and it == args.profile_skip + args.profile_active - 1:
            prof.stop()
            os.makedirs(args.trace_dir, exist_ok=True)
            prof.export_chrome_trace(os.path.join(args.trace_dir, f"rank{rank}.pt.trace.json.gz"))
            prof = None
    if distributed:
        dist.barrier()
        del gen, disc, opt_d, opt_g
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
