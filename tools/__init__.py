"""Maintenance scripts run by the Makefile (``make lock``, ``make check-fresh-setup``)."""
