"""Prompt data, read the same way by the learner and by the launcher's start-up check: the sources
(files, directories, ``datasets`` names, built-in tasks) and the prepared rows."""
