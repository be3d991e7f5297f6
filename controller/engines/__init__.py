"""One engine copy's path: a report read, a failure decided (restart or give up), restarts,
launches, StartEngine / StopEngine and fencing (`Actuator`), the node manager client, the
generation counter, and adopting the engines that run when the store is new.

Imports `controller.model`, `controller.store`, `controller.rules`.
"""
