"""The read side of the API: protobuf views of the tables, paging and filters.

Imports every room below it (`controller.capacity` and down), never `controller.core`.
"""
