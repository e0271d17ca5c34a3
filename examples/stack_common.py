"""What the training-stack examples share: their flags, a synthetic dataset, the injected faults.

The stack examples (train_hf.py, train_lightning.py, train_fsdp2.py, train_compiled.py) are
ordinary scripts for their framework, run unmodified under `diagnose run`; only the faults below
are ours, injected the way a real one shows up:
- a straggler: one rank sleeps before each backward (a slower GPU, a noisy neighbour);
- a slow input pipeline: each sample's fetch sleeps (a slow disk, heavy decoding).
Not a fault but data as it comes: `Tokens(lengths=(a, b))` gives sequences of varying length, each
batch padded to its longest (`pad_batch`), so the ranks' work differs from step to step.
"""
from __future__ import annotations

import argparse
import os
import time

import torch
from torch.utils.data import Dataset


def parse_args(doc: str, steps: int = 12, batch_size: int = 16, extra=None) -> argparse.Namespace:
    """extra(parser): a script's own flags, added to the shared ones."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=steps, help="optimizer steps")
    p.add_argument("--batch-size", type=int, default=batch_size, help="micro-batch per rank")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--straggler-rank", type=int, default=-1, help="this rank sleeps before each backward")
    p.add_argument("--straggler-ms", type=float, default=150.0)
    p.add_argument("--slow-getitem-ms", type=float, default=0.0, help="each sample's fetch sleeps this long")
    p.add_argument("--callback", metavar="DIR", default=None,
                   help="start the probes with the framework's callback, writing to DIR (no `diagnose run`)")
    p.add_argument("--schedule", default="2,2,5", help="the callback's profiler schedule")
    if extra is not None:
        extra(p)
    return p.parse_args()


def rank() -> int:
    return int(os.environ.get("RANK", 0))


class Tokens(Dataset):
    """Random token sequences (input_ids = labels: a language-model batch); optionally slow to fetch.
    lengths=(a, b): each sequence a..b tokens long (drawn from its index), else `seq` each."""

    def __init__(self, n: int, seq: int = 32, vocab: int = 128, slow_ms: float = 0.0,
                 lengths: tuple[int, int] | None = None) -> None:
        self.n, self.seq, self.vocab, self.slow_s, self.lengths = n, seq, vocab, slow_ms / 1000.0, lengths

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        if not 0 <= i < self.n:
            raise IndexError(i)  # iterated as a sequence (the Trainer's length-grouped sampler does), it ends
        if self.slow_s:
            time.sleep(self.slow_s)
        g = torch.Generator().manual_seed(i)
        seq = self.seq if self.lengths is None else int(torch.randint(self.lengths[0], self.lengths[1] + 1, (1,),
                                                                      generator=g))
        ids = torch.randint(0, self.vocab, (seq,), generator=g)
        return {"input_ids": ids, "labels": ids}


def pad_batch(items: list[dict]) -> dict:
    """A batch of sequences padded to its longest, as DataCollatorWithPadding does (labels -100 on
    the padding, an attention mask)."""
    longest = max(len(x["input_ids"]) for x in items)
    ids = torch.zeros(len(items), longest, dtype=torch.long)
    labels = torch.full((len(items), longest), -100, dtype=torch.long)
    mask = torch.zeros(len(items), longest, dtype=torch.long)
    for j, x in enumerate(items):
        n = len(x["input_ids"])
        ids[j, :n], labels[j, :n], mask[j, :n] = x["input_ids"], x["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def straggle(args: argparse.Namespace) -> None:
    """Called before each backward: the straggler rank sleeps there."""
    if args.straggler_rank == rank():
        time.sleep(args.straggler_ms / 1000.0)
