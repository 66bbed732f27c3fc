"""The one request pipeline under every HTTP API: a neutral input (inputs.py) is checked,
rendered and queued (start.py), and comes back as typed output (output.py) that each API renders."""
