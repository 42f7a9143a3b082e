"""``P2RStrategy``: its engines, placement, step runners and the torch pieces they share (the torch-free rules are
``lightning_p2r.layout``)."""

from .strategy import P2RStrategy

__all__ = ["P2RStrategy"]
