"""The live launch board: a launch drawn one pixel a sandbox, over a binary websocket.

``protocol`` is the wire format (no Django: tools and benchmarks decode it
too), ``wordmark`` the picture, ``ticker`` the one process that watches the
database and sends each team one frame a tick, ``consumer`` the websocket,
``views`` and ``urls`` the page and its buttons.
"""
