"""The gRPC face: the servicer (it translates, nothing more) and the `Controllers` protocol it
answers from (one controller on SQLite, or the HA leader's).

Imports `controller.core` and below.
"""
