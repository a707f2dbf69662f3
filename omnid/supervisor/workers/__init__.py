"""The worker handles: one worker (local or Ray-placed), a stage and its replicas, their pipes, logs, restarts and memory."""
