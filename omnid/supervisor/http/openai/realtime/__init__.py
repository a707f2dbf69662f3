"""OpenAI's Realtime API (`/v1/realtime`): the door and session (session.py), its conversation, settings,
responses, transcripts, voice activity and events."""
