"""The socket API (HTTP/1.1 + JSON on the daemon's Unix socket, and its TCP listener): app.py the
application (its route table), core.py what every request meets and every handler is given (the
error shape, the caller's uid, the admin checks, a job taken), and its endpoints by room: jobs.py,
stages.py (with adapters.py, a stage's LoRA adapters), keys.py, admin.py (the daemon as a whole)."""
