"""The async execution core: requests, background callers and the calls queue."""
