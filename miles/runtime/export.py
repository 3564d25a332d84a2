"""--save-hf as a run part: when the run finishes, the trained policy as a Hugging Face checkpoint
(with --lora-rank, the PEFT adapter, or base + adapter merged with --lora-merge-on-export)."""

from __future__ import annotations

from miles.config.schema import RunConfig
from miles.lora.peft_files import export_lora
from miles.models.checkpoint import save_model
from miles.runtime.parts import RunPart
from miles.runtime.protocols import Trainer


class ExportPart(RunPart):
    name = "export"

    def __init__(self, cfg: RunConfig, trainer: Trainer, tokenizer) -> None:
        self.cfg, self.trainer, self.tokenizer = cfg, trainer, tokenizer

    def end(self) -> None:
        cfg = self.cfg
        self.trainer.sync_policy()
        if cfg.lora.enabled:
            export_lora(
                self.trainer.policy, cfg.checkpoint.save_hf, cfg.model.model, cfg.lora.lora_merge_on_export,
                self.tokenizer,
            )  # fmt: skip
        else:
            save_model(self.trainer.policy, cfg.checkpoint.save_hf, tokenizer=self.tokenizer)
