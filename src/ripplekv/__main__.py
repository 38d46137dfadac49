"""`python -m ripplekv`: the command line, as the `ripplekv` script runs it."""

from ripplekv.cli import main

if __name__ == "__main__":
    main()
