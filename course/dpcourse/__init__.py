"""Helper library of the data-parallel training course: launch ranks, check results, draw pictures."""

from .env import rank_device
from .failures import LaunchError
from .launcher import launch, resolve_backend

__all__ = ["launch", "resolve_backend", "rank_device", "LaunchError"]
