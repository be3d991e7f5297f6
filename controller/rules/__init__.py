"""Pure rules, no state and no I/O: the deployment file's checks, node reports' checks, a
deployment's expansion into instances, placement, the restart policy, work in slices.

Imports only `motor` (the shared contract): every other room of the controller may import it.
"""
