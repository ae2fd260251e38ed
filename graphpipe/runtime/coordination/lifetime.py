"""A clean exit with pipelines alive: what happens to them when the process ends.

The guarantee: a script that ends (or calls ``destroy_process_group``) without ``close()`` on
its pipelines exits with status 0, not an abort. Every pipeline still alive at exit is closed,
and every gloo group a pipeline owns is released (its worker threads joined), before the
interpreter finalizes.

Why before: a gloo worker thread (``ProcessGroupGloo::runLoop``) may drop the last reference
to a finished collective (an ``AsyncWork``: the last step's loss broadcast on the pipeline's
control group, say) after the main thread has let go of the work's tensor. Torch keeps a
tensor's Python object alive while C++ still holds the tensor: the tensor then owns that
object, and freeing it needs the GIL (``TensorImpl::decref_pyobject`` ->
``gil_scoped_acquire``). A thread that asks for the GIL while the interpreter finalizes is
ended by ``pthread_exit``, whose forced unwinding through the noexcept ``~AsyncWork`` calls
``std::terminate`` (SIGABRT, ``terminate called without an active exception``). So no gloo
worker of a pipeline may still be running once ``Py_FinalizeEx`` has set the interpreter
finalizing: the groups are destroyed (``~ProcessGroupGloo`` joins their workers) while the
interpreter can still take their tensors' Python objects back.

The gloo groups that matter are owned by the pipeline's ``PipelineGroups``, which can
outlive the pipeline: a pipeline held by a local variable goes when its function returns,
while its ``PipelineGroups`` (in reference cycles with the fault handling and the
communication engine) waits for the garbage collector, which at exit means the collection
``Py_FinalizeEx`` runs after it has set the interpreter finalizing
(``Py_FinalizeEx`` -> ``PyGC_Collect`` -> ``~ProcessGroupGloo``): the window of the abort
above. Registering the pipelines alone is therefore not enough; their groups register too.

So at exit, before the interpreter finalizes, ``release_at_exit`` (an ``atexit`` hook) takes
every pipeline still alive and

1. closes it (``Pipeline.close``: graphs and plans first, as always);
2. lets go of its own gloo groups (``PipelineGroups.release``): the last reference goes,
   and ``~ProcessGroupGloo`` joins its worker threads, each having released its works
   while the interpreter can still take their tensors' Python objects back;
3. keeps it alive through finalization (one extra reference that is never dropped): the
   tensors it holds that works of *other* groups may still hold (the data-parallel
   buckets and gradients on ``dp_group``, the clipped norm on the pipeline group) keep
   their Python objects, so no worker thread of those groups needs the GIL for them. The
   process is ending: the operating system takes the memory back.

and then every ``PipelineGroups`` still alive, its pipeline gone or not (each registers
itself when it builds its groups, ``release_groups_at_exit``; so does a ``DataParallel`` with
the replicas' agreement group it owns): it releases its groups (2) and is kept alive (3)
too. With that, every ``~ProcessGroupGloo`` of a pipeline's groups runs inside the hook
(``_PyAtExit_Call``), never in finalization's collection.

``profiles/exit_soak.py`` runs such a script many times and fails a run that aborts or whose
ranks report a pipeline gloo group still held after the hooks (its doc has the commands and
the figures); ``tests/test_exit_dist.py`` runs it twice in the default suite.

**The store's host.** Global rank 0 of an ``env://`` job serves the job's store, so its exit
takes the store with it. When that process failed (a step, or its construction at or before
a join: it gave up on a late peer, or refused its own arguments) and its exception ends it,
its peers would read only that the store is gone. So the failure registers a hold
(``hold_store``), and the first exit hook (``wait_for_readers``) waits, bounded, until the
peers have marked that they read why.

Owns: the registry of live pipelines and of their ``PipelineGroups`` (weak references), the
holds of the store's host. May touch: a registered pipeline's ``close`` and a registered
``PipelineGroups``' ``release``, at exit only; the store, through a hold's count, at exit.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import weakref
from collections.abc import Callable
from typing import Any

__all__ = [
    "HOLD_S",
    "hold_store",
    "keep_through_exit",
    "release_at_exit",
    "release_groups_at_exit",
    "wait_for_readers",
]

_LIVE: weakref.WeakSet = weakref.WeakSet()  # pipelines
_GROUPS: weakref.WeakSet = weakref.WeakSet()  # their PipelineGroups
_registered = False


def _register() -> None:
    global _registered
    if not _registered:
        atexit.register(release_at_exit)
        _registered = True


def keep_through_exit(pipeline: Any) -> None:
    """Register ``pipeline`` (with ``close()`` and ``groups.release()``) for the exit hook."""
    _LIVE.add(pipeline)
    _register()


def release_groups_at_exit(groups: Any) -> None:
    """Register ``groups`` (a ``PipelineGroups``, with ``release()``) for the exit hook: it
    owns the gloo groups, and outlives its pipeline when it is in a reference cycle."""
    _GROUPS.add(groups)
    _register()


HOLD_S = 30.0
"""The longest the store's host waits at exit for its peers to read why it failed."""

# (how many peers have read it, how many to wait for, seconds, what they read)
_HOLDS: list[tuple[Callable[[], int], int, float, str]] = []
_hold_registered = False


def hold_store(readers: Callable[[], int], expected: int, seconds: float, what: str) -> None:
    """This process serves the job's store and failed (a step, ``faults``; or its
    construction, at or before a join): before it ends, wait until ``readers()`` (a count in
    the store that each peer raises once it has read ``what``) reaches ``expected``, at most
    ``seconds``, so that the peers' errors name this rank's error instead of a store that is
    gone. ``what``: in words, for the line on stderr (``its failure notice of step 3``)."""
    global _hold_registered
    if expected < 1:
        return
    _HOLDS.append((readers, expected, seconds, what))
    if not _hold_registered:
        atexit.register(wait_for_readers)  # registered after release_at_exit: runs first
        _hold_registered = True


def wait_for_readers() -> None:
    """The exit hook of ``hold_store``: one line on stderr when it has to wait, one when a
    peer never read what it waited for."""
    import sys
    import time

    for readers, expected, seconds, what in _HOLDS:
        deadline = time.monotonic() + seconds
        said = False
        while True:
            try:
                got = readers()
            except Exception:  # the store is gone already: nothing to wait for
                break
            if got >= expected:
                break
            now = time.monotonic()
            if now >= deadline:
                print(
                    f"graphpipe: {got} of {expected} peers read {what} within {seconds:g} s; "
                    "exiting (the store goes with this process)",
                    file=sys.stderr,
                )
                break
            if not said and now + seconds - 1.0 > deadline:
                print(
                    f"graphpipe: this process serves the job's store; waiting up to "
                    f"{seconds:g} s for {expected - got} peer(s) to read {what}",
                    file=sys.stderr,
                )
                said = True
            time.sleep(0.05)
    _HOLDS.clear()


def release_at_exit() -> None:
    """The exit hook (see the module doc); safe to call more than once."""
    for pipeline in list(_LIVE):
        with contextlib.suppress(Exception):  # exiting: nothing to report to anyone
            pipeline.close()
        with contextlib.suppress(Exception):
            pipeline.groups.release()
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(pipeline))
        _LIVE.discard(pipeline)
    for groups in list(_GROUPS):  # also those whose pipeline is gone (see the module doc)
        with contextlib.suppress(Exception):
            groups.release()
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(groups))
        _GROUPS.discard(groups)
