"""motorctl: the command-line client of the controller, and `motorctl up` (a local cluster)."""
