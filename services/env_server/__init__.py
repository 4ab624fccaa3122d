"""The environment server: a Python environment (a TRL class or tool functions) served over HTTP, protocol
``asyncgrpo.env/v1`` (``environments/server.py`` is the app; this package its command line)."""
