"""Tests use the launcher's local Redis helper: a real ``redis-server`` on a free port, never a fake."""

from services.launcher.local_redis import RedisServer, answers, free_port, start_redis, use_or_start_redis

__all__ = ["RedisServer", "answers", "free_port", "start_redis", "use_or_start_redis"]
