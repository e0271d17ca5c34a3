"""A single-GPU training job that makes the device idle for one known reason (the labelled CUDA
fixtures of tests/fixtures/gpu_h200: recorded with `benchmarks/gpu_check.sh` when a GPU is lent).

Run it unmodified under the probes, as a user would:

    diagnose run --out runs -- python examples/gpu_idle.py --cause item-sync

Causes (--cause), each sized so that its idle time dwarfs a healthy step's own gaps:
  none           a compute-bound MLP (fp32 matmuls of 2048 x 4096 x 4096): the host runs ahead
  tiny-kernels   a deep, narrow model on a micro-batch of 8: hundreds of microsecond kernels per
                 step, the device waits for each launch (launch overhead)
  pageable-copy  each step's input (64 MiB) is copied from pageable host memory with
                 non_blocking=True, which is not asynchronous from pageable memory (fix: pin_memory)
  pinned-copy    the same 64 MiB input from pinned memory (the fix, to measure it)
  item-sync      `loss.item()` after each forward, then --host-ms (3) of host work (logging) before
                 the backward is launched: the device drains and waits (a host sync)
  stream-wait    after each forward a side stream computes an auxiliary term (a chain of matmuls)
                 that the backward waits for (cudaStreamWaitEvent): serial, not idle
  cuda-graph     forward and backward replayed from CUDA graphs (make_graphed_callables), with
                 --host-ms (25) of host work between steps: graph launches and a host gap
  dataloader     each batch takes 30 ms to produce in the Dataset with num_workers=0 (the
                 DataLoader starves the device); `--num-workers 4` is the fix (the twin run)
  host-stall     --host-ms (25) of host work (a CPU op, `cpu_augment`) in the middle of each
                 forward: longer than the device's step, so the device drains its queue and waits
                 (a long launch gap with the op named); shorter, the queue hides it

On a machine without CUDA it runs on the CPU (the causes that need a device do their host part
only); that is for checking the script, not for recording fixtures.
"""
from __future__ import annotations

import argparse
import math
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

CAUSES = ("none", "tiny-kernels", "pageable-copy", "pinned-copy", "item-sync", "stream-wait", "cuda-graph",
          "dataloader", "host-stall")
HOST_MS = {"item-sync": 3.0, "cuda-graph": 25.0, "host-stall": 25.0}


class Batches(Dataset):
    """Whole batches (the DataLoader runs with batch_size=None), each `slow_ms` to produce. Two
    batches made up front and served in turn: making random data would itself be a slow loader."""

    def __init__(self, n: int, batch: int, dim: int, slow_ms: float = 0.0) -> None:
        g = torch.Generator().manual_seed(0)
        self.data = [(torch.randn(batch, dim, generator=g), torch.randn(batch, 1, generator=g)) for _ in range(2)]
        self.n, self.slow_s = n, slow_ms / 1000.0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.slow_s:
            time.sleep(self.slow_s)  # decoding, augmentation, a slow disk
        return self.data[i % 2]


def host_work(ms: float, name: str) -> None:
    """ms of real host computation, as one named op in the trace."""
    with torch.profiler.record_function(name):
        end = time.perf_counter() + ms / 1000.0
        a = torch.full((32, 32), 0.01)
        while time.perf_counter() < end:
            a = torch.tanh(a @ a)


def mlp(dim: int, width: int, layers: int) -> nn.Sequential:
    mods: list[nn.Module] = [nn.Linear(dim, width), nn.ReLU()]
    for _ in range(layers - 1):
        mods += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*mods, nn.Linear(width, 1))


class Stalled(nn.Module):
    """The MLP with host work in the middle of its forward."""

    def __init__(self, first: nn.Module, second: nn.Module, stall_ms: float) -> None:
        super().__init__()
        self.first, self.second, self.stall_ms = first, second, stall_ms

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        host_work(self.stall_ms, "cpu_augment")
        return self.second(x)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cause", choices=CAUSES, default="none")
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--host-ms", type=float, default=None, help="the host work of item-sync, cuda-graph, host-stall")
    args = p.parse_args(argv)
    if args.host_ms is None:
        args.host_ms = HOST_MS.get(args.cause, 0.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 matmuls: a few ms of device work per step
    dim, batch, width, layers = 256, 2048, 4096, 4
    if not cuda:
        batch, width = 64, 256  # a check of the script, not a recording
    if args.cause == "tiny-kernels":
        batch, width, layers = 8, 64, 40
    if args.cause in ("pageable-copy", "pinned-copy"):
        dim = 64 * 2**20 // (4 * batch)  # 64 MiB of fp32 input per step
    model = mlp(dim, width, layers)
    if args.cause == "host-stall":
        model = Stalled(model[:4], model[4:], stall_ms=args.host_ms)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    loss_fn = nn.MSELoss()
    n = args.steps + 2
    slow_ms = 30.0 if args.cause == "dataloader" else 0.0
    pin = cuda and args.cause != "pageable-copy"
    loader = DataLoader(Batches(n, batch, dim, slow_ms), batch_size=None, num_workers=args.num_workers,
                        pin_memory=pin, persistent_workers=args.num_workers > 0)
    side = torch.cuda.Stream() if cuda and args.cause == "stream-wait" else None
    aux_w = torch.randn(width, width, device=device) / width**0.5 if side is not None else None
    if args.cause == "cuda-graph" and cuda:
        sample = torch.randn(batch, dim, device=device, requires_grad=False)
        model = torch.cuda.make_graphed_callables(model, (sample,))
    step = 0
    for x, y in loader:
        if step >= args.steps:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = loss_fn(out, y)
        if side is not None:
            # an auxiliary term on its own stream, from the forward's output; the backward waits for it
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                h = out.detach().expand(-1, width).contiguous()
                for _ in range(6):
                    h = torch.tanh(h @ aux_w)
                aux = h.mean()
            torch.cuda.current_stream().wait_stream(side)
            loss = loss + 0.0 * aux
        if args.cause == "item-sync":
            if not math.isfinite(loss.item()):  # a NaN check each step: the host waits for the device
                raise SystemExit("loss is NaN")
            host_work(args.host_ms, "log_metrics")
        loss.backward()
        opt.step()
        if args.cause == "cuda-graph":
            host_work(args.host_ms, "host_bookkeeping")
        step += 1
    if cuda:
        torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
