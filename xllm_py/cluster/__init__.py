"""Cluster membership: etcd registry client, embedded etcd server, instance meta, agent."""
