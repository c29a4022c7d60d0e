"""Faults: typed specs, their injection into a live run, network partitions, and chaos campaigns."""
