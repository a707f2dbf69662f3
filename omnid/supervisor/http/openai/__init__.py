"""OpenAI-compatible endpoints, one file each (chat, completions, images, speech, models, realtime/), on
common.py (a request made into its job) and jobs.py (a job followed into its answer)."""
