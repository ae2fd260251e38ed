"""How many decoder layers each pipeline stage holds: the even split, and a chosen one checked.

Plain Python (no torch, no numpy), so that the command line checks ``--layers-per-stage``
before any rank starts, and the models and the planner share one rule: stage ``s`` holds a
contiguous run of ``counts[s]`` layers, in order; every middle stage holds at least one (a
stage with no parameters would be a pure relay); the first and the last stage may hold none
(they also hold the embedding and the head).

Owns: nothing (functions on lists). May touch: nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["check_layers_per_stage", "layers_per_stage"]


def _check_positive_int(name: str, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {name}={value!r}")


def layers_per_stage(n_layers: int, num_stages: int) -> list[int]:
    """How many blocks each stage gets: as even as possible, middle stages first.

    Stage 0 also holds the embedding and the last stage the final norm and the head, so when
    the layers do not divide evenly the spare ones go to the middle stages, then to stage 0,
    then to the last stage. Every middle stage must get at least one block (a stage with no
    parameters would be a pure relay), so ``n_layers >= num_stages - 2`` is required; the
    first and last stages may end up with only the embedding or the head.
    """
    _check_positive_int("num_stages", num_stages)
    if not isinstance(n_layers, int) or isinstance(n_layers, bool) or n_layers < 0:
        raise ValueError(f"n_layers must be a non-negative int, got n_layers={n_layers!r}")
    if n_layers < num_stages - 2:
        raise ValueError(
            f"n_layers={n_layers} is too few for num_stages={num_stages}: every middle stage "
            f"needs a block, so n_layers must be >= num_stages - 2 = {num_stages - 2}"
        )
    base, spare = divmod(n_layers, num_stages)
    counts = [base] * num_stages
    order = [*range(1, num_stages - 1), 0, num_stages - 1]
    for stage in order[:spare]:
        counts[stage] += 1
    return counts


def check_layers_per_stage(
    counts: Sequence[int], n_layers: int, num_stages: int, *, name: str = "layers_per_stage"
) -> list[int]:
    """``counts`` as a list, checked: ``num_stages`` ints summing to ``n_layers``, each
    ``>= 0`` and each middle stage's ``>= 1``. Raises ``ValueError`` naming ``name`` and the
    offending value."""
    _check_positive_int("num_stages", num_stages)
    if isinstance(counts, (str, bytes)) or not isinstance(counts, Sequence):
        raise ValueError(
            f"{name} must be a list of {num_stages} ints, got {type(counts).__name__} {counts!r}"
        )
    out = list(counts)
    if len(out) != num_stages:
        raise ValueError(
            f"{name}={out} has {len(out)} entries, expected one per stage: {num_stages}"
        )
    for stage, count in enumerate(out):
        if not isinstance(count, int) or isinstance(count, bool) or count < 0:
            raise ValueError(
                f"{name}={out}: stage {stage}'s count {count!r} is not a non-negative int"
            )
        if 0 < stage < num_stages - 1 and count < 1:
            raise ValueError(
                f"{name}={out}: middle stage {stage} holds no layer (every middle stage "
                "needs at least one; only the first and the last may hold none)"
            )
    if sum(out) != n_layers:
        raise ValueError(f"{name}={out} sums to {sum(out)}, but the model has {n_layers} layers")
    return out
