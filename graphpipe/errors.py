"""Errors graphpipe raises on purpose."""

from __future__ import annotations

__all__ = ["PipelineError"]


class PipelineError(RuntimeError):
    """A step failed on another pipeline rank (or a peer is gone); the message names the rank,
    the action it was running, and the original error."""
