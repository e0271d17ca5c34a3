"""A PyTorch Lightning script, as people write them: a LightningModule, a DataLoader, and
`Trainer(accelerator="cpu", devices=2, strategy="ddp")`.

    diagnose run -- torchrun --nproc_per_node=2 examples/train_lightning.py --straggler-rank 1

Under torchrun Lightning joins the launched processes (it starts none of its own). `--straggler-rank
R` makes rank R sleep in `on_before_backward`, Lightning's own hook before each backward.
`--torch-profiler DIR` turns on Lightning's own PyTorchProfiler (steps 2-3), writing into DIR: a job
that profiles itself (under `diagnose run` the probes' profiler stands aside).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stack_common, beside this file

from stack_common import Tokens, parse_args, straggle  # noqa: E402


def main() -> int:
    args = parse_args(__doc__, extra=lambda p: p.add_argument("--torch-profiler", metavar="DIR", default=None))
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)  # ranks share a small host

    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(128, 64)
            self.body = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
            self.head = nn.Linear(64, 128)

        def training_step(self, batch, batch_idx):
            logits = self.head(self.body(self.embed(batch["input_ids"])))
            return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def on_before_backward(self, loss) -> None:
            straggle(args)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    pl.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", 1))
    n = args.batch_size * args.grad_accum * world * (args.steps + 1)
    loader = DataLoader(Tokens(n, slow_ms=args.slow_getitem_ms), batch_size=args.batch_size, num_workers=0)
    callbacks = []
    if args.callback:  # the code way in, instead of `diagnose run`
        from diagnose.probes.lightning import DiagnoseCallback

        callbacks.append(DiagnoseCallback(args.callback, schedule=args.schedule))
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                         max_steps=args.steps, accumulate_grad_batches=args.grad_accum, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=callbacks, profiler=_profiler(args.torch_profiler))
    trainer.fit(TinyLM(), loader)
    return 0


def _profiler(directory: str | None):
    if directory is None:
        return None
    import torch
    from lightning.pytorch.profilers import PyTorchProfiler

    return PyTorchProfiler(dirpath=directory, filename="prof", export_to_chrome=True,
                           schedule=torch.profiler.schedule(wait=1, warmup=1, active=2, repeat=1))


if __name__ == "__main__":
    sys.exit(main())
