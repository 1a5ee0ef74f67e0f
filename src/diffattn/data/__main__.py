"""`python -m diffattn.data TEXT OUT.bin`: tokenize a text file into a token file."""

import sys

try:  # a Ctrl-C at any point, the imports of torch and the tokenizers included, is one line and exit 130
    from diffattn.data.lm import main

    code = main()
except KeyboardInterrupt:
    print("interrupted", file=sys.stderr)
    exec("pass")  # so that python -m exits 130, not by SIGINT: see diffattn.cli.main.forget_keyboard_interrupt
    code = 130
sys.exit(code)
