"""omnid: a supervisor that serves multi-stage inference pipelines on warm stage workers.

Layout (each part by its name):
  config        the TOML configuration and its validation
  supervisor/   the daemon process: stage handles, job scheduler, socket API
  worker/       the stage worker process: input queue, engine loop, hand-off downstream
  engines/      vllm, diffusers and python engines (heavy imports live only here)
  dataplane     the copy-based stage-to-stage transport (framing, codec)
  protocol      control and event messages between supervisor and workers
  store         the sqlite job store and job output folders
  locks         GPU lock files
"""

__version__ = "0.1.0"
