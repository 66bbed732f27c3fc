"""The package's version, in a module of its own: the protocol and the server report it, and the
package face (unison/__init__.py) imports both, so it cannot live there."""

__version__ = "0.1.0"
