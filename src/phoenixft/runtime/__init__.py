"""Processes of a job: the launcher, node agents, workers, the zygote they are forked from, and the run directory."""
