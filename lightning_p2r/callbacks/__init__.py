"""Lightning callbacks of the package."""

from .pseudo_to_real import DelinkEvent, PseudoToReal

__all__ = ["DelinkEvent", "PseudoToReal"]
