"""The HTTP front ends: the socket API, its OpenAI paths, the OpenAPI document, admission, the TCP door."""
