"""`diffattn <command>`: one module per command on top of the library; main.py dispatches."""
