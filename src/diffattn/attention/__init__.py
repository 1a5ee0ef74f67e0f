"""The attention registry and one file per variant: reference op, fast op, module, registry entry."""
