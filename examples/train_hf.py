"""A Hugging Face Trainer script, as people write them: a tiny GPT-2 built from a config (no
download), the Trainer's own DataLoader, DDP, optimizer and gradient accumulation.

    diagnose run -- torchrun --nproc_per_node=2 examples/train_hf.py --grad-accum 2 --straggler-rank 1

On CPU the Trainer uses gloo. `--straggler-rank R` makes rank R sleep before each backward (a
`training_step` override, the most common Trainer customisation; its loop is untouched).

`--lengths 16,256` trains on sequences of 16 to 256 tokens, each batch padded to its longest (no
fault injected: the ranks' work differs with their batches); `--group-by-length` is the Trainer's
own fix (its length-grouped sampler gives the ranks batches of like length at each step).
`--width` sets the model's hidden size (64), so that its work grows with the tokens.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # stack_common, beside this file

from stack_common import Tokens, pad_batch, parse_args, straggle  # noqa: E402


def _flags(p) -> None:
    p.add_argument("--lengths", default=None, metavar="MIN,MAX", help="sequences of MIN..MAX tokens")
    p.add_argument("--group-by-length", action="store_true", help="the Trainer's length-grouped sampler")
    p.add_argument("--width", type=int, default=64, help="the model's hidden size")


def main() -> int:
    args = parse_args(__doc__, extra=_flags)
    lengths = tuple(int(x) for x in args.lengths.split(",")) if args.lengths else None
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    torch.manual_seed(0)
    torch.set_num_threads(1)  # ranks share a small host
    config = GPT2Config(vocab_size=128, n_positions=max(64, lengths[1] if lengths else 0), n_embd=args.width,
                        n_layer=2, n_head=2, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    n = args.batch_size * args.grad_accum * 2 * (args.steps + 1)
    training = TrainingArguments(
        output_dir=str(Path(tempfile.gettempdir()) / "diagnose-example-hf"),  # nothing is saved there
        per_device_train_batch_size=args.batch_size, gradient_accumulation_steps=args.grad_accum,
        max_steps=args.steps, learning_rate=1e-3, logging_steps=10_000, save_strategy="no", report_to=[],
        use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, ddp_find_unused_parameters=False,
        train_sampling_strategy="group_by_length" if args.group_by_length else "random")
    class StragglingTrainer(Trainer):  # the one override: the injected fault, before each micro-batch
        def training_step(self, *a, **kw):
            straggle(args)
            return super().training_step(*a, **kw)

    callbacks = []
    if args.callback:  # the code way in, instead of `diagnose run`
        from diagnose.probes.hf import DiagnoseCallback

        callbacks.append(DiagnoseCallback(args.callback, schedule=args.schedule))
    StragglingTrainer(model=model, args=training, train_dataset=Tokens(n, slow_ms=args.slow_getitem_ms, lengths=lengths),
                      data_collator=pad_batch if lengths else None, callbacks=callbacks).train()
    return 0


if __name__ == "__main__":
    sys.exit(main())
