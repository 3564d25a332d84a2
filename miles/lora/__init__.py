"""LoRA: low-rank adapters trained over a frozen base (`adapters`), kept in PEFT's file format
(`peft_files`), and served by the rollout engines as merged low-rank updates (`serving`)."""
