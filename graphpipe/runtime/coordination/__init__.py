"""Coordination between the ranks outside the data path: agreement, failure, the store.

``checks`` (the constructor's argument checks), ``config`` (every rank joins, configured
alike), ``groups`` (process groups), ``store`` (the job's c10d store, every access wrapped),
``status`` (what a blocked process is doing), ``faults`` (every rank raises, naming the failing
rank and action), ``lifetime`` (live pipelines at exit). The bottom of the runtime: imports
nothing else of it.
"""
