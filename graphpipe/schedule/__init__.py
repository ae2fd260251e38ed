"""The schedule half: what each rank runs, as data, and the passes over it. No torch.

==============  ==============================================================================
module          owns
==============  ==============================================================================
ir              the vocabulary: ``Op``, ``Action``, ``Placement``, the schedule kinds by name,
                torch's CSV (``load_csv`` / ``dump_csv``)
packed          the array encoding of actions (one integer per cell) and its checks
costs           ``Costs``: what each action is expected to take (plain data)
generators      the built-in schedules (``dualpipev``, ``zbv``, ``1f1b``): rank -> actions
timing          the dataflow timing of a schedule under ``Costs``
lower           a compute schedule -> per-rank steps with their sends and receives
validate        dependency, deadlock and placement checks, with the failing cells named
simulate        the execution model: step time, bubbles, in-flight memory
render          the grid as text and as a picture
footprint       the memory the passes themselves need for a size, before they build it
splits          how many layers each stage holds: the even split and a chosen one checked
planner         the stage split and micro-batch count that fit a memory budget
==============  ==============================================================================

Each module imports only modules listed before it (``tests/test_imports.py`` holds the
order); none imports torch or the runtime.
"""
