"""The public API for sandboxes and what they are made from, mounted under ``/api/v1`` by ``console.urls``.

One router a resource.  A handler parses its input, finds the caller's
objects (``selectors``: another team's are not found), calls one service,
and shapes the answer (``answers``).  Refusals are ``console.errors``;
``console.api_base`` turns them into statuses in one place.
"""
