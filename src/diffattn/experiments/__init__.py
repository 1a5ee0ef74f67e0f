"""Experiments built on the library: the needle comparison and the study."""
