"""`python -m diffattn.data TEXT OUT.bin`: tokenize a text file into a token file."""

import sys

from diffattn.data.lm import _main

sys.exit(_main())
