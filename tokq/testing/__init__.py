"""Test and benchmark fixtures that start real servers: a Redis Cluster on loopback (cluster)
and a TCP proxy that injects faults (fault_proxy). The product never imports this package."""
