"""Diagnostics users run by hand on a pair (python -m tools.<name>); not a serving or calibration path."""
