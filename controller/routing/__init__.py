"""What the routers and front doors are told and what they tell: the endpoint feed
(WatchEndpoints), the front doors' reports of what they route to, LoRA adapters loaded at run time.

Imports `controller.engines` and below.
"""
