"""``python -m vitblocks ...`` runs the command line (same as the ``vitblocks`` script)."""
import sys

from .cli import main

if __name__ == '__main__':
    sys.exit(main())
