"""The front door: Motor's OpenAI port, its own process in front of the router.

- cli.py: the process (`motor-front-door`, `python -m front_door`) and the table the sync pushes;
- policy.py: what each request gets (an answer of its own, or the router);
- relay.py: the client side, which moves the bytes (messages.py, bodies.py, router_pool.py).

It imports nothing of the controller or the sync: the sync tells it, over HTTP, what is served.
"""
