"""Training: config, optimizer, checkpoints, run folders, signals, distributed, diagnostics, the loop."""
