"""Lightning callbacks of the package."""

from .pseudo_to_real import DelinkEvent, PseudoToReal
from .throughput import Throughput

__all__ = ["DelinkEvent", "PseudoToReal", "Throughput"]
