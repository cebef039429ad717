"""The OpenAI-compatible HTTP gateway: a stateless process in front of the daemon's Route."""
