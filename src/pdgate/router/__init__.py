"""pdgate router: the OpenAI-compatible HTTP front that runs the prefill/decode flow."""

__version__ = "0.1.0"
