"""Writes, one function a mutation (``<entity>_<action>``, keyword-only): check, record, then queue once committed.

A service validates against the team's objects and limits (``admission``),
changes state only through ``sandboxes.transitions``, and queues work only
through ``sandboxes.commands``, after its transaction commits.  It raises the
domain errors of ``console.errors``; it knows nothing of HTTP.
"""
