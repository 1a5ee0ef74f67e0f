"""Evaluation: the suite (ppl, needles, noise, outliers, quantization), heads, table formatting."""
