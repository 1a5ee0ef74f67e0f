"""Evaluation, one module per measure: perplexity, needles, noise, outliers, quantization (with the probes they
share), run together by suite.evaluate_model; heads, batched log-likelihoods (loglik), table formatting."""
