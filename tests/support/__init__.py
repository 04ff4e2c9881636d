"""Helpers the test modules share (tests/ is on the path: ``from support.x import y``)."""
