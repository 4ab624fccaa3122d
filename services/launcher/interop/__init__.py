"""Translation of a peer's configuration into ours: ``asyncgrpo config from-trl`` and ``config from-verl``.

One module per peer holds that peer's table (every option read, what it becomes here, what has no effect
and why) and its translation's order: :mod:`~services.launcher.interop.trl` (with its ``trl_algorithm`` and
``trl_trainer`` sides) and :mod:`~services.launcher.interop.verl` (with its ``verl_trainer`` side).
:mod:`~services.launcher.interop.translation` is what both share: the result, the refusals, reading the
peer's file and writing our TOML.
"""
