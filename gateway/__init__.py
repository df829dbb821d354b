"""prefixgate's HTTP face: the OpenAI-compatible API over aiohttp on uvloop (no torch in this process:
the engine runs in its own, see engine/process_client.py)."""

from importlib.metadata import version

__version__ = version("prefixgate")  # GET /version, the OpenAPI document's info
