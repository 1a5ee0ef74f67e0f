"""Data: LM token windows, synthetic tasks, classification files."""
