"""The framework callbacks (diagnose.probes.hf, diagnose.probes.lightning) on real single-process
training in this process: one step record per optimizer step (gradient accumulation's
micro-batches are one step), the framework's DataLoader timed, a trace that `diagnose analyze`
reads, and every hook undone when training ends. (The 2-process jobs under `diagnose run` are in
tests/test_e2e_stacks.py.)"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from diagnose.pipeline import diagnose_paths  # noqa: E402

STEPS = 6


def records(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "rank0.steps.jsonl").read_text().splitlines()]


def assert_probed(out: Path) -> None:
    steps = records(out)
    assert [s["step"] for s in steps] == list(range(STEPS))
    assert all(s["dataloader_ms"] > 0 for s in steps), steps
    assert list(out.glob("rank0.*.pt.trace.json.gz")) and (out / "rank0.probe.json").exists()
    d = diagnose_paths([out], jobs=1)
    assert d.run.steps_analysed >= 2
    assert next(c for c in d.checks if c.id == "dataloader_starvation").status != "not_measurable"


def test_hugging_face_callback(tmp_path, monkeypatch):
    pytest.importorskip("transformers", reason="the test extra installs transformers: pip install -e '.[test]'")
    from torch.utils.data import DataLoader
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    from diagnose.probes.hf import DiagnoseCallback
    from diagnose.examples.stack_common import Tokens

    monkeypatch.chdir(tmp_path)
    before = DataLoader.__iter__
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_positions=64, n_embd=32, n_layer=1, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), per_device_train_batch_size=4,
                             gradient_accumulation_steps=2, max_steps=STEPS, save_strategy="no", report_to=[],
                             use_cpu=True, dataloader_num_workers=0, disable_tqdm=True, logging_steps=10_000)
    out = tmp_path / "traces"
    Trainer(model=model, args=args, train_dataset=Tokens(4 * 2 * (STEPS + 1)),
            callbacks=[DiagnoseCallback(out, schedule="1,1,3")]).train()
    assert DataLoader.__iter__ is before  # the hooks are gone with the training
    assert_probed(out)


def test_lightning_callback(tmp_path):
    pl = pytest.importorskip("lightning.pytorch", reason="the test extra installs lightning: pip install -e '.[test]'")
    from torch import nn
    from torch.utils.data import DataLoader

    from diagnose.probes.lightning import DiagnoseCallback
    from diagnose.examples.stack_common import Tokens

    class TinyLM(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.embed, self.head = nn.Embedding(128, 16), nn.Linear(16, 128)

        def training_step(self, batch, batch_idx):
            logits = self.head(self.embed(batch["input_ids"]))
            return nn.functional.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    before = DataLoader.__iter__
    out = tmp_path / "traces"
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, accumulate_grad_batches=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         default_root_dir=str(tmp_path), callbacks=[DiagnoseCallback(out, schedule="1,1,3")])
    trainer.fit(TinyLM(), DataLoader(Tokens(4 * 2 * (STEPS + 1)), batch_size=4))
    assert DataLoader.__iter__ is before
    assert_probed(out)
