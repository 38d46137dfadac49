"""Moved to the command `ripplekv fit lukv` (same options); kept only while scripts/reproduce.sh calls this path."""

import sys

from ripplekv.cli.app import main

if __name__ == "__main__":
    sys.argv = ["ripplekv", "fit", "lukv", *sys.argv[1:]]
    main()
