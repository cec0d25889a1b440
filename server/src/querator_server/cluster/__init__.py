"""Cluster mode: several nodes behind one queue namespace, coordinated through etcd.

Imported only when the server runs with ``--cluster`` (docs/cluster.md); a single
server never loads it.
"""

from .coordinator import ClusterSettings, Coordinator

__all__ = ["ClusterSettings", "Coordinator"]
