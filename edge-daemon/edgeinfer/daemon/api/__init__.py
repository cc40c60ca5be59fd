"""The daemon's HTTP surface: OpenAI-compatible generation endpoints and operator endpoints."""
