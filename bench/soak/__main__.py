"""`python -m bench.soak`: the chaos soak's command line (options: `--help`)."""

import sys

from bench.soak.run import main

sys.exit(main(prog="python -m bench.soak"))
