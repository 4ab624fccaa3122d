"""Every setting of the pipeline, torch-free: one pydantic model per service and one for the whole file.

``base`` holds what every service shares and how a TOML file and the environment are read; ``generator``,
``scorer``, ``learner`` and ``launcher`` are the tables of one configuration file; ``pipeline`` validates
the whole file across services. Every service validates the whole file it is given at start, so the
settings live here rather than beside each service (services never import each other).
"""
