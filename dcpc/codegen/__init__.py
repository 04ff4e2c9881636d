"""Stages 4 and 5: lower a checked schedule to a kernel plan, emit it as a module."""
