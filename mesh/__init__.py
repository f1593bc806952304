"""Atomesh: a prefill/decode disaggregation gateway (aiohttp). See docs/architecture.md."""

__version__ = "0.1.0"
