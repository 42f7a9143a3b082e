"""Files the package writes for the user (caches, cluster files, a run's config), written whole or not at all."""

from .atomic import write_atomically

__all__ = ["write_atomically"]
