"""``python -m lightning_p2r.cli COMMAND ...``: the ``lightning-p2r`` console script."""

from lightning_p2r.cli import main

main()
