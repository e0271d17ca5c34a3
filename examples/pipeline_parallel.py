"""A real GPipe-style pipeline-parallel training job: one stage per rank, activations and
gradients sent between stage ranks with torch.distributed send/recv (gloo on CPU, NCCL on GPUs).

    torchrun --nproc_per_node=2 examples/pipeline_parallel.py --microbatches 4 --trace-dir runs/pp

Each step runs all micro-batches forward (stage s receives from s-1, computes, sends to s+1),
then all backward in reverse direction (fill-drain, as torch.distributed.pipelining's
ScheduleGPipe), then the optimizer step. The micro-batch spans carry the same profiler labels
as ScheduleGPipe ("Forward {i}", "Backward {i}", the receive inside the span), so the trace
reads like one from the library. With p stages of equal cost and m micro-batches each
stage idles (p - 1) / (m + p - 1) of the step.

Flags:
  --microbatches M          micro-batches per step (the bubble shrinks as M grows)
  --micro-batch-size B      samples per micro-batch (fixed: the work per micro-batch does not change with M)
  --stage-layers L0,L1,...  layers per stage (unequal values make unbalanced stages); default --layers each
  --trace-dir DIR           record torch.profiler traces there (ProfilerStep#N marks each step)
  --library                 run the same stages with torch.distributed.pipelining's ScheduleGPipe instead
  --virtual-stages V        with --library: V stages per rank (stage s on rank s mod world, --stage-layers
                            one entry per stage), scheduled by ScheduleInterleaved1F1B, whose profiler
                            ranges read "PP:{stage}{F|B}{micro-batch}"
"""
from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--micro-batch-size", type=int, default=64)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4, help="layers per stage")
    p.add_argument("--stage-layers", default=None, help="comma list, one entry per stage (overrides --layers)")
    p.add_argument("--steps", type=int, default=7, help="default: the profiled window (wait + warmup + active)")
    p.add_argument("--trace-dir", default=None)
    p.add_argument("--library", action="store_true", help="torch.distributed.pipelining.ScheduleGPipe")
    p.add_argument("--virtual-stages", type=int, default=1, help="with --library: ScheduleInterleaved1F1B")
    p.add_argument("--profile-wait", type=int, default=1)
    p.add_argument("--profile-warmup", type=int, default=1)
    p.add_argument("--profile-active", type=int, default=5)
    return p.parse_args(argv)


def build_stage(width: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = []
    for _ in range(layers):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods)


class Stage:
    """One pipeline stage on this rank: GPipe fill-drain over the micro-batches of a step."""

    def __init__(self, rank: int, world: int, module: nn.Module, args: argparse.Namespace, device) -> None:
        self.rank, self.world, self.module, self.args, self.device = rank, world, module, args, device
        self.first, self.last = rank == 0, rank == world - 1
        self.shape = (args.micro_batch_size, args.width)
        g = torch.Generator().manual_seed(rank)
        m = args.microbatches
        self.inputs = [torch.randn(self.shape, generator=g).to(device) for _ in range(m)] if self.first else None
        self.targets = [torch.randn(self.shape, generator=g).to(device) for _ in range(m)] if self.last else None

    def step(self) -> None:
        m = self.args.microbatches
        saved: list[tuple[torch.Tensor, torch.Tensor]] = []
        sends = []
        for i in range(m):
            with record_function(f"Forward {i}"):
                if self.first:
                    x = self.inputs[i]
                else:
                    x = torch.empty(self.shape, device=self.device)
                    dist.recv(x, src=self.rank - 1)
                    x.requires_grad_(True)
                out = self.module(x)
                if self.last:
                    out = nn.functional.mse_loss(out, self.targets[i]) / m
                else:
                    sends.append(dist.isend(out.detach().contiguous(), dst=self.rank + 1))
                saved.append((x, out))
        for w in sends:
            w.wait()
        sends = []
        for i in range(m):
            with record_function(f"Backward {i}"):
                x, out = saved[i]
                if self.last:
                    out.backward()
                else:
                    grad = torch.empty(self.shape, device=self.device)
                    dist.recv(grad, src=self.rank + 1)
                    out.backward(grad)
                if not self.first:
                    sends.append(dist.isend(x.grad.contiguous(), dst=self.rank - 1))
        for w in sends:
            w.wait()


class LibraryStage:
    """The same stages driven by torch.distributed.pipelining: PipelineStage + ScheduleGPipe, or
    with V stages per rank (modules[k] is stage rank + k * world) ScheduleInterleaved1F1B."""

    def __init__(self, rank: int, world: int, modules: list[nn.Module], args: argparse.Namespace, device) -> None:
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe, ScheduleInterleaved1F1B

        self.rank, self.world = rank, world
        n = world * len(modules)
        loss = lambda out, target: nn.functional.mse_loss(out, target)  # noqa: E731
        stages = [PipelineStage(mod, rank + k * world, n, device) for k, mod in enumerate(modules)]
        if len(stages) == 1:
            self.schedule = ScheduleGPipe(stages[0], n_microbatches=args.microbatches, loss_fn=loss)
        else:
            self.schedule = ScheduleInterleaved1F1B(stages, n_microbatches=args.microbatches, loss_fn=loss)
        g = torch.Generator().manual_seed(rank)
        n = args.microbatches * args.micro_batch_size
        self.x = torch.randn(n, args.width, generator=g).to(device)
        self.y = torch.randn(n, args.width, generator=g).to(device)

    def step(self) -> None:
        if self.rank == 0:
            self.schedule.step(self.x)
        elif self.rank == self.world - 1:
            self.schedule.step(target=self.y, losses=[])
        else:
            self.schedule.step()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    torch.manual_seed(rank)
    torch.set_num_threads(1)  # ranks share a small host: keep them from fighting over cores
    v = args.virtual_stages if args.library else 1
    per_stage = [int(x) for x in args.stage_layers.split(",")] if args.stage_layers else [args.layers] * world * v
    if len(per_stage) != world * v:
        raise SystemExit(f"--stage-layers has {len(per_stage)} entries for {world * v} stages")
    modules = [build_stage(args.width, per_stage[rank + k * world]).to(device) for k in range(v)]
    opt = torch.optim.SGD([q for mod in modules for q in mod.parameters()], lr=1e-4)
    stage = LibraryStage(rank, world, modules, args, device) if args.library else Stage(rank, world, modules[0], args,
                                                                                         device)

    prof = None
    if args.trace_dir:
        acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if use_cuda else [])
        prof = torch.profiler.profile(
            activities=acts,
            schedule=torch.profiler.schedule(wait=args.profile_wait, warmup=args.profile_warmup,
                                             active=args.profile_active, repeat=1),
            on_trace_ready=torch.profiler.tensorboard_trace_handler(args.trace_dir, worker_name=f"rank{rank}",
                                                                    use_gzip=True),
            record_shapes=True)
        prof.start()
    for _ in range(args.steps):
        opt.zero_grad(set_to_none=True)
        stage.step()
        opt.step()
        if prof is not None:
            prof.step()
    if prof is not None:
        prof.stop()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
