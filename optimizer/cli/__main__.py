"""`python -m kiln.optimizer.cli ...`: the `optimize` command line."""

from kiln.optimizer.cli.app import main

main()
