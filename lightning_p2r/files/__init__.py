"""Files the package writes for the user (caches, cluster files, a run's config), written whole or not at all."""

from .atomic import replaced_atomically, write_atomically

__all__ = ["replaced_atomically", "write_atomically"]
