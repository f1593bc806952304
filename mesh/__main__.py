"""`python -m mesh ...`: the `mesh` command where no console script is installed."""

from mesh.cli import main

main()
