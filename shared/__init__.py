"""The project's shared vocabulary: wire records, their codec, the Redis Streams transport, settings.

Every service imports this package and nothing of another service. It stays light (pydantic, redis,
msgpack, numpy, prometheus-client): importing it must never import torch or vllm, which a test checks.
"""
