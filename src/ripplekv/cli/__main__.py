"""`python -m ripplekv.cli`: the same app as the `ripplekv` command."""

from ripplekv.cli import main

main()
