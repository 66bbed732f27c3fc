"""Benchmarks: commands that print figures, never timed tests."""

from typing import Any

# A JSON object as a server answers it or a result file holds it: its values are whatever that JSON
# holds (numbers, strings, lists, objects), read by key where they are used.
Json = dict[str, Any]
