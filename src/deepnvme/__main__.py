"""``python -m deepnvme``: the ``deepnvme`` command line, for when the console script is not
on PATH."""

import sys

from .cli.main import main

if __name__ == "__main__":
    sys.exit(main())
