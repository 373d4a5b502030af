"""`python -m kvq` runs the command line."""

from kvq.cli import main

main()
