"""megatron_async: asynchronous torch_dist checkpointing for megatron-core."""
__version__ = "0.1.0"
