"""The controller's durable state: the interface (base.py), SQLite (sqlite.py), etcd (etcd.py,
etcd_client.py) and the write metrics every store is measured by (metrics.py)."""
