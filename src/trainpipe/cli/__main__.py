"""`python -m trainpipe.cli ARGS`: the `trainpipe` command (what torchrun and the emitted launch files start)."""

import sys

from trainpipe.cli import main

if __name__ == "__main__":
    sys.exit(main())
