"""Errors graphpipe raises on purpose."""

from __future__ import annotations

__all__ = ["PipelineClosed", "PipelineError"]


class PipelineError(RuntimeError):
    """A step failed on another pipeline rank (or a peer is gone); the message names the rank,
    the action it was running, and the original error."""


class PipelineClosed(PipelineError):
    """The pipeline cannot run any more (a peer is gone, or NCCL state is lost): every call
    raises it; build a new pipeline (and process groups)."""
