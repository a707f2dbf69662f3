"""The job flow: scheduling, dispatch to replicas, recovery of dead workers, the feeders, live jobs, sleep tending."""
