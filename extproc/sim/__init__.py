"""Discrete-event simulator that replays prefix-sharing workloads against routing policies.

Modules, one job each: ``workloads`` (traces and generators → SimRequest), ``cache`` (the
chunk-level LRU every cache model uses), ``replica`` (KV cache + time model of one model
server), ``policies`` (ours via extproc.router.Router, the peers' published policies and the
bounds), ``engine`` (the heapq event loop) and ``report`` (metrics, table, JSON, plot).
"""
