"""The HTTP worker: the app and its plumbing (errors, streaming, metrics, the web page), the
request pipeline, and the APIs over it. The launcher that starts workers is unison/deploy/."""
