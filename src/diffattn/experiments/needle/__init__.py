"""The default `diffattn compare`: train DIFF and its matched baseline, check claims, report."""
