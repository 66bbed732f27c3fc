"""Deployment: `unison serve`'s launcher, data-parallel replicas and how a worker routes between
them (KV-aware), and the pool of models behind one address."""
