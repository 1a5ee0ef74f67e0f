"""`python -m diffattn.train ...` (torchrun entry point): the same as `diffattn train ...`."""

import sys

from diffattn.train.loop import main

sys.exit(main())
