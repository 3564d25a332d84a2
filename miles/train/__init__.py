"""miles.train: the trainer (log-prob recomputation, losses, optimizer, checkpoints)."""
