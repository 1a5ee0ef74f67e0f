"""Model config, blocks and transformers (LM, encoder, classifier)."""
