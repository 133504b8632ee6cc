"""What a host's Celery worker does with the commands on its lane, and what its host agent keeps in step.

Each module is one kind of work: ``bring_up`` (create on the engine),
``take_down`` (destroy), ``dispatch`` (a launch's sandboxes, in chunks over
hosts), ``snapshots`` (take and forget), ``snapshot_copy`` (a snapshot to a
host that lacks it), ``reconcile`` (the record against the engine, both
ways) and ``heartbeat`` (the host's registration and capacity).  They call
the engine through ``engine_link`` and change state only through
``sandboxes.transitions``.
"""
