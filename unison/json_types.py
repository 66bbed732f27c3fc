"""The type of JSON objects whose contents are the sender's to choose: request bodies, chat
messages, Hugging Face config files, JSON Schemas. Their values are read by key and checked
where they are used, so the value type is left open."""

from typing import Any

JSONObject = dict[str, Any]  # Any: a JSON value, whatever the request or the file holds
