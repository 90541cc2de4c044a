"""``python -m jaxspec.cli``: the ``jaxspec`` command."""

import sys

from jaxspec.cli import main

if __name__ == "__main__":  # importing the module (as the test set-up does) runs nothing
    sys.exit(main())
