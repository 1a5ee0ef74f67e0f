import sys

from diffattn.cli.main import main

sys.exit(main())
