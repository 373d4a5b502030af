"""`python -m kvq` runs the command line."""

from kvq.entry import main

main()
