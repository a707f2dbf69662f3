"""omnid: a supervisor that serves multi-stage inference pipelines on warm stage workers.

Layout (each part by its name):
  vocabulary    the shared words: states, event types, error codes, the job record
  config        the TOML configuration and its validation; params: per-job engine parameters
  supervisor/   the daemon process: stage handles, job scheduler, recovery, reload, socket API
  worker/       the stage worker process: input queue, engine loop, windows, hand-off downstream
  engines/      vllm, diffusers and python engines (heavy imports live only here)
  dataplane     the stage-to-stage transport (framing, acks, offers); shm: its shared memory
  protocol      control and event messages between supervisor and workers
  store         the sqlite job store and job output folders
  locks         GPU lock files
"""

__version__ = "0.1.0"
