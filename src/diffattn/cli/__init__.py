"""`diffattn <command>`: one module per command on top of the library."""

from diffattn.cli.main import main

__all__ = ["main"]
