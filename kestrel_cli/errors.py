"""The one exception users see: a clear, one-line message (the CLI prints it, no traceback)."""


class KestrelError(Exception):
    """Bad input: missing or corrupt files, unknown architectures, prompts too long, ..."""
