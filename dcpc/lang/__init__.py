"""The schedule language: YAML with source marks, shape expressions, pydantic models."""
